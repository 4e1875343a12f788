// Host-side misuse: xent::Error whose message names the argument and the value. One test each.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "harness.h"

namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xtest::error_of;

// A valid single-rank problem that each test breaks in one way.
struct Fixture {
  int64_t N = 4, V = 10;
  xtest::Matrix x = xtest::random_logits(4, 10, 1, DType::f32);
  std::vector<int64_t> t = {1, 2, 3, 4};
  xtest::HostLogits buf = xtest::make_shard(x, 0, 10, DType::f32);
  xtest::HostTargets tg{t, IndexType::i64};
  std::vector<float> loss = std::vector<float>(4), lse = std::vector<float>(4);
  xent::Options opt;
  xent::Outputs out;
  xent::Group g = xent::Group::local(xent::Backend::cpu);
  Fixture() {
    out.loss = loss.data();
    out.lse = lse.data();
  }
  void forward() { xent::forward(g, buf.view(), tg.view(), opt, out); }
  xent::LogitsView lv() { return buf.view(); }
};

TEST(Errors, TargetsRowsMismatch) {
  Fixture f;
  xent::TargetsView tv = f.tg.view();
  tv.rows = 3;
  const std::string msg = error_of([&] { xent::forward(f.g, f.lv(), tv, f.opt, f.out); });
  EXPECT_THAT(msg, HasSubstr("targets.rows"));
  EXPECT_THAT(msg, HasSubstr("3"));
  EXPECT_THAT(msg, HasSubstr("4"));
}

TEST(Errors, RowStrideBelowCols) {
  Fixture f;
  xent::LogitsView lv = f.lv();
  lv.row_stride = 7;
  const std::string msg = error_of([&] { xent::forward(f.g, lv, f.tg.view(), f.opt, f.out); });
  EXPECT_THAT(msg, HasSubstr("row_stride"));
  EXPECT_THAT(msg, HasSubstr("7"));
}

TEST(Errors, ColsBelowOne) {
  Fixture f;
  xent::LogitsView lv = f.lv();
  lv.cols = 0;
  const std::string msg = error_of([&] { xent::forward(f.g, lv, f.tg.view(), f.opt, f.out); });
  EXPECT_THAT(msg, HasSubstr("cols"));
  EXPECT_THAT(msg, HasSubstr("0"));
}

TEST(Errors, NullLogitsData) {
  Fixture f;
  xent::LogitsView lv = f.lv();
  lv.data = nullptr;
  const std::string msg = error_of([&] { xent::forward(f.g, lv, f.tg.view(), f.opt, f.out); });
  EXPECT_THAT(msg, HasSubstr("logits.data"));
  EXPECT_THAT(msg, HasSubstr("null"));
}

TEST(Errors, NullTargetsData) {
  Fixture f;
  xent::TargetsView tv = f.tg.view();
  tv.data = nullptr;
  const std::string msg = error_of([&] { xent::forward(f.g, f.lv(), tv, f.opt, f.out); });
  EXPECT_THAT(msg, HasSubstr("targets.data"));
  EXPECT_THAT(msg, HasSubstr("null"));
}

TEST(Errors, LabelSmoothingOne) {
  Fixture f;
  f.opt.label_smoothing = 1.0f;
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("label_smoothing"));
  EXPECT_THAT(msg, HasSubstr("1"));
}

TEST(Errors, LabelSmoothingNegative) {
  Fixture f;
  f.opt.label_smoothing = -0.1f;
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("label_smoothing"));
  EXPECT_THAT(msg, HasSubstr("-0.1"));
}

TEST(Errors, LabelSmoothingNaN) {
  Fixture f;
  f.opt.label_smoothing = std::nanf("");
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("label_smoothing"));
  EXPECT_THAT(msg, AnyOf(HasSubstr("nan"), HasSubstr("NaN")));
}

TEST(Errors, NegativeZLoss) {
  Fixture f;
  f.opt.z_loss = -0.5f;
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("z_loss"));
  EXPECT_THAT(msg, HasSubstr("-0.5"));
}

TEST(Errors, NegativeSoftcap) {
  Fixture f;
  f.opt.softcap = -2.0f;
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("softcap"));
  EXPECT_THAT(msg, HasSubstr("-2"));
}

// A target outside [0, V) that is not ignore_index: forward throws (CPU backend), naming the
// row and the value; the same for a negative target that is not ignore_index.
// grad_scale: finite and > 0, and fused only; each refusal names the value and the rule.
TEST(Errors, GradScaleNotPositiveOrNotFinite) {
  for (const float bad : {0.0f, -0.5f, std::nanf(""), INFINITY}) {
    Fixture f;
    f.opt.grad_scale = bad;
    const std::string msg = error_of([&] { f.forward(); });
    EXPECT_THAT(msg, HasSubstr("grad_scale = "));
    EXPECT_THAT(msg, HasSubstr("must be finite and > 0"));
  }
}

TEST(Errors, GradScaleWithoutFusedGradient) {
  for (const GradMode mode : {GradMode::deferred, GradMode::none}) {
    Fixture f;
    f.opt.grad_mode = mode;
    f.opt.grad_scale = 0.25f;
    const std::string msg = error_of([&] { f.forward(); });
    EXPECT_THAT(msg, HasSubstr("grad_scale = 0.25"));
    EXPECT_THAT(msg, HasSubstr(xent::to_string(mode)));
    EXPECT_THAT(msg, HasSubstr("fused only"));
  }
}

