// The statistics kernel: one pass over each row of this shard, its record for the exchange
// (docs/design.md, "The record"). Three variants, picked on the host:
//   plain:   no softcap, no sum, no argmax: an online log-sum-exp, one exponential per element;
//   capped:  a softcap c in [kMinCap, kMaxCap] and nothing else: z < c, so exp(z - c) needs no
//            running max (capped_exp);
//   general: anything else (label smoothing's sum, argmax, other caps), decided per row.
#include <cuda_runtime.h>

#include <type_traits>

#include "backend.h"
#include "core/dtype.h"
#include "core/record.h"
#include "cuda/launch.cuh"
#include "cuda/row_walk.cuh"

namespace xent::cuda {
namespace {

using namespace detail;

enum class Variant { plain, capped, general };

// Records the smallest bad row and its target into error[0..1] (error[0] = -1 means none). The
// row goes in with an atomic min (as unsigned, -1 is the largest); the target is then written by
// every thread that lowered the row, each rewriting targets[current row] until the row it read
// did not change across its write: the last write is always that of the final row.
__device__ void report_bad_target(int64_t* error, const void* targets, IndexType type,
                                  int64_t row) {
  auto* e_row = reinterpret_cast<unsigned long long*>(error);
  auto* e_val = e_row + 1;
  const unsigned long long old = atomicMin(e_row, static_cast<unsigned long long>(row));
  if (old <= static_cast<unsigned long long>(row)) return;
  __threadfence();
  for (;;) {
    const unsigned long long r = atomicAdd(e_row, 0ull);
    const int64_t value = core::load_target(targets, type, static_cast<int64_t>(r));
    atomicExch(e_val, static_cast<unsigned long long>(value));
    __threadfence();
    if (atomicAdd(e_row, 0ull) == r) return;
  }
}

// The capped variant's range of caps. Within it, lse = c + log(sum of exp(z - c)) while e^(-2c),
// the smallest term, is a normal float, and capped_exp's scaled reciprocal stays in range.
constexpr float kMinCap = 1e-3f;
constexpr float kMaxCap = 40.0f;

// 1 / d on the FMA pipes, for a normal d of either sign with 1 / d normal: a seed from the bits
// (relative error <= 5.1 %; the unsigned subtraction carries d's sign over), one third-order step
// (error cubed) and one Newton step (squared): about 2e-8, as rcp.approx's.
__device__ __forceinline__ float rcp_fma(float d) {
  float r = __uint_as_float(0x7ef311c3u - __float_as_uint(d));
  float h = fmaf(-d, r, 1.0f);
  r = fmaf(r, fmaf(h, h, h), r);
  h = fmaf(-d, r, 1.0f);
  return fmaf(r, h, r);
}

// exp(z - c) = 2^(out r) for the softcapped z of x (core::CapScales, core::cap_r), all on the
// multi-function units (MUFU): an exponential, a reciprocal and an exponential. 4-byte logits
// leave the MUFU room for that; 2-byte logits take capped_exp2.
__device__ __forceinline__ float capped_exp(float x, const core::CapScales& k) {
  return core::exp2_f(k.out * core::cap_r(x, k));
}

// capped_exp for 2-byte logits, where the three MUFU operations per element would exceed the
// MUFU's 16 results per clock per SM at the memory roofline (and the pass is issue-bound
// besides): the reciprocal runs on the FMA pipes with the scale folded in, out r = 1 / d with
// d = (1 + e) / out (inv_out = 1 / out). x must be clamped so that x * in <= 64 (d stays
// finite; r = 2^-64 is 0 to the sum). About 13 instructions per element with the clamp and sum.
// (A polynomial exponential on the FMA pipes for one element in 16, 8 or 4 as well measured
// 0.6, 1.0 and 1.8 % faster on H200: not worth a second exponential.)
__device__ __forceinline__ float capped_exp2(float x, const core::CapScales& k, float inv_out) {
  const float e = core::exp2_f(x * k.in);
  return core::exp2_f(rcp_fma(fmaf(e, inv_out, inv_out)));
}

// Each 16-bit lane of w clamped to at most that of lim, NaN kept (min.NaN).
template <typename T>
__device__ __forceinline__ uint32_t min_nan_x2(uint32_t w, uint32_t lim) {
  uint32_t y;
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(y) : "r"(w), "r"(lim));
  else
    asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(y) : "r"(w), "r"(lim));
  return y;
}

