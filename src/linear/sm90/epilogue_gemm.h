// The epilogue engine of the fused lm head (docs/linear.md, "GEMM engines"): xent's own GEMM for
// sm_90a, a CUTLASS 3 kernel (TMA, warp-specialized, fp32 accumulators) whose epilogue runs the
// logits path's gradient on the accumulators, so that the lean sweep's fp32 logits are never
// written, and the forward's statistics from the accumulators without logits. This header holds no
// CUTLASS: the kernels live in grad_gemm.cu and stats_gemm.cu, built only where CMake found
// CUTLASS's headers and sm_90 is among the architectures (XENT_HAVE_SM90_GEMMS).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/problem.h"
#include "xent/xent.h"

namespace xent::linear::sm90 {

// The logits GEMM z = a @ b^T: a [m, k] and b [n, k], row-major bf16 with leading dimensions lda
// and ldb (elements).
struct Operands {
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  int64_t m = 0, n = 0, k = 0;
};

// Why the engine cannot run a GEMM of these operands here ("" where it can): the build holds no
// kernels, the current device is not compute capability 9.0, the inputs are not bf16, or a
// pointer, leading dimension or k (the rows' length) is not a multiple of 16 bytes (TMA's and
// CUTLASS's rule).
std::string why_not(DType inputs, const void* a, int64_t lda, const void* b, int64_t ldb,
                    int64_t k);

// grad [m, n] (bf16, leading dimension ldg): the gradient of the logits a @ b^T, whose column 0
// is pc.vocab_start of the vocabulary (pc: that chunk's problem), as cuda::gradient makes it from
// fp32 logits (GradAgent), from each row's lse, scalars[Workspace::kScale] and a per-row
// grad_output (reduction none; null: 1); targets [m].
void gradient_gemm(const Operands& g, const core::Problem& pc, TargetsView targets,
                   const float* lse, const float* scalars, const float* grad_output, void* grad,
                   int64_t ldg, cudaStream_t stream);

// The statistics of the logits a @ b^T (pc: that chunk's problem, its column 0 at pc.vocab_start;
// targets [m]) as partial records, one per row and 256-column tile (partials.h: floats
// [stats_tiles(pc.real_cols)][Partial::kFields][m]); no logits are written. Softcap first;
// columns past pc.real_cols are padding.
void stats_gemm(const Operands& g, const core::Problem& pc, TargetsView targets, float* partials,
                cudaStream_t stream);

// record [pc.layout.fields][pc.rows]: each row's partials merged, as cuda::stats writes a chunk's
// record from its fp32 logits; a target out of range is reported into error (cuda::stats's rule).
void merge_stats(const core::Problem& pc, TargetsView targets, const float* partials, float* record,
                 int64_t* error, cudaStream_t stream);

}  // namespace xent::linear::sm90
