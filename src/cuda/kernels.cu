// The CUDA backend: the steps of backend.h as kernels over the shared math of src/core.
//
// Launch shapes (every row kernel has 256-thread blocks):
//   - a row is owned by a warp when it holds at most 512 16-byte packs (4096 bf16/fp16 or 2048
//     fp32 columns: 8 rows per block), else by the whole block (a block per row);
//   - each thread keeps kU = 4 16-byte loads in flight before it uses any of them;
//   - the gradient kernel walks the rows last to first, so the rows the stats kernel read last
//     are still in L2 when it starts; it stores 16-byte packs at the output row's alignment and
//     loads 16-byte packs too where the input row has the same alignment modulo 16 bytes (always
//     in place; out of place with equal strides and aligned bases), else element by element;
//   - finalize is one 256-thread block per 256 rows (at most Workspace::kPartials blocks, a
//     number that depends on rows alone); each block reduces its rows' totals in a fixed shape
//     into Workspace::partials, and the last block to finish (a self-resetting counter) reduces
//     those in block order: bitwise reproducible. Measured on H100 at N = 8192 (32 blocks):
//     6.3 us against 14.1 us for the single 1024-thread block it replaces;
//   - count_valid is one block of 1024 threads looping over the rows in a fixed order, then a
//     CUB block reduction: bitwise reproducible, no scratch, no atomics;
//   - scale_rows is a grid-stride loop over at most 4 blocks per SM; each block first reads the
//     scalar grad_output and returns when it is 1;
//   - every launch uses programmatic dependent launch on sm_90+ (XENT_CUDA_PDL=0 turns it off):
//     each kernel triggers its successor at entry and waits (griddepcontrol.wait) for its
//     predecessor before touching global memory, so launch latency overlaps the previous
//     kernel's tail. Measured on H100: about 1% of forward + backward at 8192 x 16032.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include "backend.h"
#include "core/dtype.h"
#include "core/record.h"
#include "cuda/rowwise.cuh"
#include "cuda/tuning.cuh"

namespace xent::cuda {
namespace {

using detail::GroupReduce;
using detail::kBlock;
using detail::Pack;
using detail::pdl_trigger;
using detail::pdl_wait;
using detail::RowSplit;
using detail::split_row;

constexpr int kU = 4;               // 16-byte loads in flight per thread
constexpr int kWarpRowPacks = 512;  // rows of at most this many packs go to a warp
constexpr int kReduceThreads = 1024;
constexpr int kFinalizeThreads = 256;
static_assert(Workspace::kPartials <= kFinalizeThreads,
              "the last finalize block reduces one partial per thread");

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(std::string("xent: CUDA call ") + what + " failed: " + cudaGetErrorString(e));
}

std::atomic<bool>& pdl_flag() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("XENT_CUDA_PDL");
    return !(e != nullptr && e[0] == '0');
  }()};
  return on;
}

// What the launches need of the current device, read once per device: its multiprocessors,
// and whether it takes programmatic dependent launch (compute capability 9.0 and newer).
struct DeviceInfo {
  int sms;
  bool pdl;
};

DeviceInfo device_info() {
  static std::array<std::atomic<int>, 128> cache{};  // sms * 2 + pdl, 0 = not read yet
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  const bool cached = dev >= 0 && dev < static_cast<int>(cache.size());
  int v = cached ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (v == 0) {  // devices past the cache are read on every call, never another's
    int sms = 0, major = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
          "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
          "cudaDeviceGetAttribute(cudaDevAttrComputeCapabilityMajor)");
    v = sms * 2 + (major >= 9 ? 1 : 0);
    if (cached) cache[dev].store(v, std::memory_order_relaxed);
  }
  return DeviceInfo{v / 2, (v & 1) != 0};
}

// Launches kernel<<<grid, block, 0, stream>>>(args...), with programmatic stream serialization
// where the device and the switch allow it, and checks the launch.
template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), unsigned grid, unsigned block,
            cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = (pdl_flag().load(std::memory_order_relaxed) && device_info().pdl) ? 1 : 0;
  // The launch's own status only: cudaGetLastError here would also report (and clear) an
  // earlier, unrelated asynchronous error of the caller's as if this launch had failed.
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) {
    cudaGetLastError();  // this launch's error is reported here, not by the caller's next check
    throw Error(std::string("xent: launch of ") + name + " failed: " + cudaGetErrorString(e));
  }
}

