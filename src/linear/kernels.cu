// The fused lm head's own kernels on the CUDA backend (cuda.h): a sum over the ranks' fp32
// partials, rounded once into the output's dtype (a grid-stride loop over the elements), and the
// move of the gradient's scale into its GEMMs' alpha (one thread).
#include <cuda_runtime.h>

#include <algorithm>

#include "backend.h"
#include "core/dtype.h"
#include "cuda/launch.cuh"
#include "error.h"
#include "linear/cuda.h"

namespace xent::linear::device {

namespace {

constexpr int kThreads = 256;

template <typename E>
__global__ void __launch_bounds__(kThreads)
    store_sum_kernel(const float* src, int ranks, int64_t rank_stride, int64_t ld, MatrixView dst,
                     int64_t r0, int64_t rows) {
  using T = typename E::type;
  const int64_t cols = dst.cols, n = rows * cols;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t i = e / cols, j = e - i * cols;
    const float* s = src + i * ld + j;
    float sum = s[0];
    for (int q = 1; q < ranks; ++q) sum += s[q * rank_stride];
    static_cast<T*>(dst.data)[(r0 + i) * dst.row_stride + j] = E::store(sum);
  }
}

__global__ void take_gemm_scale_kernel(float* set, const float* grad_output) {
  float* g = set + Workspace::kGemmScale;
  g[0] = set[Workspace::kScale] * (grad_output == nullptr ? 1.0f : grad_output[0]);
  g[1] = 0.0f;
  g[2] = 1.0f;
  set[Workspace::kScale] = 1.0f;
}

}  // namespace

void zero_rows(MatrixView dst, int64_t r0, int64_t rows, cudaStream_t stream) {
  if (rows <= 0) return;
  const size_t es = dtype_size(dst.dtype);
  check_cuda(cudaMemset2DAsync(static_cast<char*>(dst.data) + r0 * dst.row_stride * es,
                               dst.row_stride * es, 0, dst.cols * es, rows, stream),
             "cudaMemset2DAsync (zero rows)");
}

void take_gemm_scale(float* set, const float* grad_output, cudaStream_t stream) {
  take_gemm_scale_kernel<<<1, 1, 0, stream>>>(set, grad_output);
  check_cuda(cudaGetLastError(), "xent take_gemm_scale kernel launch");
}

void store_sum(const float* src, int ranks, int64_t rank_stride, int64_t ld, MatrixView dst,
               int64_t r0, int64_t rows, cudaStream_t stream) {
  const int64_t n = rows * dst.cols;
  if (n == 0) return;
  const int64_t max_blocks = static_cast<int64_t>(cuda::detail::device_info().sms) * 8;
  const auto blocks = static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, max_blocks));
  core::dispatch_dtype(dst.dtype, [&](auto e) {
    store_sum_kernel<decltype(e)>
        <<<blocks, kThreads, 0, stream>>>(src, ranks, rank_stride, ld, dst, r0, rows);
  });
  check_cuda(cudaGetLastError(), "xent store_sum kernel launch");
}

}  // namespace xent::linear::device
