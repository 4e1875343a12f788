// Timing driver for the CUDA backend (not a test). bf16, N = 8192 (or argv[1]), mean reduction,
// softcap 0 (or argv[2]: 30 is Gemma 2's), V_local in {16032, 32064, 128256}, both grad modes,
// through the public API, timed with CUDA events; the device-to-device copy bandwidth is measured
// in the same run. Prints:
//   - forward + backward time against the 3-pass roofline 3 * N * V * 2 bytes / copy_bw
//     (copy_bw counts bytes read + written),
//   - each kernel alone (stats, finalize, gradient) and the stats kernel's read rate against the
//     copy bandwidth.
// L2 is flushed before each timed iteration, outside the timed region, by a read-only pass (the
// stats kernel) over 256 MiB of other data: L2 then holds clean lines, as after any read. (A
// memset would leave ~50 MB of dirty lines whose write-back lands inside the timed region.)
// Forward + backward runs with and without programmatic dependent launch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <xent/xent.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "backend.h"
#include "core/problem.h"

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Timer {
  cudaEvent_t a, b;
  // The flush: 8192 rows x 16384 bf16 columns (256 MiB) read by the stats kernel.
  void *flush = nullptr, *flush_t = nullptr, *flush_rec = nullptr;
  static constexpr int64_t kFR = 8192, kFC = 16384;
  Timer() {
    ck(cudaEventCreate(&a), "event");
    ck(cudaEventCreate(&b), "event");
    ck(cudaMalloc(&flush, kFR * kFC * 2), "cudaMalloc flush");
    ck(cudaMemset(flush, 0x3c, kFR * kFC * 2), "memset flush");
    ck(cudaMalloc(&flush_t, kFR * 8), "cudaMalloc flush");
    ck(cudaMemset(flush_t, 0, kFR * 8), "memset flush");
    ck(cudaMalloc(&flush_rec, kFR * 8 * 4), "cudaMalloc flush");
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    cudaFree(flush);
    cudaFree(flush_t);
    cudaFree(flush_rec);
  }
  void flush_l2() {
    xent::LogitsView lv{flush, xent::DType::bf16, kFR, kFC, kFC};
    xent::TargetsView tv{flush_t, xent::IndexType::i64, kFR};
    const xent::core::Problem p = xent::core::make_problem(lv, tv, xent::Options{});
    xent::cuda::stats(p, lv, tv, static_cast<float*>(flush_rec), nullptr, nullptr);
  }
  // Median over `iters` runs of f (after `warm` untimed runs), in ms. Before each, untimed:
  // `pre` if given, else the L2 flush (either keeps the GPU busy while f is enqueued, so that
  // no host launch latency lands inside the timed region).
  double median(const std::function<void()>& f, const std::function<void()>& pre = nullptr,
                int iters = 20, int warm = 3) {
    for (int i = 0; i < warm; ++i) f();
    std::vector<float> t;
    for (int i = 0; i < iters; ++i) {
      if (pre)
        pre();
      else
        flush_l2();
      ck(cudaEventRecord(a, nullptr), "record");
      f();
      ck(cudaEventRecord(b, nullptr), "record");
      ck(cudaEventSynchronize(b), "sync");
      float ms = 0;
      ck(cudaEventElapsedTime(&ms, a, b), "elapsed");
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 8192;
  const float softcap = argc > 2 ? static_cast<float>(std::atof(argv[2])) : 0.0f;
  const std::vector<int64_t> vocabs = {16032, 32064, 128256};
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  Timer timer;

  // Copy bandwidth: a 2 GiB device-to-device copy, bytes read + written.
  const size_t copy_bytes = size_t(2) << 30;
  void *src = nullptr, *dst = nullptr;
  ck(cudaMalloc(&src, copy_bytes), "cudaMalloc");
  ck(cudaMalloc(&dst, copy_bytes), "cudaMalloc");
  ck(cudaMemset(src, 1, copy_bytes), "memset");
  const double copy_ms = timer.median([&] {
    ck(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, nullptr), "copy");
  });
  const double copy_bw = 2.0 * copy_bytes / (copy_ms * 1e-3);
  std::printf("programmatic dependent launch: %s by default (Options::programmatic_launch)\n",
              xent::Options{}.programmatic_launch ? "on" : "off");
  std::printf("copy bandwidth: %.1f GB/s (read + write, %zu MiB copy, %.3f ms)\n\n", copy_bw * 1e-9,
              copy_bytes >> 20, copy_ms);
  ck(cudaFree(src), "free");
  ck(cudaFree(dst), "free");

  std::printf(
      "forward + backward, bf16, mean, softcap %g: ms and %% of the 3-pass roofline, with and "
      "without programmatic dependent launch (PDL)\n",
      softcap);
  std::printf("%-6s %-7s %-9s %9s %10s %7s %10s %7s\n", "N", "V_local", "mode", "roof ms", "PDL ms",
              "%roof", "noPDL ms", "%roof");
  struct KernelRow {
    int64_t v;
    double stats, finalize, gradient;
  };
  std::vector<KernelRow> krows;
  xent::Group g = xent::Group::local(xent::Backend::cuda, 0);
  for (int64_t V : vocabs) {
    const size_t elems = static_cast<size_t>(N * V);
    std::vector<__nv_bfloat16> host(elems);
    std::mt19937 rng(42);
    uint64_t state = 0x9e3779b97f4a7c15ull;  // xorshift: fast, random enough for timing
    for (auto& h : host) {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      const float u1 = static_cast<float>(state & 0xffffff) * (1.0f / 16777216.0f);
      const float u2 = static_cast<float>((state >> 24) & 0xffffff) * (1.0f / 16777216.0f);
      h = __float2bfloat16_rn(4.0f * (u1 + u2 - 1.0f));
    }
    std::vector<int64_t> tgt(N);
    for (int64_t i = 0; i < N; ++i) tgt[i] = (i % 17 == 0) ? -100 : (rng() % V);
    void *x = nullptr, *t = nullptr;
    float *loss = nullptr, *lse = nullptr;
    ck(cudaMalloc(&x, elems * 2), "cudaMalloc logits");
    ck(cudaMalloc(&t, N * 8), "cudaMalloc");
    ck(cudaMalloc(&loss, 4), "cudaMalloc");
    ck(cudaMalloc(&lse, N * 4), "cudaMalloc");
    ck(cudaMemcpy(x, host.data(), elems * 2, cudaMemcpyHostToDevice), "H2D");
    ck(cudaMemcpy(t, tgt.data(), N * 8, cudaMemcpyHostToDevice), "H2D");
    xent::LogitsView lv{x, xent::DType::bf16, N, V, V};
    xent::TargetsView tv{t, xent::IndexType::i64, N};
    const double roof_ms = 3.0 * N * V * 2 / copy_bw * 1e3;
    for (xent::GradMode mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
      xent::Options opt;
      opt.softcap = softcap;
      opt.grad_mode = mode;
      g.reserve(N, opt);
      xent::Outputs out;
      out.loss = loss;
      out.lse = lse;
      // The logits are restored from `host` once; later iterations run on the previous
      // iteration's gradient, which costs the same.
      auto step = [&] {
        xent::forward(g, lv, tv, opt, out, nullptr);
        xent::backward(g, lv, tv, lse, nullptr, opt, nullptr);
      };
      const double ms = timer.median(step);
      opt.programmatic_launch = false;
      const double ms_nopdl = timer.median(step);
      opt.programmatic_launch = true;
      std::printf("%-6lld %-7lld %-9s %9.3f %10.3f %6.1f%% %10.3f %6.1f%%\n", (long long)N,
                  (long long)V, xent::to_string(mode), roof_ms, ms, 100.0 * roof_ms / ms, ms_nopdl,
                  100.0 * roof_ms / ms_nopdl);
      std::fflush(stdout);
      ck(cudaMemcpy(x, host.data(), elems * 2, cudaMemcpyHostToDevice), "H2D");
    }
    // Kernels alone.
    {
      xent::Options opt;
      opt.softcap = softcap;
      const xent::core::Problem p = xent::core::make_problem(lv, tv, opt);
      xent::Workspace& ws = g.workspace();
      ws.prepare(N, p.layout.fields, 1, nullptr);
      KernelRow k{V, 0, 0, 0};
      auto stats = [&] { xent::cuda::stats(p, lv, tv, ws.send, ws.error, nullptr); };
      k.stats = timer.median(stats);
      xent::Outputs out;
      out.loss = loss;
      // finalize reads the records the stats kernel just wrote (in L2), as in forward().
      k.finalize = timer.median(
          [&] {
            xent::cuda::finalize(p, tv, ws.recv, 1, out, lse, ws.scalars, ws.partials, nullptr);
          },
          stats);
      k.gradient = timer.median(
          [&] { xent::cuda::gradient(p, lv, lv, tv, lse, ws.scalars, nullptr, nullptr); });
      krows.push_back(k);
    }
    ck(cudaFree(x), "free");
    ck(cudaFree(t), "free");
    ck(cudaFree(loss), "free");
    ck(cudaFree(lse), "free");
  }
  std::printf(
      "\nkernels alone (PDL on): stats read rate against the copy bandwidth; finalize; "
      "gradient (read + write) against the copy bandwidth\n");
  std::printf("%-8s %9s %10s %7s %12s %9s %8s\n", "V_local", "stats ms", "stats GB/s", "%copy",
              "finalize ms", "grad ms", "%copy");
  for (const KernelRow& k : krows) {
    const double bytes = static_cast<double>(N) * k.v * 2;
    const double sbw = bytes / (k.stats * 1e-3), gbw = 2 * bytes / (k.gradient * 1e-3);
    std::printf("%-8lld %9.3f %10.1f %6.1f%% %12.4f %9.3f %7.1f%%\n", (long long)k.v, k.stats,
                sbw * 1e-9, 100.0 * sbw / copy_bw, k.finalize, k.gradient, 100.0 * gbw / copy_bw);
  }
  return 0;
}
