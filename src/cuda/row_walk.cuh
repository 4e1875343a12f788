// The row walk of every row kernel, written once (as CUB's agents are): the tuning policy, the
// mapping of rows to groups of threads (a warp, or the whole block), and one thread's share of a
// row: element by element at the unaligned head and at the tail, 16-byte packs in the body with
// several loads in flight. The kernels (stats.cu, gradient.cu) are the math of src/core on top.
#pragma once

#include <climits>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/warp/warp_reduce.cuh>
#include <string>
#include <type_traits>

#include "core/dtype.h"
#include "core/math.h"
#include "error.h"
#include "xent/xent.h"

namespace xent::cuda::detail {

// The knobs of the row kernels, in one place.
struct RowPolicy {
  // Measured and rejected: 8 loads in flight (3 or 4 blocks per SM), loading the next chunk
  // before using the current one (64 registers), and whole chunks without a check per pack
  // (more registers: 8192 x 16032 on H100 fell from 91.8 to 87.5 % of the 3-pass roofline).
  static constexpr int kBlock = 256;         // threads of every row kernel's block
  static constexpr int kLoads = 4;           // 16-byte loads in flight per thread
  static constexpr int kWarpRowPacks = 512;  // rows of at most this many packs go to one warp
  // Resident blocks per SM that __launch_bounds__ asks the register allocator for.
  // The softcap statistics (46 registers, 5 blocks resident) measured slower with more: at 6 and
  // 8 (40 and 32 registers) its pass over 8192 x 128000 bf16, cap 30, took 0.607 and 0.616 ms
  // against 0.596 (H200).
  static constexpr int kStatsBlocksPerSm = 4;    // the plain and the softcap statistics
  static constexpr int kGeneralBlocksPerSm = 3;  // statistics with sum or argmax
  static constexpr int kGradBlocksPerSm = 4;
};
constexpr int kBlock = RowPolicy::kBlock;

// Sixteen bytes of logits, as one load/store and as elements.
template <typename T>
union alignas(16) Pack {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
  uint4 v;
  T e[kN];
};

// A pack's elements as floats. bf16 by bit operations on each 32-bit word (one per element: a
// shift and a mask), rather than a conversion per element; other dtypes through E::load.
template <typename E>
__device__ __forceinline__ void unpack(const Pack<typename E::type>& v,
                                       float (&out)[Pack<typename E::type>::kN]) {
  using T = typename E::type;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w[4] = {v.v.x, v.v.y, v.v.z, v.v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int e = 0; e < Pack<T>::kN; ++e) out[e] = E::load(v.e[e]);
  }
}

// A pack whose every element is -inf: what a missing pack of a plain statistics chunk reads as.
template <typename T>
__device__ __forceinline__ uint4 neg_inf_pack() {
  if constexpr (sizeof(T) == 4)
    return make_uint4(0xff800000u, 0xff800000u, 0xff800000u, 0xff800000u);
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
  return make_uint4(0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u);  // half
}

// A row goes to a warp while it has at most kWarpRowPacks packs, else to the whole block.
template <typename T>
constexpr bool block_per_row(int64_t cols) {
  return cols / Pack<T>::kN > RowPolicy::kWarpRowPacks;
}

// f(std::integral_constant<int, threads per row>{}) for rows of `cols` columns.
template <typename T, typename F>
decltype(auto) dispatch_group(int64_t cols, F&& f) {
  return block_per_row<T>(cols) ? f(std::integral_constant<int, kBlock>{})
                                : f(std::integral_constant<int, 32>{});
}

// Blocks of a launch with one row per group of kGroup threads.
template <int kGroup>
unsigned row_blocks(int64_t rows) {
  constexpr int64_t per_block = kBlock / kGroup;
  const int64_t blocks = (rows + per_block - 1) / per_block;
  if (blocks > INT_MAX)
    fail("logits.rows = " + std::to_string(rows) + " is too many rows for one launch");
  return static_cast<unsigned>(blocks);
}

// This thread's row (group index; may be past the last row) and its lane in the row's group.
template <int kGroup>
__device__ __forceinline__ int64_t group_index() {
  return static_cast<int64_t>(blockIdx.x) * (kBlock / kGroup) + threadIdx.x / kGroup;
}
template <int kGroup>
__device__ __forceinline__ int group_lane() {
  return static_cast<int>(threadIdx.x % kGroup);
}

// Reduction of one value per thread over the group of threads that owns a row: a warp of a
// kBlock-thread block, or a whole block of kGroup threads.
template <typename V, int kGroup>
struct GroupReduce {
  using Block = cub::BlockReduce<V, kGroup>;
  using Storage = typename Block::TempStorage;
  template <typename Op>
  static __device__ __forceinline__ V reduce(Storage& s, V v, Op op) {
    return Block(s).Reduce(v, op);
  }
};

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

// How a row of n elements starting at p splits: [0, head) element by element until p + head is
// 16-byte aligned, then nv packs, then the tail [tail0, n). Works for any row stride.
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

