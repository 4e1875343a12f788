// The statistics GEMM's partial records (stats_gemm.cu): each 256-column tile of the logits GEMM
// leaves, for each of its rows, the statistics of its columns (core::LocalStats) as six floats,
// field-major [tiles][kFields][ld]; merge_stats (stats_gemm.cu) merges a row's tiles into its
// record, as the statistics kernel makes it from fp32 logits. No CUTLASS here: the plan (host
// code) sizes the partials from it.
#pragma once

#include <cstdint>

#include "core/record.h"

namespace xent::linear::sm90 {

// Columns of the statistics GEMM's tiles (its TileShape's N).
constexpr int64_t kStatsTileCols = 256;

struct Partial {
  enum Field : int { kMax, kSum, kTarget, kZSum, kBest, kBestIndex, kFields };
};

inline int64_t stats_tiles(int64_t cols) {
  return (cols + kStatsTileCols - 1) / kStatsTileCols;
}

// Tile t's partial of `row` (floats of partials, ld rows).
XENT_HD void write_partial(const core::LocalStats& st, float* partials, int64_t ld, int64_t t,
                           int64_t row) {
  float* p = partials + t * Partial::kFields * ld + row;
  p[Partial::kMax * ld] = st.lse.m;
  p[Partial::kSum * ld] = st.lse.s;
  p[Partial::kTarget * ld] = st.target_z;
  p[Partial::kZSum * ld] = st.sum_z;
  p[Partial::kBest * ld] = st.best.value;
  p[Partial::kBestIndex * ld] = core::index_to_slot(static_cast<int32_t>(st.best.index));
}

XENT_HD core::LocalStats read_partial(const float* partials, int64_t ld, int64_t t, int64_t row) {
  const float* p = partials + t * Partial::kFields * ld + row;
  core::LocalStats st;
  st.lse.m = p[Partial::kMax * ld];
  st.lse.s = p[Partial::kSum * ld];
  st.target_z = p[Partial::kTarget * ld];
  st.sum_z = p[Partial::kZSum * ld];
  st.best.value = p[Partial::kBest * ld];
  st.best.index = core::slot_to_index(p[Partial::kBestIndex * ld]);
  return st;
}

}  // namespace xent::linear::sm90
