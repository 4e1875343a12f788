// The single-pass kernel: one rank, fused gradient, each row read from memory once. A block holds
// its row in registers (kPacks 16-byte packs per thread), takes the row's statistics from them
// (StatsAgent, as the statistics kernel does), writes its record, and writes the gradient from
// the same registers (GradAgent). The steps around it are the two-pass path's: count_valid before
// it (the reduction's scale, from the targets alone) and finalize after it (lse, losses and the
// reductions from the records). The gradient takes its lse from the row's record through
// core::merge_records, the very value finalize writes.
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "backend.h"
#include "core/dtype.h"
#include "core/record.h"
#include "cuda/launch.cuh"
#include "cuda/row_agents.cuh"

namespace xent::cuda {
namespace {

using namespace detail;

// The block shapes, smallest first: kThreads threads holding kPacks packs each. Registers hold
// the row (32 of them for 8 packs); the launch bounds keep a thread at 64 registers, so that
// 1024 threads (four or two blocks, 64 to 128 KB of rows in flight) fit an SM.
template <int Threads, int Packs>
struct Shape {
  static constexpr int kThreads = Threads;
  static constexpr int kPacks = Packs;
  static constexpr int kMinBlocks = 1024 / Threads;
};
using SmallShape = Shape<256, 8>;
using LargeShape = Shape<512, 8>;
static_assert(SmallShape::kPacks % 4 == 0 && LargeShape::kPacks % 4 == 0,
              "the statistics take the packs in chunks of 16 elements (2 or 4 packs)");

struct SinglePassPointers {
  float* record;
  int64_t* error;
  const float* scalars;  // the reduction's scale, from count_valid
};

template <typename E, typename S, Variant kVariant, bool kCap>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    single_pass_kernel(const core::Problem p, const LogitsView in, const LogitsView out,
                       const TargetsView targets, const SinglePassPointers ptr) {
  using T = typename E::type;
  using Agent = StatsAgent<E, S::kThreads, kVariant>;
  constexpr int kN = Pack<T>::kN;
  __shared__ typename Agent::Storage smem;
  __shared__ float row_lse;
  __shared__ int64_t row_target;
  pdl_trigger();
  pdl_wait();

  const int64_t row = blockIdx.x;
  const int t = static_cast<int>(threadIdx.x);
  const T* x = static_cast<const T*>(in.data) + row * in.row_stride;
  const int n = static_cast<int>(p.cols);  // all real (single_pass_fits)
  RowTarget<E> rt;
  if (t == 0) rt.fetch(p, targets, row, x, n);

  // The row into registers: pack t + u * kThreads of the aligned body, and one element of the
  // head and of the tail where this thread has one.
  const RowSplit s = split_row(x, n);
  const uint4* q = reinterpret_cast<const uint4*>(x + s.head);
  Pack<T> v[S::kPacks];
#pragma unroll
  for (int u = 0; u < S::kPacks; ++u) {
    const int i = t + u * S::kThreads;
    v[u].v = i < s.nv ? __ldg(q + i) : Agent::fill();
  }
  const bool has_head = t < s.head;
  const bool has_tail = t < n - s.tail0;
  const T head = has_head ? x[t] : T{};
  const T tail = has_tail ? x[s.tail0 + t] : T{};

  // The statistics, in chunks of 16 elements (StatsAgent unpacks a chunk at once: the walk's
  // chunks of 32 two-byte elements would not fit in registers beside the row).
  constexpr int kU = 16 / kN;
  Agent a(p);
  if (has_head) a.elem(head, t);
  if (has_tail) a.elem(tail, s.tail0 + t);
#pragma unroll
  for (int j = 0; j < S::kPacks / kU; ++j) {
    const int i0 = t + j * kU * S::kThreads;
    if (i0 < s.nv) {
      Chunk<T, kU> c;
#pragma unroll
      for (int u = 0; u < kU; ++u) c.v[u] = v[j * kU + u];
      const int left = s.nv - i0;
      c.valid = left >= kU * S::kThreads ? kU : (left + S::kThreads - 1) / S::kThreads;
      c.col0 = s.head + i0 * kN;
      c.stride = S::kThreads * kN;
      a.chunk(c);
    }
  }
  const core::LocalStats st = a.finish(smem);
  if (t == 0) {
    rt.write_record(p, st, a.k, targets, ptr.record, row, ptr.error);
    row_lse = core::merge_records(ptr.record, 1, p.layout, p.rows, row).lse;
    row_target = rt.target;
  }
  __syncthreads();

  // The gradient, from the registers.
  T* dx = static_cast<T*>(out.data) + row * out.row_stride;
  if (!has_gradient(p, row_target)) {
    RowWalk<T, S::kThreads>::zero(dx, n, t);
    return;
  }
  const GradAgent<E, kCap> grad(p, row_target, row_lse, ptr.scalars[Workspace::kScale]);
  if (has_head) dx[t] = grad(head, t);
  if (has_tail) dx[s.tail0 + t] = grad(tail, s.tail0 + t);
  const bool same_alignment =
      ((reinterpret_cast<uintptr_t>(x) ^ reinterpret_cast<uintptr_t>(dx)) & 15u) == 0;
#pragma unroll
  for (int u = 0; u < S::kPacks; ++u) {
    const int i = t + u * S::kThreads;
    if (i < s.nv) {
      const int col0 = s.head + i * kN;
      Pack<T> g;
#pragma unroll
      for (int e = 0; e < kN; ++e) g.e[e] = grad(v[u].e[e], col0 + e);
      if (same_alignment) {
        reinterpret_cast<uint4*>(dx + s.head)[i] = g.v;
      } else {  // a separate gradient buffer whose rows sit differently modulo 16 bytes
#pragma unroll
        for (int e = 0; e < kN; ++e) dx[col0 + e] = g.e[e];
      }
    }
  }
}

// f(shape) for the smallest shape whose registers hold a row of `cols` elements of type T.
template <typename T, typename F>
void dispatch_shape(int64_t cols, F&& f) {
  constexpr int kN = Pack<T>::kN;
  if (cols <= static_cast<int64_t>(SmallShape::kThreads) * SmallShape::kPacks * kN)
    f(SmallShape{});
  else
    f(LargeShape{});
}

}  // namespace

bool single_pass_fits(const core::Problem& p, DType dtype) {
  if (p.real_cols != p.cols) return false;  // padding columns: the two-pass path
  const int64_t n = static_cast<int64_t>(16 / dtype_size(dtype));  // elements per pack
  // Rows that a warp takes on the two-pass path stay there (a block per row would idle).
  const bool block_row = p.cols / n > RowPolicy::kWarpRowPacks;
  return block_row && p.cols <= static_cast<int64_t>(LargeShape::kThreads) * LargeShape::kPacks * n;
}

void single_pass(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
                 float* record, int64_t* error, const float* scalars, cudaStream_t stream) {
  if (p.rows == 0) return;
  check_shape(p, in);
  if (out.data != in.data) check_shape(p, out, "grad");
  if (!single_pass_fits(p, in.dtype))
    fail("the single-pass kernel cannot hold rows of " + std::to_string(p.cols) + " columns");
  if (p.rows > INT_MAX)
    fail("logits.rows = " + std::to_string(p.rows) + " is too many rows for one launch");
  const SinglePassPointers ptr{record, error, scalars};
  const Variant v = variant_of(p);
  core::dispatch_dtype(in.dtype, [&](auto e) {
    using E = decltype(e);
    dispatch_shape<typename E::type>(p.cols, [&](auto shape) {
      dispatch_bool(p.softcap > 0.0f, [&](auto cap) {
        const auto go = [&](auto variant) {
          launch("xent single-pass kernel",
                 single_pass_kernel<E, decltype(shape), variant(), cap()>,
                 static_cast<unsigned>(p.rows), decltype(shape)::kThreads, p.programmatic_launch,
                 stream, p, in, out, targets, ptr);
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

}  // namespace xent::cuda
