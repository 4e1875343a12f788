// Multi-rank tests, run under mpirun with 2, 3 and 4 ranks. Every rank builds the same global
// [N, Vpad] logits (fixed seeds), takes its own (uneven) slice of the vocabulary, runs xent, and
// checks that ITS loss, lse and accuracy equal the unsharded double-precision reference
// (tests/reference.h, checked by tests/harness.h) and that ITS gradient shard equals the
// reference's slice.
//
// XENT_TEST_BACKEND=cpu (default): xent::mpi::host_group(MPI_COMM_WORLD), host buffers.
// XENT_TEST_BACKEND=cuda: xent::mpi::nccl_group(MPI_COMM_WORLD) (NCCL), device buffers; every test
//   skips (GTEST_SKIP) where there are fewer visible GPUs than ranks on a node.
// XENT_TEST_BACKEND=cuda-mpi: xent::mpi::cuda_group(MPI_COMM_WORLD) (MPI through host memory, CUDA
//   IPC peer memory), device buffers; ranks may share a GPU; every test skips without one.
// XENT_TEST_DEVICE_EXCHANGE=1 (CUDA backends): every call with Options::device_exchange, and each
//   forward must have taken it (the group's communicator made peer memory). With cuda-mpi on one
//   GPU the ranks' processes take turns on it, so that every rank's kernel runs: the device
//   exchange of several ranks, tested on one GPU.
//
// Only rank 0 prints gtest's usual output; other ranks print their failures, prefixed with the
// rank. The exit status is non-zero on every rank if any rank failed.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <xent/mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"

