// The recompute GEMM whose epilogue writes the gradient of its logits in bf16 from the fp32
// accumulators (GradAgent, the logits path's own math: one rounding), and no logits: the lean
// sweep's chunk gradient, read by its d_weight and d_hidden GEMMs.
#include "backend.h"
#include "core/dtype.h"
#include "core/finalize.h"
#include "cuda/row_agents.cuh"
#include "linear/sm90/kernel.cuh"

namespace xent::linear::sm90 {

namespace {

struct GradVisit {
  struct Params {
    core::Problem p;  // the chunk's
    TargetsView targets;
    const float* lse;
    const float* scalars;
    const float* grad_output;  // per row (reduction none), or null: 1
    __nv_bfloat16* grad;
    int64_t ldg;
  };

  // The softcap is decided once a tile, so that the loop over the accumulators holds only the
  // math of the case at hand (GradAgent's kCap): with a run-time test inside it, a row without a
  // softcap may still pay for the softcap's exponential and reciprocal.
  template <class Acc, class Crd>
  static CUTLASS_DEVICE void tile(const Params& P, Acc& acc, Crd& crd, int m, int n) {
    if (P.p.softcap > 0.0f)
      rows<true>(P, acc, crd, m, n);
    else
      rows<false>(P, acc, crd, m, n);
  }

  template <bool kCap, class Acc, class Crd>
  static CUTLASS_DEVICE void rows(const Params& P, Acc& acc, Crd& crd, int m, int n) {
    using namespace cute;
    using F32 = core::Elem<DType::f32>;
    using BF16 = core::Elem<DType::bf16>;
    static_assert(size<1>(Acc{}) % 2 == 0);
    const bool pairs = P.ldg % 2 == 0;  // then two adjacent columns are 4-byte aligned
    // A tile whose columns are all real and inside the chunk (all but a chunk's last) stores its
    // rows' pairs without a test per column.
    constexpr int kTileCols = size<1>(TileShape{});
    const int tile_end = (get<1>(crd(0, 0)) / kTileCols + 1) * kTileCols;
    const bool whole = pairs && tile_end <= n && tile_end <= static_cast<int>(P.p.real_cols);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(acc); ++r) {
      const int row = get<0>(crd(r, 0));
      if (row >= m) continue;
      const int64_t y = core::load_target(P.targets.data, P.targets.type, row);
      const core::RowFactor f = core::gradient_row_factor(
          P.grad_output, P.p.reduction == Reduction::none ? row : 0, P.p.grad_scale, false);
      const bool has = cuda::detail::has_gradient(P.p, y);
      const cuda::detail::GradAgent<F32, kCap, BF16> grad(P.p, y, P.lse[row],
                                                          P.scalars[Workspace::kScale] * f.factor);
      __nv_bfloat16* out = P.grad + row * P.ldg;
      // Most rows' targets lie outside the tile: their columns need no test for it either.
      if (whole && has && (grad.tl < tile_end - kTileCols || grad.tl >= tile_end)) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(acc); j += 2) {
          const int col = get<1>(crd(r, j));
          *reinterpret_cast<__nv_bfloat162*>(out + col) =
              __halves2bfloat162(grad.off_target(acc(r, j)), grad.off_target(acc(r, j + 1)));
        }
        continue;
      }
      if (whole && has) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(acc); j += 2) {
          const int col = get<1>(crd(r, j));
          *reinterpret_cast<__nv_bfloat162*>(out + col) =
              __halves2bfloat162(grad.real(acc(r, j), col), grad.real(acc(r, j + 1), col + 1));
        }
        continue;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(acc); j += 2) {
        const int col = get<1>(crd(r, j));  // even; column col + 1 is j + 1's
        const __nv_bfloat16 g0 = has ? grad(acc(r, j), col) : BF16::store(0.0f);
        const __nv_bfloat16 g1 = has ? grad(acc(r, j + 1), col + 1) : BF16::store(0.0f);
        if (pairs && col + 1 < n) {
          *reinterpret_cast<__nv_bfloat162*>(out + col) = __halves2bfloat162(g0, g1);
        } else {
          if (col < n) out[col] = g0;
          if (col + 1 < n) out[col + 1] = g1;
        }
      }
    }
  }
};

}  // namespace

void gradient_gemm(const Operands& g, const core::Problem& pc, TargetsView targets,
                   const float* lse, const float* scalars, const float* grad_output, void* grad,
                   int64_t ldg, cudaStream_t stream) {
  const GradVisit::Params params{
      pc, targets, lse, scalars, grad_output, static_cast<__nv_bfloat16*>(grad), ldg};
  EpilogueKernel<GradVisit>::run(g, params, stream, "xent gradient GEMM (sm90)");
}

}  // namespace xent::linear::sm90
