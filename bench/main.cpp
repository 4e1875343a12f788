// xent_dist_bench: the nccl-tests-style benchmark and verifier of xent's vocab-parallel
// cross-entropy. One MPI rank per vocabulary shard; every rank regenerates its shard of the global
// logits from a hash, times forward + backward, and (--check) compares loss, lse and its gradient
// shard with an independent fp64 reference. Times are the slowest rank's, like nccl-tests.
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "device.h"
#include "options.h"
#include "reference.h"
#include "xent/mpi.h"

#ifndef XENT_BENCH_VERSION
#define XENT_BENCH_VERSION "unknown"
#endif

namespace xb {
namespace {

struct Env {
  int rank = 0, ranks = 1;
  std::string hostname, mpi, cuda_runtime, cuda_driver, nccl, copy_how, started;
  double copy_bw = 0.0;  // bytes/s, slowest rank
  std::vector<std::string> rank_lines;
};

// Returns at the same instant on every rank of one host (within a microsecond or so): the ranks
// agree on a start a little after the latest of their clocks and spin until it. A barrier alone
// releases them tens of microseconds apart, and the first rank would then time its wait for the
// last. Ranks on several hosts rely on their clocks agreeing; the wait is capped at 10 ms.
void start_together() {
  using clock = std::chrono::system_clock;
  const double now_us =
      std::chrono::duration<double, std::micro>(clock::now().time_since_epoch()).count();
  double latest = now_us;
  MPI_Allreduce(&now_us, &latest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const double start = std::min(latest + 1000.0, now_us + 10000.0);
  while (std::chrono::duration<double, std::micro>(clock::now().time_since_epoch()).count() <
         start) {
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Result {
  int64_t tokens = 0, width = 0;
  std::string mode;
  double fwd_ms = 0, bwd_ms = 0, total_ms = 0, gather_ms = 0, extra_bytes = 0;
  int64_t wrong = 0;
};

xent::DType to_xent_dtype(int d) {
  return d == kF32 ? xent::DType::f32 : d == kBF16 ? xent::DType::bf16 : xent::DType::f16;
}
xent::Reduction to_xent_reduction(int r) {
  return r == kNone  ? xent::Reduction::none
         : r == kSum ? xent::Reduction::sum
                     : xent::Reduction::mean;
}
const char* dtype_name(int d) {
  return d == kF32 ? "f32" : d == kBF16 ? "bf16" : "f16";
}
const char* reduction_name(int r) {
  return r == kNone ? "none" : r == kSum ? "sum" : "mean";
}

std::string first_line(const std::string& s) {
  const size_t nl = s.find('\n');
  std::string out = nl == std::string::npos ? s : s.substr(0, nl);
  while (!out.empty() && (out.back() == ' ' || out.back() == '\r')) out.pop_back();
  return out;
}

Env gather_env(Device& dev, const xent::Group& group) {
  Env env;
  MPI_Comm_rank(MPI_COMM_WORLD, &env.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &env.ranks);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  env.hostname = host;
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(mpi, &len);
  env.mpi = first_line(mpi);
  int rt = 0, drv = 0, nv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  cudaGetLastError();
  env.cuda_runtime =
      rt > 0 ? std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10) : "none";
  env.cuda_driver =
      drv > 0 ? std::to_string(drv / 1000) + "." + std::to_string((drv % 1000) / 10) : "none";
  if (ncclGetVersion(&nv) == ncclSuccess && nv > 0)
    env.nccl = std::to_string(nv / 10000) + "." + std::to_string((nv % 10000) / 100) + "." +
               std::to_string(nv % 100);
  else
    env.nccl = "unknown";
  std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S%z", std::localtime(&now));
  env.started = when;

  // One line per rank, gathered to rank 0.
  char line[512];
  if (dev.gpu()) {
    cudaDeviceProp prop;
    cuda_ok(cudaGetDeviceProperties(&prop, group.device()), "cudaGetDeviceProperties");
    char bus[32] = {0};
    cudaDeviceGetPCIBusId(bus, sizeof bus, group.device());
    std::snprintf(line, sizeof line, "#  Rank %3d Pid %7d on %12s device %2d [%s] %s, %.0f GiB",
                  env.rank, static_cast<int>(getpid()), host, group.device(), bus, prop.name,
                  static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  } else {
    std::snprintf(line, sizeof line,
                  "#  Rank %3d Pid %7d on %12s CPU backend (host memory, MPI all-gather)", env.rank,
                  static_cast<int>(getpid()), host);
  }
  std::vector<char> all(env.rank == 0 ? sizeof line * static_cast<size_t>(env.ranks) : 1);
  MPI_Gather(line, sizeof line, MPI_CHAR, all.data(), sizeof line, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (env.rank == 0)
    for (int r = 0; r < env.ranks; ++r)
      env.rank_lines.emplace_back(all.data() + sizeof line * static_cast<size_t>(r));

  MPI_Barrier(MPI_COMM_WORLD);  // measure the copy bandwidth on every rank at once
  double bw = dev.copy_bandwidth(&env.copy_how);
  MPI_Allreduce(&bw, &env.copy_bw, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return env;
}

uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

std::string describe(const Mismatch& m) {
  char buf[320];
  switch (m.kind) {
    case 1:
      std::snprintf(buf, sizeof buf,
                    "gradient [row %" PRId64 ", global column %" PRId64
                    "] = %.9g, expected %.9g (tolerance %.3g)",
                    m.row, m.col, m.got, m.want, m.tol);
      break;
    case 2:
      if (m.row >= 0)
        std::snprintf(buf, sizeof buf,
                      "loss [row %" PRId64 "] = %.9g, expected %.9g (tolerance %.3g)", m.row, m.got,
                      m.want, m.tol);
      else
        std::snprintf(buf, sizeof buf, "loss = %.9g, expected %.9g (tolerance %.3g)", m.got, m.want,
                      m.tol);
      break;
    case 3:
      std::snprintf(buf, sizeof buf, "lse [row %" PRId64 "] = %.9g, expected %.9g (tolerance %.3g)",
                    m.row, m.got, m.want, m.tol);
      break;
    case 4:
      std::snprintf(buf, sizeof buf, "loss or lse is not bitwise the same on every rank");
      break;
    case 5:
      std::snprintf(
          buf, sizeof buf,
          "bench self-check: the GPU reference disagrees with the host reference at row %" PRId64
          " (%.17g vs %.17g)",
          m.row, m.got, m.want);
      break;
    default: std::snprintf(buf, sizeof buf, "unknown mismatch");
  }
  return buf;
}

// Compares forward's loss and lse and the gradient now in `grad` with the fp64 reference.
int64_t verify(Device& dev, const Problem& p, const void* grad, const float* loss_buf,
               const float* lse_buf, Mismatch& first) {
  const int64_t n_loss = p.reduction == kNone ? p.rows : 1;
  std::vector<float> loss(static_cast<size_t>(n_loss)), lse(static_cast<size_t>(p.rows));
  dev.download(loss.data(), loss_buf, loss.size() * sizeof(float));
  dev.download(lse.data(), lse_buf, lse.size() * sizeof(float));

  std::vector<RefRow> ref;
  int64_t wrong = 0;
  if (dev.gpu()) {
    Buffer rows(dev, static_cast<size_t>(p.rows) * sizeof(RefRow));
    cuda_ref_rows(p, rows.as<RefRow>(), dev.stream());
    ref.resize(static_cast<size_t>(p.rows));
    dev.download(ref.data(), rows.get(), ref.size() * sizeof(RefRow));
    const double inv = inv_valid_rows(ref);
    const int64_t gpu_wrong =
        cuda_check_grad(p, grad, rows.as<RefRow>(), inv, &first, dev.stream());
    wrong += gpu_wrong;
    // Redo the first rows on the host (all of them when small): checks the bench's own GPU
    // reference and GPU comparison against the plain host code.
    Problem head = p;
    head.rows = std::min<int64_t>(p.rows, std::max<int64_t>(4, (int64_t(1) << 22) / p.vocab));
    const std::vector<RefRow> host = host_ref_rows(head);
    for (size_t r = 0; r < host.size(); ++r) {
      const double a = ref[r].loss, b = host[r].loss, c = ref[r].lse, d = host[r].lse;
      if (ref[r].ignored != host[r].ignored || !(std::fabs(a - b) <= 1e-9 * (1 + std::fabs(b))) ||
          !(std::fabs(c - d) <= 1e-9 * (1 + std::fabs(d)))) {
        if (first.kind == 0) first = Mismatch{5, 0, static_cast<int64_t>(r), -1, a, b, 0.0};
        ++wrong;
      }
    }
    const int64_t gpu_head =
        cuda_check_grad(head, grad, rows.as<RefRow>(), inv, nullptr, dev.stream());
    std::vector<unsigned char> g(static_cast<size_t>(head.rows * head.width) *
                                 dtype_bytes(p.dtype));
    dev.download(g.data(), grad, g.size());
    const int64_t host_head = host_check_grad(head, g.data(), host, inv, nullptr);
    if (host_head != gpu_head) {
      std::fprintf(stderr,
                   "xent_dist_bench: bench self-check: over the first %" PRId64
                   " rows the GPU check counted %" PRId64
                   " wrong gradient values, the host check %" PRId64 "\n",
                   head.rows, gpu_head, host_head);
      wrong += std::max<int64_t>(0, host_head - gpu_head) + 1;
    }
  } else {
    ref = host_ref_rows(p);
    wrong += host_check_grad(p, grad, ref, inv_valid_rows(ref), &first);
  }
  wrong += check_outputs(p, ref, loss.data(), lse.data(), &first);

  // Every rank must hold bitwise the same loss and lse (lse only where the row counts).
  uint64_t h = fnv1a(0xcbf29ce484222325ull, loss.data(), loss.size() * sizeof(float));
  for (size_t r = 0; r < lse.size(); ++r)
    if (!ref[r].ignored) h = fnv1a(h, &lse[r], sizeof(float));
  uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (lo != hi) {
    if (first.kind == 0) first = Mismatch{4, 0, -1, -1, 0.0, 0.0, 0.0};
    ++wrong;
  }
  return wrong;
}

class Bench {
 public:
  Bench(const Settings& s, xent::Group& group, Device& dev, const Env& env)
      : s_(s), group_(group), dev_(dev), env_(env) {}

  std::vector<Result> run() {
    // This rank's shard: the padded vocabulary split as evenly as it goes, in rank order.
    const int64_t P = env_.ranks, base = s_.padded / P, extra = s_.padded % P;
    const int64_t width = base + (env_.rank < extra ? 1 : 0);
    shard_ = xent::plan_shard(group_, width, s_.vocab);
    max_width_ = base + (extra > 0 ? 1 : 0);

    std::vector<Result> results;
    const size_t steps = s_.tokens.size() * s_.modes.size();
    size_t step = 0;
    // Rank 0 says what it is doing on stderr: CPU runs of GPU-sized presets take minutes per
    // size. On a terminal the line is rewritten in place (and cleared before each row); in a log
    // or a pipe each phase gets a line of its own.
    const bool tty = isatty(2);
    for (const int64_t n : s_.tokens) {
      std::vector<Result> rows = run_size(n, [&](const std::string& mode, bool timing) {
        if (env_.rank != 0) return;
        if (!timing) ++step;
        const char* phase = timing ? "timing" : s_.check ? "checking" : "first call";
        std::fprintf(stderr,
                     "%sxent_dist_bench: [%zu/%zu] %" PRId64 " tokens x %" PRId64 ", %s: %s...%s",
                     tty ? "\r" : "", step, steps, n, max_width_, mode.c_str(), phase,
                     tty ? "\033[K" : "\n");
        std::fflush(stderr);
      });
      for (Result& r : rows) {
        if (env_.rank == 0 && tty) std::fprintf(stderr, "\r\033[K");
        print_row(r);
        results.push_back(r);
      }
    }
    return results;
  }

  int64_t max_width() const { return max_width_; }

  void print_row(const Result& r) const {
    if (env_.rank != 0) return;
    const double bytes = 3.0 * static_cast<double>(r.tokens) * static_cast<double>(r.width) *
                         static_cast<double>(dtype_bytes(s_.dtype));
    const double gbs = bytes / (r.total_ms * 1e-3) / 1e9;
    const double roof_ms = bytes / env_.copy_bw * 1e3;
    char wrong[32];
    if (s_.check)
      std::snprintf(wrong, sizeof wrong, "%" PRId64, r.wrong);
    else
      std::snprintf(wrong, sizeof wrong, "N/A");
    std::printf("%10" PRId64 " %11" PRId64 " %9s %9.3f %9.3f %9.3f %11.3f %9.1f %6.1f %9.2f %7s\n",
                r.tokens, r.width, r.mode.c_str(), r.fwd_ms, r.bwd_ms, r.total_ms, r.gather_ms, gbs,
                100.0 * roof_ms / r.total_ms, r.extra_bytes / (1 << 20), wrong);
    std::fflush(stdout);
  }

 private:
  template <typename Progress>
  std::vector<Result> run_size(int64_t n, Progress&& progress) {
    Problem p;
    p.rows = n;
    p.vocab = s_.vocab;
    p.padded = s_.padded;
    p.start = shard_.start;
    p.width = shard_.width;
    p.dtype = s_.dtype;
    p.reduction = s_.reduction;
    xent::Options opt;
    xent::apply(shard_, opt);
    opt.label_smoothing = static_cast<float>(s_.label_smoothing);
    opt.z_loss = static_cast<float>(s_.z_loss);
    opt.softcap = static_cast<float>(s_.softcap);
    opt.reduction = to_xent_reduction(s_.reduction);
    // The reference sees exactly the fp32 values the library is given.
    p.smoothing = opt.label_smoothing;
    p.z_loss = opt.z_loss;
    p.softcap = opt.softcap;
    p.grad_output = static_cast<float>(s_.grad_output);
    p.seed = s_.seed;
    p.ignore_index = opt.ignore_index;
    p.ignore_threshold = static_cast<uint32_t>(
        std::min(4294967295.0, std::floor(s_.ignore_fraction * 4294967296.0)));
    p.step = static_cast<float>(s_.logit_range / 256.0);

    const size_t eb = dtype_bytes(p.dtype);
    const int64_t n_loss = p.reduction == kNone ? n : 1;
    Buffer logits(dev_, static_cast<size_t>(n * p.width) * eb);
    Buffer targets(dev_, static_cast<size_t>(n) * sizeof(int64_t));
    Buffer loss(dev_, static_cast<size_t>(n_loss) * sizeof(float));
    Buffer lse(dev_, static_cast<size_t>(n) * sizeof(float));
    Buffer gout(dev_, static_cast<size_t>(n_loss) * sizeof(float));
    {
      const std::vector<int64_t> t = host_targets(p);
      dev_.upload(targets.get(), t.data(), t.size() * sizeof(int64_t));
      const std::vector<float> g(static_cast<size_t>(n_loss), static_cast<float>(p.grad_output));
      dev_.upload(gout.get(), g.data(), g.size() * sizeof(float));
    }
    xent::LogitsView lv;
    lv.data = logits.get();
    lv.dtype = to_xent_dtype(p.dtype);
    lv.rows = n;
    lv.cols = p.width;
    lv.row_stride = p.width;
    xent::TargetsView tv;
    tv.data = targets.get();
    tv.type = xent::IndexType::i64;
    tv.rows = n;
    xent::Outputs out;
    out.loss = loss.as<float>();
    out.lse = lse.as<float>();
    cudaStream_t stream = dev_.stream();

    // The all-gather of the stats records alone, as the library would issue it.
    double gather_ms = 0.0;
    {
      const size_t rb = xent::record_bytes(opt) * static_cast<size_t>(n);
      Buffer send(dev_, rb), recv(dev_, rb * static_cast<size_t>(env_.ranks));
      dev_.zero(send.get(), rb);
      for (int i = 0; i < std::max(2, s_.warmup); ++i)
        group_.comm().all_gather(send.get(), recv.get(), rb, stream);
      dev_.marks(2);
      dev_.sync();
      dev_.mark(0);
      for (int i = 0; i < s_.iters; ++i)
        group_.comm().all_gather(send.get(), recv.get(), rb, stream);
      dev_.mark(1);
      dev_.sync();
      gather_ms = dev_.ms(0, 1) / s_.iters;
    }

    std::vector<Result> results;
    for (size_t m = 0; m < s_.modes.size(); ++m) {
      progress(s_.modes[m], false);
      const bool fused = s_.modes[m] == "fused";
      opt.grad_mode = fused ? xent::GradMode::fused : xent::GradMode::deferred;
      auto fwd = [&] { xent::forward(group_, lv, tv, opt, out, stream); };
      auto bwd = [&] {
        xent::backward(group_, lv, tv, lse.as<float>(), gout.as<float>(), opt, stream);
      };

      dev_.fill_logits(p, logits.get());  // pristine logits for the first (checked) call
      dev_.zero(loss.get(), loss.bytes());
      dev_.zero(lse.get(), lse.bytes());
      dev_.sync();

      // Extra memory: what the first call (and reserve) takes beyond the inputs and outputs.
      const int64_t before = dev_.memory_in_use();
      group_.reserve(n, opt);
      fwd();
      bwd();
      dev_.sync();
      group_.check_errors(stream);
      // The allocator rounds small allocations up to its pages; the workspace is exact.
      extra_bytes_ = std::max<int64_t>(extra_bytes_ + dev_.memory_in_use() - before,
                                       static_cast<int64_t>(group_.workspace_bytes()));

      Result r;
      r.tokens = n;
      r.width = max_width_;
      r.mode = s_.modes[m];
      if (s_.check) {
        Mismatch first;
        r.wrong = verify(dev_, p, logits.get(), loss.as<float>(), lse.as<float>(), first);
        if (r.wrong > 0)
          std::fprintf(stderr,
                       "xent_dist_bench: rank %d: %" PRId64 " tokens, %s: %" PRId64
                       " wrong; first: %s\n",
                       env_.rank, n, r.mode.c_str(), r.wrong, describe(first).c_str());
      }

      // Timing: forward + backward on the buffer as it is (the gradient of the previous
      // iteration stands in for the logits: the same work, finite values).
      progress(s_.modes[m], true);
      cudaGraphExec_t gf = nullptr, gb = nullptr;
      if (s_.graph) {
        gf = capture(fwd);
        gb = capture(bwd);
      }
      auto run_fwd = [&] { gf ? cuda_ok(cudaGraphLaunch(gf, stream), "cudaGraphLaunch") : fwd(); };
      auto run_bwd = [&] { gb ? cuda_ok(cudaGraphLaunch(gb, stream), "cudaGraphLaunch") : bwd(); };
      for (int i = 0; i < s_.warmup; ++i) {
        run_fwd();
        run_bwd();
      }
      const int iters = s_.iters;
      if (s_.idle) {
        // Each step alone, from an idle device, the ranks starting together: what the host's
        // latency costs a training step that reaches its loss with the GPU waiting. Medians.
        dev_.marks(3 * iters);
        for (int i = 0; i < iters; ++i) {
          dev_.sync();
          start_together();
          dev_.mark(3 * i);
          run_fwd();
          dev_.mark(3 * i + 1);
          run_bwd();
          dev_.mark(3 * i + 2);
        }
        dev_.sync();
        group_.check_errors(stream);
        std::vector<double> f(iters), b(iters), t(iters);
        for (int i = 0; i < iters; ++i) {
          f[i] = dev_.ms(3 * i, 3 * i + 1);
          b[i] = dev_.ms(3 * i + 1, 3 * i + 2);
          t[i] = dev_.ms(3 * i, 3 * i + 2);
        }
        r.fwd_ms = median(f);
        r.bwd_ms = median(b);
        r.total_ms = median(t);
      } else {
        dev_.marks(2 * iters + 1);
        dev_.sync();
        dev_.mark(0);
        for (int i = 0; i < iters; ++i) {
          run_fwd();
          dev_.mark(2 * i + 1);
          run_bwd();
          dev_.mark(2 * i + 2);
        }
        dev_.sync();
        group_.check_errors(stream);
        for (int i = 0; i < iters; ++i) {
          r.fwd_ms += dev_.ms(2 * i, 2 * i + 1) / iters;
          r.bwd_ms += dev_.ms(2 * i + 1, 2 * i + 2) / iters;
        }
        r.total_ms = dev_.ms(0, 2 * iters) / iters;
      }
      if (gf) cudaGraphExecDestroy(gf);
      if (gb) cudaGraphExecDestroy(gb);

      // The slowest rank's times and memory; the wrong values of all ranks.
      double mine[5] = {r.fwd_ms, r.bwd_ms, r.total_ms, gather_ms,
                        static_cast<double>(std::max<int64_t>(0, extra_bytes_))};
      double worst[5];
      MPI_Allreduce(mine, worst, 5, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      long long w = r.wrong, wsum = 0;
      MPI_Allreduce(&w, &wsum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
      r.fwd_ms = worst[0];
      r.bwd_ms = worst[1];
      r.total_ms = worst[2];
      r.gather_ms = worst[3];
      r.extra_bytes = worst[4];
      r.wrong = wsum;
      results.push_back(r);
    }
    return results;
  }

  template <typename F>
  cudaGraphExec_t capture(F&& f) {
    cudaStream_t stream = dev_.stream();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
            "cudaStreamBeginCapture");
    try {
      f();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    cudaGraphDestroy(graph);
    return exec;
  }

  const Settings& s_;
  xent::Group& group_;
  Device& dev_;
  const Env& env_;
  xent::Shard shard_;
  int64_t max_width_ = 0;
  int64_t extra_bytes_ = 0;  // grows with the library's workspace over the sweep
};

void print_header(const Settings& s, const Env& env, int64_t width) {
  std::printf("# xent_dist_bench %s: vocab-parallel cross-entropy, forward + backward\n",
              XENT_BENCH_VERSION);
  std::printf("# command: %s\n", s.command.c_str());
  std::printf("# %d rank(s), one vocabulary shard each; backend %s\n", env.ranks, s.device.c_str());
  std::printf("# model %s%s%s: vocab %" PRId64 " padded to %" PRId64 " (pad-to %" PRId64
              "), %" PRId64 " columns per rank, dtype %s\n",
              s.model.c_str(), s.config.empty() ? "" : " from ", s.config.c_str(), s.vocab,
              s.padded, s.pad_to, width, dtype_name(s.dtype));
  std::printf(
      "# reduction %s, label smoothing %g, z-loss %g, softcap %g, ignore fraction %g, grad_output "
      "%g, "
      "logits in [-%g, %g), seed %" PRIu64 "\n",
      reduction_name(s.reduction), s.label_smoothing, s.z_loss, s.softcap, s.ignore_fraction,
      s.grad_output, s.logit_range, s.logit_range / 2, s.seed);
  std::printf("# timing: %d iteration(s) after %d warm-up, %s%s; check: %s\n", s.iters, s.warmup,
              s.device == "cuda" ? "CUDA events on one stream" : "MPI_Wtime",
              s.graph  ? ", replayed from CUDA graphs"
              : s.idle ? ", each step from an idle device, ranks starting together (median)"
                       : "",
              s.check ? "on (fp64 reference)" : "off (#wrong N/A; -c to verify)");
  std::printf("# MPI: %s\n", env.mpi.c_str());
  std::printf("# CUDA runtime %s, driver %s; NCCL %s\n", env.cuda_runtime.c_str(),
              env.cuda_driver.c_str(), env.nccl.c_str());
  for (const std::string& l : env.rank_lines) std::printf("%s\n", l.c_str());
  std::printf("# copy bandwidth %.1f GB/s (%s, slowest rank)\n", env.copy_bw / 1e9,
              env.copy_how.c_str());
  std::printf(
      "# roofline: the logits read twice and the gradient written once at that bandwidth\n");
  std::printf("#\n");
  std::printf("# %8s %11s %9s %9s %9s %9s %11s %9s %6s %9s\n", "", "", "", "forward", "backward",
              "total", "all-gather", "", "", "extra");
  std::printf("# %8s %11s %9s %9s %9s %9s %11s %9s %6s %9s %7s\n", "tokens", "vocab/rank", "mode",
              "ms", "ms", "ms", "ms", "GB/s", "%roof", "MiB", "#wrong");
  std::fflush(stdout);
}

nlohmann::json to_json(const Settings& s, const Env& env, const std::vector<Result>& results,
                       int64_t wrong) {
  using nlohmann::json;
  json j;
  j["tool"] = "xent_dist_bench";
  j["version"] = XENT_BENCH_VERSION;
  j["command"] = s.command;
  j["env"] = {{"hostname", env.hostname},
              {"started", env.started},
              {"ranks", env.ranks},
              {"backend", s.device},
              {"ranks_detail", env.rank_lines},
              {"mpi", env.mpi},
              {"cuda_runtime", env.cuda_runtime},
              {"cuda_driver", env.cuda_driver},
              {"nccl", env.nccl},
              {"copy_bandwidth_gbps", env.copy_bw / 1e9},
              {"copy_bandwidth_method", env.copy_how}};
  j["config"] = {{"file", s.config},
                 {"model", s.model},
                 {"vocab_size", s.vocab},
                 {"pad_to", s.pad_to},
                 {"padded_vocab", s.padded},
                 {"tp", env.ranks},
                 {"dtype", dtype_name(s.dtype)},
                 {"reduction", reduction_name(s.reduction)},
                 {"label_smoothing", s.label_smoothing},
                 {"z_loss", s.z_loss},
                 {"softcap", s.softcap},
                 {"ignore_fraction", s.ignore_fraction},
                 {"grad_output", s.grad_output},
                 {"logit_range", s.logit_range},
                 {"seed", s.seed},
                 {"iters", s.iters},
                 {"warmup", s.warmup},
                 {"graph", s.graph},
                 {"idle", s.idle},
                 {"check", s.check},
                 {"modes", s.modes},
                 {"tokens", s.tokens}};
  json rows = json::array();
  for (const Result& r : results) {
    const double bytes = 3.0 * static_cast<double>(r.tokens) * static_cast<double>(r.width) *
                         static_cast<double>(dtype_bytes(s.dtype));
    const double roof_ms = bytes / env.copy_bw * 1e3;
    json row = {{"tokens", r.tokens},
                {"vocab_per_rank", r.width},
                {"mode", r.mode},
                {"dtype", dtype_name(s.dtype)},
                {"fwd_ms", r.fwd_ms},
                {"bwd_ms", r.bwd_ms},
                {"total_ms", r.total_ms},
                {"allgather_ms", r.gather_ms},
                {"gbps", bytes / (r.total_ms * 1e-3) / 1e9},
                {"roofline_ms", roof_ms},
                {"roofline_pct", 100.0 * roof_ms / r.total_ms},
                {"extra_mib", r.extra_bytes / (1 << 20)}};
    row["wrong"] = s.check ? json(r.wrong) : json(nullptr);
    rows.push_back(row);
  }
  j["results"] = rows;
  j["wrong_total"] = s.check ? json(wrong) : json(nullptr);
  return j;
}

// ---- Up-front checks: before the first size, on every rank ---------------------------------

std::string bytes_text(double b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f bytes (%.1f GiB)", b, b / (1 << 30));
  return buf;
}

// What one rank holds at once at `tokens` rows of `width` columns, in bytes (a size's buffers are
// freed before the next, and the library's workspace grows to the largest). A double, not an
// int64: tokens x width x 4 bytes can pass 2^63 with two flags each below 2^31, and must be
// refused, not wrapped round to a size that fits.
double bytes_needed(const Settings& s, double tokens, double width, int ranks) {
  xent::Options opt;
  opt.label_smoothing = static_cast<float>(s.label_smoothing);
  const double record = static_cast<double>(xent::record_bytes(opt));
  const double per_row = 8.0 + 4.0                             // targets (int64), lse
                         + (s.reduction == kNone ? 8.0 : 0.0)  // loss and grad_output per row
                         + 2.0 * record * (1 + ranks)  // the all-gather's buffers; the workspace's
                         + 4.0                         // the workspace's lse
                         + (s.check ? sizeof(RefRow) + 8.0 : 0.0);  // reference; loss, lse copies
  // The logits: forward and backward write the gradient in place.
  return tokens * width * static_cast<double>(dtype_bytes(s.dtype)) + tokens * per_row;
}

// The ranks that draw on the same memory as this one: on the CPU backend those on this node
// (MemAvailable is the node's), on CUDA those on this rank's GPU (one, unless oversubscribed).
int ranks_sharing(bool gpu, int device) {
  MPI_Comm node = MPI_COMM_NULL, same = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  MPI_Comm_split(node, gpu ? device : 0, 0, &same);
  int n = 1;
  MPI_Comm_size(same, &n);
  MPI_Comm_free(&same);
  MPI_Comm_free(&node);
  return n;
}

// Refuses, with exit status 2 on every rank, a sweep whose largest size cannot fit: otherwise it
// fails only at allocation, sizes later, with an MPI_Abort. Returns false when refused.
bool check_memory(const Settings& s, Device& dev, int64_t width, int sharing) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int64_t n = *std::max_element(s.tokens.begin(), s.tokens.end());
  const double need = bytes_needed(s, static_cast<double>(n), static_cast<double>(width), ranks);
  std::string how;
  const double avail = static_cast<double>(dev.memory_available(&how));
  int refused = need * sharing > avail ? 1 : 0, any = 0;
  MPI_Allreduce(&refused, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!any) return true;
  int me = refused ? rank : ranks, speaker = 0;
  MPI_Allreduce(&me, &speaker, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == speaker) {
    std::string m = "xent_dist_bench: " + s.tokens_from + ", " + s.vocab_from + ": " +
                    std::to_string(n) + " tokens x " + std::to_string(width) + " columns of " +
                    dtype_name(s.dtype) + " need " + bytes_text(need) + " per rank";
    if (sharing > 1)
      m += ", " + bytes_text(need * sharing) + " for the " + std::to_string(sharing) +
           " ranks on this " + (dev.gpu() ? "GPU" : "node");
    m += "; rank " + std::to_string(rank) + " has " + bytes_text(avail) + " of " + how +
         (dev.gpu() ? ": use fewer tokens, or more ranks (GPUs)"
                    : ": use fewer tokens, or more ranks over more nodes");
    std::fprintf(stderr, "%s\n", m.c_str());
    std::fflush(stderr);
  }
  return false;
}

// The CPU backend is plain loops: it goes over the logits at a few hundred MB/s per core, and the
// presets are sized for GPUs (a preset's sweep takes many minutes). The estimate counts the
// bytes the sweep goes over, per size and mode: generating the logits (1 pass), the first call
// and each warm-up and timed iteration (3 passes: read twice, write once), and with --check the
// fp64 reference (the global row twice and the shard once, each about 3 passes' worth: a hash
// and an exp per element), at the rate of a slow core (measured: 0.15 GB/s), so that it errs long.
constexpr double kCpuBytesPerSecond = 0.15e9;  // per core

double cpu_seconds(const Settings& s, int64_t width, int sharing) {
  const double eb = static_cast<double>(dtype_bytes(s.dtype));
  const double passes =
      1.0 + 3.0 * (1 + s.warmup + s.iters) +
      (s.check ? 3.0 * (2.0 * static_cast<double>(s.vocab) / static_cast<double>(width) + 1.0)
               : 0.0);
  double bytes = 0.0;
  for (const int64_t n : s.tokens)
    bytes += static_cast<double>(n) * static_cast<double>(width) * eb * passes *
             static_cast<double>(s.modes.size());
  // Ranks beyond the node's cores share them (mpirun --oversubscribe).
  const double cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  return bytes / kCpuBytesPerSecond * std::max(1.0, sharing / cores);
}

int run(const Settings& s) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const bool gpu = s.device == "cuda";
  xent::Group group =
      gpu ? xent::mpi::nccl_group(MPI_COMM_WORLD) : xent::mpi::host_group(MPI_COMM_WORLD);
  std::unique_ptr<Device> dev = gpu ? make_cuda_device(group.device()) : make_host_device();
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int64_t width = s.padded / ranks + (s.padded % ranks ? 1 : 0);  // the widest shard
  const int sharing = ranks_sharing(gpu, group.device());
  if (!check_memory(s, *dev, width, sharing)) return 2;
  if (!gpu && rank == 0) {
    const double sec = cpu_seconds(s, width, sharing);
    if (sec > 60)
      std::fprintf(stderr,
                   "xent_dist_bench: warning: this sweep may take about %.0f minutes on the CPU "
                   "backend (%zu size(s) up to %" PRId64 " tokens x %" PRId64
                   " columns, %zu mode(s), %d iteration(s) + %d warm-up%s; estimated at %.2f "
                   "GB/s per core): the presets are sized for GPUs; --tokens 256 -n 1 -w 0 is "
                   "quick\n",
                   std::ceil(sec / 60), s.tokens.size(),
                   *std::max_element(s.tokens.begin(), s.tokens.end()), width, s.modes.size(),
                   s.iters, s.warmup, s.check ? ", --check" : "", kCpuBytesPerSecond / 1e9);
  }
  const Env env = gather_env(*dev, group);
  Bench bench(s, group, *dev, env);
  if (rank == 0) print_header(s, env, width);
  const std::vector<Result> results = bench.run();

  int64_t wrong = 0;
  for (const Result& r : results) wrong += r.wrong;
  int status = 0;
  if (rank == 0) {
    std::vector<std::string> means;
    for (const std::string& mode : s.modes) {
      double sum = 0.0;
      int count = 0;
      for (const Result& r : results) {
        if (r.mode != mode) continue;
        const double bytes = 3.0 * static_cast<double>(r.tokens) * static_cast<double>(r.width) *
                             static_cast<double>(dtype_bytes(s.dtype));
        sum += 100.0 * bytes / env.copy_bw * 1e3 / r.total_ms;
        ++count;
      }
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f (%s)", count ? sum / count : 0.0, mode.c_str());
      means.push_back(buf);
    }
    std::string m;
    for (const std::string& x : means) m += (m.empty() ? "" : ", ") + x;
    std::printf("# mean %% of the 3-pass roofline: %s\n", m.c_str());
    if (s.check)
      std::printf("# #wrong in all: %" PRId64 " (%s)\n", wrong, wrong ? "FAILED" : "OK");
    else
      std::printf("# #wrong: not checked (-c to verify)\n");
    if (!s.json.empty()) {
      std::ofstream f(s.json, std::ios::trunc);
      f << to_json(s, env, results, wrong).dump(2) << "\n";
      if (!f) {
        std::fprintf(stderr, "xent_dist_bench: --json = '%s': could not write the file\n",
                     s.json.c_str());
        status = 1;
      } else {
        std::printf("# results written to %s\n", s.json.c_str());
      }
    }
    std::fflush(stdout);
  }
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return wrong > 0 ? 1 : status;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  cudaGetLastError();  // clear "no driver" and the like
  return n;
}

}  // namespace
}  // namespace xb

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  // Every rank parses the same command line; they agree on the outcome before anything else.
  xb::Settings s;
  std::string message;
  int status = xb::parse_settings(argc, argv, ranks, rank, xb::cuda_device_count(), s, message);
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (worst != xb::kParseOk) {
    int me = status == worst ? rank : ranks, speaker = 0;
    MPI_Allreduce(&me, &speaker, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == speaker) {
      if (worst == xb::kParseHelp)
        std::printf("%s", message.c_str());
      else
        std::fprintf(stderr, "%s\n", message.c_str());
      std::fflush(nullptr);
    }
    MPI_Finalize();
    return worst == xb::kParseHelp ? 0 : 2;
  }

  int rc = 0;
  try {
    rc = xb::run(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "xent_dist_bench: rank %d: %s\n", rank, e.what());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
