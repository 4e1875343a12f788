// The statistics kernel: one pass over each row of this shard, its record for the exchange
// (docs/design.md, "The record"). The math is StatsAgent's (row_agents.cuh), in one of three
// variants picked on the host (variant_of).
#include <cuda_runtime.h>

#include <type_traits>

#include "backend.h"
#include "core/dtype.h"
#include "core/record.h"
#include "cuda/launch.cuh"
#include "cuda/row_agents.cuh"

namespace xent::cuda {
namespace {

using namespace detail;

template <typename E, int kGroup, Variant kVariant>
__global__ void __launch_bounds__(kBlock, kVariant == Variant::general
                                              ? RowPolicy::kGeneralBlocksPerSm
                                              : RowPolicy::kStatsBlocksPerSm)
    stats_kernel(const core::Problem p, const LogitsView logits, const TargetsView targets,
                 float* record, int64_t* error) {
  using T = typename E::type;
  using Agent = StatsAgent<E, kGroup, kVariant>;
  __shared__ typename Agent::Storage smem;
  pdl_trigger();
  pdl_wait();

  const int64_t row = group_index<kGroup>();
  if (row >= p.rows) return;  // uniform over the row's group
  const int t = group_lane<kGroup>();
  const T* x = static_cast<const T*>(logits.data) + row * p.row_stride;
  const int n = static_cast<int>(p.real_cols);
  RowTarget<E> rt;
  if (t == 0) rt.fetch(p, targets, row, x, n);
  Agent a(p);
  RowWalk<T, kGroup>::read(
      x, n, t, Agent::fill(), [&](T v, int col) { a.elem(v, col); },
      [&](const Chunk<T>& c) { a.chunk(c); });
  const core::LocalStats st = a.finish(smem);
  if (t == 0) rt.write_record(p, st, a.k, targets, record, row, error);
}

}  // namespace

void stats(const core::Problem& p, LogitsView logits, TargetsView targets, float* record,
           int64_t* error, cudaStream_t stream) {
  if (p.rows == 0) return;
  check_shape(p, logits);
  const Variant v = variant_of(p);
  core::dispatch_dtype(logits.dtype, [&](auto e) {
    using E = decltype(e);
    dispatch_group<typename E::type>(p.real_cols, [&](auto group) {
      const auto go = [&](auto variant) {
        launch("xent stats kernel", stats_kernel<E, group(), variant()>,
               row_blocks<group()>(p.rows), kBlock, p.programmatic_launch, stream, p, logits,
               targets, record, error);
      };
      using V = Variant;
      if (v == V::plain)
        go(std::integral_constant<V, V::plain>{});
      else if (v == V::capped)
        go(std::integral_constant<V, V::capped>{});
      else
        go(std::integral_constant<V, V::general>{});
    });
  });
}

}  // namespace xent::cuda
