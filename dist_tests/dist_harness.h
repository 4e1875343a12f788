// The environment and the harness that the multi-rank tests share (test_dist.cpp,
// test_dist_errors.cpp; dist_main.cpp sets the environment up from XENT_TEST_BACKEND and
// XENT_TEST_DEVICE_EXCHANGE). Those files put their tests in this namespace (inside an anonymous
// one) and name it all unqualified.
//
// The environment: this rank, the group (xent::mpi::host_group, nccl_group or cuda_group over
// MPI_COMM_WORLD), its stream, and the reason every test skips (none: empty); the Dist fixture;
// Buf, a buffer where the group computes (host memory for cpu, device memory for the CUDA
// backends).
//
// The harness: run_dist runs one DistCase on every rank. Every rank builds the same global
// [N, Vpad] logits (fixed seeds), takes its own (uneven) slice of the vocabulary, runs xent, and
// checks that ITS loss, lse and accuracy equal the unsharded double-precision reference
// (tests/reference.h, checked by tests/harness.h) and that ITS gradient shard equals the
// reference's slice.
#pragma once

#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <xent/xent.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"

namespace xdist {

using ::testing::HasSubstr;
using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;
using xtest::GradTol;
using xtest::Matrix;

// ------------------------------------------------------------------------------ environment

struct Env {
  int rank = 0, size = 1;
  bool cuda = false;
  bool exchange = false;  // XENT_TEST_DEVICE_EXCHANGE=1
  std::string skip;       // non-empty: every test skips with this reason
  std::optional<xent::Group> group;
  cudaStream_t stream = nullptr;
};
inline Env& env() {
  static Env e;
  return e;
}

class Dist : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!env().skip.empty()) GTEST_SKIP() << env().skip;
  }
  const xent::Group& g() { return *env().group; }
  int rank() const { return env().rank; }
  int size() const { return env().size; }
};

inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "[rank %d] %s: %s\n", env().rank, what, cudaGetErrorString(e));
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
}

