// Device helpers of the CUDA backend: 16-byte packs of any logits dtype, the split of a row into
// a scalar head (up to the first 16-byte boundary), a vector body and a scalar tail, and the
// reduction of a per-thread value over a row's group of threads (a warp or the whole block).
#pragma once

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>

#include "core/dtype.h"
#include "core/math.h"

namespace xent::cuda::detail {

constexpr int kBlock = 256;  // threads of every row kernel; a row is a warp or the whole block

// Sixteen bytes of logits, as one load/store and as elements.
template <typename T>
union alignas(16) Pack {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
  uint4 v;
  T e[kN];
};

// A pack whose every element is -inf: what a missing element of a plain stats batch reads as.
template <typename T>
__device__ __forceinline__ uint4 neg_inf_pack();
template <>
__device__ __forceinline__ uint4 neg_inf_pack<float>() {
  return make_uint4(0xff800000u, 0xff800000u, 0xff800000u, 0xff800000u);
}
template <>
__device__ __forceinline__ uint4 neg_inf_pack<__nv_bfloat16>() {
  return make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
}
template <>
__device__ __forceinline__ uint4 neg_inf_pack<__half>() {
  return make_uint4(0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u);
}

// How a row of n elements starting at p splits: [0, head) scalar until p + head is 16-byte
// aligned, then nv packs, then the scalar tail [tail0, n). Works for any row stride.
struct RowSplit {
  int head;
  int nv;
  int tail0;
};

template <typename T>
__device__ __forceinline__ RowSplit split_row(const T* p, int n) {
  constexpr int kN = Pack<T>::kN;
  int head = static_cast<int>(((16u - (reinterpret_cast<uintptr_t>(p) & 15u)) & 15u) / sizeof(T));
  if (head > n) head = n;
  const int nv = (n - head) / kN;
  return RowSplit{head, nv, head + nv * kN};
}

// Reduction of one value per thread over the group of threads that owns a row.
template <typename V, int kGroup>
struct GroupReduce;

template <typename V>
struct GroupReduce<V, 32> {
  using Warp = cub::WarpReduce<V>;
  struct Storage {
    typename Warp::TempStorage warp[kBlock / 32];
  };
  template <typename Op>
  static __device__ __forceinline__ V reduce(Storage& s, V v, Op op) {
    return Warp(s.warp[threadIdx.x / 32]).Reduce(v, op);
  }
};

template <typename V>
struct GroupReduce<V, kBlock> {
  using Block = cub::BlockReduce<V, kBlock>;
  using Storage = typename Block::TempStorage;
  template <typename Op>
  static __device__ __forceinline__ V reduce(Storage& s, V v, Op op) {
    return Block(s).Reduce(v, op);
  }
};

// Programmatic dependent launch (Hopper): every kernel lets the next one in the stream be
// scheduled at once (its blocks then wait in pdl_wait), and waits for the previous one to have
// completed, its memory visible, before it touches global memory. No-ops without PDL.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace xent::cuda::detail
