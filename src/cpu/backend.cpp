// The CPU backend: the same steps as the CUDA kernels, over core/math.h. The per-element work
// (stats, gradient, scale_rows) runs in kernels.inc, vectorised, over blocks of rows on
// XENT_CPU_THREADS threads (default: std::thread::hardware_concurrency()). Each row's math is
// the same whichever thread runs it, and the only cross-row sums (the loss of the reduction,
// the valid rows) stay serial in row order in finalize and count_valid: every result is the
// same to the bit for every thread count.
#include "backend.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/finalize.h"

namespace xent::cpu {

// The row kernels (with their 8-lane vectors, vec8.inc), once for the baseline instruction set
// (8 lanes as two 16-byte vectors) and once for AVX2 (x86-64, GCC; native 32-byte vectors): the
// same lanes and operations, hence the same bits (see vec8.inc).
#define XENT_CPU_PAIRS 1
namespace generic {
#include "cpu/kernels.inc"
}  // namespace generic
#undef XENT_CPU_PAIRS

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define XENT_CPU_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
#define XENT_CPU_PAIRS 0
namespace avx2 {
#include "cpu/kernels.inc"
}  // namespace avx2
#undef XENT_CPU_PAIRS
#pragma GCC pop_options
#else
#define XENT_CPU_AVX2 0
#endif

namespace {

bool ignored(const core::Problem& p, int64_t target) {
  return target == p.ignore_index;
}

// AVX2 where the CPU has it, unless XENT_CPU_ISA=generic (the baseline code: the same results,
// for checking exactly that).
bool use_avx2() {
#if XENT_CPU_AVX2
  static const bool cpu_has = __builtin_cpu_supports("avx2");
  const char* env = std::getenv("XENT_CPU_ISA");
  return cpu_has && !(env != nullptr && std::strcmp(env, "generic") == 0);
#else
  return false;
#endif
}

constexpr int kMaxThreads = 1024;
// A thread costs tens of microseconds to start: one per at least this many elements.
constexpr int64_t kMinElementsPerThread = int64_t{1} << 16;

// XENT_CPU_THREADS (a positive integer; anything else is ignored), read on every call, else the
// hardware's concurrency.
int configured_threads() {
  if (const char* env = std::getenv("XENT_CPU_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (*end == '\0' && v >= 1) return static_cast<int>(std::min<long>(v, kMaxThreads));
  }
  // hardware_concurrency() reads /sys on every call (glibc's get_nprocs): once per process.
  static const int cores = [] {
    const unsigned hc = std::thread::hardware_concurrency();
    return hc == 0 ? 1 : static_cast<int>(std::min<unsigned>(hc, kMaxThreads));
  }();
  return cores;
}

// Calls f(r0, r1) on contiguous blocks covering rows [0, rows), one block per thread, the
// calling thread taking the first; returns when all are done. Threads are started per call
// (no pool to outlive a fork).
template <typename F>
void parallel_rows(int64_t rows, int64_t cols, F&& f) {
  if (rows <= 0) return;
  const int64_t work = rows * std::max<int64_t>(cols, 1);
  const int64_t useful = std::min<int64_t>(rows, work / kMinElementsPerThread);
  const int64_t n = useful <= 1 ? 1 : std::min<int64_t>(configured_threads(), useful);
  if (n <= 1) {
    f(int64_t{0}, rows);
    return;
  }
  const auto block = [&](int64_t i) { f(rows * i / n, rows * (i + 1) / n); };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(n - 1));
  int64_t started = 1;
  try {
    for (; started < n; ++started) pool.emplace_back(block, started);
  } catch (const std::system_error&) {  // no more threads: the rest run here
  }
  block(0);
  for (int64_t i = started; i < n; ++i) block(i);
  for (auto& t : pool) t.join();
}

}  // namespace

void stats(const core::Problem& p, LogitsView logits, TargetsView targets, float* record) {
  const bool avx2 = use_avx2();
  parallel_rows(p.rows, p.real_cols, [&](int64_t r0, int64_t r1) {
#if XENT_CPU_AVX2
    if (avx2) return avx2::stats(p, logits, targets, record, r0, r1);
#endif
    (void)avx2;
    generic::stats(p, logits, targets, record, r0, r1);
  });
}

void finalize_rows(const core::Problem& p, TargetsView targets, const float* gathered, int ranks,
                   int64_t r0, int64_t r1, const Outputs& out, float* lse, Totals& totals) {
  for (int64_t r = r0; r < r1; ++r) {
    const core::RowTotal t =
        core::finalize_row(p, targets.data, targets.type, gathered, ranks, r, out, lse);
    if (t.valid) {
      totals.loss += t.loss;  // rows in order, in double as the CUDA backend's (finalize_totals)
      ++totals.valid;
      totals.correct += t.correct ? 1 : 0;
    }
  }
}

void finalize(const core::Problem& p, TargetsView targets, const float* gathered, int ranks,
              const Outputs& out, float* lse, float* scalars) {
  Totals t;
  finalize_rows(p, targets, gathered, ranks, 0, p.rows, out, lse, t);
  scalars[Workspace::kScale] = core::finalize_totals(p, t.loss, static_cast<float>(t.valid),
                                                     static_cast<float>(t.correct), out);
  scalars[Workspace::kValid] = static_cast<float>(t.valid);
}

void gradient(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
              const float* lse, const float* scalars, const float* grad_output, GradRows rows) {
  const bool avx2 = use_avx2();
  const float scale0 = scalars[Workspace::kScale];
  const bool rescaled = rows == GradRows::rescaled;
  parallel_rows(p.rows, p.cols, [&](int64_t r0, int64_t r1) {
#if XENT_CPU_AVX2
    if (avx2)
      return avx2::gradient(p, in, out, targets, lse, scale0, grad_output, rescaled, r0, r1);
#endif
    (void)avx2;
    generic::gradient(p, in, out, targets, lse, scale0, grad_output, rescaled, r0, r1);
  });
}

void scale_rows(const core::Problem& p, LogitsView grad, const float* grad_output) {
  const bool avx2 = use_avx2();
  parallel_rows(p.rows, p.cols, [&](int64_t r0, int64_t r1) {
#if XENT_CPU_AVX2
    if (avx2) return avx2::scale_rows(p, grad, grad_output, r0, r1);
#endif
    (void)avx2;
    generic::scale_rows(p, grad, grad_output, r0, r1);
  });
}

void count_valid(const core::Problem& p, TargetsView targets, float* scalars) {
  int64_t valid = 0;
  for (int64_t r = 0; r < p.rows; ++r)
    valid += ignored(p, core::load_target(targets.data, targets.type, r)) ? 0 : 1;
  scalars[Workspace::kValid] = static_cast<float>(valid);
  scalars[Workspace::kScale] =
      core::gradient_scale(p.reduction == Reduction::mean, static_cast<float>(valid), p.grad_scale);
}

}  // namespace xent::cpu
