// The epilogue engine of the fused lm head (docs/linear.md, "GEMM engines"): xent's own GEMMs for
// sm_90a, CUTLASS 3 kernels (TMA, warp-specialized, fp32 accumulators) whose epilogues run the
// logits path's math on the accumulators, so that no fp32 logits are ever written. This header
// holds no CUTLASS: the kernels live in stats_gemm.cu and grad_gemm.cu, built only where CMake
// found CUTLASS's headers and sm_90 is among the architectures (XENT_HAVE_SM90_GEMMS).
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

// Columns of the GEMM's tile: the statistics leave one partial per row and tile of columns.
constexpr int64_t kTileCols = 256;
// A tile's partial statistics of a row, field-major [tile][kTileFields][rows]: the max m of its
// softcapped logits z, the sum of exp(z - m), the target's z (-inf where the target is not in the
// tile), the sum of z (label smoothing) and the argmax column as a float slot (accuracy).
enum TileField : int { kTileMax, kTileSum, kTileTarget, kTileSumZ, kTileArgmax, kTileFields };
inline int64_t tiles(int64_t cols) {
  return (cols + kTileCols - 1) / kTileCols;
}

// Why the engine cannot run a GEMM of these operands here ("" where it can): the build holds no
// kernels, the current device is not compute capability 9.0, the inputs are not bf16, or a
// pointer or leading dimension is not 16-byte aligned (TMA's rule).
std::string why_not(DType inputs, const void* a, int64_t lda, const void* b, int64_t ldb);

// partials: each tile's statistics of the logits of rows [0, m) and columns [0, n), whose column
// 0 is pc.vocab_start of the vocabulary (pc: that chunk's problem; its options: softcap,
// smoothing, accuracy); targets [m].
void stats_gemm(const Operands& g, const core::Problem& pc, TargetsView targets, float* partials,
                cudaStream_t stream);

// grad [m, n] (bf16, leading dimension ldg): the gradient of the logits, as cuda::gradient makes
// it from fp32 logits (GradAgent), from each row's lse, scalars[Workspace::kScale] and a per-row
// grad_output (reduction none; null: 1).
void gradient_gemm(const Operands& g, const core::Problem& pc, TargetsView targets,
                   const float* lse, const float* scalars, const float* grad_output, void* grad,
                   int64_t ldg, cudaStream_t stream);

}  // namespace xent::linear::sm90
