// xent_dist_bench: the GPU side of the check. A plain fp64 softmax per row over the rank's
// regenerated global row (one block per row), and an element-wise comparison of the gradient
// shard against it. Independent of the library's kernels and math.
#include <cstdio>
#include <cub/block/block_reduce.cuh>
#include <stdexcept>
#include <string>

#include "reference.h"

namespace xb {
namespace {

constexpr int kThreads = 256;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("xent_dist_bench: ") + what + ": " +
                             cudaGetErrorString(e));
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 8192 ? (blocks > 0 ? blocks : 1) : 8192);
}

__global__ void fill_logits_kernel(Problem p, void* data) {
  const int64_t n = p.rows * p.width;
  const float pad = pad_logit(p);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.width, col = p.start + i % p.width;
    store_elem(p.dtype, data, i, col < p.vocab ? gen_logit(p, r, col) : pad);
  }
}

struct MaxOp {
  __device__ double operator()(double a, double b) const { return a > b ? a : b; }
};

__global__ void ref_rows_kernel(Problem p, RefRow* rows) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ double row_max;
  const int64_t r = blockIdx.x;
  RefRow row;
  row.target = gen_target(p, r);
  row.ignored = row.target == p.ignore_index ? 1 : 0;
  if (!row.ignored) {
    double m = -INFINITY, sz = 0.0;
    for (int64_t c = threadIdx.x; c < p.vocab; c += blockDim.x) {
      const double z = ref_z(p, gen_logit(p, r, c));
      m = z > m ? z : m;
      sz += z;
    }
    const double bm = Reduce(tmp).Reduce(m, MaxOp{});
    if (threadIdx.x == 0) row_max = bm;
    __syncthreads();
    const double gm = row_max;
    const double bsz = Reduce(tmp).Sum(sz);
    __syncthreads();
    double s = 0.0;
    for (int64_t c = threadIdx.x; c < p.vocab; c += blockDim.x)
      s += exp(ref_z(p, gen_logit(p, r, c)) - gm);
    const double bs = Reduce(tmp).Sum(s);
    if (threadIdx.x == 0) {
      row.lse = gm + log(bs);
      row.sum_z = bsz;
      row.target_z = ref_z(p, gen_logit(p, r, row.target));
    }
  }
  if (threadIdx.x == 0) {
    ref_finish_row(p, row);
    rows[r] = row;
  }
}

struct CheckState {
  unsigned long long wrong;
  int taken;
  Mismatch first;
};

__global__ void check_grad_kernel(Problem p, const void* grad, const RefRow* rows, double row_scale,
                                  CheckState* st) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t n = p.rows * p.width;
  unsigned long long wrong = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.width, col = p.start + i % p.width;
    const double x = col < p.vocab ? gen_logit(p, r, col) : pad_logit(p);
    const double got = load_elem(p.dtype, grad, i);
    double want, tol;
    if (!check_grad_elem(p, rows[r], col, x, got, row_scale, &want, &tol)) {
      ++wrong;
      if (atomicCAS(&st->taken, 0, 1) == 0) {
        Mismatch m;
        m.kind = 1;
        m.row = r;
        m.col = col;
        m.got = got;
        m.want = want;
        m.tol = tol;
        st->first = m;
      }
    }
  }
  const unsigned long long total = Reduce(tmp).Sum(wrong);
  if (threadIdx.x == 0 && total) atomicAdd(&st->wrong, total);
}

}  // namespace

void cuda_fill_logits(const Problem& p, void* dev, cudaStream_t stream) {
  fill_logits_kernel<<<grid_for(p.rows * p.width), kThreads, 0, stream>>>(p, dev);
  cuda_check(cudaGetLastError(), "fill_logits_kernel");
}

void cuda_ref_rows(const Problem& p, RefRow* rows, cudaStream_t stream) {
  if (p.rows == 0) return;
  ref_rows_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p, rows);
  cuda_check(cudaGetLastError(), "ref_rows_kernel");
}

int64_t cuda_check_grad(const Problem& p, const void* grad, const RefRow* rows, double inv_valid,
                        Mismatch* first, cudaStream_t stream) {
  CheckState* st = nullptr;
  cuda_check(cudaMalloc(&st, sizeof(CheckState)), "cudaMalloc(check state)");
  cuda_check(cudaMemsetAsync(st, 0, sizeof(CheckState), stream), "cudaMemsetAsync");
  check_grad_kernel<<<grid_for(p.rows * p.width), kThreads, 0, stream>>>(
      p, grad, rows, ref_row_scale(p, inv_valid), st);
  cuda_check(cudaGetLastError(), "check_grad_kernel");
  CheckState host;
  cuda_check(cudaMemcpyAsync(&host, st, sizeof host, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync");
  cuda_check(cudaStreamSynchronize(stream), "check_grad_kernel (synchronize)");
  cuda_check(cudaFree(st), "cudaFree");
  if (host.wrong && first && first->kind == 0) *first = host.first;
  return static_cast<int64_t>(host.wrong);
}

}  // namespace xb