TEST(Errors, TargetOutOfRange) {
  for (int64_t bad : {int64_t{10}, int64_t{12345}, int64_t{-1}}) {
    Fixture f;
    f.t[2] = bad;
    f.tg = xtest::HostTargets(f.t, IndexType::i64);
    const std::string msg = error_of([&] { f.forward(); });
    EXPECT_THAT(msg, HasSubstr("targets[2]"));
    EXPECT_THAT(msg, HasSubstr(std::to_string(bad)));
  }
}

// A target in a padded column (vocab_size <= target < columns) is out of range too.
TEST(Errors, TargetInPaddedColumn) {
  Fixture f;
  f.opt.vocab_size = 8;  // columns 8 and 9 are padding
  f.t[1] = 9;
  f.tg = xtest::HostTargets(f.t, IndexType::i64);
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("targets[1]"));
  EXPECT_THAT(msg, HasSubstr("9"));
  EXPECT_THAT(msg, HasSubstr("8"));
}

TEST(Errors, NullLossOutput) {
  Fixture f;
  f.out.loss = nullptr;
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("loss"));
  EXPECT_THAT(msg, HasSubstr("null"));
}

// forward(make_outputs): the outputs made by the callback are checked as given ones are.
TEST(Errors, NullLossFromMakeOutputs) {
  Fixture f;
  int calls = 0;
  const auto make = [&] {
    ++calls;
    xent::Outputs o = f.out;
    o.loss = nullptr;
    return o;
  };
  const std::string msg =
      error_of([&] { xent::forward(f.g, f.buf.view(), f.tg.view(), f.opt, make); });
  EXPECT_THAT(msg, HasSubstr("loss"));
  EXPECT_THAT(msg, HasSubstr("null"));
  EXPECT_EQ(calls, 1);
}

TEST(Errors, DeferredWithoutLse) {
  Fixture f;
  f.opt.grad_mode = GradMode::deferred;
  f.out.lse = nullptr;
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("lse"));
  EXPECT_THAT(msg, HasSubstr("deferred"));
}

TEST(Errors, DeferredBackwardWithoutLse) {
  Fixture f;
  f.opt.grad_mode = GradMode::deferred;
  f.forward();
  float one = 1.0f;
  const std::string msg =
      error_of([&] { xent::backward(f.g, f.lv(), f.tg.view(), nullptr, &one, f.opt); });
  EXPECT_THAT(msg, HasSubstr("lse"));
  EXPECT_THAT(msg, HasSubstr("null"));
}

TEST(Errors, BackwardInGradModeNone) {
  Fixture f;
  f.opt.grad_mode = GradMode::none;
  f.forward();
  float one = 1.0f;
  const std::string msg =
      error_of([&] { xent::backward(f.g, f.lv(), f.tg.view(), f.lse.data(), &one, f.opt); });
  EXPECT_THAT(msg, HasSubstr("none"));
}

// vocab_size larger than the columns a single rank holds: the shard cannot cover it.
TEST(Errors, PlanShardCannotCoverVocab) {
  xent::Group g = xent::Group::local();
  const std::string msg = error_of([&] { xent::plan_shard(g, 10, 12); });
  EXPECT_THAT(msg, HasSubstr("vocab_size"));
  EXPECT_THAT(msg, HasSubstr("12"));
}

// A failed call leaves the group usable.
TEST(Errors, GroupUsableAfterError) {
  Fixture f;
  f.opt.label_smoothing = 2.0f;
  EXPECT_THROW(f.forward(), xent::Error);
  f.opt.label_smoothing = 0.0f;
  f.t[0] = 99;
  f.tg = xtest::HostTargets(f.t, IndexType::i64);
  EXPECT_THROW(f.forward(), xent::Error);
  f.t[0] = 1;
  f.tg = xtest::HostTargets(f.t, IndexType::i64);
  const xtest::RefResult ref = xtest::reference(f.x, f.t, xtest::ref_options(f.opt, 10));
  f.buf = xtest::make_shard(f.x, 0, 10, DType::f32);
  f.forward();
  EXPECT_NEAR(f.loss[0], ref.loss, xtest::loss_tol(ref.mag));
}

}  // namespace

// One rank obeys the tiling rule of many: its shard is the whole vocabulary. A gap (vocab_start
// > 0) or a vocab_size past its columns used to give inf losses and a finite gradient, silently.
namespace one_rank {
TEST(Errors, OneRankShardMustStartAtZero) {
  for (int64_t start : {3, 100}) {
    Fixture f;
    f.opt.vocab_start = start;
    const std::string msg = error_of([&] { f.forward(); });
    EXPECT_THAT(msg, HasSubstr("vocab_start = " + std::to_string(start) + " on rank 0"));
    EXPECT_THAT(msg, HasSubstr("must be 0"));
  }
}

TEST(Errors, OneRankShardMustCoverTheVocabulary) {
  Fixture f;
  f.opt.vocab_size = 20;  // 10 columns
  const std::string msg = error_of([&] { f.forward(); });
  EXPECT_THAT(msg, HasSubstr("sum to 10"));
  EXPECT_THAT(msg, HasSubstr("vocab_size = 20"));
}
}  // namespace one_rank
