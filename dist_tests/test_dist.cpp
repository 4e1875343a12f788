// Multi-rank tests of correctness, run under mpirun with 2, 3 and 4 ranks (dist_main.cpp sets
// the ranks' group up): each runs one or more DistCases through run_dist (dist_harness.h), which
// checks every rank's loss, lse, accuracy and gradient shard against the unsharded
// double-precision reference.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dist_harness.h"

namespace xdist {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

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
    c.x.at(2, j) = j < w[0] ? 0.5 * static_cast<double>(j % 3) : -kInf;  // ranks >= 1: all -inf
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

}  // namespace
}  // namespace xdist
