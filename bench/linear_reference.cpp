#include "linear_reference.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "reference.h"

namespace xb {

void cublas_ok(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(st));
}

namespace {

// Row-major C[m, n] += op(A) op(B) in fp64, op(A) [m, k]: cublasDgemm on the GPU (through
// device copies), else plain loops. The reference's GEMMs.
void gemm64(Device& dev, cublasHandle_t handle, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
            const double* A, int64_t lda, const double* B, int64_t ldb, double* C, int64_t ldc) {
  if (m == 0 || n == 0 || k == 0) return;
  if (!dev.gpu()) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p) {
        const double a = ta ? A[p * lda + i] : A[i * lda + p];
        if (a == 0.0) continue;
        for (int64_t j = 0; j < n; ++j)
          C[i * ldc + j] += a * (tb ? B[j * ldb + p] : B[p * ldb + j]);
      }
    return;
  }
  auto staged = [&](const double* host, int64_t rows, int64_t cols, int64_t ld) {
    const size_t bytes = static_cast<size_t>((rows - 1) * ld + cols) * sizeof(double);
    auto buf = std::make_unique<Buffer>(dev, bytes);
    dev.upload(buf->get(), host, bytes);
    return buf;
  };
  const auto a = staged(A, ta ? k : m, ta ? m : k, lda), b = staged(B, tb ? n : k, tb ? k : n, ldb);
  const auto c = staged(C, m, n, ldc);
  const double one = 1.0;
  cublas_ok(cublasDgemm(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                        int(n), int(m), int(k), &one, b->as<double>(), int(ldb), a->as<double>(),
                        int(lda), &one, c->as<double>(), int(ldc)),
            "cublasDgemm");
  dev.download(C, c->get(), c->bytes());
}

// The fp32 error of one element of the logits' gradient, as a bound: the library computes
// exp(z - lse) in fp32, lse carrying about |lse| 2^-24 and the argument about |z - lse| 2^-24 (and
// a softcapped z about 2 c 2^-24), so the softmax term moves by that much relative (2^-23: twice
// it): a few 1e-7 for logits of a few units, 1.5e-5 at |z - lse| of 256, past the fixed 5e-6 of
// the magnitude (Tolerance) that covers the GEMMs. A softcap's slope, 4 r (1 - r) from
// r = 1 / (1 + e^(2x/c)) of about 4 ulps, is off by up to 16 x 2^-24 absolute where it saturates
// (a tiny slope: not a relative error). The fp32 logits themselves are exact here (Inputs:
// integers over 128 times a power of two, whose sums over H keep within 24 bits while they stay
// below 2^10 times the weight's scale, as random signs keep them).
double fp32_grad_err(const Problem& p, double soft, double g, double z, double lse, double scale,
                     double slope) {
  const double arg = std::fabs(z - lse) + std::fabs(lse) + 2.0 * p.softcap;
  return std::fabs(soft * scale * slope) * std::ldexp(arg, -23) +
         (p.softcap > 0.0 ? std::fabs(g * scale) * std::ldexp(1.0, -20) : 0.0);
}

}  // namespace

