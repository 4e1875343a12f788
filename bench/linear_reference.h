// The fused lm head's fp64 reference (xent_dist_bench --hidden --check): the inputs, which it
// regenerates exactly, one rank's reference loss, lse, d_hidden and d_weight, and the tolerances
// that linear_op.cpp's verify holds each output to.
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <vector>

#include "device.h"
#include "gen.h"

namespace xb {

void cublas_ok(cublasStatus_t st, const char* what);

// The inputs: k / 128 with k uniform integers in [-128, 128), the weight times a power of two
// near logit_range / sqrt(H) (logits of a few units): exact in every dtype, so the reference
// regenerates them. The weight's padding rows are large: a library that read them would be off.
inline double unit_value(uint64_t seed, uint64_t salt, int64_t row, int64_t col) {
  const uint64_t h = mix64(mix64(seed ^ salt) + static_cast<uint64_t>(row) * 0x9e3779b97f4a7c15ull +
                           static_cast<uint64_t>(col));
  return static_cast<double>(static_cast<int>(h >> 56) - 128) / 128.0;
}
struct Inputs {
  uint64_t seed;
  int64_t vocab, H;
  double wscale;
  double hidden(int64_t i, int64_t h) const { return unit_value(seed, 0x68696464ull, i, h); }
  double weight(int64_t j, int64_t h) const {
    return j >= vocab ? 16.0 * wscale : wscale * unit_value(seed, 0x77656967ull, j, h);
  }
};

// Rows [r0, r0 + rows) of `f` ([rows, H] row-major) in `dtype` on the device.
template <typename F>
void upload_matrix(Device& dev, void* dst, int dtype, int64_t rows, int64_t H, F f) {
  std::vector<unsigned char> host(static_cast<size_t>(rows * H) * dtype_bytes(dtype));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t h = 0; h < H; ++h) store_elem(dtype, host.data(), i * H + h, float(f(i, h)));
  dev.upload(dst, host.data(), host.size());
}

// The fp64 reference of one rank: per-row statistics (RefRow, gen.h) over the global vocabulary,
// d_hidden [T, H] and this rank's d_weight [width, H], each with the sum of its terms' magnitudes
// (mag), the sum of the other factor's magnitudes (abs, for the 16-bit gradient's atol) and the
// fp32 error of the logits' gradient carried through the products (fp32: fp32_grad_err).
struct LinearRef {
  std::vector<RefRow> rows;
  std::vector<double> dh, dh_mag, dh_abs, dh_fp32, dw, dw_mag, dw_abs, dw_fp32;
};

LinearRef linear_reference(Device& dev, cublasHandle_t handle, const Problem& p, const Inputs& in);

// Tolerances (tests/linear_harness.h): an element of d_hidden or d_weight within its dtype's one
// ulp of its value (out_rtol: 0 for f32) plus half an ulp of its smallest spacing, plus 5e-6 of its
// terms' magnitudes; the gradient of the logits is fp32, 0 where it is below fp32's normal range
// at worst (an exp that flushes), which adds 2^-126 times `abs`; on CUDA for 16-bit inputs it is
// 16-bit, which adds 2^-8 (bf16) or 2^-11 (f16) of the magnitude and half its subnormal spacing
// times `abs`. On top: the fp32 error of the logits' gradient through the products (LinearRef's
// fp32, fp32_grad_err).
struct Tolerance {
  double out_rtol, out_atol, mag_rtol, abs_atol;
};
Tolerance linear_tolerance(int dtype, bool gpu);

// The loss and lse: within 1e-5 of the larger of the value and the magnitude of its terms
// (RefRow::loss_mag: a loss near 0 can be the difference of a large lse and target logit), plus
// 1e-6.
bool loss_ok(double got, double want, double magnitude);
double loss_magnitude(const RefRow& r);

}  // namespace xb
