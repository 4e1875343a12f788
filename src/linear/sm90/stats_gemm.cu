// The logits GEMM whose epilogue leaves each tile's statistics of each row (epilogue_gemm.h:
// TileField) and no logits: the max of the tile's softcapped logits over the quad that holds the
// row, then the sum of exp(z - max), the target's z, the sum of z and the argmax, each merged
// over the quad and written by its first lane. merge_tiles (kernels.cu) makes the chunk's
// records of them, as the statistics kernel makes them from fp32 logits.
#include "core/dtype.h"
#include "core/record.h"
#include "linear/sm90/kernel.cuh"

namespace xent::linear::sm90 {

namespace {

struct StatsVisit {
  struct Params {
    core::Problem p;  // the chunk's: vocab_start, softcap, layout, ignore_index, vocab_size
    TargetsView targets;
    float* partials;  // [tiles][kTileFields][m]
  };

  template <class Acc, class Crd>
  static CUTLASS_DEVICE void tile(const Params& P, Acc& acc, Crd& crd, int m, int n, int tile_n,
                                  int thread_idx) {
    using namespace cute;
    const core::CapScales k(P.p.softcap);
    const bool want_sum = P.p.layout.sum_field >= 0, want_max = P.p.layout.max_field >= 0;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(acc); ++r) {
      const int row = get<0>(crd(r, 0));
      int tl = -1;  // the target's column in this GEMM, or -1
      if (row < m) {
        const int64_t y = core::load_target(P.targets.data, P.targets.type, row);
        const int64_t l = y - P.p.vocab_start;
        if (y != P.p.ignore_index && core::target_in_range(y, P.p.vocab_size) && l >= 0 && l < n)
          tl = static_cast<int>(l);
      }
      float mx = core::kNegInf;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(acc); ++j)
        if (get<1>(crd(r, j)) < n) mx = fmaxf(mx, core::softcap(acc(r, j), k));
      mx = quad_merge(mx, [](float a, float b) { return fmaxf(a, b); });
      // -inf logits add 0 and NaN ones make the sum NaN, as core::LseAcc's.
      const float base = mx == core::kNegInf ? 0.0f : mx;
      float s = 0.0f, t = core::kNegInf, sz = 0.0f;
      core::ArgMax best;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(acc); ++j) {
        const int col = get<1>(crd(r, j));
        if (col >= n) continue;
        const float z = core::softcap(acc(r, j), k);
        s += core::exp_f(z - base);
        if (col == tl) t = z;
        if (want_sum) sz += z;
        if (want_max) best.add(z, col);
      }
      const auto plus = [](float a, float b) { return a + b; };
      s = quad_merge(s, plus);
      t = quad_merge(t, [](float a, float b) { return fmaxf(a, b); });
      if (want_sum) sz = quad_merge(sz, plus);
      if (want_max) {
        CUTLASS_PRAGMA_UNROLL
        for (int d = 1; d <= 2; d <<= 1) {
          core::ArgMax o;
          o.value = __shfl_xor_sync(0xffffffffu, best.value, d);
          o.index = __shfl_xor_sync(0xffffffffu, static_cast<int>(best.index), d);
          best.merge(o);
        }
      }
      if ((thread_idx & 3) != 0 || row >= m) continue;
      float* out = P.partials + static_cast<int64_t>(tile_n) * kTileFields * m + row;
      out[int64_t{kTileMax} * m] = mx;
      out[int64_t{kTileSum} * m] = s;
      out[int64_t{kTileTarget} * m] = t;
      if (want_sum) out[int64_t{kTileSumZ} * m] = sz;
      if (want_max)
        out[int64_t{kTileArgmax} * m] = core::index_to_slot(
            best.index < 0 ? -1 : static_cast<int32_t>(P.p.vocab_start + best.index));
    }
  }
};

}  // namespace

void stats_gemm(const Operands& g, const core::Problem& pc, TargetsView targets, float* partials,
                cudaStream_t stream) {
  EpilogueKernel<StatsVisit>::run(g, StatsVisit::Params{pc, targets, partials}, stream,
                                  "xent stats GEMM (sm90)");
}

}  // namespace xent::linear::sm90