LinearRef linear_reference(Device& dev, cublasHandle_t handle, const Problem& p, const Inputs& in) {
  const int64_t T = p.rows, H = in.H, V = p.vocab;
  LinearRef ref;
  ref.rows.resize(static_cast<size_t>(T));
  std::vector<double> X(static_cast<size_t>(T * H)), Xabs(X.size()), xsum(H, 0.0), wsum(H, 0.0);
  for (int64_t i = 0; i < T; ++i) {
    RefRow& r = ref.rows[static_cast<size_t>(i)];
    r.target = gen_target(p, i);
    r.ignored = r.target == p.ignore_index;
    for (int64_t h = 0; h < H; ++h) {
      X[i * H + h] = in.hidden(i, h);
      Xabs[i * H + h] = std::fabs(X[i * H + h]);
      if (!r.ignored) xsum[h] += Xabs[i * H + h];
    }
  }
  // Logits a chunk of global columns at a time, twice: the statistics, then the gradient.
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(V, (int64_t(1) << 22) / std::max<int64_t>(1, T)));
  std::vector<double> W, Wabs, Z;
  auto logits = [&](int64_t c0, int64_t n) {
    W.assign(static_cast<size_t>(n * H), 0.0);
    Wabs.resize(W.size());
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < H; ++h) {
        W[j * H + h] = in.weight(c0 + j, h);
        Wabs[j * H + h] = std::fabs(W[j * H + h]);
      }
    Z.assign(static_cast<size_t>(T * n), 0.0);
    gemm64(dev, handle, false, true, T, n, H, X.data(), H, W.data(), H, Z.data(), n);
  };
  std::vector<double> m(T, -INFINITY), e(T, 0.0);  // running max and sum of exp(z - max)
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t n = std::min(chunk, V - c0);
    logits(c0, n);
    for (int64_t i = 0; i < T; ++i) {
      RefRow& r = ref.rows[static_cast<size_t>(i)];
      for (int64_t j = 0; j < n; ++j) {
        const double z = ref_z(p, Z[i * n + j]);
        if (z > m[i]) {
          e[i] = e[i] * std::exp(m[i] - z) + 1.0;
          m[i] = z;
        } else {
          e[i] += std::exp(z - m[i]);
        }
        r.sum_z += z;
        if (c0 + j == r.target) r.target_z = z;
      }
    }
  }
  for (int64_t i = 0; i < T; ++i) {
    RefRow& r = ref.rows[static_cast<size_t>(i)];
    r.lse = m[i] + std::log(e[i]);
    ref_finish_row(p, r);
  }
  const double scale = ref_row_scale(p, inv_valid_rows(ref.rows)), Vd = static_cast<double>(V);
  const int64_t width = p.width;
  for (auto* v : {&ref.dh, &ref.dh_mag, &ref.dh_abs, &ref.dh_fp32})
    v->assign(static_cast<size_t>(T * H), 0.0);
  for (auto* v : {&ref.dw, &ref.dw_mag, &ref.dw_abs, &ref.dw_fp32})
    v->assign(static_cast<size_t>(width * H), 0.0);
  std::vector<double> G, Gabs, Gfp32;
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t n = std::min(chunk, V - c0);
    logits(c0, n);
    G.assign(Z.size(), 0.0);
    Gabs.assign(Z.size(), 0.0);
    Gfp32.assign(Z.size(), 0.0);
    for (int64_t i = 0; i < T; ++i) {
      const RefRow& r = ref.rows[static_cast<size_t>(i)];
      if (r.ignored) continue;
      for (int64_t j = 0; j < n; ++j) {
        const double x = Z[i * n + j], z = ref_z(p, x);
        const double soft = (1.0 + 2.0 * p.z_loss * r.lse) * std::exp(z - r.lse);
        const double g = soft - p.smoothing / Vd - (c0 + j == r.target ? 1.0 - p.smoothing : 0.0);
        const double slope = ref_slope(p, x);
        G[i * n + j] = g * scale * slope;
        Gabs[i * n + j] = std::fabs(G[i * n + j]);
        Gfp32[i * n + j] = fp32_grad_err(p, soft, g, z, r.lse, scale, slope);
      }
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < H; ++h) wsum[h] += Wabs[j * H + h];
    gemm64(dev, handle, false, false, T, H, n, G.data(), n, W.data(), H, ref.dh.data(), H);
    gemm64(dev, handle, false, false, T, H, n, Gabs.data(), n, Wabs.data(), H, ref.dh_mag.data(),
           H);
    gemm64(dev, handle, false, false, T, H, n, Gfp32.data(), n, Wabs.data(), H, ref.dh_fp32.data(),
           H);
    // This rank's rows of the weight in the chunk: [a, b) global.
    const int64_t a = std::max(c0, p.start), b = std::min(c0 + n, p.start + width);
    if (a >= b) continue;
    double* dw = ref.dw.data() + (a - p.start) * H;
    double* dw_mag = ref.dw_mag.data() + (a - p.start) * H;
    gemm64(dev, handle, true, false, b - a, H, T, G.data() + (a - c0), n, X.data(), H, dw, H);
    gemm64(dev, handle, true, false, b - a, H, T, Gabs.data() + (a - c0), n, Xabs.data(), H, dw_mag,
           H);
    gemm64(dev, handle, true, false, b - a, H, T, Gfp32.data() + (a - c0), n, Xabs.data(), H,
           ref.dw_fp32.data() + (a - p.start) * H, H);
    for (int64_t j = a; j < b; ++j)
      std::copy(xsum.begin(), xsum.end(), ref.dw_abs.begin() + (j - p.start) * H);
  }
  for (int64_t i = 0; i < T; ++i)
    if (!ref.rows[static_cast<size_t>(i)].ignored)
      std::copy(wsum.begin(), wsum.end(), ref.dh_abs.begin() + i * H);
  return ref;
}

Tolerance linear_tolerance(int dtype, bool gpu) {
  constexpr double kLinearRtol = 5e-6;
  const bool bf16 = dtype == kBF16, rounded = gpu && dtype != kF32;
  Tolerance t{0.0, std::ldexp(1.0, -150), kLinearRtol, std::ldexp(1.0, -126)};
  if (dtype == kF32) return t;
  t.out_rtol = bf16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
  t.out_atol = bf16 ? std::ldexp(1.0, -134) : std::ldexp(1.0, -25);
  if (rounded) {
    t.mag_rtol += bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    t.abs_atol = bf16 ? std::ldexp(1.0, -134) : std::ldexp(1.0, -25);
  }
  return t;
}

bool loss_ok(double got, double want, double magnitude) {
  return std::fabs(got - want) <= 1e-5 * std::max(std::fabs(want), magnitude) + 1e-6;  // NaN: false
}
double loss_magnitude(const RefRow& r) {
  return r.ignored ? 0.0 : r.loss_mag;
}

}  // namespace xb
