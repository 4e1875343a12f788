// The math of one row on top of a row walk (row_walk.cuh), as CUB's agents are: StatsAgent
// accumulates a thread's share of a row's statistics and merges them over the row's group into
// its record; GradAgent is the gradient of one element. The statistics kernel (stats.cu), the
// gradient kernel (gradient.cu) and the single-pass kernel (single_pass.cu) are these agents on
// different walks. Three statistics variants, picked on the host (variant_of):
//   plain:   no softcap, no sum, no argmax: an online log-sum-exp, one exponential per element;
//   capped:  a softcap c in [kMinCap, kMaxCap] and nothing else: z < c, so exp(z - c) needs no
//            running max (capped_exp);
//   general: anything else (label smoothing's sum, argmax, other caps), decided per row.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "core/dtype.h"
#include "core/record.h"
#include "cuda/row_walk.cuh"

namespace xent::cuda::detail {

enum class Variant { plain, capped, general };

// Records the smallest bad row and its target into error[0..1] (error[0] = -1 means none). The
// row goes in with an atomic min (as unsigned, -1 is the largest); the target is then written by
// every thread that lowered the row, each rewriting targets[current row] until the row it read
// did not change across its write: the last write is always that of the final row.
__device__ inline void report_bad_target(int64_t* error, const void* targets, IndexType type,
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
// 0.6, 1.0 and 1.8 % faster on H200 once; with a degree-5 polynomial, 9 instructions in place of
// one MUFU.EX2, for one element in 8, 4 and 2 the forward + backward of 8192 x 128000 with cap 30
// took 1.708, 1.713 and 1.789 ms against 1.692 (H200, two runs each): the pass is issue-bound
// as much as MUFU-bound, so instructions moved to the FMA pipes cost as much as they free.)
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

inline Variant variant_of(const core::Problem& p) {
  const bool extra = p.layout.sum_field >= 0 || p.layout.max_field >= 0;
  if (extra) return Variant::general;
  if (p.softcap <= 0.0f) return Variant::plain;
  return p.softcap >= kMinCap && p.softcap <= kMaxCap ? Variant::capped : Variant::general;
}

// A thread's share of one row's statistics. Feed it the row through a walk (elem for single
// elements, chunk for chunks of packs, missing packs filled with fill()), then finish.
template <typename E, int kGroup, Variant kVariant>
struct StatsAgent {
  using T = typename E::type;
  static constexpr int kN = Pack<T>::kN;
  static constexpr bool kGeneral = kVariant == Variant::general;
  using Acc = std::conditional_t<kGeneral, Part, core::LseAcc>;
  using Merge = std::conditional_t<kGeneral, MergePart, MergeLse>;
  using Reduce = GroupReduce<Acc, kGroup>;
  using Storage = typename Reduce::Storage;

  float cap;
  core::CapScales k;
  float inv_out;   // Variant::capped: 1 / k.out
  uint32_t x_lim;  // Variant::capped on 2-byte logits: the largest logit with x * in <= 64, twice
  bool want_sum, want_max;
  int64_t vocab_start;
  Acc acc{};
  float capped_sum = 0.0f;  // Variant::capped: sum of exp(z - c)

  __device__ __forceinline__ explicit StatsAgent(const core::Problem& p)
      : cap(kVariant == Variant::plain ? 0.0f : p.softcap),
        k(cap),
        inv_out(kVariant == Variant::capped ? 1.0f / k.out : 0.0f),
        x_lim(0),
        want_sum(kGeneral && p.layout.sum_field >= 0),
        want_max(kGeneral && p.layout.max_field >= 0),
        vocab_start(p.vocab_start) {
    if constexpr (kVariant == Variant::capped && sizeof(T) == 2) {
      const float lim = 64.0f / k.in;
      uint16_t h;
      if constexpr (std::is_same_v<T, __nv_bfloat16>)
        h = __bfloat16_as_ushort(__float2bfloat16_rz(lim));
      else
        h = __half_as_ushort(__float2half_rz(lim));
      x_lim = static_cast<uint32_t>(h) * 0x10001u;
    }
  }

  // What a missing pack of a chunk reads as: -inf for plain (it adds nothing), else anything
  // (the other variants skip packs past Chunk::valid).
  static __device__ __forceinline__ uint4 fill() {
    return kVariant == Variant::plain ? neg_inf_pack<T>() : make_uint4(0u, 0u, 0u, 0u);
  }

  __device__ __forceinline__ void elem(T v, int col) {
    if constexpr (kVariant == Variant::capped) {
      capped_sum += capped_exp(E::load(v), k);
    } else {
      const float z = core::softcap(E::load(v), k);
      lse_of(acc).add(z);
      if constexpr (kGeneral) {
        if (want_sum) acc.sum += z;
        if (want_max) acc.best.add(z, vocab_start + col);
      }
    }
  }

  template <int kU>
  __device__ __forceinline__ void chunk(const Chunk<T, kU>& c) {
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
          if (ok && want_max) acc.best.add(ze, vocab_start + c.col(u, e));
        }
      }
      add_chunk(lse_of(acc), z);
    }
  }

  // The row's statistics over its group of threads (complete in lane 0 only); target_z is the
  // caller's (RowTarget).
  __device__ __forceinline__ core::LocalStats finish(Storage& smem) {
    if constexpr (kVariant == Variant::capped) {
      acc.m = capped_sum > 0.0f ? cap : core::kNegInf;
      acc.s = capped_sum;
    }
    const Acc all = Reduce::reduce(smem, acc, Merge{});
    core::LocalStats st;
    if constexpr (kGeneral) {
      st.lse = all.lse;
      st.sum_z = all.sum;
      st.best = all.best;
    } else {
      st.lse = all;
    }
    return st;
  }
};