// Rows and columns as the kernels index them: columns in int (checked), rows in int64.
void check_shape(const core::Problem& p, LogitsView logits, const char* name = "logits") {
  if (p.cols > INT_MAX - 64)
    throw Error(std::string("xent: ") + name + ".cols = " + std::to_string(p.cols) +
                ": the CUDA backend takes at most 2^31 - 65 columns per shard");
  if (reinterpret_cast<uintptr_t>(logits.data) % dtype_size(logits.dtype) != 0)
    throw Error(std::string("xent: ") + name + ".data is not aligned to its element size (" +
                to_string(logits.dtype) + ")");
}

template <typename T>
bool block_per_row(int64_t cols) {
  return cols / Pack<T>::kN > kWarpRowPacks;
}

// Grid of a one-row-per-group launch.
template <typename T>
unsigned row_blocks(int64_t rows, int64_t cols) {
  const int64_t per_block = block_per_row<T>(cols) ? 1 : kBlock / 32;
  const int64_t blocks = (rows + per_block - 1) / per_block;
  if (blocks > INT_MAX)
    throw Error("xent: logits.rows = " + std::to_string(rows) + " is too many rows for one launch");
  return static_cast<unsigned>(blocks);
}

// ------------------------------------------------------------------------------- the errors

// Records the smallest bad row and its target into error[0..1] (error[0] = -1 means none). The
// row goes in with an atomic min (as unsigned, -1 is the largest); the target is then written by
// every thread that lowered the row, each rewriting targets[current row] until the row it read
// did not change across its write: the last write is always that of the final row.
__device__ void report_bad_target(int64_t* error, const void* targets, IndexType type,
                                  int64_t row) {
  auto* e_row = reinterpret_cast<unsigned long long*>(error);
  auto* e_val = e_row + 1;
  const unsigned long long old = atomicMin(e_row, static_cast<unsigned long long>(row));
  if (old <= static_cast<unsigned long long>(row)) return;
  __threadfence();
  for (;;) {
    const unsigned long long r = atomicAdd(e_row, 0ull);
    const int64_t value = core::load_target(targets, type, static_cast<int64_t>(r));
    atomicExch(e_val, static_cast<unsigned long long>(value));
    __threadfence();
    if (atomicAdd(e_row, 0ull) == r) return;
  }
}

// ---------------------------------------------------------------------------------- stats

struct StatsArgs {
  const void* data;
  int64_t rows;
  int64_t stride;
  int real_cols;
  int64_t vocab_start;
  int64_t vocab_size;
  const void* targets;
  IndexType ttype;
  int64_t ignore_index;
  float cap;
  core::RecordLayout layout;
  float* record;
  int64_t* error;
};

// A thread's share of a row when the row needs more than its log-sum-exp.
struct Part {
  core::LseAcc lse;
  float sum = 0.0f;
  core::ArgMax best;
};

struct MergeLse {
  __device__ __forceinline__ core::LseAcc operator()(core::LseAcc a, const core::LseAcc& b) const {
    a.merge(b);
    return a;
  }
};
struct MergePart {
  __device__ __forceinline__ Part operator()(Part a, const Part& b) const {
    a.lse.merge(b.lse);
    a.sum += b.sum;
    a.best.merge(b.best);
    return a;
  }
};

__device__ __forceinline__ core::LseAcc& lse_of(core::LseAcc& a) {
  return a;
}
__device__ __forceinline__ core::LseAcc& lse_of(Part& a) {
  return a.lse;
}