// A thread's share of a row when the row needs more than its log-sum-exp.
struct Part {
  core::LseAcc lse;
  float sum = 0.0f;
  core::ArgMax best;
};

struct MergeLse {
  __device__ __forceinline__ core::LseAcc operator()(core::LseAcc a, const core::LseAcc& b) const {
    a.merge(b);
    return a;
  }
};
struct MergePart {
  __device__ __forceinline__ Part operator()(Part a, const Part& b) const {
    a.lse.merge(b.lse);
    a.sum += b.sum;
    a.best.merge(b.best);
    return a;
  }
};

__device__ __forceinline__ core::LseAcc& lse_of(core::LseAcc& a) {
  return a;
}
__device__ __forceinline__ core::LseAcc& lse_of(Part& a) {
  return a.lse;
}

// An online log-sum-exp over one chunk of z values: its max, one rescale of the running sum, then
// exp(z - m) of every element.
template <int kU, int kN>
__device__ __forceinline__ void add_chunk(core::LseAcc& L, const float (&z)[kU][kN]) {
  float cm = core::kNegInf;
#pragma unroll
  for (int u = 0; u < kU; ++u)
#pragma unroll
    for (int e = 0; e < kN; ++e) cm = fmaxf(cm, z[u][e]);
  const float nm = fmaxf(L.m, cm);
  if (nm == core::kNegInf) return;
  float sum = 0.0f;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    float su = 0.0f;
#pragma unroll
    for (int e = 0; e < kN; ++e) su += core::exp_f(z[u][e] - nm);
    sum += su;
  }
  L.s = L.s * core::rescale(L.m, nm) + sum;
  L.m = nm;
}

