// The fused lm head's float64 reference and the tolerances that its results are held to, shared
// by the runner of linear_harness.h and the tests that check a call by hand.
//
// The reference: logits = hidden @ weight^T in double over the real vocabulary (rows of the
// weight past vocab_size never enter), reference() of reference.h on them (loss, lse, the
// gradient dL/dlogits times grad_output), then d_hidden = grad @ weight and d_weight = grad^T @
// hidden in double. None of the library's code is used.
#pragma once

#include <xent/linear.h>

#include <cstdlib>
#include <string>

#include "harness.h"

namespace xtest {

// ------------------------------------------------------------------------------------------
// Tolerances of d_hidden and d_weight
//
// Each element is a sum of products, d_hidden[i][h] = sum_j g_ij w_jh (over the shard's real
// columns, then over the ranks) and d_weight[j][h] = sum_i g_ij x_ih (over the rows), and its
// magnitude is the sum of the absolute values of those products (computed by the reference).
// The library's error, relative to that magnitude, comes from
//   - the fp32 GEMM of the logits (a sum over H): an error of about sqrt(H) 2^-24 relative to
//     sum_h |x_ih w_jh| in z_ij, which moves g_ij by about g_ij times that (softmax), a few 1e-7
//     with these inputs (|z| of a few units);
//   - the fp32 gradient itself (exp, lse: a few ulp, tolerances.h);
//   - the fp32 GEMMs of d_hidden and d_weight (a sum over V or over N, at most 300 terms here):
//     about sqrt(terms) 2^-24, a worst case of terms x 2^-24 = 1.8e-5;
// so 5e-6 of the magnitude (measured: 8e-7 at most here, 1e-6 at 64 rows, H = 48 and 300
// classes: docs/linear.md). An output in bf16 (or f16) is rounded once from fp32: at most half an
// ulp, and the tolerance allows one (2^-7 or 2^-10 relative to the value) on top.
constexpr double kLinearRtol = 5e-6;

// The CUDA backend rounds the gradient of the logits to the inputs' dtype before the two GEMMs
// that consume it (16-bit tensor-core GEMMs, as the unfused path's): each g_ij then carries a
// relative error of at most half an ulp (2^-8 in bf16, 2^-11 in f16), or an absolute one of half
// the subnormal spacing where it is tiny (2^-134, 2^-25), which adds g_rtol x the magnitude and
// g_atol x sum_j |w_jh| (or sum_i |x_ih|) to an element's error. 0 where the gradient is fp32.
struct GradRounding {
  double rtol = 0.0, atol = 0.0;
};
inline GradRounding grad_rounding(xent::Backend b, xent::DType inputs) {
  if (b == xent::Backend::cpu || inputs == xent::DType::f32) return {};
  if (inputs == xent::DType::bf16) return {std::ldexp(1.0, -8), std::ldexp(1.0, -134)};
  return {std::ldexp(1.0, -11), std::ldexp(1.0, -25)};
}

inline double out_rtol(xent::DType d) {
  return d == xent::DType::f32 ? 0.0 : grad_rtol(d);
}

// ------------------------------------------------------------------------------------------
// The reference

struct LinearRef {
  RefResult r;      // loss, lse, ..., grad [rows, Vpad] (times grad_output)
  Matrix d_hidden;  // [rows, H]
  Matrix d_weight;  // [Vpad, H]; rows past vocab_size 0
  Matrix dh_mag;    // [rows, H]: sum_j |g_ij w_jh|
  Matrix dw_mag;    // [Vpad, H]: sum_i |g_ij x_ih|
  Matrix dh_abs;    // [rows, H]: sum_j |w_jh| over the rows with a gradient
  Matrix dw_abs;    // [Vpad, H]: sum_i |x_ih| over the rows with a gradient
};

inline LinearRef linear_reference(const Matrix& hidden, const Matrix& weight,
                                  const std::vector<int64_t>& targets, const RefOptions& o,
                                  const std::vector<double>& grad_output) {
  const int64_t N = hidden.rows, H = hidden.cols, Vpad = weight.rows;
  const int64_t V = o.vocab_size < 0 ? Vpad : o.vocab_size;
  Matrix logits(N, Vpad, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      double s = 0.0;
      for (int64_t h = 0; h < H; ++h) s += hidden.at(i, h) * weight.at(j, h);
      logits.at(i, j) = s;
    }
  LinearRef ref;
  ref.r = reference(logits, targets, o, grad_output);
  ref.d_hidden = Matrix(N, H, 0.0);
  ref.dh_mag = Matrix(N, H, 0.0);
  ref.d_weight = Matrix(Vpad, H, 0.0);
  ref.dw_mag = Matrix(Vpad, H, 0.0);
  ref.dh_abs = Matrix(N, H, 0.0);
  ref.dw_abs = Matrix(Vpad, H, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      const double g = ref.r.grad.at(i, j);
      for (int64_t h = 0; h < H; ++h) {
        ref.d_hidden.at(i, h) += g * weight.at(j, h);
        ref.dh_mag.at(i, h) += std::fabs(g * weight.at(j, h));
        ref.d_weight.at(j, h) += g * hidden.at(i, h);
        ref.dw_mag.at(j, h) += std::fabs(g * hidden.at(i, h));
        ref.dh_abs.at(i, h) += std::fabs(weight.at(j, h));
        ref.dw_abs.at(j, h) += std::fabs(hidden.at(i, h));
      }
    }
  return ref;
}

// Rows [r0, r0 + n) of m.
inline Matrix rows_of(const Matrix& m, int64_t r0, int64_t n) {
  Matrix out(n, m.cols);
  std::copy(m.v.begin() + r0 * m.cols, m.v.begin() + (r0 + n) * m.cols, out.v.begin());
  return out;
}

// The per-row results of rows [r0, r0 + n) (the reduced loss, accuracy and grad as they are).
inline RefResult rows_of(const RefResult& r, int64_t r0, int64_t n) {
  RefResult s = r;
  const auto cut = [&](auto& v) { v.assign(v.begin() + r0, v.begin() + r0 + n); };
  cut(s.row_loss);
  cut(s.row_mag);
  cut(s.lse);
  cut(s.zloss);
  cut(s.argmax);
  cut(s.row_scale);
  return s;
}

// got (a [rows, cols] buffer in its dtype, its stride gap NaN) against want's rows [row0, ...):
// |got - want| <= out_rtol |want| + kLinearRtol * mag, and the gap left NaN. `worst`, if given,
// receives the largest |got - want| / mag seen (where mag > 0).
inline ::testing::AssertionResult matrix_matches(const char* what, const HostLogits& got,
                                                 const Matrix& want, const Matrix& mag,
                                                 int64_t row0, double* worst = nullptr,
                                                 const Matrix* abs_mag = nullptr,
                                                 GradRounding gr = {}) {
  int bad = 0;
  std::ostringstream msg;
  for (int64_t i = 0; i < got.rows; ++i) {
    for (int64_t j = 0; j < got.cols; ++j) {
      const double w = want.at(row0 + i, j), m = mag.at(row0 + i, j), have = got.get(i, j);
      const double err = std::fabs(have - w);
      const double lim = out_rtol(got.dtype) * std::fabs(w) + (kLinearRtol + gr.rtol) * m +
                         (abs_mag != nullptr ? gr.atol * abs_mag->at(row0 + i, j) : 0.0);
      if (worst != nullptr && m > 0.0 && got.dtype == xent::DType::f32)
        *worst = std::max(*worst, err / m);
      if (!(err <= lim)) {  // NaN-safe
        if (bad < 8)
          msg << "\n  " << what << "[" << row0 + i << "][" << j << "] = " << have << ", want " << w
              << " (err " << err << " > tol " << lim << ", magnitude " << m << ")";
        ++bad;
      }
    }
    for (int64_t j = got.cols; j < got.stride; ++j)
      if (!std::isnan(got.get(i, j))) {
        if (bad < 8) msg << "\n  " << what << " stride gap [" << i << "][" << j << "] written";
        ++bad;
      }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " elements of " << what << " wrong ("
                                       << dtype_name(got.dtype) << "):" << msg.str();
}

inline xent::MatrixView matrix_view(HostLogits& m) {
  return xent::MatrixView{m.rows > 0 ? m.bytes.data() : nullptr, m.dtype, m.rows, m.cols, m.stride};
}

}  // namespace xtest