// kPlain: no softcap, no sum, no argmax (the common case, and the fastest loop). Otherwise each
// of them is decided at run time.
template <typename E, int kGroup, bool kPlain>
__global__ void __launch_bounds__(kBlock, kPlain ? 4 : 3) stats_kernel(const StatsArgs a) {
  using T = typename E::type;
  constexpr int kN = Pack<T>::kN;
  using Acc = std::conditional_t<kPlain, core::LseAcc, Part>;
  using Merge = std::conditional_t<kPlain, MergeLse, MergePart>;
  using Reduce = GroupReduce<Acc, kGroup>;
  __shared__ typename Reduce::Storage smem;
  pdl_trigger();
  pdl_wait();

  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kBlock / kGroup) + threadIdx.x / kGroup;
  if (row >= a.rows) return;  // uniform over the row's group
  const int t = static_cast<int>(threadIdx.x % kGroup);
  const T* p = static_cast<const T*>(a.data) + row * a.stride;
  const int n = a.real_cols;
  const float cap = kPlain ? 0.0f : a.cap;
  const bool want_sum = !kPlain && a.layout.sum_field >= 0;
  const bool want_max = !kPlain && a.layout.max_field >= 0;

  // The target and its logit are fetched before the pass and used after it.
  int64_t target = 0;
  int local = -1;
  T xt{};
  if (t == 0) {
    target = core::load_target(a.targets, a.ttype, row);
    const int64_t l = target - a.vocab_start;
    if (target != a.ignore_index && core::target_in_range(target, a.vocab_size) && l >= 0 &&
        l < n) {
      local = static_cast<int>(l);
      xt = p[local];
    }
  }

  Acc acc{};
  auto add_one = [&](float x, int col) {
    const float z = core::softcap(x, cap);
    lse_of(acc).add(z);
    if constexpr (!kPlain) {
      if (want_sum) acc.sum += z;
      if (want_max) acc.best.add(z, a.vocab_start + col);
    }
  };

  const RowSplit s = split_row(p, n);
  if (t < s.head) add_one(E::load(p[t]), t);
  if (t < n - s.tail0) add_one(E::load(p[s.tail0 + t]), s.tail0 + t);

  const uint4* q = reinterpret_cast<const uint4*>(p + s.head);
  for (int i0 = t; i0 < s.nv; i0 += kGroup * kU) {
    Pack<T> v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kGroup;
      if constexpr (kPlain)
        v[u].v = i < s.nv ? __ldg(q + i) : detail::neg_inf_pack<T>();
      else
        v[u].v = i < s.nv ? __ldg(q + i) : make_uint4(0u, 0u, 0u, 0u);
    }
    float z[kU][kN];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kGroup;
#pragma unroll
      for (int e = 0; e < kN; ++e) {
        if constexpr (kPlain) {
          z[u][e] = E::load(v[u].e[e]);  // a missing pack reads as -inf
        } else {
          const bool ok = i < s.nv;
          const float ze = core::softcap(E::load(v[u].e[e]), cap);
          z[u][e] = ok ? ze : core::kNegInf;
          if (ok && want_sum) acc.sum += ze;
          if (ok && want_max) acc.best.add(ze, a.vocab_start + s.head + i * kN + e);
        }
      }
    }
    // One chunk: its max, one rescale of the running sum, then exp(z - m) of every element.
    float cm = core::kNegInf;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float mu = z[u][0];
#pragma unroll
      for (int e = 1; e < kN; ++e) mu = fmaxf(mu, z[u][e]);
      cm = fmaxf(cm, mu);
    }
    core::LseAcc& L = lse_of(acc);
    const float nm = fmaxf(L.m, cm);
    if (nm != core::kNegInf) {
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        float su = 0.0f;
#pragma unroll
        for (int e = 0; e < kN; ++e) su += core::exp_f(z[u][e] - nm);
        sum += su;
      }
      L.s = L.s * core::rescale(L.m, nm) + sum;
      L.m = nm;
    }
  }

  acc = Reduce::reduce(smem, acc, Merge{});
  if (t == 0) {
    core::LocalStats st;
    st.lse = lse_of(acc);
    if constexpr (!kPlain) {
      st.sum_z = acc.sum;
      st.best = acc.best;
    }
    if (local >= 0) st.target_z = core::softcap(E::load(xt), cap);
    core::write_record(st, a.layout, a.record, a.rows, row);
    if (target != a.ignore_index && !core::target_in_range(target, a.vocab_size) &&
        a.error != nullptr)
      report_bad_target(a.error, a.targets, a.ttype, row);
  }
}

// ------------------------------------------------------------------------------- gradient

struct GradArgs {
  const void* in;  // the logits
  int64_t in_stride;
  void* out;  // the gradient: the logits themselves (in place), or a buffer that does not overlap
  int64_t out_stride;
  int64_t rows;
  int cols;
  int real_cols;
  int64_t vocab_start;
  int64_t vocab_size;
  const void* targets;
  IndexType ttype;
  int64_t ignore_index;
  const float* lse;
  const float* scalars;
  const float* grad_output;  // nullptr: 1
  bool per_row;              // grad_output has one value per row (Reduction::none)
  float smoothing;
  float inv_vocab;
  float z_loss;
  float cap;
};