// Lane 0's view of a row's target, fetched before the pass over the row and used after it.
template <typename E>
struct RowTarget {
  using T = typename E::type;
  int64_t target = 0;
  int local = -1;  // its column in this shard (n real columns), -1 if elsewhere or not a class
  T xt{};

  __device__ __forceinline__ void fetch(const core::Problem& p, const TargetsView& targets,
                                        int64_t row, const T* x, int n) {
    target = core::load_target(targets.data, targets.type, row);
    const int64_t l = target - p.vocab_start;
    if (target != p.ignore_index && core::target_in_range(target, p.vocab_size) && l >= 0 &&
        l < n) {
      local = static_cast<int>(l);
      xt = x[local];
    }
  }

  // By lane 0: the row's record from its statistics, and the report of a target out of range.
  __device__ __forceinline__ void write_record(const core::Problem& p, core::LocalStats st,
                                               const core::CapScales& k, const TargetsView& targets,
                                               float* record, int64_t row, int64_t* error) const {
    if (local >= 0) st.target_z = core::softcap(E::load(xt), k);
    core::write_record(st, p.layout, record, p.rows, row);
    if (target != p.ignore_index && !core::target_in_range(target, p.vocab_size) &&
        error != nullptr)
      report_bad_target(error, targets.data, targets.type, row);
  }

  // By lane 0: the row's record in the one-row layout (core::write_record, rows 1), and the
  // report of a target out of range.
  __device__ __forceinline__ void one_row_record(const core::Problem& p, core::LocalStats st,
                                                 const core::CapScales& k,
                                                 const TargetsView& targets, float* rec,
                                                 int64_t row, int64_t* error) const {
    if (local >= 0) st.target_z = core::softcap(E::load(xt), k);
    core::write_record(st, p.layout, rec, 1, 0);
    if (target != p.ignore_index && !core::target_in_range(target, p.vocab_size) &&
        error != nullptr)
      report_bad_target(error, targets.data, targets.type, row);
  }

  // The global lse that finalize computes from this row's record when it is the only rank's:
  // the record built here (one row) and merged as finalize merges it.
  __device__ __forceinline__ float one_rank_lse(const core::Problem& p,
                                                const core::LocalStats& st) const {
    float rec[core::RecordLayout::kMaxFields];
    core::write_record(st, p.layout, rec, 1, 0);
    return core::merge_records(rec, 1, p.layout, 1, 0).lse;
  }
};

// Whether a row with this target has a gradient (else its gradient row is 0).
__device__ __forceinline__ bool has_gradient(const core::Problem& p, int64_t target) {
  return target != p.ignore_index && core::target_in_range(target, p.vocab_size);
}

// d loss / d x of one element of a row whose target has a gradient: lse is the row's global
// log-sum-exp, scale the reduction's scale times grad_output. Padding columns give 0. The
// gradient is stored as EO (the logits' own dtype, or a 16-bit one from fp32 logits: the fused
// lm head's chunks, whose gradient feeds 16-bit GEMMs).
template <typename E, bool kCap, typename EO = E>
struct GradAgent {
  using T = typename E::type;
  core::GradCoef c;
  core::CapScales k;
  int tl;  // the target's column in this shard, or -1
  int rc;  // real columns

  __device__ __forceinline__ GradAgent(const core::Problem& p, int64_t target, float lse,
                                       float scale)
      : c(core::grad_coef(lse, scale, p.smoothing, p.inv_vocab, p.z_loss)),
        k(kCap ? p.softcap : 0.0f),
        tl(-1),
        rc(static_cast<int>(p.real_cols)) {
    const int64_t l = target - p.vocab_start;
    if (l >= 0 && l < rc) tl = static_cast<int>(l);
  }

  __device__ __forceinline__ typename EO::type operator()(T v, int col) const {
    const float g = value(v, col);          // computed for every column, then selected:
    return EO::store(col < rc ? g : 0.0f);  // a select, not a branch: padding columns give 0
  }
  // The same for a column known to be real (col < rc), without the select.
  __device__ __forceinline__ typename EO::type real(T v, int col) const {
    return EO::store(value(v, col));
  }
  // The same for a column known to be real and not the target's, without a test. It spells out
  // value's two lines rather than calling value(v, false)-style helpers: routing operator() through
  // such a helper changed the logits path's SASS (stop 55, cuobjdump), and this leaves it as it
  // was.
  __device__ __forceinline__ typename EO::type off_target(T v) const {
    const core::CappedLogit z = core::cap_logit(E::load(v), k);
    return EO::store(core::grad_x(z.z, z.slope, false, c));
  }
  __device__ __forceinline__ float value(T v, int col) const {
    const core::CappedLogit z = core::cap_logit(E::load(v), k);
    return core::grad_x(z.z, z.slope, col == tl, c);
  }
};

}  // namespace xent::cuda::detail
