// The recompute GEMM whose epilogue writes the gradient of its logits in bf16 from the fp32
// accumulators (GradAgent, the logits path's own math: one rounding), and no logits: the lean
// sweep's chunk gradient, read by its d_weight and d_hidden GEMMs. Whole tiles leave through
// shared memory by bulk copies, a row at a time; the chunk's ragged last tile by plain stores.
#include "backend.h"
#include "core/dtype.h"
#include "core/finalize.h"
#include "cuda/row_agents.cuh"
#include "linear/sm90/kernel.cuh"

namespace xent::linear::sm90 {

namespace {

// Shared-memory proxy fence with a compiler barrier: the stores before it stay before it.
__device__ __forceinline__ void fence_for_async_copy() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

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

  static constexpr int kTileCols = cute::size<1>(TileShape{});
  static constexpr int kWarps = 8;  // the cooperative kernel's two consumer warpgroups
  // A whole tile's gradient leaves through shared memory, a row of the tile (512 bytes) at a time
  // by one asynchronous bulk copy, instead of as 4-byte stores that touch eight rows each. Each
  // consumer warp stages its 8 rows of one accumulator row index r (the four threads of a quad
  // hold a row) in 8 slots of its own; a slot is padded by 16 bytes so that the quads' 4-byte
  // stores hit 32 different banks. 33 KiB: the main loop keeps its four stages.
  static constexpr int kSlotCols = kTileCols + 8;
  struct SharedStorage {
    alignas(128) __nv_bfloat16 slots[kWarps * 8][kSlotCols];
  };

  // The softcap is decided once a tile, so that the loop over the accumulators holds only the
  // math of the case at hand (GradAgent's kCap): with a run-time test inside it, a row without a
  // softcap may still pay for the softcap's exponential and reciprocal.
  template <class Acc, class Crd>
  static CUTLASS_DEVICE void tile(const Params& P, Acc& acc, Crd& crd, int m, int n, int thread,
                                  SharedStorage& smem) {
    if (P.p.softcap > 0.0f)
      rows<true>(P, acc, crd, m, n, thread, smem);
    else
      rows<false>(P, acc, crd, m, n, thread, smem);
  }

  // The block's last bulk copies must have read shared memory before it exits.
  static CUTLASS_DEVICE void finish() { cute::tma_store_wait<0>(); }

  template <bool kCap, class Acc, class Crd>
  static CUTLASS_DEVICE void rows(const Params& P, Acc& acc, Crd& crd, int m, int n, int thread,
                                  SharedStorage& smem) {
    using namespace cute;
    using F32 = core::Elem<DType::f32>;
    using BF16 = core::Elem<DType::bf16>;
    static_assert(size<1>(Acc{}) % 2 == 0 && size<1>(Acc{}) * 4 == kTileCols);
    const bool pairs = P.ldg % 2 == 0;  // then two adjacent columns are 4-byte aligned
    // A tile whose columns are all real and inside the chunk (all but a chunk's last), in a
    // gradient whose rows are 16-byte aligned, is staged and copied whole.
    const int tile_start = get<1>(crd(0, 0)) / kTileCols * kTileCols;
    const int tile_end = tile_start + kTileCols;
    const bool whole = tile_end <= n && tile_end <= static_cast<int>(P.p.real_cols) &&
                       P.ldg % 8 == 0 && reinterpret_cast<uintptr_t>(P.grad) % 16 == 0;
    const int lane = thread % 32;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(acc); ++r) {
      const int row = get<0>(crd(r, 0));
      const bool in = row < m;
      const int64_t y = in ? core::load_target(P.targets.data, P.targets.type, row) : 0;
      const core::RowFactor f = core::gradient_row_factor(
          P.grad_output, P.p.reduction == Reduction::none && in ? row : 0, P.p.grad_scale, false);
      const bool has = in && cuda::detail::has_gradient(P.p, y);
      const cuda::detail::GradAgent<F32, kCap, BF16> grad(P.p, y, in ? P.lse[row] : 0.0f,
                                                          P.scalars[Workspace::kScale] * f.factor);
      __nv_bfloat16* out = P.grad + row * P.ldg;
      if (whole) {
        __nv_bfloat162 g[size<1>(Acc{}) / 2];
        // Most rows' targets lie outside the tile: their columns need no test for it.
        if (!has)
          values(acc, crd, r, g, [](float, int) { return BF16::store(0.0f); });
        else if (grad.tl < tile_start || grad.tl >= tile_end)
          values(acc, crd, r, g, [&](float v, int) { return grad.off_target(v); });
        else
          values(acc, crd, r, g, [&](float v, int col) { return grad.real(v, col); });
        // The slot's previous copy, issued by the quad's first thread, has read it.
        if (lane % 4 == 0) tma_store_wait<0>();
        __syncwarp();
        __nv_bfloat16* slot = smem.slots[thread / 32 * 8 + lane / 4];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size<1>(acc); j += 2)
          *reinterpret_cast<__nv_bfloat162*>(slot + get<1>(crd(r, j)) - tile_start) = g[j / 2];
        fence_for_async_copy();
        __syncwarp();
        if (lane % 4 == 0 && in) {
          SM90_BULK_COPY_S2G::copy(slot, out + tile_start, kTileCols * sizeof(__nv_bfloat16));
          tma_store_arrive();
        }
        continue;
      }
      if (!in) continue;
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

  // Row r's gradient in this thread's columns as bf16 pairs, value(accumulator, column) each.
  template <class Acc, class Crd, class Value>
  static CUTLASS_DEVICE void values(Acc& acc, Crd& crd, int r, __nv_bfloat162* g, Value value) {
    using namespace cute;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size<1>(acc); j += 2) {
      const int col = get<1>(crd(r, j));
      g[j / 2] = __halves2bfloat162(value(acc(r, j), col), value(acc(r, j + 1), col + 1));
    }
  }
};

static_assert(EpilogueKernel<GradVisit>::Mainloop::DispatchPolicy::Stages == 4,
              "the staging slots leave the main loop its four stages");

}  // namespace

void gradient_gemm(const Operands& g, const core::Problem& pc, TargetsView targets,
                   const float* lse, const float* scalars, const float* grad_output, void* grad,
                   int64_t ldg, cudaStream_t stream) {
  const GradVisit::Params params{
      pc, targets, lse, scalars, grad_output, static_cast<__nv_bfloat16*>(grad), ldg};
  EpilogueKernel<GradVisit>::run(g, params, stream, "xent gradient GEMM (sm90)");
}

}  // namespace xent::linear::sm90
