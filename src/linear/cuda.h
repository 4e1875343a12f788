// The CUDA backend of the fused lm head: the chunk loop over device memory (docs/linear.md), and
// its one kernel of its own.
#pragma once

#include "linear/check.h"

namespace xent::linear {

// As run_cpu, stream-ordered: no host synchronisation except where a buffer grows (the first call
// of a shape), every step on `stream`.
void run_cuda(const Group& group, const Call& call, const Agreed& agreed, Pass pass,
              const float* lse, const float* grad_output, cudaStream_t stream);

namespace device {
// dst's rows [r0, r0 + rows) = the sum over q < ranks, in order, of src[q * rank_stride + i * ld
// + j] (fp32), rounded once to dst's dtype: d_hidden summed over the ranks' partials, and an fp32
// accumulator stored (ranks = 1).
void store_sum(const float* src, int ranks, int64_t rank_stride, int64_t ld, MatrixView dst,
               int64_t r0, int64_t rows, cudaStream_t stream);
}  // namespace device

}  // namespace xent::linear
