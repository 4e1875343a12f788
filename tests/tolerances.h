// How close the library must come to the reference (reference.h), per dtype, and the gradient
// comparison that applies it.
#pragma once

#include "reference.h"

namespace xtest {

// ------------------------------------------------------------------------------------------
// Tolerances
//
// Loss (every dtype): the library accumulates in fp32, the reference in double, both on the
//   same rounded inputs, so |loss - ref| <= 1e-5 * max(1, magnitude), where magnitude is the
//   sum of the absolute values of the loss's terms (|lse| + |z_y| + ...): a relative error of
//   ~1e-5 on the terms before they cancel. lse: the same with magnitude |lse|.
// Gradient: fp32 -> relative 3e-5 (a few fp32 roundings in exp/log/sums of up to 5000 terms);
//   bf16 -> 1 ulp relative (2^-7: the library rounds once from fp32, an error <= 1/2 ulp);
//   fp16 -> 1 ulp relative (2^-10) plus 6e-8 (one fp16 subnormal ulp, gradients ~1/(N V) are
//   subnormal in fp16). Plus an absolute 2e-6 * |row scale|: values that cancel to ~0 in fp32
//   (the target column, p_y - 1 with p_y ~ 1) carry an absolute fp32 error of the row's scale.
//   `ulps` > 1 where the gradient is rounded twice (fused forward, then backward by a
//   grad_output that is not a power of two).

inline double loss_tol(double magnitude) {
  return 1e-5 * std::max(1.0, magnitude);
}

inline double grad_rtol(xent::DType d) {
  switch (d) {
    case xent::DType::bf16: return 0.0078125;    // 2^-7
    case xent::DType::f16: return 0.0009765625;  // 2^-10
    default: return 3e-5;
  }
}
inline double grad_atol(xent::DType d) {
  return d == xent::DType::f16 ? 6e-8 : 0.0;
}

struct GradTol {
  double ulps = 1.0;         // multiplies the dtype's relative tolerance
  double scale_atol = 2e-6;  // times |row scale|
};

// Compares a shard's gradient (columns [col0, col0 + cols) of the global reference gradient)
// and checks that the stride gap still holds `gap` (NaN: checks it is still NaN).
inline ::testing::AssertionResult grad_matches(const HostLogits& got, const RefResult& ref,
                                               int64_t col0, GradTol tol = {},
                                               bool check_gap = true, double gap = std::nan("")) {
  int bad = 0;
  double worst = 0.0;
  std::ostringstream msg;
  for (int64_t i = 0; i < got.rows; ++i) {
    const double atol = grad_atol(got.dtype) + tol.scale_atol * std::fabs(ref.row_scale[i]);
    for (int64_t j = 0; j < got.cols; ++j) {
      const double want = ref.grad.at(i, col0 + j);
      const double have = got.get(i, j);
      const double lim = tol.ulps * grad_rtol(got.dtype) * std::fabs(want) + atol;
      const double err = std::fabs(have - want);
      if (!(err <= lim)) {  // NaN-safe
        if (bad < 8)
          msg << "\n  grad[" << i << "][" << col0 + j << "] = " << have << ", want " << want
              << " (err " << err << " > tol " << lim << ")";
        ++bad;
        worst = std::max(worst, err);
      }
    }
    if (check_gap) {
      for (int64_t j = got.cols; j < got.stride; ++j) {
        const double have = got.get(i, j);
        const bool same = std::isnan(gap) ? std::isnan(have) : have == gap;
        if (!same) {
          if (bad < 8) msg << "\n  stride gap [" << i << "][" << j << "] was written: " << have;
          ++bad;
        }
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " gradient elements wrong (" << dtype_name(got.dtype) << ", shard at column "
         << col0 << ", worst abs err " << worst << "):" << msg.str();
}

// Bitwise equality of two shards' storage (e.g. "forward left the logits untouched").
inline bool same_bytes(const HostLogits& a, const HostLogits& b) {
  return a.bytes == b.bytes;
}

}  // namespace xtest
