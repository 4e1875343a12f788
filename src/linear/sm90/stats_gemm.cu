// The forward's logits GEMM whose epilogue makes each tile's statistics of its rows (max and sum
// of exp, the target's logit, the sum of the logits, the argmax; softcap first) from the fp32
// accumulators, and writes them as partial records (partials.h): no logits are written. Each
// thread adds its columns as the statistics kernel adds a row's (core::LocalStats); the four
// threads of a quad hold a row's 256 columns of the tile and merge theirs by shuffles.
#include "backend.h"
#include "core/dtype.h"
#include "core/math.h"
#include "core/record.h"
#include "cuda/row_agents.cuh"
#include "linear/sm90/kernel.cuh"
#include "linear/sm90/partials.h"

namespace xent::linear::sm90 {

namespace {

__device__ __forceinline__ core::LocalStats from_lane(const core::LocalStats& st, int lane) {
  core::LocalStats o;
  o.lse.m = __shfl_xor_sync(0xffffffffu, st.lse.m, lane);
  o.lse.s = __shfl_xor_sync(0xffffffffu, st.lse.s, lane);
  o.target_z = __shfl_xor_sync(0xffffffffu, st.target_z, lane);
  o.sum_z = __shfl_xor_sync(0xffffffffu, st.sum_z, lane);
  o.best.value = __shfl_xor_sync(0xffffffffu, st.best.value, lane);
  o.best.index = __shfl_xor_sync(0xffffffffu, st.best.index, lane);
  return o;
}

struct StatsVisit {
  struct Params {
    core::Problem p;  // the chunk's
    TargetsView targets;
    float* partials;  // [tiles][Partial::kFields][m]
  };
  struct SharedStorage {};

  // The softcap is decided once a tile, so that the loops over the accumulators hold only the
  // math of the case at hand (as the statistics kernel's kCap).
  template <class Acc, class Crd>
  static CUTLASS_DEVICE void tile(const Params& P, Acc& acc, Crd& crd, int m, int, int,
                                  SharedStorage&) {
    if (P.p.softcap > 0.0f)
      rows<true>(P, acc, crd, m);
    else
      rows<false>(P, acc, crd, m);
  }
  static CUTLASS_DEVICE void finish() {}

  template <bool kCap, class Acc, class Crd>
  static CUTLASS_DEVICE void rows(const Params& P, Acc& acc, Crd& crd, int m) {
    using namespace cute;
    constexpr int kRows = size<0>(Acc{}), kCols = size<1>(Acc{});
    static_assert(kCols * 4 == kStatsTileCols, "a quad holds a row's columns of the tile");
    const int real = static_cast<int>(P.p.real_cols);
    const int64_t t = get<1>(crd(0, 0)) / kStatsTileCols;
    const bool plain =
        (t + 1) * kStatsTileCols <= real && P.p.layout.sum_field < 0 && P.p.layout.max_field < 0;
    const int lane = threadIdx.x % 32;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(crd(r, 0));
      const bool in = row < m;
      int tl = -1;  // the target's column in this chunk
      if (in) {
        const int64_t y = core::load_target(P.targets.data, P.targets.type, row);
        const int64_t l = y - P.p.vocab_start;
        if (y != P.p.ignore_index && l >= 0 && l < real) tl = static_cast<int>(l);
      }
      core::LocalStats st;
      int nan = 0;
      const bool target_in_tile = tl >= t * kStatsTileCols && tl < (t + 1) * kStatsTileCols;
      if (plain && !target_in_tile)
        max_and_sum<kCap>(P, acc, r, st, nan);
      else if (plain)
        columns<kCap, true>(P, acc, crd, r, tl, st, nan);
      else
        columns<kCap, false>(P, acc, crd, r, tl, st, nan);
      CUTLASS_PRAGMA_UNROLL
      for (int x = 1; x < 4; x *= 2) {
        core::merge(st, from_lane(st, x));
        nan |= __shfl_xor_sync(0xffffffffu, nan, x);
      }
      // A NaN logit makes the row's lse NaN through every later merge (one whose maxima are all
      // -inf would otherwise keep the other side's sum).
      if (nan) st.lse = core::LseAcc{0.0f, __int_as_float(0x7fc00000)};
      if (in && lane % 4 == 0) write_partial(st, P.partials, m, t, row);
    }
  }