namespace {

using ::testing::HasSubstr;
using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;
using xtest::GradTol;
using xtest::Matrix;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ------------------------------------------------------------------------------ environment

struct Env {
  int rank = 0, size = 1;
  bool cuda = false;
  bool exchange = false;  // XENT_TEST_DEVICE_EXCHANGE=1
  std::string skip;       // non-empty: every test skips with this reason
  std::optional<xent::Group> group;
  cudaStream_t stream = nullptr;
};
Env& env() {
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

void cuda_ok(cudaError_t e, const char* what) {
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

void sync() {
  if (env().cuda) cuda_ok(cudaStreamSynchronize(env().stream), "cudaStreamSynchronize");
}

// Every rank calls this: true on every rank iff `mine` holds on all ranks.
bool all_ranks(bool mine) {
  int v = mine ? 1 : 0, all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// The same float values (bitwise) on every rank.
bool same_on_all_ranks(const std::vector<float>& v) {
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

void run_dist(const DistCase& c) {
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
DistCase make_case(int64_t N, std::vector<int64_t> widths, uint64_t seed, DType dt = DType::f32,
                   double p_ignore = 0.0, int64_t vocab_size = -1, double sigma = 2.0,
                   double mean = 0.0) {
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
std::vector<int64_t> growing(int ranks, int64_t base) {
  std::vector<int64_t> w(ranks);
  for (int r = 0; r < ranks; ++r) w[r] = base + 3 * r;
  return w;
}

// ------------------------------------------------------------------------------ correctness

TEST_F(Dist, UnevenShardsPlain) {
  DistCase c = make_case(16, growing(size(), 11), 101);
  run_dist(c);
}

TEST_F(Dist, UnevenShardsAllOptionsNoneReduction) {
  DistCase c = make_case(24, xtest::uneven_widths(150, size()), 102, DType::f32, 0.2);
  c.opt.label_smoothing = 0.15f;
  c.opt.z_loss = 0.01f;
  c.opt.softcap = 5.0f;
  c.opt.compute_accuracy = true;
  c.opt.reduction = Reduction::none;
  c.grad_output.resize(24);
  for (int i = 0; i < 24; ++i) c.grad_output[i] = (i % 3 == 0) ? 0.5 : (i % 3 == 1 ? 2.0 : 1.0);
  run_dist(c);
}

TEST_F(Dist, DeferredSumWithGradOutput) {
  DistCase c = make_case(20, growing(size(), 17), 103, DType::f32, 0.1);
  c.opt.reduction = Reduction::sum;
  c.opt.grad_mode = GradMode::deferred;
  c.opt.label_smoothing = 0.1f;
  c.opt.z_loss = 0.02f;
  c.grad_output = {0.37};
  run_dist(c);
}

TEST_F(Dist, GradModeNone) {
  DistCase c = make_case(12, growing(size(), 9), 104);
  c.opt.grad_mode = GradMode::none;
  c.opt.compute_accuracy = true;
  run_dist(c);
}

TEST_F(Dist, IgnoredTokens) {
  for (GradMode m : {GradMode::fused, GradMode::deferred}) {
    DistCase c = make_case(32, growing(size(), 13), 105, DType::f32, 0.5);
    c.opt.grad_mode = m;
    c.opt.label_smoothing = 0.1f;
    c.opt.compute_accuracy = true;
    c.targets[0] = c.opt.ignore_index;
    run_dist(c);
  }
}

TEST_F(Dist, AllIgnoredBatch) {
  for (GradMode m : {GradMode::fused, GradMode::deferred}) {
    DistCase c = make_case(8, growing(size(), 7), 106);
    for (auto& t : c.targets) t = c.opt.ignore_index;
    c.opt.grad_mode = m;
    c.opt.label_smoothing = 0.2f;
    c.opt.z_loss = 0.01f;
    c.opt.compute_accuracy = true;
    run_dist(c);  // mean: loss 0, gradient 0, accuracy 0
  }
}

TEST_F(Dist, ZeroRows) {
  for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
    DistCase c = make_case(0, growing(size(), 5), 107);
    c.opt.reduction = red;
    c.opt.compute_accuracy = true;
    run_dist(c);
  }
}

// Shards of width 1 (every other rank), targets on them.
TEST_F(Dist, ShardOfWidthOne) {
  std::vector<int64_t> w(size());
  for (int r = 0; r < size(); ++r) w[r] = r % 2 == 0 ? 1 : 6 + r;
  DistCase c = make_case(16, w, 108);
  const auto s = xtest::starts_of(w);
  for (int64_t i = 0; i < 16; ++i) c.targets[i] = s[i % size()];  // the width-1 columns too
  c.opt.label_smoothing = 0.1f;
  c.opt.compute_accuracy = true;
  for (GradMode m : {GradMode::fused, GradMode::deferred}) {
    c.opt.grad_mode = m;
    run_dist(c);
  }
}

// Every target on the first or last column of some shard.
TEST_F(Dist, TargetsOnShardBoundaries) {
  const auto w = growing(size(), 6);
  DistCase c = make_case(4 * size(), w, 109);
  const auto s = xtest::starts_of(w);
  for (int64_t i = 0; i < c.x.rows; ++i) {
    const int k = static_cast<int>((i / 2) % size());
    c.targets[i] = i % 2 == 0 ? s[k] : s[k] + w[k] - 1;
    c.x.at(i, c.targets[i]) = 4.0;  // make them the argmax too, for half of the rows
    if (i % 4 >= 2) c.x.at(i, c.targets[i]) = -1.0;
  }
  c.opt.label_smoothing = 0.05f;
  c.opt.compute_accuracy = true;
  c.opt.reduction = Reduction::none;
  run_dist(c);
}

// +-1e4 and -inf, including a row whose logits on whole shards are -inf (those ranks' local
// lse is -inf) and a row where everything but the target is -inf.
TEST_F(Dist, ExtremeLogits) {
  const auto w = growing(size(), 5);
  const auto s = xtest::starts_of(w);
  DistCase c = make_case(6, w, 110);
  const int64_t Vp = c.x.cols;
  c.targets = {1, s[size() - 1], 2, Vp - 1, 0, 3};
  for (int64_t j = 0; j < Vp; ++j) {
    c.x.at(0, j) = j == 1 ? 1e4 : 0.0;  // target 1e4
    c.x.at(1, j) = j < s[size() - 1] ? -1e4 : (j == s[size() - 1] ? 1e4 - 1 : 1e4 - 2);
    c.x.at(2, j) = j < s[1] ? 0.5 * static_cast<double>(j % 3) : -kInf;  // ranks >= 1: all -inf
    c.x.at(3, j) = j == Vp - 1 ? 2.0 : -kInf;                            // only the target finite
    c.x.at(4, j) = j == 0 ? -1e4 : 0.0;                                  // target at -1e4
  }
  c.opt.reduction = Reduction::none;
  c.opt.compute_accuracy = true;
  c.tol.scale_atol = 1e-3;  // fp32 resolution of z - lse at |lse| ~ 1e4
  for (GradMode m : {GradMode::fused, GradMode::deferred}) {
    c.opt.grad_mode = m;
    run_dist(c);
  }
  // With a softcap -inf becomes -c: smoothing and z-loss stay finite.
  c.opt.softcap = 20.0f;
  c.opt.label_smoothing = 0.1f;
  c.opt.z_loss = 1e-3f;
  c.opt.reduction = Reduction::mean;
  c.opt.grad_mode = GradMode::fused;
  run_dist(c);
}

// Label smoothing needs the GLOBAL sum of the logits: every rank must report the unsharded
// loss. With logits centred far from 0 a shard-local sum would be off by ~e * mean * (1 - w/V).
TEST_F(Dist, LabelSmoothingExactAcrossShards) {
  DistCase c = make_case(32, xtest::uneven_widths(200, size()), 111, DType::f32, 0.1, -1, 2.0, 5.0);
  c.opt.label_smoothing = 0.3f;
  for (Reduction red : {Reduction::mean, Reduction::none}) {
    c.opt.reduction = red;
    run_dist(c);
  }
}

// The real vocabulary ends inside the last rank's shard; its padded columns hold garbage.
TEST_F(Dist, PaddedVocabLastRankPartlyPadding) {
  auto w = growing(size(), 8);
  int64_t total = 0;
  for (auto x : w) total += x;
  const int64_t V = total - (w.back() - 3);  // the last rank keeps 3 real columns
  DistCase c = make_case(16, w, 112, DType::f32, 0.1, V);
  for (int64_t i = 0; i < c.x.rows; ++i)
    for (int64_t j = V; j < total; ++j) c.x.at(i, j) = (j % 2) ? 1e4 : std::nan("");
  c.targets[1] = V - 1;
  c.opt.label_smoothing = 0.1f;
  c.opt.z_loss = 0.01f;
  c.opt.compute_accuracy = true;
  for (GradMode m : {GradMode::fused, GradMode::deferred}) {
    c.opt.grad_mode = m;
    run_dist(c);
  }
}

// The last rank's shard is padding only (real columns all on the ranks below it).
TEST_F(Dist, LastRankOnlyPadding) {
  auto w = growing(size(), 6);
  int64_t total = 0;
  for (auto x : w) total += x;
  const int64_t V = total - w.back();
  DistCase c = make_case(10, w, 113, DType::f32, 0.0, V);
  c.opt.label_smoothing = 0.1f;
  c.opt.compute_accuracy = true;
  run_dist(c);
}

TEST_F(Dist, HalfPrecision) {
  for (DType dt : {DType::bf16, DType::f16}) {
    for (GradMode m : {GradMode::fused, GradMode::deferred}) {
      SCOPED_TRACE(xtest::dtype_name(dt));
      DistCase c = make_case(24, xtest::uneven_widths(300, size()), 114, dt, 0.1);
      c.opt.grad_mode = m;
      c.opt.label_smoothing = 0.1f;
      c.opt.softcap = 8.0f;
      c.grad_output = {m == GradMode::fused ? 0.5 : 0.3};
      run_dist(c);
    }
  }
}

TEST_F(Dist, Int32Targets) {
  DistCase c = make_case(16, growing(size(), 10), 115, DType::f32, 0.2);
  c.itype = IndexType::i32;
  c.opt.compute_accuracy = true;
  c.opt.grad_mode = GradMode::deferred;
  run_dist(c);
}

// Ties for the maximum across a shard boundary go to the smaller global column.
TEST_F(Dist, ArgmaxAcrossShards) {
  const auto w = growing(size(), 4);
  const auto s = xtest::starts_of(w);
  DistCase c = make_case(2 * size(), w, 116);
  for (int64_t i = 0; i < c.x.rows; ++i) {
    const int k = static_cast<int>(i % size());
    const int64_t boundary = k + 1 < size() ? s[k + 1] : s[k];  // first column of rank k + 1
    c.x.at(i, boundary) = 9.0;
    c.x.at(i, boundary - 1) = 9.0;  // last column of rank k: wins the tie
    c.targets[i] = i % 2 ? boundary - 1 : boundary;
  }
  c.opt.compute_accuracy = true;
  c.opt.grad_mode = GradMode::none;
  run_dist(c);
}

TEST_F(Dist, MediumUneven) {
  DistCase c =
      make_case(64, xtest::uneven_widths(5000 + 16, size()), 117, DType::bf16, 0.1, 5000, 3.0);
  c.opt.label_smoothing = 0.1f;
  c.opt.z_loss = 1e-3f;
  c.opt.softcap = 15.0f;
  c.opt.compute_accuracy = true;
  c.opt.grad_mode = GradMode::deferred;
  c.grad_output = {0.7};
  run_dist(c);
}

// Shards wide enough for the single pass (a block a row at 16032 bf16 columns, clusters of blocks
// at 64128), with more rows than a GPU's resident clusters, so that each walks several; a rank
// whose shard the single pass does not take (1000 columns) among ranks whose shards it does; three
// calls in a row on new data (with the device exchange, the epochs alternate the slots).
TEST_F(Dist, WideShardsCallsInARow) {
  std::vector<int64_t> mixed = growing(size(), 16032);
  mixed[0] = 1000;
  const struct {
    int64_t rows;
    std::vector<int64_t> widths;
  } shapes[] = {{600, growing(size(), 16032)}, {256, growing(size(), 64128)}, {300, mixed}};
  for (const auto& shape : shapes)
    for (int call = 0; call < 3; ++call) {
      SCOPED_TRACE("rank 0 width " + std::to_string(shape.widths[0]) + ", call " +
                   std::to_string(call));
      // The CPU backend has no single pass: a few rows check the shapes there.
      DistCase c =
          make_case(env().cuda ? shape.rows : 4, shape.widths, 300 + call, DType::bf16, 0.1);
      if (call == 1) {
        c.opt.softcap = 30.0f;
        c.opt.reduction = Reduction::none;
      } else if (call == 2) {
        c.opt.label_smoothing = 0.1f;
        c.opt.z_loss = 1e-3f;
        c.opt.compute_accuracy = true;
        c.opt.reduction = Reduction::sum;
      }
      run_dist(c);
    }
}

// The group's communicator, but its peer memory asks each kernel of the device exchange for
// `share` times the device's resident blocks (PeerMemory::device_share).
class ShareOverride : public xent::Communicator {
 public:
  ShareOverride(xent::Communicator& inner, float share) : inner_(inner), share_(share) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  xent::Backend backend() const override { return inner_.backend(); }
  int device() const override { return inner_.device(); }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    inner_.all_gather(send, recv, bytes, stream);
  }
  bool has_peer_memory() const override { return inner_.has_peer_memory(); }
  const xent::PeerMemory* peer_memory(size_t bytes) override {
    const xent::PeerMemory* m = inner_.peer_memory(bytes);
    if (m == nullptr) return nullptr;
    memory_ = *m;
    memory_.device_share = share_;
    return &memory_;
  }

 private:
  xent::Communicator& inner_;
  float share_;
  xent::PeerMemory memory_;
};

// The exchange's kernels take their rows by ticket, so no grid has to be resident: here rank 0's
// single-pass kernel has four times the clusters that fit at once, the other ranks' as many as
// fit. (With rows dealt out by cluster index, rank 0's clusters that could not start yet held
// rows that the other ranks waited for, while its running ones waited for those ranks' later
// rows: every rank stopped at the wait's timeout.)
TEST_F(Dist, ExchangeGridLargerThanResident) {
  if (!env().cuda || !env().exchange) GTEST_SKIP() << "the device exchange's kernels (CUDA)";
  const xent::Group g = xent::Group::custom(
      std::make_shared<ShareOverride>(env().group->comm(), env().rank == 0 ? 4.0f : 1.0f));
  // 20000 bf16 columns a rank: a block of 512 threads a row, 2 resident on a multiprocessor;
  // 1100 rows are more than four times that on 132 multiprocessors.
  DistCase c = make_case(1100, growing(size(), 20000), 77, DType::bf16, 0.1);
  c.group = &g;
  run_dist(c);
}

// ------------------------------------------------------------------------------ bad input

// Runs f on every rank; every rank must throw xent::Error, none may hang; returns the message.
template <typename F>
std::string every_rank_throws(F&& f) {
  std::string msg;
  bool threw = false;
  try {
    f();
  } catch (const xent::Error& e) {
    threw = true;
    msg = e.what();
  }
  EXPECT_TRUE(threw) << "rank " << env().rank << " did not throw";
  EXPECT_TRUE(all_ranks(threw)) << "not every rank threw";
  return msg;
}

// After a failed call the group still works (no rank is left behind in a collective).
void expect_group_still_works() {
  DistCase c = make_case(4, growing(env().size, 3), 199);
  run_dist(c);
}

struct Small {
  std::vector<int64_t> w;
  DistCase c;
  xent::Shard shard;
  xent::Options opt;
  xtest::HostLogits host;
  std::unique_ptr<Buf> dlog, dtgt, dloss;
  std::vector<int64_t> targets;
  Small() {
    w = growing(env().size, 4);
    c = make_case(6, w, 150);
    targets = c.targets;
    shard = xent::plan_shard(*env().group, w[env().rank]);
    xent::apply(shard, opt);
    opt.device_exchange = env().exchange;
    host = xtest::make_shard(c.x, shard.start, shard.width, DType::f32);
    dlog = std::make_unique<Buf>(host.bytes.size());
    dlog->put(host.bytes.data(), host.bytes.size());
    dloss = std::make_unique<Buf>(64);
  }
  void forward(int64_t rows, const std::vector<int64_t>& t, const xent::Options& o,
               DType dtype = DType::f32) {
    xtest::HostTargets tg(t, IndexType::i64);
    dtgt = std::make_unique<Buf>(tg.bytes());
    dtgt->put(tg.view().data, tg.bytes());
    xent::LogitsView lv = host.view();
    lv.data = dlog->ptr();
    lv.rows = rows;
    lv.dtype = dtype;  // (a narrower dtype reads fewer bytes of the same buffer)
    xent::TargetsView tv = tg.view();
    tv.data = dtgt->ptr();
    tv.rows = rows;
    xent::Outputs out;
    out.loss = dloss->as<float>();
    xent::forward(*env().group, lv, tv, o, out, env().stream);
    if (env().cuda) env().group->check_errors(env().stream);  // device-side bad targets
  }
};

TEST_F(Dist, TargetOutOfRangeEveryRankThrows) {
  {
    Small s;
    const int64_t V = s.shard.vocab_size;
    std::vector<int64_t> t = s.targets;
    t[3] = V + 2;
    const std::string msg = every_rank_throws([&] { s.forward(6, t, s.opt); });
    EXPECT_THAT(msg, HasSubstr("targets[3]"));
    EXPECT_THAT(msg, HasSubstr(std::to_string(V + 2)));
  }
  expect_group_still_works();
}

TEST_F(Dist, RowsDisagreeEveryRankThrows) {
  {
    Small s;
    const int64_t rows = rank() == size() - 1 ? 5 : 6;  // the last rank passes one row less
    std::string msg;
    if (env().cuda) {  // the CUDA forward does not check: check_layout is the collective that does
      msg = every_rank_throws([&] { xent::check_layout(g(), s.shard, rows); });
    } else {
      msg = every_rank_throws([&] { s.forward(rows, s.targets, s.opt); });
    }
    EXPECT_THAT(msg, HasSubstr("rows"));
    EXPECT_THAT(msg, HasSubstr("5"));
  }
  expect_group_still_works();
}

TEST_F(Dist, VocabStartNotTilingEveryRankThrows) {
  {
    Small s;
    xent::Shard bad = s.shard;
    xent::Options o = s.opt;
    if (rank() == 1) {  // rank 1 claims to start one column later: a hole in the vocabulary
      bad.start += 1;
      o.vocab_start += 1;
    }
    std::string msg = every_rank_throws([&] { xent::check_layout(g(), bad, 6); });
    EXPECT_THAT(msg, HasSubstr("vocab_start"));
    EXPECT_THAT(msg, HasSubstr(std::to_string(s.w[0] + 1)));
    if (!env().cuda) {
      msg = every_rank_throws([&] { s.forward(6, s.targets, o); });
      EXPECT_THAT(msg, HasSubstr("vocab_start"));
      EXPECT_THAT(msg, HasSubstr(std::to_string(s.w[0] + 1)));
    }
  }
  expect_group_still_works();
}

TEST_F(Dist, PlanShardCannotCoverVocabEveryRankThrows) {
  int64_t total = 0;
  for (auto x : growing(size(), 4)) total += x;
  const std::string msg =
      every_rank_throws([&] { xent::plan_shard(g(), growing(size(), 4)[rank()], total + 1); });
  EXPECT_THAT(msg, HasSubstr("vocab_size"));
  EXPECT_THAT(msg, HasSubstr(std::to_string(total + 1)));
  expect_group_still_works();
}

// The NCCL forward exchanges nothing on the host unless XENT_CHECK_RANKS=1 asks it to.
bool host_checks() {
  const char* e = std::getenv("XENT_CHECK_RANKS");
  return !env().cuda || (e != nullptr && e[0] == '1');
}

TEST_F(Dist, OptionsDisagreeEveryRankThrows) {
  if (!host_checks()) GTEST_SKIP() << "the CUDA forward checks no options (XENT_CHECK_RANKS=1)";
  {
    Small s;
    xent::Options o = s.opt;
    if (rank() == size() - 1) o.label_smoothing = 0.1f;  // one rank smooths, the others do not
    const std::string msg = every_rank_throws([&] { s.forward(6, s.targets, o); });
    EXPECT_THAT(msg, HasSubstr("label_smoothing"));
  }
  expect_group_still_works();
}

// Ranks that pass different targets, or logits of different dtypes, used to get a loss each
// computed from mixed records, silently.
TEST_F(Dist, TargetsDisagreeEveryRankThrows) {
  if (!host_checks()) GTEST_SKIP() << "the CUDA forward checks no targets (XENT_CHECK_RANKS=1)";
  {
    Small s;
    std::vector<int64_t> t = s.targets;
    if (rank() == size() - 1) t[2] = (t[2] + 1) % s.shard.vocab_size;  // still in range
    const std::string msg = every_rank_throws([&] { s.forward(6, t, s.opt); });
    EXPECT_THAT(msg, HasSubstr("targets differ between rank " + std::to_string(size() - 1)));
  }
  expect_group_still_works();
}

TEST_F(Dist, DtypeDisagreeEveryRankThrows) {
  if (!host_checks()) GTEST_SKIP() << "the CUDA forward checks no dtype (XENT_CHECK_RANKS=1)";
  {
    Small s;
    const DType mine = rank() == size() - 1 ? DType::bf16 : DType::f32;
    const std::string msg = every_rank_throws([&] { s.forward(6, s.targets, s.opt, mine); });
    EXPECT_THAT(msg, HasSubstr("logits.dtype = bf16 on rank " + std::to_string(size() - 1)));
    EXPECT_THAT(msg, HasSubstr("f32 on rank 0"));
  }
  expect_group_still_works();
}

// ------------------------------------------------------------------------------ main

// Non-zero ranks: print only failures, prefixed with the rank.
class RankPrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankPrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (t.result()->Failed())
      std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, t.test_suite_name(), t.name());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  Env& e = env();
  MPI_Comm_rank(MPI_COMM_WORLD, &e.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &e.size);
  const std::string be =
      std::getenv("XENT_TEST_BACKEND") ? std::getenv("XENT_TEST_BACKEND") : "cpu";
  const bool nccl = be == "cuda", shared = be == "cuda-mpi";
  const char* ex = std::getenv("XENT_TEST_DEVICE_EXCHANGE");
  e.cuda = nccl || shared;
  e.exchange = ex != nullptr && ex[0] == '1';
  if ((!e.cuda && be != "cpu") || (e.exchange && !e.cuda)) {
    if (e.rank == 0)
      std::fprintf(stderr,
                   "XENT_TEST_BACKEND=%s: expected cpu, cuda or cuda-mpi (and one of the last two "
                   "for XENT_TEST_DEVICE_EXCHANGE=1)\n",
                   be.c_str());
    MPI_Finalize();
    return 2;
  }

  if (e.cuda) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();
      devices = 0;
    }
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, e.rank, MPI_INFO_NULL, &node);
    int local_ranks = 1;
    MPI_Comm_size(node, &local_ranks);
    MPI_Comm_free(&node);
    const int ok = devices >= (shared ? 1 : local_ranks) ? 1 : 0;
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok)
      e.skip = shared ? "XENT_TEST_BACKEND=cuda-mpi needs a GPU (none visible)"
                      : "XENT_TEST_BACKEND=cuda needs a GPU per rank on each node (" +
                            std::to_string(devices) + " visible, " + std::to_string(local_ranks) +
                            " ranks on this node)";
  }
  if (e.skip.empty()) {
    if (e.cuda) {
      e.group =
          nccl ? xent::mpi::nccl_group(MPI_COMM_WORLD) : xent::mpi::cuda_group(MPI_COMM_WORLD);
      cuda_ok(cudaSetDevice(e.group->device()), "cudaSetDevice");
      cuda_ok(cudaStreamCreateWithFlags(&e.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    } else {
      e.group = xent::mpi::host_group(MPI_COMM_WORLD);
    }
  }

  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (e.rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankPrinter(e.rank));
  }
  const int mine = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (e.rank == 0 && worst != 0 && mine == 0)
    std::fprintf(stderr, "rank 0 passed, but another rank failed (see [rank k] lines)\n");
  if (e.stream) cudaStreamDestroy(e.stream);
  e.group.reset();  // before MPI_Finalize (an NCCL group owns its communicator)
  MPI_Finalize();
  return worst != 0 ? 1 : 0;
}
