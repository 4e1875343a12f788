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

// C = A B^T (beta 0), A [m, k], B [n, k], C [m, n], each row of C the same bits whatever the
// rows around it: the BLAS is called on blocks of exactly kRowBlock rows, and row i of A always at
// position (first + i) % kRowBlock of its block (the other positions of a partial block zero rows:
// scratch in pad_a, kRowBlock x k, and pad_c, kRowBlock x n). A BLAS chooses its kernels by shape,
// and within one shape a row's bits may depend on its position: OpenBLAS's generic x86 kernels sum
// the rows past a whole number of their kernel's rows in another order, and its Haswell kernel
// (also taken on AMD Zen) gives 80 of a block's 128 positions other bits than position 0 (0.3.21,
// an AMD EPYC). With `first` the row's index in the call's whole batch, a row goes through the
// same kernel at the same position whatever the chunking: the logits, and so the loss, do not
// depend on it.
void sgemm_nt_row_invariant(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                            const float* b, int64_t ldb, float* c, int64_t ldc, int64_t first,
                            float* pad_a, float* pad_c);

// Rows [r0, r0 + rows) of v widened to fp32 into dst (rows x v.cols, contiguous).
void to_f32(MatrixView v, int64_t r0, int64_t rows, float* dst);
// src (rows x dst.cols, leading dimension ld) rounded once to dst's dtype into dst's rows
// [r0, r0 + rows).
void store(const float* src, int64_t ld, MatrixView dst, int64_t r0, int64_t rows);
// Rows [r0, r0 + rows) of v set to +0 (all bits clear, in every dtype).
void zero_rows(MatrixView v, int64_t r0, int64_t rows);

}  // namespace xent::linear::host
