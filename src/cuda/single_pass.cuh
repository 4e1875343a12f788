// The single-pass kernel: fused gradient, each row read from memory once. A row is held
// on chip by one block, or for wide rows by a cluster of blocks that each hold a part and merge
// their statistics through distributed shared memory (sm_90). A thread holds kPacks 16-byte packs
// in registers and, in the wider shapes, kSmemPacks more in shared memory (copied there
// asynchronously, so that they are in flight beside the register loads). From the held row: its
// statistics (StatsAgent, as the statistics kernel takes them), its record, then the gradient
// (GradAgent). The steps around it are the two-pass path's: count_valid before it (the
// reduction's scale, from the targets alone) and finalize after it (lse, losses and the reductions
// from the records). The gradient takes the lse that finalize computes from the row's record
// (RowTarget::one_rank_lse). On several ranks (Options::device_exchange) the grid is persistent:
// each cluster takes row after row by ticket (in increasing order on every rank), the row's
// record goes to the other ranks device-side, and the gradient waits for theirs
// (cuda/exchange.cuh).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>
#include <tuple>

#include "backend.h"
#include "core/dtype.h"
#include "core/record.h"
#include "cuda/cluster.cuh"
#include "cuda/exchange.cuh"
#include "cuda/launch.cuh"
#include "cuda/row_agents.cuh"
#include "error.h"

