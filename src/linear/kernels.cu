// The fused lm head's own kernels on the CUDA backend (cuda.h): a sum over the ranks' fp32
// partials, rounded once into the output's dtype (a grid-stride loop over the elements), the
// move of the gradient's scale into its GEMMs' alpha (one thread), and the records of a chunk
// from the epilogue engine's tile partials (a thread per row, the tiles in order).
#include <cuda_runtime.h>

#include <algorithm>

#include "backend.h"
#include "core/dtype.h"
#include "core/record.h"
#include "cuda/launch.cuh"
#include "cuda/row_agents.cuh"
#include "error.h"
#include "linear/cuda.h"
#include "linear/sm90/epilogue_gemm.h"

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

__global__ void __launch_bounds__(kThreads)
    merge_tiles_kernel(const core::Problem p, const float* partials, int64_t tiles,
                       const TargetsView targets, float* record, int64_t* error) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (row >= p.rows) return;
  core::LocalStats st;
  const bool want_sum = p.layout.sum_field >= 0, want_max = p.layout.max_field >= 0;
  for (int64_t t = 0; t < tiles; ++t) {  // in order: the same record on every run
    const float* f = partials + t * sm90::kTileFields * p.rows + row;
    core::LocalStats tile;
    tile.lse.m = f[sm90::kTileMax * p.rows];
    tile.lse.s = f[sm90::kTileSum * p.rows];
    tile.target_z = f[sm90::kTileTarget * p.rows];
    if (want_sum) tile.sum_z = f[sm90::kTileSumZ * p.rows];
    if (want_max) {
      tile.best.value = tile.lse.m;  // the tile's largest z
      tile.best.index = core::slot_to_index(f[sm90::kTileArgmax * p.rows]);
    }
    core::merge(st, tile);
  }
  core::write_record(st, p.layout, record, p.rows, row);
  const int64_t y = core::load_target(targets.data, targets.type, row);
  if (y != p.ignore_index && !core::target_in_range(y, p.vocab_size) && error != nullptr)
    cuda::detail::report_bad_target(error, targets.data, targets.type, row);
}

}  // namespace

void merge_tiles(const core::Problem& pc, const float* partials, int64_t tiles, TargetsView targets,
                 float* record, int64_t* error, cudaStream_t stream) {
  if (pc.rows == 0) return;
  const auto blocks = static_cast<unsigned>((pc.rows + kThreads - 1) / kThreads);
  merge_tiles_kernel<<<blocks, kThreads, 0, stream>>>(pc, partials, tiles, targets, record, error);
  check_cuda(cudaGetLastError(), "xent merge_tiles kernel launch");
}

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
