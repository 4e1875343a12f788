// fp32 host matrices for the CPU backend's fused lm head: the one GEMM (CBLAS where the build
// found one, XENT_HAVE_CBLAS; else a plain loop, correct and slow) and the conversions between a
// MatrixView of any dtype and fp32. The CUDA backend's twins will be cuBLASLt and its kernels.
#pragma once

#include <cstdint>

#include "xent/linear.h"

namespace xent::linear::host {

// C = op(A) op(B) + beta C, row-major fp32 with leading dimensions (elements): op(A) is [m, k]
// (A stored [k, m] when trans_a), op(B) is [k, n] (B stored [n, k] when trans_b), C is [m, n].
// beta 0: C is written without being read (NaN there included).
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// The rows of each BLAS call of sgemm_nt_row_invariant.
constexpr int64_t kRowBlock = 128;

// C = A B^T (beta 0), A [m, k], B [n, k], C [m, n], each row of C the same bits whatever m: the
// BLAS is called on blocks of exactly kRowBlock rows, the last padded with zero rows (scratch in
// pad_a, kRowBlock x k, and pad_c, kRowBlock x n). A BLAS chooses its kernels by shape, and
// OpenBLAS's sum the rows past a whole number of its kernel's rows in another order (its generic
// x86 kernels, which it uses on CPUs it does not recognise: the last m % 4 rows), so a chunk's
// logits would depend on the chunk's size. Calls of one shape put each row through the same
// kernel: the logits, and so the loss, do not depend on the chunking.
void sgemm_nt_row_invariant(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                            const float* b, int64_t ldb, float* c, int64_t ldc, float* pad_a,
                            float* pad_c);

// Rows [r0, r0 + rows) of v widened to fp32 into dst (rows x v.cols, contiguous).
void to_f32(MatrixView v, int64_t r0, int64_t rows, float* dst);
// src (rows x dst.cols, leading dimension ld) rounded once to dst's dtype into dst's rows
// [r0, r0 + rows).
void store(const float* src, int64_t ld, MatrixView dst, int64_t r0, int64_t rows);
// Rows [r0, r0 + rows) of v set to +0 (all bits clear, in every dtype).
void zero_rows(MatrixView v, int64_t r0, int64_t rows);

}  // namespace xent::linear::host
