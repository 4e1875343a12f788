// The formulas of the loss, written once for the CPU backend and the CUDA kernels alike.
// Everything is fp32 whatever the logits' dtype (docs/design.md, "The math").
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define XENT_HD __host__ __device__ __forceinline__
#else
#define XENT_HD inline
#endif

namespace xent::core {

constexpr float kNegInf = -INFINITY;

constexpr float kLog2e = 1.4426950408889634f;

// 2^x. On the GPU one MUFU.EX2 (ex2.approx.ftz: results below 2^-126 flush to 0, far below any
// tolerance, and no denormal fix-up instructions around it).
XENT_HD float exp2_f(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// e^x: a few ulp on the GPU, well inside the fp32 budget of a softmax.
XENT_HD float exp_f(float x) {
  return exp2_f(x * kLog2e);
}

// 1 / d. On the GPU one MUFU.RCP (rcp.approx.ftz: about 1 ulp).
XENT_HD float rcp_f(float d) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
  return y;
#else
  return 1.0f / d;
#endif
}

XENT_HD float log_f(float x) {
#if defined(__CUDA_ARCH__)
  return __logf(x);
#else
  return std::log(x);
#endif
}

// The softcap z = c tanh(x / c) (c > 0), as z = c - 2c r with r = 1 / (1 + e^(2x/c)): one
// exponential and one reciprocal, no clamp (x -> +inf: r = 0, z = c; x -> -inf: r = 1, z = -c),
// and exp(z - c) = e^(-2c r) without a subtraction that cancels. kIn = 2 log2(e) / c turns x
// into the exponent of 2; kOut = -2c log2(e) turns r into that of exp(z - c).
struct CapScales {
  float c = 0.0f, in = 0.0f, out = 0.0f;
  XENT_HD explicit CapScales(float cap)
      : c(cap), in(cap > 0.0f ? 2.0f * kLog2e / cap : 0.0f), out(-2.0f * kLog2e * cap) {}
};

// r = 1 / (1 + e^(2x/c)), in [0, 1].
XENT_HD float cap_r(float x, const CapScales& k) {
  return rcp_f(1.0f + exp2_f(x * k.in));
}

// exp(from - to) for rescaling a running sum from max `from` to max `to >= from`; 0 when the sum
// was empty (from = -inf), which also avoids -inf - -inf = NaN.
XENT_HD float rescale(float from, float to) {
  return from == kNegInf ? 0.0f : exp_f(from - to);
}

// A running log-sum-exp: max m and sum s of exp(z - m). Merges in any order.
struct LseAcc {
  float m = kNegInf;
  float s = 0.0f;

  XENT_HD void add(float z) {
    if (z == kNegInf) return;
    if (z > m) {
      s = s * rescale(m, z) + 1.0f;
      m = z;
    } else {
      s += exp_f(z - m);
    }
  }
  XENT_HD void merge(LseAcc o) {
    const float nm = m > o.m ? m : o.m;
    if (nm == kNegInf) return;
    s = s * rescale(m, nm) + o.s * rescale(o.m, nm);
    m = nm;
  }
  // -inf for an empty row; NaN when a NaN logit reached the sum (never a finite or -inf value).
  XENT_HD float lse() const { return s == 0.0f ? kNegInf : m + log_f(s); }
};

// log(exp(a) + exp(b)), with -inf as the empty value.
XENT_HD float log_add_exp(float a, float b) {
  const float m = a > b ? a : b;
  if (m == kNegInf) return kNegInf;
  return m + log_f(rescale(a, m) + rescale(b, m));
}

// A running argmax; ties go to the smaller column, like torch.argmax.
struct ArgMax {
  float value = kNegInf;
  int64_t index = -1;

