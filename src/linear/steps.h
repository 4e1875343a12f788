// The pieces each schedule is made of, one implementation per backend, so that each schedule's
// loop is written once. Lean (lean.cpp): cpu_lean.cpp (fp32 BLAS, the CPU kernels) and
// cuda_lean.cpp (cuBLASLt, the CUDA kernels); fast (fast.cpp): cpu_fast.cpp and cuda_fast.cpp.
// Lean's rows are those of the whole problem in rank order (with sequence parallelism every
// rank's, gathered by begin); its columns this rank's shard's, chunk by chunk.
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
  // fp32 logits of rows [r0, r0 + rows) and columns [v0, v0 + cols) (cols >= 1); on the epilogue
  // engine, straight from the GEMM's accumulators, their statistics' partials (forward) or their
  // 16-bit gradient (the sweep) instead.
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

// The pieces the fast schedule is made of (fast.cpp), one implementation per backend: cpu_fast.cpp
// and cuda_fast.cpp. A chunk is rows [r0, r0 + c) of this rank's (with sequence parallelism every
// rank's rows [r0, r0 + c), m = c x ranks of them in chunk order: rank b's come b-th); its
// logits are made in sub-chunks of rows [s0, s0 + k) of those m.
class FastSteps {
 public:
  virtual ~FastSteps() = default;
  // The whole problem's: the gradient's scale, d_weight's accumulator.
  virtual void begin() = 0;
  // The chunk's hidden rows (gathered with sequence parallelism), targets, and its rows of
  // forward's lse and a per-row grad_output (backward).
  virtual void rows(int64_t r0, int64_t c) = 0;
  // fp32 logits of the sub-chunk's rows, every column of this rank's shard.
  virtual void logits(int64_t s0, int64_t k) = 0;
  // Forward: their statistics, exchange and finalize (per-row outputs, the lse); on one rank
  // with the single pass, their gradient too.
  virtual void finalize(int64_t s0, int64_t k) = 0;
  // Their gradient, from the lse, into the chunk's gradient rows (nothing after a single pass).
  virtual void gradient(int64_t s0, int64_t k) = 0;
  // Forward, after the chunk's sub-chunks: this rank's rows of the per-row outputs.
  virtual void own_rows(int64_t r0, int64_t c) = 0;
  // The chunk's d_hidden rows: summed over the ranks and rounded once.
  virtual void d_hidden(int64_t chunk, int64_t r0, int64_t c) = 0;
  // The chunk's part of d_weight added to its accumulator (or written, one chunk).
  virtual void d_weight(int64_t chunk) = 0;
  // After the chunks: the reduced loss (forward), d_weight rounded once, the sums joined.
  virtual void end() = 0;
};

}  // namespace xent::linear
