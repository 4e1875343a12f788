// The single-pass kernel's on-chip primitives (single_pass.cuh): 16-byte copies from global to
// shared memory in flight beside register loads, and a block cluster's rank, barrier and
// distributed shared memory, each with a one-block fallback so that other architectures compile.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

namespace xent::cuda::single_pass_detail {

// cp.async: a 16-byte copy from global to shared memory that needs no register (sm_80 on; shapes
// with shared-memory packs run on sm_90 only, see single_pass_fits).
__device__ __forceinline__ void copy_async_16(uint4* to, const uint4* from) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(to))),
               "l"(from));
#else
  *to = *from;
#endif
}
__device__ __forceinline__ void wait_async_copies() {  // this thread's own
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
// A cluster's calls, from sm_90 on (single_pass_fits picks no cluster shape below it; the
// fallbacks only keep other architectures compiling).
__device__ __forceinline__ int cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return static_cast<int>(cooperative_groups::this_cluster().block_rank());
#else
  return 0;
#endif
}
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}
template <typename V>
__device__ __forceinline__ const V& in_block(const V& v, int rank) {  // v in block `rank`'s smem
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return *cooperative_groups::this_cluster().map_shared_rank(&v, rank);
#else
  return v;
#endif
}

template <typename V>
__device__ __forceinline__ V* to_block(V& v, int rank) {  // v in block `rank`'s smem, to write
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(&v, rank);
#else
  return &v;
#endif
}

// A barrier for every thread of a cluster of kBlocks (1: this block's, no cluster call).
template <int kBlocks>
__device__ __forceinline__ void sync_cluster() {
  if constexpr (kBlocks > 1)
    cluster_sync();
  else
    __syncthreads();
}

// v = value in every block of a cluster of kBlocks (1: in this block, no cluster call).
template <int kBlocks, typename V>
__device__ __forceinline__ void set_in_cluster(V& v, const V value) {
  if constexpr (kBlocks > 1)
    for (int b = 0; b < kBlocks; ++b) *to_block(v, b) = value;
  else
    v = value;
}

}  // namespace xent::cuda::single_pass_detail