namespace xent::cuda {
namespace single_pass_detail {

using namespace detail;

// The shapes, smallest first: clusters of kBlocks blocks of kThreads threads, each thread holding
// kPacks packs in registers (4 registers a pack) and kSmemPacks in shared memory. The launch
// bounds keep a thread at 64 registers, so that 1024 threads fit an SM: 64 to 256 KB of rows in
// flight on it.
template <int Threads, int Packs, int Blocks, int SmemPacks = 0>
struct Shape {
  static constexpr int kThreads = Threads;
  static constexpr int kPacks = Packs;          // in registers
  static constexpr int kSmemPacks = SmemPacks;  // in shared memory
  static constexpr int kBlocks = Blocks;        // a cluster's, 8 at most (the portable size)
  static constexpr int kMinBlocks = 1024 / Threads;
  static constexpr int kBlockPacks = Threads * (Packs + SmemPacks);
  static constexpr size_t kSmemBytes = static_cast<size_t>(Threads) * SmemPacks * 16;
  static constexpr int64_t kRowPacks = static_cast<int64_t>(kBlockPacks) * Blocks;
};
// kN gradient elements of type O as one store: 16 bytes where the gradient has the logits' dtype,
// 8 where fp32 logits (4 to a pack) give a 16-bit gradient (the fused lm head's sub-chunks).
template <typename O, int kN>
union alignas(kN * sizeof(O)) OutPack {
  std::conditional_t<kN * sizeof(O) == 16, uint4, uint2> v;
  O e[kN];
};
static_assert(sizeof(OutPack<__nv_bfloat16, 4>) == 8 && sizeof(OutPack<float, 4>) == 16,
              "a pack's gradient is one store");

struct SinglePassPointers {
  float* record;  // one rank: its records; device exchange: every rank's (finalize's `gathered`)
  int64_t* error;
  const float* scalars;  // the reduction's scale, from count_valid
};

// E: the logits' dtype; EO: the gradient's (E, or 16 bits from fp32 logits).
template <typename E, typename EO, typename S, Variant kVariant, bool kCap, bool kExchange>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    single_pass_kernel(const core::Problem p, const LogitsView in, const LogitsView out,
                       const TargetsView targets, const SinglePassPointers ptr,
                       const PeerExchange xc) {
  using T = typename E::type;
  using O = typename EO::type;
  using Agent = StatsAgent<E, S::kThreads, kVariant>;
  constexpr int kN = Pack<T>::kN;
  __shared__ typename Agent::Storage smem;
  __shared__ core::LocalStats part;  // this block's share of the row, for its cluster
  __shared__ float row_lse;
  __shared__ int64_t row_target;
  __shared__ int64_t next_row[2];  // kExchange: the cluster's rows by ticket, by turn parity
  pdl_trigger();
  pdl_wait();

  const int rank = S::kBlocks > 1 ? cluster_rank() : 0;
  const int t = static_cast<int>(threadIdx.x);
  uint32_t epoch = 0;  // the exchange's, read by the thread that exchanges
  if constexpr (kExchange)
    if (t == 0 && rank == 0) epoch = exchange_epoch(xc);
  // One row a cluster; with the exchange, turn after turn, each taking the next row's ticket.
  const auto one_row = [&](const int64_t row, const int turn) {
    const T* x = static_cast<const T*>(in.data) + row * in.row_stride;
    // The real columns: padding columns past them are never read, and get gradient 0 below.
    const int n = static_cast<int>(p.real_cols);
    RowTarget<E> rt;
    if (t == 0) rt.fetch(p, targets, row, x, n);

    // This block's part of the row on chip: of the aligned body, packs base + t + u * kThreads into
    // registers and sbase + t + u * kThreads into shared memory; the unaligned head goes to the
    // first block, the tail to the last, an element a thread. The register loads are issued first:
    // the statistics start on them while the copies are in flight. Issued after the copies, they
    // cost the capped path 7 % (H100, 8192 x 256000 bf16, softcap 30: 4.28 against 4.00 ms).
    const RowSplit s = split_row(x, n);
    const int base = rank * S::kBlockPacks;
    const int sbase = base + S::kThreads * S::kPacks;  // the packs held in shared memory
    const uint4* q = reinterpret_cast<const uint4*>(x + s.head);
    Pack<T> v[S::kPacks];
#pragma unroll
    for (int u = 0; u < S::kPacks; ++u) {
      const int i = base + t + u * S::kThreads;
      v[u].v = i < s.nv ? __ldg(q + i) : Agent::fill();
    }
    extern __shared__ uint4 held[];  // kThreads * kSmemPacks: thread t's packs t + u * kThreads
    if constexpr (S::kSmemPacks > 0) {
#pragma unroll
      for (int u = 0; u < S::kSmemPacks; ++u) {
        const int i = sbase + t + u * S::kThreads;
        if (i < s.nv) copy_async_16(&held[t + u * S::kThreads], q + i);
      }
    }
    const bool has_head = rank == 0 && t < s.head;
    const bool has_tail = rank == S::kBlocks - 1 && t < n - s.tail0;
    const T head = has_head ? x[t] : T{};
    const T tail = has_tail ? x[s.tail0 + t] : T{};

    // The statistics, in chunks of 16 elements (StatsAgent unpacks a chunk at once: the walk's
    // chunks of 32 two-byte elements would not fit in registers beside the row).
    constexpr int kU = 16 / kN;
    Agent a(p);
    if (has_head) a.elem(head, t);
    if (has_tail) a.elem(tail, s.tail0 + t);
    // The chunks of the thread's packs `first + t + u * kThreads`, u < kCount, pack(u) the u-th.
    const auto take = [&](int first, auto count, const auto& pack) {
      constexpr int kCount = decltype(count)::value;
      static_assert(kCount % kU == 0, "whole chunks of 16 elements");
#pragma unroll
      for (int j = 0; j < kCount / kU; ++j) {
        const int i0 = first + t + j * kU * S::kThreads;
        if (i0 < s.nv) {
          Chunk<T, kU> c;
#pragma unroll
          for (int u = 0; u < kU; ++u) c.v[u] = pack(j * kU + u);
          const int left = s.nv - i0;
          c.valid = left >= kU * S::kThreads ? kU : (left + S::kThreads - 1) / S::kThreads;
          c.col0 = s.head + i0 * kN;
          c.stride = S::kThreads * kN;
          a.chunk(c);
        }
      }
    };
    take(base, std::integral_constant<int, S::kPacks>{}, [&](int u) { return v[u]; });
    if constexpr (S::kSmemPacks > 0) {
      wait_async_copies();  // this thread's own copies: it reads only those
      take(sbase, std::integral_constant<int, S::kSmemPacks>{}, [&](int u) {
        const int h = t + u * S::kThreads;
        Pack<T> w;
        w.v = sbase + h < s.nv ? held[h] : Agent::fill();
        return w;
      });
    }
    core::LocalStats st = a.finish(smem);
    if constexpr (S::kBlocks > 1) {
      // Every block merges the cluster's parts in rank order: the same statistics in each.
      if (t == 0) part = st;
      cluster_sync();
      if (t == 0) {
        st = in_block(part, 0);
        for (int r = 1; r < S::kBlocks; ++r) core::merge(st, in_block(part, r));
      }
    }
    if constexpr (kExchange) {
      // Block 0 exchanges the record and gives every block of the cluster the global lse, as
      // finalize merges the gathered records, and the next row: its ticket, taken before the
      // exchange's round trips so that it arrives under them. (Rows dealt out in turn, first +
      // clusters, ..., ran 1 to 11 % slower on one H200, 8192 rows of 16032 to 128256 columns:
      // the clusters that end last set the time.)
      if (t == 0 && rank == 0) {
        const int64_t next = take_ticket(xc);
        float rec[core::RecordLayout::kMaxFields];
        rt.one_row_record(p, st, a.k, targets, rec, row, ptr.error);
        publish_record(xc, p.layout, rec, row, epoch);
        gather_record(xc, p.layout, row, ptr.record, epoch);
        const float lse = core::merge_records(ptr.record, xc.ranks, p.layout, p.rows, row).lse;
        set_in_cluster<S::kBlocks>(row_lse, lse);
        set_in_cluster<S::kBlocks>(next_row[turn & 1], next);
      }
      if (t == 0) row_target = rt.target;
    } else if (t == 0) {
      if (rank == 0) rt.write_record(p, st, a.k, targets, ptr.record, row, ptr.error);
      row_lse = rt.one_rank_lse(p, st);
      row_target = rt.target;
    }
    sync_cluster<S::kBlocks>();  // and no block leaves while another reads its part

    // This block's part of the gradient, from the registers (0 for a row without one).
    O* dx = static_cast<O*>(out.data) + row * out.row_stride;
    using Out = OutPack<O, kN>;
    // Whether a pack's gradient is one aligned store (in place, always).
    const bool vector_out = reinterpret_cast<uintptr_t>(dx + s.head) % sizeof(Out) == 0;
    const auto write_pack = [&](const auto& f, const Pack<T>& in_pack, int i) {
      const int col0 = s.head + i * kN;
      Out g;
#pragma unroll
      for (int e = 0; e < kN; ++e) g.e[e] = f(in_pack.e[e], col0 + e);
      if (vector_out) {
        reinterpret_cast<decltype(g.v)*>(dx + s.head)[i] = g.v;
      } else {  // a separate gradient buffer whose rows sit differently modulo the store
#pragma unroll
        for (int e = 0; e < kN; ++e) dx[col0 + e] = g.e[e];
      }
    };
    const auto write = [&](const auto& f) {
      if (has_head) dx[t] = f(head, t);
      if (has_tail) dx[s.tail0 + t] = f(tail, s.tail0 + t);
#pragma unroll
      for (int u = 0; u < S::kPacks; ++u) {
        const int i = base + t + u * S::kThreads;
        if (i < s.nv) write_pack(f, v[u], i);
      }
#pragma unroll
      for (int u = 0; u < S::kSmemPacks; ++u) {
        const int i = sbase + t + u * S::kThreads;
        if (i < s.nv) {
          Pack<T> w;
          w.v = held[t + u * S::kThreads];
          write_pack(f, w, i);
        }
      }
    };
    if (has_gradient(p, row_target))
      write(GradAgent<E, kCap, EO>(p, row_target, row_lse, ptr.scalars[Workspace::kScale]));
    else
      write([](T, int) { return O{}; });
    if (rank == S::kBlocks - 1)  // the padding (kMostPadding columns at most, single_pass_fits)
      for (int c = n + t; c < static_cast<int>(p.cols); c += S::kThreads) dx[c] = O{};
  };
  if constexpr (kExchange) {
    // What the exchange costs, one H200, one rank, 8192 x 64128 bf16: 0.636 ms against the
    // one-row kernel's 0.557. Nsight Compute: mostly the other warps' wait at the barrier for
    // thread 0's exchange (twice the one-row kernel's stall samples there), then registers (the
    // loop spills: 8 % more instructions, 34 MB of local-memory loads against 0.26). Tried:
    // without the exchange's waits, 0.612 to 0.636; a cluster a row with its ticket taken at its
    // start, 0.671 without the waits and 0.683 with them (the ticket's round trip exposed); the
    // lse merged from the gathered words in registers, 0.630 (0.190 against 0.188 at 16032).
    // Turn k reads next_row[k & 1] after the cluster's last barrier of that turn; the next write
    // to it, in turn k + 2, comes after every thread of the cluster has passed turn k + 1's.
    if (t == 0 && rank == 0) {
      const int64_t first = take_ticket(xc);
      set_in_cluster<S::kBlocks>(next_row[1], first);
    }
    sync_cluster<S::kBlocks>();
    int64_t row = next_row[1];
    for (int turn = 0; row < p.rows; ++turn) {
      one_row(row, turn);
      row = next_row[turn & 1];
    }
  } else {
    one_row(blockIdx.x / S::kBlocks, 0);
  }
}

// f(shape) for the smallest shape that holds a row of `cols` elements of type T.
// Measured on H100 (8192 rows, bf16, mean, fused, forward + backward; 93 % of the 2-pass floor):
// 128256 columns 1.497 ms in clusters of 2 of these shapes, against 1.611 ms with 8 packs in
// registers and 8 in shared memory, and 1.684 ms with the whole row in registers (clusters of 4;
// Nsight Compute: at most 62 of them resident, 248 of the 264 block slots). With softcap 30 the
// clusters now beat the two-pass path too (256000 columns: 4.007 against 4.325 ms; 64128: 0.895
// against 1.091), so capped rows take them; in clusters of 8 of the whole-row-in-registers
// shapes they had lost (5.05 against 4.33 ms at 256000). Also rejected:
// clusters of 256-thread blocks (1.937 ms); 4 packs per thread at 3 blocks per SM (40 registers,
// spilled: 2.356 ms); streaming loads and stores (__ldcs, __stcs: 1.776 ms, and no gain at 16032
// or 32064 columns); an L2 prefetch of the row a block's successor takes (2.09 ms: the prefetched
// lines were evicted before use). Rows of up to 4096 packs stay in registers: 32064 columns run
// at 94 % of the floor there. Clusters of 3 keep Qwen's 151936 columns from clusters of 4 that
// would be 58 % full (1.885 against 2.147 ms).
using Shapes = std::tuple<Shape<256, 8, 1>, Shape<512, 8, 1>, Shape<512, 4, 1, 12>,
                          Shape<512, 4, 2, 12>, Shape<512, 4, 3, 12>, Shape<512, 4, 4, 12>>;
constexpr int64_t kLargestRowPacks =
    std::tuple_element_t<std::tuple_size_v<Shapes> - 1, Shapes>::kRowPacks;
// The widest row one block holds in registers: the limit below compute capability 9.0 (no
// clusters, and shared memory per SM too small for two blocks of the wider shapes).
constexpr int64_t kLargestBlockRowPacks = std::tuple_element_t<1, Shapes>::kRowPacks;

// Padding columns (past vocab_size) that the single-pass kernel zeroes in its gradient, at most:
// one block's threads write them an element each, where the two-pass path would stream them.
constexpr int64_t kMostPadding = 4096;

// 16-byte packs in a row of p's real columns (the ones the kernel holds).
inline int64_t row_packs(const core::Problem& p, DType dtype) {
  return p.real_cols / static_cast<int64_t>(16 / dtype_size(dtype));
}

template <size_t I = 0, typename F>
void dispatch_shape(int64_t packs, F&& f) {
  using S = std::tuple_element_t<I, Shapes>;
  if constexpr (I + 1 == std::tuple_size_v<Shapes>)
    f(S{});
  else if (packs <= S::kRowPacks)
    f(S{});
  else
    dispatch_shape<I + 1>(packs, std::forward<F>(f));
}

// Refuses what the kernel cannot take (api.cpp asked single_pass_fits before), and a gradient
// whose dtype is not the logits' (with `mixed`, fp32 logits may have a 16-bit gradient).
void check_single_pass(const core::Problem& p, LogitsView in, LogitsView out, bool mixed);

// f(E, EO) for the logits' and the gradient's dtypes, among the pairs check_single_pass takes.
template <bool kMixed, typename F>
void dispatch_dtypes(DType in, DType out, F&& f) {
  core::dispatch_dtype(in, [&](auto e) {
    using E = decltype(e);
    if (out == in) {
      f(e, e);
    } else if constexpr (kMixed && std::is_same_v<typename E::type, float>) {
      core::dispatch_dtype(out, [&](auto eo) {
        if constexpr (!std::is_same_v<typename decltype(eo)::type, float>) f(e, eo);
      });
    }
  });
}

// Launches the single-pass kernel on p's rows: a cluster a row, or (kExchange) as many clusters
// as are resident at once, device_share of them, each taking rows by ticket (more would start
// only to find the tickets taken).
template <bool kExchange>
void launch_single_pass(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
                        const SinglePassPointers& ptr, const PeerExchange& xc, float device_share,
                        cudaStream_t stream) {
  const int64_t packs = row_packs(p, in.dtype);
  const Variant v = variant_of(p);
  dispatch_dtypes<!kExchange>(in.dtype, out.dtype, [&](auto e, auto eo) {
    using E = decltype(e);
    using EO = decltype(eo);
    dispatch_shape(packs, [&](auto shape) {
      using S = decltype(shape);
      if (p.rows > INT_MAX / S::kBlocks)
        fail("logits.rows = " + std::to_string(p.rows) + " is too many rows for one launch");
      dispatch_bool(p.softcap > 0.0f, [&](auto cap) {
        const auto go = [&](auto variant) {
          const auto kernel = single_pass_kernel<E, EO, S, variant(), cap(), kExchange>;
          // Per kernel (one per instantiation of this lambda) and device.
          if constexpr (S::kSmemBytes > 48 * 1024) {
            // Past 48 KB a kernel asks for its shared memory, on each device.
            static PerDevice asked;
            asked.get(current_device(), [&] {
              const cudaError_t e = cudaFuncSetAttribute(
                  kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes);
              if (e != cudaSuccess) launch_failed("xent single-pass kernel (shared memory)", e);
              return 1;
            });
          }
          int64_t clusters = p.rows;
          if constexpr (kExchange) {
            static PerDevice resident;
            const int n = resident.get(current_device(), [&] {
              return resident_clusters(kernel, S::kThreads, S::kBlocks, S::kSmemBytes);
            });
            const auto share = static_cast<int64_t>(static_cast<double>(n) * device_share);
            clusters = std::max<int64_t>(1, std::min<int64_t>(p.rows, share));
          }
          launch_clusters("xent single-pass kernel", kernel,
                          static_cast<unsigned>(clusters * S::kBlocks), S::kThreads, S::kBlocks,
                          S::kSmemBytes, p.programmatic_launch, stream, p, in, out, targets, ptr,
                          xc);
        };
        using V = Variant;
        // Only the pairs that occur: plain has no cap, capped always one.
        if (v == V::general)
          go(std::integral_constant<V, V::general>{});
        else if constexpr (decltype(cap)::value)
          go(std::integral_constant<V, V::capped>{});
        else
          go(std::integral_constant<V, V::plain>{});
      });
    });
  });
}

}  // namespace single_pass_detail
}  // namespace xent::cuda