  XENT_HD void add(float v, int64_t i) {
    if (v > value || (v == value && (index < 0 || i < index))) {
      value = v;
      index = i;
    }
  }
  XENT_HD void merge(ArgMax o) {
    if (o.index >= 0) add(o.value, o.index);
  }
};

// Per-row loss from the global statistics: lse - (1 - e) * t - e * S / V + w * lse^2.
// `sum_z` is only read when label smoothing is on.
XENT_HD float row_loss(float lse, float target_z, float sum_z, float smoothing, float inv_vocab,
                       float z_loss) {
  float loss = lse - (1.0f - smoothing) * target_z + z_loss * lse * lse;
  if (smoothing > 0.0f) loss -= smoothing * inv_vocab * sum_z;
  return loss;
}

// The per-row constants of the gradient: d loss / d z_j = softmax_coef * exp(z_j - lse) - uniform
// - target_coef * [j == y], all times the row's scale.
struct GradCoef {
  float lse;
  float softmax_coef;  // (1 + 2 w lse) * scale
  float uniform;       // e / V * scale
  float target_coef;   // (1 - e) * scale
};

XENT_HD GradCoef grad_coef(float lse, float scale, float smoothing, float inv_vocab, float z_loss) {
  GradCoef c;
  c.lse = lse;
  c.softmax_coef = (1.0f + 2.0f * z_loss * lse) * scale;
  c.uniform = smoothing * inv_vocab * scale;
  c.target_coef = (1.0f - smoothing) * scale;
  return c;
}

// A logit after the softcap, and the slope dz/dx = 1 - tanh^2(x / c) = 4 r (1 - r) (which does
// not cancel near z = c as 1 - (z / c)^2 does). Without a cap (k.c = 0): z = x, slope 1.
struct CappedLogit {
  float z;
  float slope;
};
XENT_HD CappedLogit cap_logit(float x, const CapScales& k) {
  if (!(k.c > 0.0f)) return {x, 1.0f};
  const float r = cap_r(x, k);
  return {k.c - 2.0f * k.c * r, 4.0f * r * (1.0f - r)};
}

// z = c * tanh(x / c) with a softcap (k.c > 0), else z = x.
XENT_HD float softcap(float x, const CapScales& k) {
  return cap_logit(x, k).z;
}

// Gradient w.r.t. the raw logit x of a real (non-padding) column, from its softcapped logit z
// and the softcap's slope there.
XENT_HD float grad_x(float z, float slope, bool is_target, const GradCoef& c) {
  float g = c.softmax_coef * exp_f(z - c.lse) - c.uniform;
  if (is_target) g -= c.target_coef;
  return g * slope;
}

// The reduction's scale of every row: 1 / valid rows for a mean (0 when no row is valid: an
// all-ignored batch gives loss 0 and gradient 0 rather than NaN), else 1.
XENT_HD float reduction_scale(bool mean, float valid_rows) {
  return mean ? (valid_rows > 0.0f ? 1.0f / valid_rows : 0.0f) : 1.0f;
}

// What the gradient of a row is multiplied by: the reduction's scale times Options::grad_scale.
XENT_HD float gradient_scale(bool mean, float valid_rows, float grad_scale) {
  return reduction_scale(mean, valid_rows) * grad_scale;
}

// The fused backward's factor of a row whose gradient forward wrote for grad_output =
// grad_scale: 1 exactly when grad_output equals grad_scale (the rows are then left alone).
// grad_output null means 1.
XENT_HD float fused_backward_factor(const float* grad_output, int64_t i, float grad_scale) {
  return (grad_output == nullptr ? 1.0f : grad_output[i]) / grad_scale;
}

// What the gradient step folds into row i's scale (scalars[kScale]), and whether it writes the
// row at all. Every row (forward's fused gradient, the deferred backward): grad_output, null
// meaning 1. Rescaled rows only (the fused backward into forward's own gradient buffer, the
// logits intact): the row's fused_backward_factor, the row recomputed and rounded once where
// that is not 1 and left as forward wrote it where it is (kScale holds grad_scale already).
struct RowFactor {
  float factor;
  bool write;
};
XENT_HD RowFactor gradient_row_factor(const float* grad_output, int64_t i, float grad_scale,
                                      bool rescaled_only) {
  if (!rescaled_only) return {grad_output == nullptr ? 1.0f : grad_output[i], true};
  const float f = fused_backward_factor(grad_output, i, grad_scale);
  return {f, f != 1.0f};
}

// A target is either ignore_index or a real class of the global vocabulary.
XENT_HD bool target_in_range(int64_t target, int64_t vocab_size) {
  return target >= 0 && target < vocab_size;
}

}  // namespace xent::core
