// Small API contracts: names, sizes, shard planning on one rank, the record size.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "reference.h"

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
