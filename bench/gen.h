// xent_dist_bench: the problem, its deterministic data, and the independent fp64 reference.
//
// Shared by the host code and the CUDA kernels (bench/reference.cu). Nothing here comes from the
// library: the reference is a plain per-row softmax in double precision over the global row, which
// every rank regenerates from a hash of (seed, row, global column), so no rank needs another
// rank's logits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define XB_HD __host__ __device__ inline
#else
#define XB_HD inline
#endif

namespace xb {

enum DTypeCode : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum ReductionCode : int { kNone = 0, kMean = 1, kSum = 2 };

// One rank's view of one benchmark size: plain data, passed by value to kernels.
struct Problem {
  int64_t rows = 0;    // tokens
  int64_t vocab = 0;   // real classes V
  int64_t padded = 0;  // global width, padding included
  int64_t start = 0;   // this rank's first global column
  int64_t width = 0;   // this rank's columns (padding included)
  int dtype = kBF16;
  int reduction = kMean;
  double smoothing = 0.0;
  double z_loss = 0.0;
  double softcap = 0.0;
  double grad_output = 1.0;  // the value of every grad_output element
  uint64_t seed = 0;
  uint32_t ignore_threshold = 0;  // rows whose hash falls below it are ignored (ignore_fraction)
  int64_t ignore_index = -100;
  float step = 1.0f / 32;  // logits are k * step, k in [-256, 128): exact in f32, bf16 and f16
};

// A row's reference statistics, fp64.
struct RefRow {
  double lse = 0.0;
  double target_z = 0.0;
  double sum_z = 0.0;
  double loss = 0.0;
  double loss_mag = 0.0;  // the size of the terms the loss is made of (for its tolerance)
  int64_t target = 0;
  int32_t ignored = 0;
  int32_t pad_ = 0;
};

// A value the check found wrong: what, where, what it was and what it should have been.
struct Mismatch {
  int32_t kind = 0;  // 0 none, 1 gradient, 2 loss, 3 lse, 4 cross-rank, 5 self-check
  int32_t pad_ = 0;
  int64_t row = -1;
  int64_t col = -1;  // global column (gradient)
  double got = 0.0;
  double want = 0.0;
  double tol = 0.0;
};

XB_HD uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// The logit of global (row, col): (k + o) * step with k uniform in [-128, 127] and a per-row offset
// o uniform in [-128, 0], so -256 <= k + o < 128 (at most 8 significant bits: exact in f32, bf16
// and f16) and logits lie in [-256, 128) * step. Each row has its own level, so rows differ in lse,
// and the sum of a row's logits (label smoothing) is well away from 0 with the same sign in every
// row: a wrong (e.g. shard-local) sum cannot average out of a mean loss.
XB_HD int row_offset(const Problem& p, int64_t row) {
  const uint64_t h = mix64(mix64(p.seed ^ 0x2545f4914f6cdd1dull) + static_cast<uint64_t>(row));
  return static_cast<int>(h % 129) - 128;
}
XB_HD float gen_logit(const Problem& p, int64_t row, int64_t col) {
  const uint64_t h =
      mix64(p.seed * 0x9e3779b97f4a7c15ull ^
            mix64(static_cast<uint64_t>(row) * 0x100000001b3ull + static_cast<uint64_t>(col)));
  const int k = static_cast<int>(h >> 56) - 128;  // top 8 bits
  return static_cast<float>(k + row_offset(p, row)) * p.step;
}

// Padding columns hold a large finite value: a library that forgot to mask them would be far off.
XB_HD float pad_logit(const Problem& p) {
  return 512.0f * p.step;
}

// The target of a row (the same on every rank), or ignore_index. Row 0 is never ignored, so that
// a mean always has at least one row.
XB_HD int64_t gen_target(const Problem& p, int64_t row) {
  const uint64_t h = mix64(mix64(p.seed ^ 0x5bd1e995ull) + static_cast<uint64_t>(row));
  if (row > 0 && static_cast<uint32_t>(h >> 32) < p.ignore_threshold) return p.ignore_index;
  return static_cast<int64_t>((h & 0xffffffffull) % static_cast<uint64_t>(p.vocab));
}

// ---- element encodings (written by hand: the logits are exact in every dtype) -------------------

XB_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
XB_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
// Exact for the generated values (at most 8 significant bits).
XB_HD uint16_t f32_to_bf16_exact(float f) {
  return static_cast<uint16_t>(float_bits(f) >> 16);
}
XB_HD float bf16_to_f32(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}
// Exact for normal half values with at most 11 significant bits (the generated logits), and 0.
XB_HD uint16_t f32_to_f16_exact(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if ((u & 0x7fffffffu) == 0) return sign;
  const int e = static_cast<int>((u >> 23) & 0xffu) - 127 + 15;
  return static_cast<uint16_t>(sign | (e << 10) | ((u >> 13) & 0x3ffu));
}
XB_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, nan
  if (e == 0) {                                                      // zero, subnormal
    const float v = static_cast<float>(m) * (1.0f / 16777216.0f);    // m * 2^-24
    return sign ? -v : v;
  }
  return bits_float(sign | ((e - 15 + 127) << 23) | (m << 13));
}

