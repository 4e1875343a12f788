#include "linear/blas.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "core/dtype.h"
#include "error.h"

#if XENT_HAVE_CBLAS
#include <cblas.h>
#endif

namespace xent::linear::host {

namespace {

// Without a CBLAS: C row by row, k outer and n inner (B's rows read contiguously unless
// transposed). Each element is a sum over k in order, in fp32, as a GEMM's.
void sgemm_loops(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) ci[j] = beta == 0.0f ? 0.0f : beta * ci[j];
    for (int64_t p = 0; p < k; ++p) {
      const float aip = trans_a ? a[p * lda + i] : a[i * lda + p];
      if (trans_b)
        for (int64_t j = 0; j < n; ++j) ci[j] += aip * b[j * ldb + p];
      else
        for (int64_t j = 0; j < n; ++j) ci[j] += aip * b[p * ldb + j];
    }
  }
}

}  // namespace

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#if XENT_HAVE_CBLAS
  for (int64_t v : {m, n, k, lda, ldb, ldc})
    if (v > INT_MAX)
      fail("a GEMM dimension of " + std::to_string(v) + " exceeds the CBLAS's int (2^31 - 1)");
  if (k > 0) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
                c, static_cast<int>(ldc));
    return;
  }
#endif
  sgemm_loops(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc);
}

void sgemm_nt_row_invariant(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                            const float* b, int64_t ldb, float* c, int64_t ldc, int64_t first,
                            float* pad_a, float* pad_c) {
  if (m == 0 || n == 0) return;
  // Blocks of kRowBlock positions, position first % kRowBlock holding row 0.
  for (int64_t start = -(first % kRowBlock); start < m; start += kRowBlock) {
    if (start >= 0 && start + kRowBlock <= m) {
      sgemm(false, true, kRowBlock, n, k, a + start * lda, lda, b, ldb, 0.0f, c + start * ldc, ldc);
      continue;
    }
    const int64_t lo = std::max<int64_t>(start, 0), hi = std::min(start + kRowBlock, m);
    for (int64_t i = 0; i < kRowBlock; ++i) {
      const int64_t row = start + i;
      for (int64_t j = 0; j < k; ++j)
        pad_a[i * k + j] = row >= lo && row < hi ? a[row * lda + j] : 0.0f;
    }
    sgemm(false, true, kRowBlock, n, k, pad_a, k, b, ldb, 0.0f, pad_c, n);
    for (int64_t row = lo; row < hi; ++row)
      std::memcpy(c + row * ldc, pad_c + (row - start) * n, sizeof(float) * static_cast<size_t>(n));
  }
}

void to_f32(MatrixView v, int64_t r0, int64_t rows, float* dst) {
  core::dispatch_dtype(v.dtype, [&](auto e) {
    using E = decltype(e);
    const auto* src = static_cast<const typename E::type*>(v.data);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < v.cols; ++j)
        dst[i * v.cols + j] = E::load(src[(r0 + i) * v.row_stride + j]);
  });
}

void store(const float* src, int64_t ld, MatrixView dst, int64_t r0, int64_t rows) {
  core::dispatch_dtype(dst.dtype, [&](auto e) {
    using E = decltype(e);
    auto* out = static_cast<typename E::type*>(dst.data);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < dst.cols; ++j)
        out[(r0 + i) * dst.row_stride + j] = E::store(src[i * ld + j]);
  });
}

void zero_rows(MatrixView v, int64_t r0, int64_t rows) {
  const size_t bytes = dtype_size(v.dtype);
  for (int64_t i = r0; i < r0 + rows; ++i)
    std::memset(static_cast<char*>(v.data) + i * v.row_stride * bytes, 0, v.cols * bytes);
}

}  // namespace xent::linear::host
