#include "harness.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>

#include "linear_op.h"
#include "op.h"
#include "xent/mpi.h"

namespace xb {
namespace {

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

using Step = std::function<void()>;
using GraphExec = std::unique_ptr<CUgraphExec_st, cudaError_t (*)(cudaGraphExec_t)>;

GraphExec capture(Device& dev, const Step& f) {
  cudaStream_t stream = dev.stream();
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
  return GraphExec(exec, cudaGraphExecDestroy);
}

// `f` itself, or the replay of its CUDA graph.
Step replayed(Device& dev, const Step& f, const GraphExec& g) {
  if (!g) return f;
  return [&dev, &g] { cuda_ok(cudaGraphLaunch(g.get(), dev.stream()), "cudaGraphLaunch"); };
}

// The mean time of one call of `step`, called back to back after `warmup` calls.
double time_alone(Device& dev, const Step& step, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) step();
  dev.marks(2);
  dev.sync();
  dev.mark(0);
  for (int i = 0; i < iters; ++i) step();
  dev.mark(1);
  dev.sync();
  return dev.ms(0, 1) / iters;
}

// Forward + backward on the buffer as it is, between marks around each call: back to back
// (means), or each step alone from an idle device, the ranks starting together (medians): what
// the host's latency costs a training step that reaches its loss with the GPU waiting. With a
// baseline (--interleave), it runs before each step, warm-up included, timed between marks of its
// own (its mean into r.gemm3_ms): the two alternate in one power and thermal state.
template <class Op>
void time_steps(const Settings& s, Device& dev, Op& op, Result& r, const Step& baseline = {}) {
  const Step fwd = [&op] { op.forward(); }, bwd = [&op] { op.backward(); };
  const GraphExec gf = s.graph ? capture(dev, fwd) : GraphExec(nullptr, cudaGraphExecDestroy);
  const GraphExec gb = s.graph ? capture(dev, bwd) : GraphExec(nullptr, cudaGraphExecDestroy);
  const Step run_fwd = replayed(dev, fwd, gf), run_bwd = replayed(dev, bwd, gb);
  for (int i = s.warmup; baseline && i < 2; ++i) baseline();  // as time_alone: at least two
  for (int i = 0; i < s.warmup; ++i) {
    if (baseline) baseline();
    run_fwd();
    run_bwd();
  }
  // Marks k * i, k * i + 1 and k * i + 2 around step i; back to back, a step starts at the
  // previous one's end. With a baseline (k = 3), it runs between marks k * i and k * i + 1, and
  // step i between k * i + 1 and k * i + 3.
  const int iters = s.iters, k = s.idle || baseline ? 3 : 2, b = baseline ? 1 : 0;
  dev.marks(k * iters + (s.idle ? 0 : 1));
  dev.sync();
  for (int i = 0; i < iters; ++i) {
    if (s.idle) {
      dev.sync();
      start_together();
    }
    if (baseline) {
      if (i == 0) dev.mark(0);  // later: the previous step's end
      baseline();
    }
    if (s.idle || baseline || i == 0) dev.mark(k * i + b);
    run_fwd();
    dev.mark(k * i + b + 1);
    run_bwd();
    dev.mark(k * i + b + 2);
  }
  dev.sync();
  op.check_errors();
  std::vector<double> f(iters), bw(iters), t(iters);
  for (int i = 0; i < iters; ++i) {
    f[i] = dev.ms(k * i + b, k * i + b + 1);
    bw[i] = dev.ms(k * i + b + 1, k * i + b + 2);
    t[i] = dev.ms(k * i + b, k * i + b + 2);
  }
  if (s.idle) {
    r.fwd_ms = median(f);
    r.bwd_ms = median(bw);
    r.total_ms = median(t);
    return;
  }
  for (int i = 0; i < iters; ++i) {
    r.fwd_ms += f[i] / iters;
    r.bwd_ms += bw[i] / iters;
  }
  if (!baseline) {
    r.total_ms = dev.ms(0, 2 * iters) / iters;
    return;
  }
  r.gemm3_ms = 0.0;
  for (int i = 0; i < iters; ++i) {
    r.gemm3_ms += dev.ms(k * i, k * i + 1) / iters;
    r.total_ms += t[i] / iters;
  }
}

// The slowest rank's times and memory, as nccl-tests reports them; the wrong values of all ranks.
void slowest_rank(Result& r, int64_t extra_bytes) {
  double mine[6] = {r.fwd_ms,
                    r.bwd_ms,
                    r.total_ms,
                    r.gather_ms,
                    static_cast<double>(std::max<int64_t>(0, extra_bytes)),
                    r.gemm3_ms};
  double worst[6];
  MPI_Allreduce(mine, worst, 6, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  long long w = r.wrong, wsum = 0;
  MPI_Allreduce(&w, &wsum, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  r.fwd_ms = worst[0];
  r.bwd_ms = worst[1];
  r.total_ms = worst[2];
  r.gather_ms = worst[3];
  r.extra_bytes = worst[4];
  r.gemm3_ms = worst[5];
  r.wrong = wsum;
}

// What each operation times once per size besides itself, and what it says of a row: the
// logits' all-gather, path and bytes; the lm head's three GEMMs alone (n/a where there are none).
void time_baseline(const Settings& s, Device& dev, Operation& op, Result& r) {
  r.gather_ms = time_alone(dev, op.all_gather(), std::max(2, s.warmup), s.iters);
}
void time_baseline(const Settings& s, Device& dev, LinearOperation& op, Result& r) {
  const Step gemm3 = op.gemm3();
  if (gemm3 && !s.interleave) r.gemm3_ms = time_alone(dev, gemm3, std::max(2, s.warmup), s.iters);
}
// What runs before each step (--interleave), else nothing.
Step interleaved(const Settings&, Operation&) {
  return {};
}
Step interleaved(const Settings& s, LinearOperation& op) {
  return s.interleave ? op.gemm3() : Step{};
}
void describe_row(const Settings& s, Operation& op, Result& r) {
  r.path = op.path();
  r.bytes = bytes_moved(r.tokens, r.width, s.dtype);
}
void describe_row(const Settings&, LinearOperation& op, Result& r) {
  r.path = op.path();
}

template <class Op>
std::vector<Result> sweep(const Settings& s, const Env& env, Device& dev, Op& op, int64_t width) {
  std::vector<Result> results;
  const size_t steps = s.tokens.size() * s.modes.size();
  size_t step = 0;
  // Rank 0 says what it is doing on stderr: CPU runs of GPU-sized presets take minutes per size.
  // On a terminal the line is rewritten in place (and cleared before each row); in a log or a
  // pipe each phase gets a line of its own.
  const bool tty = isatty(2);
  for (const int64_t n : s.tokens) {
    auto progress = [&](const std::string& mode, bool timing) {
      if (env.rank != 0) return;
      if (!timing) ++step;
      const char* phase = timing ? "timing" : s.check ? "checking" : "first call";
      std::fprintf(
          stderr, "%sxent_dist_bench: [%zu/%zu] %" PRId64 " tokens x %" PRId64 ", %s: %s...%s",
          tty ? "\r" : "", step, steps, n, width, mode.c_str(), phase, tty ? "\033[K" : "\n");
      std::fflush(stderr);
    };
    op.resize(n);
    Result base;
    base.tokens = n;
    base.width = width;
    time_baseline(s, dev, op, base);
    std::vector<Result> rows;
    for (const std::string& mode : s.modes) {
      progress(mode, false);
      op.first_call(mode);
      Result r = base;
      r.mode = mode;
      describe_row(s, op, r);
      if (s.check) r.wrong = op.verify();
      progress(mode, true);
      time_steps(s, dev, op, r, interleaved(s, op));
      slowest_rank(r, op.extra_bytes());
      rows.push_back(r);
    }
    for (const Result& r : rows) {
      if (env.rank == 0) {
        if (tty) std::fprintf(stderr, "\r\033[K");
        print_row(s, env, r);
      }
      results.push_back(r);
    }
  }
  return results;
}

// ---- Up-front checks: before the first size, on every rank ---------------------------------

std::string bytes_text(double b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f bytes (%.1f GiB)", b, b / (1 << 30));
  return buf;
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
  const double need = (s.hidden > 0 ? linear_bytes_needed : bytes_needed)(
      s, static_cast<double>(n), static_cast<double>(width), ranks);
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
                    dtype_name(s.dtype) +
                    (s.hidden > 0 ? ", hidden " + std::to_string(s.hidden) : std::string()) +
                    " need " + bytes_text(need) + " per rank";
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
// presets are sized for GPUs (a preset's sweep takes many minutes). The estimate takes the bytes
// the sweep goes over at the rate of a slow core (measured: 0.15 GB/s), so that it errs long.
constexpr double kCpuBytesPerSecond = 0.15e9;  // per core

void warn_if_slow(const Settings& s, int64_t width, int sharing) {
  double bytes = 0.0;
  for (const int64_t n : s.tokens)
    bytes += (s.hidden > 0 ? linear_bytes_gone_over : bytes_gone_over)(s, n, width,
                                                                       1 + s.warmup + s.iters) *
             static_cast<double>(s.modes.size());
  // Ranks beyond the node's cores share them (mpirun --oversubscribe).
  const double cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  const double sec = bytes / kCpuBytesPerSecond * std::max(1.0, sharing / cores);
  if (sec <= 60) return;
  std::fprintf(stderr,
               "xent_dist_bench: warning: this sweep may take about %.0f minutes on the CPU "
               "backend (%zu size(s) up to %" PRId64 " tokens x %" PRId64
               " columns, %zu mode(s), %d iteration(s) + %d warm-up%s; estimated at %.2f "
               "GB/s per core): the presets are sized for GPUs; --tokens 256 -n 1 -w 0 is "
               "quick\n",
               std::ceil(sec / 60), s.tokens.size(),
               *std::max_element(s.tokens.begin(), s.tokens.end()), width, s.modes.size(), s.iters,
               s.warmup, s.check ? ", --check" : "", kCpuBytesPerSecond / 1e9);
}

}  // namespace

int run(const Settings& s) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const bool gpu = s.device == "cuda";
  xent::Group group =
      gpu ? xent::mpi::nccl_group(MPI_COMM_WORLD) : xent::mpi::host_group(MPI_COMM_WORLD);
  std::unique_ptr<Device> dev = gpu ? make_cuda_device(group.device()) : make_host_device();
  const int64_t width = widest_shard(s.padded, ranks);
  const int sharing = ranks_sharing(gpu, group.device());
  if (!check_memory(s, *dev, width, sharing)) return 2;
  if (!gpu && rank == 0) warn_if_slow(s, width, sharing);
  const Env env = gather_env(*dev, group);
  if (rank == 0) print_header(s, env, width);
  std::vector<Result> results;
  if (s.hidden > 0) {
    LinearOperation op(s, group, *dev);
    results = sweep(s, env, *dev, op, width);
  } else {
    Operation op(s, group, *dev);
    results = sweep(s, env, *dev, op, width);
  }

  int64_t wrong = 0;
  for (const Result& r : results) wrong += r.wrong;
  int status = rank == 0 ? print_summary(s, env, results, wrong) : 0;
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return wrong > 0 ? 1 : status;
}

}  // namespace xb