  // Row r's columns of a plain tile (see columns) that does not hold the row's target (almost
  // every row of every tile): the max and the sum of exp below it, as columns makes them, with
  // nothing else per column. A NaN logit makes the sum NaN (fmaxf passes over it), so the columns
  // are tested for one only where the sum is NaN or the max -inf (rare).
  template <bool kCap, class Acc>
  static CUTLASS_DEVICE void max_and_sum(const Params& P, Acc& acc, int r, core::LocalStats& st,
                                         int& nan) {
    using namespace cute;
    constexpr int kCols = size<1>(Acc{});
    const core::CapScales k(kCap ? P.p.softcap : 0.0f);
    float cm = core::kNegInf;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCols; ++j) cm = fmaxf(cm, core::softcap(acc(r, j), k));
    float sum = 0.0f;
    if (cm != core::kNegInf) {
      sum = sum_below(acc, r, k, cm, [](int) { return true; });
      st.lse = core::LseAcc{cm, sum};
    }
    if (cm == core::kNegInf || sum != sum) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; ++j) {
        const float z = core::softcap(acc(r, j), k);
        nan |= z != z;
      }
    }
  }

  // Row r's columns of the tile in this thread, as the statistics kernel's plain pass (add_chunk)
  // adds them: the max, then the sum of exp below it. kPlain: every column real and neither the
  // sum nor the argmax wanted (most tiles), so no test per column.
  template <bool kCap, bool kPlain, class Acc, class Crd>
  static CUTLASS_DEVICE void columns(const Params& P, Acc& acc, Crd& crd, int r, int tl,
                                     core::LocalStats& st, int& nan) {
    using namespace cute;
    constexpr int kCols = size<1>(Acc{});
    const core::CapScales k(kCap ? P.p.softcap : 0.0f);
    const int real = static_cast<int>(P.p.real_cols);
    const bool want_sum = !kPlain && P.p.layout.sum_field >= 0;
    const bool want_max = !kPlain && P.p.layout.max_field >= 0;
    float cm = core::kNegInf;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCols; ++j) {
      const int col = get<1>(crd(r, j));
      if (!kPlain && col >= real) continue;
      const float z = core::softcap(acc(r, j), k);
      cm = fmaxf(cm, z);
      nan |= z != z;
      if (col == tl) st.target_z = z;
      if (want_sum) st.sum_z += z;
      if (want_max) st.best.add(z, P.p.vocab_start + col);
    }
    if (cm == core::kNegInf) return;
    const float sum =
        sum_below(acc, r, k, cm, [&](int j) { return kPlain || get<1>(crd(r, j)) < real; });
    st.lse = core::LseAcc{cm, sum};
  }

  // The sum of exp(z - cm) over row r's columns j in this thread for which keep(j), in column
  // order: one loop for both paths, so that their sums agree to the bit.
  template <class Acc, class Keep>
  static CUTLASS_DEVICE float sum_below(Acc& acc, int r, const core::CapScales& k, float cm,
                                        Keep keep) {
    float sum = 0.0f;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < cute::size<1>(Acc{}); ++j)
      if (keep(j)) sum += core::exp_f(core::softcap(acc(r, j), k) - cm);
    return sum;
  }
};

// Blocks of 32 rows x 8 threads: thread y merges the tiles y, y + 8, ... of row x in order
// (a warp reads 32 consecutive rows of one tile), then thread 0 of each row merges the 8 in order
// and writes its record, and the report of a target out of range (RowTarget::write_record's).
constexpr int kMergeRows = 32, kMergeSplit = 8;
__global__ void __launch_bounds__(kMergeRows* kMergeSplit)
    merge_kernel(const core::Problem p, const TargetsView targets, const float* partials,
                 int64_t tiles, float* record, int64_t* error) {
  __shared__ core::LocalStats part[kMergeSplit][kMergeRows];
  const int64_t row = blockIdx.x * static_cast<int64_t>(kMergeRows) + threadIdx.x;
  core::LocalStats st;
  if (row < p.rows)
    for (int64_t t = threadIdx.y; t < tiles; t += kMergeSplit)
      core::merge(st, read_partial(partials, p.rows, t, row));
  part[threadIdx.y][threadIdx.x] = st;
  __syncthreads();
  if (threadIdx.y != 0 || row >= p.rows) return;
  for (int y = 1; y < kMergeSplit; ++y) core::merge(st, part[y][threadIdx.x]);
  core::write_record(st, p.layout, record, p.rows, row);
  const int64_t target = core::load_target(targets.data, targets.type, row);
  if (target != p.ignore_index && !core::target_in_range(target, p.vocab_size) && error != nullptr)
    cuda::detail::report_bad_target(error, targets.data, targets.type, row);
}

}  // namespace

void merge_stats(const core::Problem& pc, TargetsView targets, const float* partials, float* record,
                 int64_t* error, cudaStream_t stream) {
  if (pc.rows == 0) return;
  const int64_t tiles = stats_tiles(pc.real_cols);
  const unsigned blocks = static_cast<unsigned>((pc.rows + kMergeRows - 1) / kMergeRows);
  merge_kernel<<<blocks, dim3(kMergeRows, kMergeSplit), 0, stream>>>(pc, targets, partials, tiles,
                                                                     record, error);
  check_cuda(cudaGetLastError(), "xent statistics merge (sm90)");
}

void stats_gemm(const Operands& g, const core::Problem& pc, TargetsView targets, float* partials,
                cudaStream_t stream) {
  const StatsVisit::Params params{pc, targets, partials};
  EpilogueKernel<StatsVisit>::run(g, params, stream, "xent statistics GEMM (sm90)");
}

}  // namespace xent::linear::sm90