// A buffer where the group computes: host memory (cpu) or device memory (cuda).
class Buf {
 public:
  explicit Buf(size_t bytes) : bytes_(bytes) {
    const size_t n = bytes > 0 ? bytes : 16;
    if (env().cuda)
      cuda_ok(cudaMalloc(&p_, n), "cudaMalloc");
    else
      p_ = std::malloc(n);
  }
  ~Buf() {
    if (env().cuda)
      cudaFree(p_);
    else
      std::free(p_);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  void put(const void* host, size_t n) {
    if (n == 0) return;
    if (env().cuda) {
      cuda_ok(cudaMemcpy(p_, host, n, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
      // From pageable memory cudaMemcpy may return before the copy lands, and the calls under
      // test run on a non-blocking stream: a sentinel that lands late overwrites their output
      // (the zero-row forward's accuracy, a memset, read back as the NaN sentinel).
      cuda_ok(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize (H2D)");
    } else {
      std::memcpy(p_, host, n);
    }
  }
  void get(void* host, size_t n) const {
    if (n == 0) return;
    if (env().cuda)
      cuda_ok(cudaMemcpy(host, p_, n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    else
      std::memcpy(host, p_, n);
  }
  template <typename T>
  T* as() {
    return static_cast<T*>(p_);
  }
  void* ptr() { return p_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

inline void sync() {
  if (env().cuda) cuda_ok(cudaStreamSynchronize(env().stream), "cudaStreamSynchronize");
}

// The same float values (bitwise) on every rank.
inline bool same_on_all_ranks(const std::vector<float>& v) {
  const int n = static_cast<int>(v.size());
  std::vector<float> all(static_cast<size_t>(n) * env().size);
  MPI_Allgather(v.data(), n, MPI_FLOAT, all.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
  for (int r = 1; r < env().size; ++r)
    if (std::memcmp(all.data() + static_cast<size_t>(r) * n, all.data(), sizeof(float) * n) != 0)
      return false;
  return true;
}

// ------------------------------------------------------------------------------ the harness

struct DistCase {
  Matrix x;                      // global [N, Vpad], rounded to dtype
  std::vector<int64_t> targets;  // global, the same on every rank
  std::vector<int64_t> widths;   // one per rank, sum = Vpad
  int64_t vocab_size = -1;       // -1: Vpad
  DType dtype = DType::f32;
  IndexType itype = IndexType::i64;
  xent::Options opt;                // layout fields filled from plan_shard
  std::vector<double> grad_output;  // empty: 1
  GradTol tol = {};
  int64_t stride_extra = 2;
  bool pad_grad_exact_zero = true;     // padded columns' gradient must be exactly 0
  const xent::Group* group = nullptr;  // null: the environment's
};

inline void run_dist(const DistCase& c) {
  const int r = env().rank;
  ASSERT_EQ(c.widths.size(), static_cast<size_t>(env().size));
  const xent::Group& g = c.group != nullptr ? *c.group : *env().group;
  const int64_t N = c.x.rows, Vpad = c.x.cols;
  const std::vector<int64_t> starts = xtest::starts_of(c.widths);
  ASSERT_EQ(starts.back() + c.widths.back(), Vpad);
  const int64_t V = c.vocab_size < 0 ? Vpad : c.vocab_size;

  const xent::Shard shard = xent::plan_shard(g, c.widths[r], c.vocab_size);
  EXPECT_EQ(shard.start, starts[r]);
  EXPECT_EQ(shard.width, c.widths[r]);
  EXPECT_EQ(shard.vocab_size, V);
  xent::Options opt = c.opt;
  opt.device_exchange = env().exchange;
  xent::apply(shard, opt);
  EXPECT_NO_THROW(xent::check_layout(g, shard, N));

  const xtest::RefOptions ro = xtest::ref_options(opt, V);
  std::vector<double> go = c.grad_output;
  if (go.empty()) go.assign(opt.reduction == Reduction::none ? N : 1, 1.0);
  const xtest::RefResult ref = xtest::reference(c.x, c.targets, ro);
  const xtest::RefResult ref_go = xtest::reference(c.x, c.targets, ro, go);

  xtest::HostLogits host =
      xtest::make_shard(c.x, starts[r], c.widths[r], c.dtype, c.widths[r] + c.stride_extra);
  const xtest::HostLogits orig = host;
  xtest::HostTargets tg(c.targets, c.itype);
  Buf dlog(host.bytes.size()), dtgt(tg.bytes());
  dlog.put(host.bytes.data(), host.bytes.size());
  xent::TargetsView tv = tg.view();
  dtgt.put(tv.data, tg.bytes());
  if (N > 0) tv.data = dtgt.ptr();
  xent::LogitsView lv = host.view();
  if (N > 0) lv.data = dlog.ptr();

  const size_t nloss = opt.reduction == Reduction::none ? static_cast<size_t>(N) : 1;
  const size_t n = static_cast<size_t>(std::max<int64_t>(N, 1));
  Buf dloss(4 * n), dlse(4 * n), dzl(4 * n), dam(8 * n), dacc(4), dgo(4 * go.size() + 4);
  {  // sentinels: NaN
    std::vector<float> nan(n, std::nanf(""));
    dloss.put(nan.data(), 4 * n);
    dlse.put(nan.data(), 4 * n);
    dzl.put(nan.data(), 4 * n);
    dacc.put(nan.data(), 4);
  }
  xent::Outputs out;
  out.loss = dloss.as<float>();
  out.lse = dlse.as<float>();
  out.z_loss = dzl.as<float>();
  if (opt.compute_accuracy) {
    out.argmax = dam.as<int64_t>();
    out.accuracy = dacc.as<float>();
  }
  xent::forward(g, lv, tv, opt, out, env().stream);
  sync();
  if (env().cuda) EXPECT_NO_THROW(g.check_errors(env().stream));
  // After the first forward has made (or failed to make) the peer memory.
  if (env().exchange && N > 0)
    EXPECT_THAT(xent::forward_path(g, lv, opt), HasSubstr("device exchange"))
        << "rank " << r << ": the communicator made no peer memory";

  xtest::GotOutputs got;
  got.loss.resize(nloss);
  dloss.get(got.loss.data(), 4 * nloss);
  got.lse.resize(N);
  dlse.get(got.lse.data(), 4 * N);
  got.zloss.resize(N);
  dzl.get(got.zloss.data(), 4 * N);
  if (opt.compute_accuracy) {
    got.argmax.resize(N);
    dam.get(got.argmax.data(), 8 * N);
    got.accuracy.resize(1);
    dacc.get(got.accuracy.data(), 4);
  }
  {
    SCOPED_TRACE("rank " + std::to_string(r) + " forward outputs (shard [" +
                 std::to_string(starts[r]) + ", " + std::to_string(starts[r] + c.widths[r]) +
                 ") of " + std::to_string(Vpad) + ", vocab " + std::to_string(V) + ")");
    xtest::expect_outputs(got, ref, c.targets, ro);
  }
  // The all-gathered records merge in rank order: every rank's loss is bitwise the same.
  EXPECT_TRUE(same_on_all_ranks(got.loss)) << "the ranks' losses differ (bitwise)";
  EXPECT_TRUE(same_on_all_ranks(got.lse)) << "the ranks' lse differ (bitwise)";

  std::vector<float> gof(go.begin(), go.end());
  dgo.put(gof.data(), 4 * gof.size());
  auto fetch = [&] {
    sync();
    dlog.get(host.bytes.data(), host.bytes.size());
  };
  auto pad_zero = [&] {
    if (!c.pad_grad_exact_zero) return;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = std::max<int64_t>(0, V - starts[r]); j < c.widths[r]; ++j)
        EXPECT_EQ(host.get(i, j), 0.0)
            << "rank " << r << ": padded column " << starts[r] + j << " of row " << i;
  };
  const std::string where = "rank " + std::to_string(r) + ": ";
  switch (opt.grad_mode) {
    case GradMode::fused: {
      fetch();
      EXPECT_TRUE(xtest::grad_matches(host, ref, starts[r], c.tol)) << where << "fused forward";
      pad_zero();
      xent::backward(g, lv, tv, out.lse, dgo.as<float>(), opt, env().stream);
      fetch();
      GradTol t2 = c.tol;
      if (!xtest::is_pow2_all(go)) t2.ulps *= 2;
      EXPECT_TRUE(xtest::grad_matches(host, ref_go, starts[r], t2)) << where << "fused backward";
      break;
    }
    case GradMode::deferred: {
      fetch();
      EXPECT_TRUE(xtest::same_bytes(host, orig)) << where << "deferred forward wrote the logits";
      xent::backward(g, lv, tv, out.lse, dgo.as<float>(), opt, env().stream);
      fetch();
      EXPECT_TRUE(xtest::grad_matches(host, ref_go, starts[r], c.tol))
          << where << "deferred backward";
      pad_zero();
      break;
    }
    case GradMode::none: {
      fetch();
      EXPECT_TRUE(xtest::same_bytes(host, orig)) << where << "grad_mode none wrote the logits";
      break;
    }
  }
}

// Default global problem: N rows, the given widths, random logits and targets.
inline DistCase make_case(int64_t N, std::vector<int64_t> widths, uint64_t seed,
                          DType dt = DType::f32, double p_ignore = 0.0, int64_t vocab_size = -1,
                          double sigma = 2.0, double mean = 0.0) {
  DistCase c;
  int64_t Vpad = 0;
  for (int64_t w : widths) Vpad += w;
  c.widths = std::move(widths);
  c.vocab_size = vocab_size;
  c.dtype = dt;
  c.x = xtest::random_logits(N, Vpad, seed, dt, sigma, mean);
  c.targets = xtest::random_targets(N, vocab_size < 0 ? Vpad : vocab_size, seed, p_ignore,
                                    c.opt.ignore_index);
  return c;
}

// Widths that differ by rank: rank r gets base + 3 r.
inline std::vector<int64_t> growing(int ranks, int64_t base) {
  std::vector<int64_t> w(ranks);
  for (int r = 0; r < ranks; ++r) w[r] = base + 3 * r;
  return w;
}

}  // namespace xdist