template <typename E, int kGroup, Variant kVariant>
__global__ void __launch_bounds__(kBlock, kVariant == Variant::general
                                              ? RowPolicy::kGeneralBlocksPerSm
                                              : RowPolicy::kStatsBlocksPerSm)
    stats_kernel(const core::Problem p, const LogitsView logits, const TargetsView targets,
                 float* record, int64_t* error) {
  using T = typename E::type;
  using Walk = RowWalk<T, kGroup>;
  constexpr int kN = Pack<T>::kN;
  constexpr int kU = RowPolicy::kLoads;
  constexpr bool kGeneral = kVariant == Variant::general;
  using Acc = std::conditional_t<kGeneral, Part, core::LseAcc>;
  using Merge = std::conditional_t<kGeneral, MergePart, MergeLse>;
  using Reduce = GroupReduce<Acc, kGroup>;
  __shared__ typename Reduce::Storage smem;
  pdl_trigger();
  pdl_wait();

  const int64_t row = group_index<kGroup>();
  if (row >= p.rows) return;  // uniform over the row's group
  const int t = group_lane<kGroup>();
  const T* x = static_cast<const T*>(logits.data) + row * p.row_stride;
  const int n = static_cast<int>(p.real_cols);
  const float cap = kVariant == Variant::plain ? 0.0f : p.softcap;
  const core::CapScales k(cap);
  const float inv_out = kVariant == Variant::capped ? 1.0f / k.out : 0.0f;
  // Variant::capped on 2-byte logits: the largest logit of the dtype with x * in <= 64, twice.
  uint32_t x_lim = 0;
  if constexpr (kVariant == Variant::capped && sizeof(T) == 2) {
    const float lim = 64.0f / k.in;
    uint16_t h;
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      h = __bfloat16_as_ushort(__float2bfloat16_rz(lim));
    else
      h = __half_as_ushort(__float2half_rz(lim));
    x_lim = static_cast<uint32_t>(h) * 0x10001u;
  }
  const bool want_sum = kGeneral && p.layout.sum_field >= 0;
  const bool want_max = kGeneral && p.layout.max_field >= 0;

  // The target and its logit are fetched before the pass and used after it.
  int64_t target = 0;
  int local = -1;
  T xt{};
  if (t == 0) {
    target = core::load_target(targets.data, targets.type, row);
    const int64_t l = target - p.vocab_start;
    if (target != p.ignore_index && core::target_in_range(target, p.vocab_size) && l >= 0 &&
        l < n) {
      local = static_cast<int>(l);
      xt = x[local];
    }
  }

  Acc acc{};
  float capped_sum = 0.0f;  // Variant::capped: sum of exp(z - c)
  auto elem = [&](T v, int col) {
    if constexpr (kVariant == Variant::capped) {
      capped_sum += capped_exp(E::load(v), k);
    } else {
      const float z = core::softcap(E::load(v), k);
      lse_of(acc).add(z);
      if constexpr (kGeneral) {
        if (want_sum) acc.sum += z;
        if (want_max) acc.best.add(z, p.vocab_start + col);
      }
    }
  };
  auto chunk = [&](const Chunk<T>& c) {
    if constexpr (kVariant == Variant::plain) {
      float z[kU][kN];  // a missing pack reads as -inf
#pragma unroll
      for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int e = 0; e < kN; ++e) z[u][e] = E::load(c.v[u].e[e]);
      add_chunk(acc, z);
    } else if constexpr (kVariant == Variant::capped) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (u < c.valid) {
          Pack<T> v = c.v[u];
          if constexpr (sizeof(T) == 2) {
            v.v.x = min_nan_x2<T>(v.v.x, x_lim);
            v.v.y = min_nan_x2<T>(v.v.y, x_lim);
            v.v.z = min_nan_x2<T>(v.v.z, x_lim);
            v.v.w = min_nan_x2<T>(v.v.w, x_lim);
          }
          float xs[kN];
          unpack<E>(v, xs);
          float s = 0.0f;
#pragma unroll
          for (int e = 0; e < kN; ++e)
            s += sizeof(T) >= 4 ? capped_exp(xs[e], k) : capped_exp2(xs[e], k, inv_out);
          capped_sum += s;
        }
      }
    } else {
      float z[kU][kN];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int e = 0; e < kN; ++e) {
          const bool ok = u < c.valid;
          const float ze = core::softcap(E::load(c.v[u].e[e]), k);
          z[u][e] = ok ? ze : core::kNegInf;
          if (ok && want_sum) acc.sum += ze;
          if (ok && want_max) acc.best.add(ze, p.vocab_start + c.col(u, e));
        }
      }
      add_chunk(lse_of(acc), z);
    }
  };
  const uint4 fill = kVariant == Variant::plain ? neg_inf_pack<T>() : make_uint4(0u, 0u, 0u, 0u);
  Walk::read(x, n, t, fill, elem, chunk);
  if constexpr (kVariant == Variant::capped) {
    acc.m = capped_sum > 0.0f ? cap : core::kNegInf;
    acc.s = capped_sum;
  }

  acc = Reduce::reduce(smem, acc, Merge{});
  if (t == 0) {
    core::LocalStats st;
    if constexpr (kGeneral) {
      st.lse = acc.lse;
      st.sum_z = acc.sum;
      st.best = acc.best;
    } else {
      st.lse = acc;
    }
    if (local >= 0) st.target_z = core::softcap(E::load(xt), k);
    core::write_record(st, p.layout, record, p.rows, row);
    if (target != p.ignore_index && !core::target_in_range(target, p.vocab_size) &&
        error != nullptr)
      report_bad_target(error, targets.data, targets.type, row);
  }
}

Variant variant_of(const core::Problem& p) {
  const bool extra = p.layout.sum_field >= 0 || p.layout.max_field >= 0;
  if (extra) return Variant::general;
  if (p.softcap <= 0.0f) return Variant::plain;
  return p.softcap >= kMinCap && p.softcap <= kMaxCap ? Variant::capped : Variant::general;
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