XB_HD void store_elem(int dtype, void* base, int64_t i, float v) {
  if (dtype == kF32)
    static_cast<float*>(base)[i] = v;
  else if (dtype == kBF16)
    static_cast<uint16_t*>(base)[i] = f32_to_bf16_exact(v);
  else
    static_cast<uint16_t*>(base)[i] = f32_to_f16_exact(v);
}
XB_HD double load_elem(int dtype, const void* base, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(base)[i];
  if (dtype == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
}

XB_HD size_t dtype_bytes(int dtype) {
  return dtype == kF32 ? 4 : 2;
}

// ---- fp64 reference ---------------------------------------------------------------------------

XB_HD double ref_z(const Problem& p, double x) {
  return p.softcap > 0.0 ? p.softcap * tanh(x / p.softcap) : x;
}
XB_HD double ref_slope(const Problem& p, double x) {
  if (!(p.softcap > 0.0)) return 1.0;
  const double t = tanh(x / p.softcap);
  return 1.0 - t * t;
}

// From the row's max-free statistics: the loss and the size of its terms.
XB_HD void ref_finish_row(const Problem& p, RefRow& r) {
  const double V = static_cast<double>(p.vocab);
  if (r.ignored) {
    r.loss = 0.0;
    r.loss_mag = 1.0;
    return;
  }
  r.loss = r.lse - (1.0 - p.smoothing) * r.target_z - p.smoothing * r.sum_z / V +
           p.z_loss * r.lse * r.lse;
  r.loss_mag = 1.0 + fabs(r.lse) + fabs(r.target_z) + p.smoothing * fabs(r.sum_z) / V +
               p.z_loss * r.lse * r.lse;
}

// The scale of a row's gradient: grad_output, divided by the valid rows for a mean.
XB_HD double ref_row_scale(const Problem& p, double inv_valid) {
  return p.reduction == kMean ? p.grad_output * inv_valid : p.grad_output;
}

// Relative tolerance of a gradient element. An error e in the row's lse is a relative error e in
// every softmax term, so the fp32 part of the budget is the lse tolerance, 1e-4 * (1 + |lse|) (long
// fp32 sums over a large vocabulary really do drift that far), plus two roundings to the output
// dtype (fused mode rescales an already rounded gradient).
XB_HD double grad_rtol(int dtype, double lse) {
  const double u = dtype == kF32 ? 5.96e-8 : dtype == kBF16 ? 3.90625e-3 : 4.8828125e-4;
  return 1e-4 * (1.0 + fabs(lse)) + 2.0 * u;
}
// Tolerance of the loss (a row's, or the reduced one's per row) and of lse, relative to the size of
// the terms they are made of.
constexpr double kLossRtol = 1e-4;
// Absolute floor: the dtype's smallest step (f16 gradients of a mean are often subnormal, step
// 2^-24), for the rounding of the stored value and, in fused mode, of the gradient before backward
// scaled it by grad_output.
XB_HD double grad_atol(int dtype, double grad_output) {
  return (dtype == kF16 ? 6.0e-8 : 1e-37) * (1.0 + fabs(grad_output));
}

// Checks one gradient element (global column `col` of row `r`) given the logit it was computed
// from. Returns true when it is within tolerance; *want and *tol receive the reference and bound.
XB_HD bool check_grad_elem(const Problem& p, const RefRow& r, int64_t col, double x, double got,
                           double row_scale, double* want, double* tol) {
  if (r.ignored || col >= p.vocab) {  // ignored rows and padding: exactly zero
    *want = 0.0;
    *tol = 0.0;
    return got == 0.0;
  }
  const double V = static_cast<double>(p.vocab);
  const double z = ref_z(p, x);
  const double prob = exp(z - r.lse);
  const double coef = 1.0 + 2.0 * p.z_loss * r.lse;
  const bool is_target = col == r.target;
  const double slope = ref_slope(p, x);
  const double scale = row_scale * slope;
  const double g = coef * prob - p.smoothing / V - (is_target ? 1.0 - p.smoothing : 0.0);
  const double mag = fabs(coef) * prob + p.smoothing / V + (is_target ? 1.0 - p.smoothing : 0.0);
  *want = g * scale;
  // fp32 gets the softcap's slope 1 - tanh^2 to about 1e-6 absolute: where the cap saturates
  // (slope ~ 0) that, not a relative error, is the bound.
  const double slope_err = p.softcap > 0.0 ? 1e-6 : 0.0;
  *tol = mag * fabs(row_scale) * (grad_rtol(p.dtype, r.lse) * fabs(slope) + slope_err) +
         grad_atol(p.dtype, p.grad_output);
  return fabs(got - *want) <= *tol;  // false for NaN
}

}  // namespace xb
