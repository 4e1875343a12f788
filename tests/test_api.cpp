// Small API contracts: names, sizes, shard planning on one rank, the record size.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "harness.h"

namespace {

using ::testing::StrEq;

TEST(Api, NamesAndSizes) {
  EXPECT_THAT(xent::to_string(xent::Backend::cpu), StrEq("cpu"));
  EXPECT_THAT(xent::to_string(xent::Backend::cuda), StrEq("cuda"));
  EXPECT_THAT(xent::to_string(xent::Reduction::mean), StrEq("mean"));
  EXPECT_THAT(xent::to_string(xent::Reduction::sum), StrEq("sum"));
  EXPECT_THAT(xent::to_string(xent::Reduction::none), StrEq("none"));
  EXPECT_THAT(xent::to_string(xent::GradMode::fused), StrEq("fused"));
  EXPECT_THAT(xent::to_string(xent::GradMode::deferred), StrEq("deferred"));
  EXPECT_THAT(xent::to_string(xent::GradMode::none), StrEq("none"));
  EXPECT_EQ(xent::dtype_size(xent::DType::f32), 4u);
  EXPECT_EQ(xent::dtype_size(xent::DType::bf16), 2u);
  EXPECT_EQ(xent::dtype_size(xent::DType::f16), 2u);
}

TEST(Api, LocalGroup) {
  xent::Group g = xent::Group::local(xent::Backend::cpu);
  EXPECT_EQ(g.rank(), 0);
  EXPECT_EQ(g.size(), 1);
  EXPECT_EQ(g.backend(), xent::Backend::cpu);
  EXPECT_NO_THROW(g.check_errors(nullptr));  // CPU: a no-op
}

TEST(Api, PlanShardOneRank) {
  xent::Group g = xent::Group::local();
  xent::Shard s = xent::plan_shard(g, 10);
  EXPECT_EQ(s.start, 0);
  EXPECT_EQ(s.width, 10);
  EXPECT_EQ(s.vocab_size, 10);
  s = xent::plan_shard(g, 16, 11);  // 5 padded columns
  EXPECT_EQ(s.width, 16);
  EXPECT_EQ(s.vocab_size, 11);
  xent::Options opt;
  xent::apply(s, opt);
  EXPECT_EQ(opt.vocab_start, 0);
  EXPECT_EQ(opt.vocab_size, 11);
  EXPECT_NO_THROW(xent::check_layout(g, s, 5));
}

// forward(make_outputs) computes what forward(outputs) does, and calls the callback once.
TEST(Api, MakeOutputsMatchesOutputs) {
  const int64_t n = 6, v = 20;
  const xtest::Matrix x = xtest::random_logits(n, v, 3, xent::DType::f32);
  const std::vector<int64_t> t = {0, 19, 7, -100, 3, 11};
  xtest::HostTargets tg{t, xent::IndexType::i64};
  xent::Group g = xent::Group::local(xent::Backend::cpu);
  xent::Options opt;
  std::vector<float> loss_a(1), lse_a(n), loss_b(1), lse_b(n);
  xtest::HostLogits a = xtest::make_shard(x, 0, v, xent::DType::f32);
  xtest::HostLogits b = xtest::make_shard(x, 0, v, xent::DType::f32);
  xent::Outputs out;
  out.loss = loss_a.data();
  out.lse = lse_a.data();
  xent::forward(g, a.view(), tg.view(), opt, out);
  int calls = 0;
  xent::forward(g, b.view(), tg.view(), opt, [&] {
    ++calls;
    xent::Outputs o;
    o.loss = loss_b.data();
    o.lse = lse_b.data();
    return o;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(loss_a[0], loss_b[0]);
  EXPECT_EQ(lse_a, lse_b);
  EXPECT_EQ(a.bytes, b.bytes);  // the fused gradient, over the logits
}

// The exchanged record grows only with the options that need more statistics.
TEST(Api, RecordBytes) {
  xent::Options plain;
  xent::Options smooth;
  smooth.label_smoothing = 0.1f;
  xent::Options acc;
  acc.compute_accuracy = true;
  const size_t b = xent::record_bytes(plain);
  EXPECT_GE(b, 2 * sizeof(float));  // lse and the target logit at least
  EXPECT_GT(xent::record_bytes(smooth), b);
  EXPECT_GT(xent::record_bytes(acc), b);
  xent::Options zl;
  zl.z_loss = 0.1f;
  zl.softcap = 5.0f;
  EXPECT_EQ(xent::record_bytes(zl), b);  // z-loss and softcap need nothing more
}

}  // namespace
