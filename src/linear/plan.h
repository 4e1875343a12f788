// The chunk plan of the fused lm head, one for every backend (docs/linear.md): how many of this
// rank's rows of hidden each chunk takes, and how many chunks there are. Every rank must make the
// same chunks (each is a collective), so the plan reads only what the ranks agree on: the rows,
// the options and the widest rank's shard.
#pragma once

#include <cstdint>

#include "xent/linear.h"

namespace xent::linear {

struct ChunkPlan {
  int64_t rows = 0;    // this rank's rows per chunk (the last chunk may have fewer)
  int64_t chunks = 0;  // ceil(this rank's rows / rows); 0 when there are none
  int64_t ranks = 1;   // ranks whose rows a chunk holds: the group's with sequence_parallel, else 1
  // Rows of a sub-chunk (the CUDA backend's fp32 logits of 16-bit inputs, made a sub-chunk at a
  // time); 0 where the backend makes a chunk's logits at once.
  int64_t sub_rows = 0;

  int64_t first(int64_t chunk) const { return chunk * rows; }
  // This rank's rows in `chunk` of a rank holding `total` rows.
  int64_t count(int64_t chunk, int64_t total) const {
    const int64_t left = total - first(chunk);
    return left < rows ? left : rows;
  }
  // Rows of logits of the largest chunk (what the backends' buffers hold).
  int64_t logits_rows() const { return rows * ranks; }
};

// Throws xent::Error naming the argument, its value and the rule (before any collective).
void check_options(const LinearOptions& lopt);

// What a chunk holds, for the rows that max_chunk_bytes allows: bytes per logit of its rows (of
// the widest shard, every rank's rows with sequence parallelism), and bytes per logit of a
// sub-chunk (0: none).
struct ChunkCost {
  size_t per_logit = 0;
  size_t sub_logit = 0;
  // Bytes of the fp32 accumulator that d_weight needs over more than one chunk (0: none, as
  // where d_weight is f32 or not computed). Where the whole gradient of every row takes no more,
  // one chunk of every row is both leaner and faster: its d_weight GEMM writes d_weight directly.
  size_t accumulator = 0;
};
// CPU: the fp32 logits, then their gradient in place: 8 bytes. CUDA: the gradient in the inputs'
// dtype (f32 inputs: the logits too, in place), and for 16-bit inputs the fp32 logits of a
// sub-chunk (src/linear/cuda.cpp makes them a sub-chunk at a time).
ChunkCost chunk_cost(Backend backend, DType inputs, size_t accumulator);

// Rows of a sub-chunk: at most kSubRows, so that its logits GEMM reads the weight once per that
// many rows (fewer leave the GEMM waiting on memory: 128 rows took 2x the GEMM's time on H100),
// and whole tiles of the GEMM's 128 rows where there are more.
constexpr int64_t kSubRows = 512;

// `rows`: this rank's rows of hidden (the same on every rank); `ranks`: the group's size;
// `widest`: the most columns of any rank's shard. Throws where max_chunk_bytes holds no row.
// With chunk_rows = 0 and 16-bit inputs on CUDA: one chunk of every row where its gradient fits
// in cost.accumulator, its sub-chunk then taking all of max_chunk_bytes; else a sub-chunk of at
// most kSubRows rows and the chunk (whole sub-chunks) in the rest.
ChunkPlan plan_chunks(const LinearOptions& lopt, int64_t rows, int ranks, int64_t widest,
                      ChunkCost cost);

}  // namespace xent::linear