// The body of an output row split at s (its 16-byte packs q): the packs of the input row x are
// 16-byte loads when kAligned (x + s.head is 16-byte aligned too: always so in place), else kN
// element loads each. kU packs in flight per thread either way; every store is a 16-byte pack.
template <typename E, int kGroup, bool kAligned, typename F>
__device__ __forceinline__ void gradient_packs(const typename E::type* x, uint4* q,
                                               const RowSplit& s, int t, F grad) {
  using T = typename E::type;
  constexpr int kN = Pack<T>::kN;
  const T* xb = x + s.head;
  for (int i0 = t; i0 < s.nv; i0 += kGroup * kU) {
    Pack<T> v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kGroup;
      if (i < s.nv) {
        if constexpr (kAligned) {
          v[u].v = reinterpret_cast<const uint4*>(xb)[i];
        } else {
#pragma unroll
          for (int e = 0; e < kN; ++e) v[u].e[e] = xb[i * kN + e];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kGroup;
      if (i < s.nv) {
        const int col0 = s.head + i * kN;
#pragma unroll
        for (int e = 0; e < kN; ++e) v[u].e[e] = E::store(grad(E::load(v[u].e[e]), col0 + e));
        q[i] = v[u].v;
      }
    }
  }
}

template <typename E, int kGroup, bool kCap>
__global__ void __launch_bounds__(kBlock, 4) gradient_kernel(const GradArgs a) {
  using T = typename E::type;
  pdl_trigger();
  pdl_wait();
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (kBlock / kGroup) + threadIdx.x / kGroup;
  if (g >= a.rows) return;
  const int64_t row = a.rows - 1 - g;  // last row first: it is the likeliest to be in L2
  const int t = static_cast<int>(threadIdx.x % kGroup);
  const T* x = static_cast<const T*>(a.in) + row * a.in_stride;
  T* p = static_cast<T*>(a.out) + row * a.out_stride;
  const int n = a.cols;
  const RowSplit s = split_row(p, n);  // the output's split: every pack store is aligned
  uint4* q = reinterpret_cast<uint4*>(p + s.head);

  const int64_t target = core::load_target(a.targets, a.ttype, row);
  if (target == a.ignore_index || !core::target_in_range(target, a.vocab_size)) {
    const T zero = E::store(0.0f);
    if (t < s.head) p[t] = zero;
    if (t < n - s.tail0) p[s.tail0 + t] = zero;
    for (int i = t; i < s.nv; i += kGroup) q[i] = make_uint4(0u, 0u, 0u, 0u);  // +0 in any dtype
    return;
  }
  const float go =
      a.grad_output == nullptr ? 1.0f : (a.per_row ? a.grad_output[row] : a.grad_output[0]);
  const float scale = a.scalars[Workspace::kScale] * go;
  const core::GradCoef c = core::grad_coef(a.lse[row], scale, a.smoothing, a.inv_vocab, a.z_loss);
  const float cap = kCap ? a.cap : 0.0f;
  const int64_t l = target - a.vocab_start;
  const int tl = (l >= 0 && l < a.real_cols) ? static_cast<int>(l) : -1;
  const int rc = a.real_cols;
  auto grad = [&](float v, int col) {
    return col < rc ? core::grad_x(core::softcap(v, cap), col == tl, c, cap) : 0.0f;
  };

  if (t < s.head) p[t] = E::store(grad(E::load(x[t]), t));
  if (t < n - s.tail0) {
    const int col = s.tail0 + t;
    p[col] = E::store(grad(E::load(x[col]), col));
  }
  // Same offset modulo 16 bytes (the common case: in place, or equal strides and alignment):
  // 16-byte loads as well.
  if (((reinterpret_cast<uintptr_t>(x) ^ reinterpret_cast<uintptr_t>(p)) & 15u) == 0)
    gradient_packs<E, kGroup, true>(x, q, s, t, grad);
  else
    gradient_packs<E, kGroup, false>(x, q, s, t, grad);
}

// ----------------------------------------------------------------------------- scale_rows

struct ScaleArgs {
  void* data;
  int64_t rows;
  int64_t stride;
  int cols;
  const float* grad_output;
  bool per_row;
};

template <typename E, int kGroup>
__global__ void __launch_bounds__(kBlock) scale_rows_kernel(const ScaleArgs a) {
  using T = typename E::type;
  constexpr int kN = Pack<T>::kN;
  pdl_trigger();
  pdl_wait();
  float f0 = 1.0f;
  if (!a.per_row) {
    f0 = a.grad_output[0];
    if (f0 == 1.0f) return;  // the common case: nothing to do
  }
  constexpr int kRows = kBlock / kGroup;
  const int t = static_cast<int>(threadIdx.x % kGroup);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / kGroup; row < a.rows;
       row += static_cast<int64_t>(gridDim.x) * kRows) {
    const float f = a.per_row ? a.grad_output[row] : f0;
    if (f == 1.0f) continue;
    T* p = static_cast<T*>(a.data) + row * a.stride;
    const RowSplit s = split_row(p, a.cols);
    if (t < s.head) p[t] = E::store(E::load(p[t]) * f);
    if (t < a.cols - s.tail0) p[s.tail0 + t] = E::store(E::load(p[s.tail0 + t]) * f);
    uint4* q = reinterpret_cast<uint4*>(p + s.head);
    for (int i0 = t; i0 < s.nv; i0 += kGroup * kU) {
      Pack<T> v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = i0 + u * kGroup;
        if (i < s.nv) v[u].v = q[i];
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = i0 + u * kGroup;
        if (i < s.nv) {
#pragma unroll
          for (int e = 0; e < kN; ++e) v[u].e[e] = E::store(E::load(v[u].e[e]) * f);
          q[i] = v[u].v;
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------- finalize

struct FinalizeArgs {
  int64_t rows;
  const void* targets;
  IndexType ttype;
  int64_t ignore_index;
  int64_t vocab_size;
  const float* gathered;
  int ranks;
  core::RecordLayout layout;
  float smoothing;
  float inv_vocab;
  float z_loss;
  Reduction reduction;
  float* loss;
  float* z_loss_out;
  int64_t* argmax;
  float* accuracy;
  float* lse;
  float* scalars;
};

struct Totals {
  double loss;
  unsigned long long valid;
  unsigned long long correct;
};
struct AddTotals {
  __device__ __forceinline__ Totals operator()(const Totals& a, const Totals& b) const {
    return Totals{a.loss + b.loss, a.valid + b.valid, a.correct + b.correct};
  }
};

// One row of finalize: the global statistics, the per-row outputs, and the row's share of the
// totals.
__device__ __forceinline__ void finalize_row(const FinalizeArgs& a, int64_t row, Totals& mine) {
  const int64_t target = core::load_target(a.targets, a.ttype, row);
  const core::RowStats g = core::merge_records(a.gathered, a.ranks, a.layout, a.rows, row);
  a.lse[row] = g.lse;
  float loss = 0.0f, zterm = 0.0f;
  if (target != a.ignore_index) {
    // A target outside [0, vocab_size): the stats kernel reported it; its loss is NaN.
    loss = core::target_in_range(target, a.vocab_size)
               ? core::row_loss(g.lse, g.target_z, g.sum_z, a.smoothing, a.inv_vocab, a.z_loss)
               : __int_as_float(0x7fc00000);
    zterm = a.z_loss * g.lse * g.lse;
    mine.loss += static_cast<double>(loss);
    mine.valid += 1;
    if (g.best.index == target) mine.correct += 1;
  }
  if (a.reduction == Reduction::none) a.loss[row] = loss;
  if (a.z_loss_out != nullptr) a.z_loss_out[row] = zterm;
  if (a.argmax != nullptr) a.argmax[row] = g.best.index;
}

// By one thread: the reduced loss, the accuracy and the scalars from the totals of all rows.
__device__ __forceinline__ void finalize_totals(const FinalizeArgs& a, const Totals& all) {
  const float valid = static_cast<float>(all.valid);
  const float scale = core::reduction_scale(a.reduction == Reduction::mean, valid);
  if (a.reduction != Reduction::none) a.loss[0] = static_cast<float>(all.loss) * scale;
  if (a.accuracy != nullptr)
    a.accuracy[0] = all.valid > 0 ? static_cast<float>(all.correct) / valid : 0.0f;
  a.scalars[Workspace::kScale] = scale;
  a.scalars[Workspace::kValid] = valid;
}

// Many blocks (at most Workspace::kPartials, a number that depends on rows alone): block b takes
// rows b * 256 + i, then every gridDim.x * 256 rows, reduces its totals in a fixed shape and
// writes them to partials[1 + 3 b ...]. The last block to finish (a counter, which it resets)
// reduces the partials in block order, again in a fixed shape: bitwise reproducible, and no
// state left behind for the next launch or a graph replay.
__global__ void __launch_bounds__(kFinalizeThreads)
    finalize_kernel(const FinalizeArgs a, unsigned long long* partials) {
  using Reduce = cub::BlockReduce<Totals, kFinalizeThreads>;
  __shared__ typename Reduce::TempStorage smem;
  __shared__ bool last;
  pdl_trigger();
  pdl_wait();
  Totals mine{0.0, 0ull, 0ull};
  const int64_t step = static_cast<int64_t>(gridDim.x) * kFinalizeThreads;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kFinalizeThreads + threadIdx.x;
       row < a.rows; row += step)
    finalize_row(a, row, mine);
  const Totals block = Reduce(smem).Reduce(mine, AddTotals{});
  if (gridDim.x == 1) {
    if (threadIdx.x == 0) finalize_totals(a, block);
    return;
  }
  unsigned long long* mine_out = partials + 1 + 3 * blockIdx.x;
  if (threadIdx.x == 0) {
    mine_out[0] = static_cast<unsigned long long>(__double_as_longlong(block.loss));
    mine_out[1] = block.valid;
    mine_out[2] = block.correct;
    __threadfence();  // the partials are visible before the count says so
    // atomicInc wraps to 0 after gridDim.x - 1: the last block resets the counter.
    const unsigned done = atomicInc(reinterpret_cast<unsigned*>(partials), gridDim.x - 1);
    last = done == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  Totals part{0.0, 0ull, 0ull};
  if (threadIdx.x < gridDim.x) {
    const unsigned long long* q = partials + 1 + 3 * threadIdx.x;
    part.loss = __longlong_as_double(static_cast<long long>(__ldcg(q)));
    part.valid = __ldcg(q + 1);
    part.correct = __ldcg(q + 2);
  }
  const Totals all = Reduce(smem).Reduce(part, AddTotals{});
  if (threadIdx.x == 0) finalize_totals(a, all);
}

// ---------------------------------------------------------------------------- count_valid

__global__ void __launch_bounds__(kReduceThreads)
    count_valid_kernel(const void* targets, IndexType ttype, int64_t rows, int64_t ignore_index,
                       bool mean, float* scalars) {
  using Reduce = cub::BlockReduce<unsigned long long, kReduceThreads>;
  __shared__ typename Reduce::TempStorage smem;
  pdl_trigger();
  pdl_wait();
  constexpr int kK = 8;
  unsigned long long mine = 0;
  for (int64_t base = 0; base < rows; base += static_cast<int64_t>(kReduceThreads) * kK) {
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const int64_t row = base + static_cast<int64_t>(k) * kReduceThreads + threadIdx.x;
      if (row < rows && core::load_target(targets, ttype, row) != ignore_index) ++mine;
    }
  }
  const unsigned long long all = Reduce(smem).Sum(mine);
  if (threadIdx.x == 0) {
    const float valid = static_cast<float>(all);
    scalars[Workspace::kScale] = core::reduction_scale(mean, valid);
    scalars[Workspace::kValid] = valid;
  }
}

}  // namespace

// ----------------------------------------------------------------------------------- host

void stats(const core::Problem& p, LogitsView logits, TargetsView targets, float* record,
           int64_t* error, cudaStream_t stream) {
  if (p.rows == 0) return;
  check_shape(p, logits);
  StatsArgs a{logits.data,    p.rows,       p.row_stride, static_cast<int>(p.real_cols),
              p.vocab_start,  p.vocab_size, targets.data, targets.type,
              p.ignore_index, p.softcap,    p.layout,     record,
              error};
  const bool plain = p.softcap <= 0.0f && p.layout.sum_field < 0 && p.layout.max_field < 0;
  core::dispatch_dtype(logits.dtype, [&](auto e) {
    using E = decltype(e);
    using T = typename E::type;
    const unsigned blocks = row_blocks<T>(p.rows, p.real_cols);
    const bool big = block_per_row<T>(p.real_cols);
    if (big && plain)
      launch("xent stats kernel", stats_kernel<E, kBlock, true>, blocks, kBlock, stream, a);
    else if (big)
      launch("xent stats kernel", stats_kernel<E, kBlock, false>, blocks, kBlock, stream, a);
    else if (plain)
      launch("xent stats kernel", stats_kernel<E, 32, true>, blocks, kBlock, stream, a);
    else
      launch("xent stats kernel", stats_kernel<E, 32, false>, blocks, kBlock, stream, a);
  });
}

void finalize(const core::Problem& p, TargetsView targets, const float* gathered, int ranks,
              const Outputs& out, float* lse, float* scalars, unsigned long long* partials,
              cudaStream_t stream) {
  // Callers skip it for rows = 0 (forward writes the zero reductions itself).
  FinalizeArgs a{p.rows,   targets.data, targets.type, p.ignore_index, p.vocab_size, gathered,
                 ranks,    p.layout,     p.smoothing,  p.inv_vocab,    p.z_loss,     p.reduction,
                 out.loss, out.z_loss,   out.argmax,   out.accuracy,   lse,          scalars};
  // The grid depends on rows alone (never on the device): the same sum everywhere.
  int64_t blocks = (p.rows + kFinalizeThreads - 1) / kFinalizeThreads;
  if (blocks > Workspace::kPartials) blocks = Workspace::kPartials;
  if (blocks < 1) blocks = 1;
  launch("xent finalize kernel", finalize_kernel, static_cast<unsigned>(blocks), kFinalizeThreads,
         stream, a, partials);
}

void gradient(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
              const float* lse, const float* scalars, const float* grad_output,
              cudaStream_t stream) {
  if (p.rows == 0) return;
  check_shape(p, in);
  if (out.data != in.data) check_shape(p, out, "grad");
  GradArgs a{in.data,
             in.row_stride,
             out.data,
             out.row_stride,
             p.rows,
             static_cast<int>(p.cols),
             static_cast<int>(p.real_cols),
             p.vocab_start,
             p.vocab_size,
             targets.data,
             targets.type,
             p.ignore_index,
             lse,
             scalars,
             grad_output,
             p.reduction == Reduction::none,
             p.smoothing,
             p.inv_vocab,
             p.z_loss,
             p.softcap};
  const bool cap = p.softcap > 0.0f;
  core::dispatch_dtype(in.dtype, [&](auto e) {
    using E = decltype(e);
    using T = typename E::type;
    const unsigned blocks = row_blocks<T>(p.rows, p.cols);
    const bool big = block_per_row<T>(p.cols);
    if (big && !cap)
      launch("xent gradient kernel", gradient_kernel<E, kBlock, false>, blocks, kBlock, stream, a);
    else if (big)
      launch("xent gradient kernel", gradient_kernel<E, kBlock, true>, blocks, kBlock, stream, a);
    else if (!cap)
      launch("xent gradient kernel", gradient_kernel<E, 32, false>, blocks, kBlock, stream, a);
    else
      launch("xent gradient kernel", gradient_kernel<E, 32, true>, blocks, kBlock, stream, a);
  });
}

void scale_rows(const core::Problem& p, LogitsView grad, const float* grad_output,
                cudaStream_t stream) {
  if (p.rows == 0 || grad_output == nullptr) return;
  check_shape(p, grad);
  ScaleArgs a{grad.data,    p.rows,
              p.row_stride, static_cast<int>(p.cols),
              grad_output,  p.reduction == Reduction::none};
  const unsigned cap_blocks = static_cast<unsigned>(device_info().sms) * 4u;
  core::dispatch_dtype(grad.dtype, [&](auto e) {
    using E = decltype(e);
    using T = typename E::type;
    unsigned blocks = row_blocks<T>(p.rows, p.cols);
    if (blocks > cap_blocks) blocks = cap_blocks;
    if (block_per_row<T>(p.cols))
      launch("xent scale_rows kernel", scale_rows_kernel<E, kBlock>, blocks, kBlock, stream, a);
    else
      launch("xent scale_rows kernel", scale_rows_kernel<E, 32>, blocks, kBlock, stream, a);
  });
}

void count_valid(const core::Problem& p, TargetsView targets, float* scalars, cudaStream_t stream) {
  // Launched for rows = 0 too: the scalars are still written.
  launch("xent count_valid kernel", count_valid_kernel, 1, kReduceThreads, stream, targets.data,
         targets.type, p.rows, p.ignore_index, p.reduction == Reduction::mean, scalars);
}

void set_programmatic_launch(bool on) {
  pdl_flag().store(on, std::memory_order_relaxed);
}
bool programmatic_launch() {
  return pdl_flag().load(std::memory_order_relaxed);
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace xent::cuda
