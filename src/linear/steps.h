// The pieces the lean schedule is made of (lean.cpp), one implementation per backend:
// cpu_steps.cpp (fp32 BLAS, the CPU kernels) and cuda_steps.cpp (cuBLASLt, the CUDA kernels).
// Rows are those of the whole problem in rank order (with sequence parallelism every rank's,
// gathered by begin); columns are this rank's shard's, chunk by chunk.
#pragma once

#include <cstdint>

namespace xent::linear {

class LeanSteps {
 public:
  virtual ~LeanSteps() = default;
  // Every rank's rows of hidden and their targets (sequence parallelism), forward's lse and a
  // per-row grad_output (backward), and the gradient's scale where no forward precedes.
  virtual void begin() = 0;
  // Forward's statistics (stats: their chunks of plan.h's stats_cols columns, their buffer over
  // the sweep's), then the sweep's chunks (the rest of the steps).
  virtual void phase(bool stats) = 0;
  // fp32 logits of rows [r0, r0 + rows) and columns [v0, v0 + cols) (cols >= 1).
  virtual void logits(int64_t r0, int64_t rows, int64_t v0, int64_t cols) = 0;
  // Their statistics into chunk c's records (cols 0: a chunk past this rank's real columns,
  // whose records say "nothing here").
  virtual void stats(int64_t c, int64_t r0, int64_t rows, int64_t v0, int64_t cols) = 0;
  // Every rank's and chunk's records merged: lse, losses, the reduction, per-row outputs.
  virtual void finalize() = 0;
  // The gradient of the block's logits, from the lse, into the chunk's gradient rows.
  virtual void gradient(int64_t r0, int64_t rows, int64_t v0, int64_t cols) = 0;
  // d_weight's rows [v0, v0 + cols) from the chunk's gradient over every row: complete, rounded
  // once (or added to, accumulate_d_weight).
  virtual void d_weight(int64_t v0, int64_t cols) = 0;
  // The chunk's part of d_hidden added to its fp32 accumulator (first: written).
  virtual void d_hidden(int64_t v0, int64_t cols, bool first) = 0;
  // After the sweep: d_hidden summed over the ranks and rounded once; d_weight's padding rows.
  virtual void end(bool any_chunk) = 0;
};

}  // namespace xent::linear