// A chunk of the body as the reading functor sees it: v[u] (u < kU; the walk's are kLoads packs)
// is pack `i0 + u * kGroup` of the body while u < valid; the rest hold the walk's fill value.
template <typename T, int kU = RowPolicy::kLoads>
struct Chunk {
  static constexpr int kN = Pack<T>::kN;
  static constexpr int kPacks = kU;
  Pack<T> v[kU];
  int valid;
  int col0;    // the column of v[0].e[0]
  int stride;  // columns from v[u] to v[u + 1]
  __device__ __forceinline__ int col(int u, int e) const { return col0 + u * stride + e; }
};

// One thread's share (lane t of kGroup) of a row of n elements of type T.
template <typename T, int kGroup>
struct RowWalk {
  static constexpr int kN = Pack<T>::kN;
  static constexpr int kLoads = RowPolicy::kLoads;

  // Reads the row: elem(x, col) for the head and tail elements, chunk(c) for each chunk of the
  // body (kLoads packs loaded before any is used; missing packs read as `fill`).
  template <typename Elem, typename ChunkF>
  static __device__ __forceinline__ void read(const T* p, int n, int t, uint4 fill, Elem&& elem,
                                              ChunkF&& chunk) {
    const RowSplit s = split_row(p, n);
    if (t < s.head) elem(p[t], t);
    if (t < n - s.tail0) elem(p[s.tail0 + t], s.tail0 + t);
    const uint4* q = reinterpret_cast<const uint4*>(p + s.head);
    for (int i0 = t; i0 < s.nv; i0 += kGroup * kLoads) {
      Chunk<T> c;
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = i0 + u * kGroup;
        c.v[u].v = i < s.nv ? __ldg(q + i) : fill;
      }
      const int left = s.nv - i0;  // > 0
      c.valid = left >= kLoads * kGroup ? kLoads : (left + kGroup - 1) / kGroup;
      c.col0 = s.head + i0 * kN;
      c.stride = kGroup * kN;
      chunk(c);
    }
  }

  // out[c] = f(in[c], c) for c in [0, n). Stores are 16-byte packs at out's alignment; loads
  // too where in's body is 16-byte aligned there (always so in place): one pack of in's type
  // where it is out's, else as many as a pack of out's elements takes (fp32 logits whose
  // gradient is stored in 16 bits: two). Otherwise element loads. in == out is allowed (in
  // place); otherwise the two must not overlap.
  template <typename TI, typename F>
  static __device__ __forceinline__ void transform(const TI* in, T* out, int n, int t, F&& f) {
    const RowSplit s = split_row(out, n);
    if (t < s.head) out[t] = f(in[t], t);
    if (t < n - s.tail0) out[s.tail0 + t] = f(in[s.tail0 + t], s.tail0 + t);
    uint4* q = reinterpret_cast<uint4*>(out + s.head);
    if ((reinterpret_cast<uintptr_t>(in + s.head) & 15u) == 0)
      transform_body<true>(in + s.head, q, s, t, f);
    else
      transform_body<false>(in + s.head, q, s, t, f);
  }

  // out[c] = +0 for c in [0, n) (all-zero bits are +0 in every dtype).
  static __device__ __forceinline__ void zero(T* out, int n, int t) {
    const RowSplit s = split_row(out, n);
    const T z{};
    if (t < s.head) out[t] = z;
    if (t < n - s.tail0) out[s.tail0 + t] = z;
    uint4* q = reinterpret_cast<uint4*>(out + s.head);
    for (int i = t; i < s.nv; i += kGroup) q[i] = make_uint4(0u, 0u, 0u, 0u);
  }

 private:
  template <bool kAligned, typename TI, typename F>
  static __device__ __forceinline__ void transform_body(const TI* xb, uint4* q, const RowSplit& s,
                                                        int t, F& f) {
    for (int i0 = t; i0 < s.nv; i0 += kGroup * kLoads) {
      TI x[kLoads][kN];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = i0 + u * kGroup;
        if (i < s.nv) {
          if constexpr (kAligned) {
            // kN elements of TI: sizeof(TI) 16-byte packs (T is 2 or 4 bytes, TI no narrower).
            constexpr int kPacksIn = kN * static_cast<int>(sizeof(TI)) / 16;
            static_assert(kPacksIn * 16 == kN * static_cast<int>(sizeof(TI)), "whole packs");
            union {
              uint4 v[kPacksIn];
              TI e[kN];
            } w;
#pragma unroll
            for (int k = 0; k < kPacksIn; ++k)
              w.v[k] = reinterpret_cast<const uint4*>(xb)[i * kPacksIn + k];
#pragma unroll
            for (int e = 0; e < kN; ++e) x[u][e] = w.e[e];
          } else {
#pragma unroll
            for (int e = 0; e < kN; ++e) x[u][e] = xb[i * kN + e];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = i0 + u * kGroup;
        if (i < s.nv) {
          const int col0 = s.head + i * kN;
          Pack<T> v;
#pragma unroll
          for (int e = 0; e < kN; ++e) v.e[e] = f(x[u][e], col0 + e);
          q[i] = v.v;
        }
      }
    }
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
