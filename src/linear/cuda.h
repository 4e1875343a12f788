// The CUDA backend of the fused lm head: the fast schedule's steps over device memory
// (cuda_fast.cpp, run by fast.cpp; the lean schedule's steps are cuda_lean.cpp), what a group
// keeps between calls (cuda_state.cpp), and the backend's kernels of its own.
#pragma once

#include "linear/check.h"
#include "linear/gemm.h"

namespace xent::linear {

// As run_cpu, stream-ordered: no host synchronisation, every step on `stream` (d_hidden's sums
// over the ranks on a side stream ordered by events, joined before the call returns).
void run_cuda(const Group& group, const Call& call, const Agreed& agreed, Pass pass,
              const float* lse, const float* grad_output, cudaStream_t stream);

// What a group keeps between calls on CUDA (Workspace::linear): host-side handles only, no
// device memory (the scratch is the call's): cuBLASLt's handle and the algorithms it chose, and
// the side stream and events on which the sums of d_hidden over the ranks overlap the GEMMs.
struct CudaState {
  device::Gemm gemm;
  cudaStream_t side = nullptr;
  cudaEvent_t ready[2] = {}, done[2] = {};
  CudaState();
  ~CudaState();
  CudaState(const CudaState&) = delete;
  CudaState& operator=(const CudaState&) = delete;
};
CudaState& cuda_state(const Group& group);

namespace device {
// dst's rows [r0, r0 + rows) = the sum over q < ranks, in order, of src[q * rank_stride + i * ld
// + j] (fp32), rounded once to dst's dtype: d_hidden summed over the ranks' partials, and an fp32
// accumulator stored (ranks = 1).
void store_sum(const float* src, int ranks, int64_t rank_stride, int64_t ld, MatrixView dst,
               int64_t r0, int64_t rows, cudaStream_t stream);
// dst's rows [r0, r0 + rows) = the sum over the ranks of their fp32 partials at `partial`, rounded
// once (every rank the same bits), through the communicator's sums: each rank's partial holds
// those rows ([rows, H], ld H), or with sequence parallelism every rank's rows of the chunk
// ([ranks * rows, H], this rank's block the rank-th). Without sequence parallelism, 16-bit dst and
// rows that split evenly over the ranks: a reduce-scatter in fp32, each rank rounding its share of
// the rows, then an all-gather of the 16-bit rows (6 bytes an element on the wire against an fp32
// all-reduce's 8); else an fp32 all-reduce, then the store. `partial` is scratch: overwritten.
void sum_over_ranks(Communicator& comm, bool sequence_parallel, float* partial, int64_t rows,
                    const MatrixView& dst, int64_t r0, cudaStream_t stream);
// Rows [r0, r0 + rows) of dst set to 0 (d_weight's rows of padding, which have no gradient).
void zero_rows(MatrixView dst, int64_t r0, int64_t rows, cudaStream_t stream);
// In a set of scalars (Workspace: kScale, kGemmScale), stream-ordered: kGemmScale's {alpha, 0, 1}
// with alpha = the gradient's scale times grad_output[0] (a scalar; null means 1), and kScale
// set to 1. The 16-bit gradient is then rounded unscaled and its GEMMs apply the scale as alpha
// in fp32: folded into the rounding instead, the mean's 1/n gives every target's element of
// near-uniform rows one shared relative error, which d_weight's rows sum rather than average
// (docs/linear.md, "Where the scale is applied").
void take_gemm_scale(float* set, const float* grad_output, cudaStream_t stream);
}  // namespace device

}  // namespace xent::linear
