// Small API contracts: names, sizes, shard planning on one rank, the record size.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "counting_allocator.h"
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

// Options::allocator: the call's per-row scratch comes from it, once, and goes back to it before
// the call returns; the group's workspace keeps only its fixed part (no growth with the rows),
// and the results are those of the workspace's own buffers, bit for bit.
TEST(Api, AllocatorHoldsThePerRowScratch) {
  const int64_t n = 4096, v = 20;
  const xtest::Matrix x = xtest::random_logits(n, v, 7, xent::DType::f32);
  std::vector<int64_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = i % 9 == 0 ? -100 : (i * 7) % v;
  xtest::HostTargets tg{t, xent::IndexType::i64};
  xent::Options own, given;
  xtest::CountingAllocator alloc;
  given.allocator = &alloc;
  xent::Group a = xent::Group::local(xent::Backend::cpu);
  xent::Group b = xent::Group::local(xent::Backend::cpu);
  std::vector<float> loss_a(1), loss_b(1);
  xtest::HostLogits la = xtest::make_shard(x, 0, v, xent::DType::f32);
  xtest::HostLogits lb = xtest::make_shard(x, 0, v, xent::DType::f32);
  xent::Outputs oa, ob;  // no lse asked: it is scratch too
  oa.loss = loss_a.data();
  ob.loss = loss_b.data();
  xent::forward(a, la.view(), tg.view(), own, oa);
  xent::forward(b, lb.view(), tg.view(), given, ob);
  EXPECT_EQ(alloc.allocations, 1);
  EXPECT_EQ(alloc.releases, 1);
  const int fields = static_cast<int>(xent::record_bytes(given) / sizeof(float));
  EXPECT_GE(alloc.largest, (fields + 1) * sizeof(float) * static_cast<size_t>(n))
      << "the records and the lse of every row";
  EXPECT_GE(a.workspace_bytes(), alloc.largest) << "without an allocator the workspace holds them";
  EXPECT_LT(b.workspace_bytes(), 8192u) << "with one it keeps the fixed part alone";
  EXPECT_EQ(loss_a[0], loss_b[0]);
  EXPECT_TRUE(xtest::same_bytes(la, lb)) << "the fused gradient";
  // A call refused after the allocation still hands it back.
  std::vector<int64_t> bad = t;
  bad[5] = v;
  xtest::HostTargets tb{bad, xent::IndexType::i64};
  EXPECT_THROW(xent::forward(b, lb.view(), tb.view(), given, ob), xent::Error);
  EXPECT_EQ(alloc.allocations, alloc.releases);
}

// grad_scale 0.5 (a power of two, so every step is exact in bf16): forward writes half the plain
// fused gradient; a backward with grad_output 0.5 leaves it as it is; backward with grad_output
// null (1) doubles it back to the plain gradient, bit for bit.
TEST(Api, GradScaleIsFoldedIntoTheFusedGradient) {
  const int64_t n = 6, v = 20;
  const xtest::Matrix x = xtest::random_logits(n, v, 5, xent::DType::bf16);
  const std::vector<int64_t> t = {0, 19, 7, -100, 3, 11};
  xtest::HostTargets tg{t, xent::IndexType::i64};
  xent::Group g = xent::Group::local(xent::Backend::cpu);
  xent::Options plain, scaled;
  scaled.grad_scale = 0.5f;
  std::vector<float> loss_a(1), loss_b(1);
  xtest::HostLogits a = xtest::make_shard(x, 0, v, xent::DType::bf16);
  xtest::HostLogits b = xtest::make_shard(x, 0, v, xent::DType::bf16);
  xent::Outputs out_a, out_b;
  out_a.loss = loss_a.data();
  out_b.loss = loss_b.data();
  xent::forward(g, a.view(), tg.view(), plain, out_a);
  xent::forward(g, b.view(), tg.view(), scaled, out_b);
  EXPECT_EQ(loss_a[0], loss_b[0]) << "grad_scale must not change the loss";
  int64_t nonzero = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < v; ++j) {
      EXPECT_EQ(b.get(i, j), 0.5 * a.get(i, j)) << "row " << i << " column " << j;
      nonzero += a.get(i, j) != 0.0 ? 1 : 0;
    }
  }
  EXPECT_GT(nonzero, 0);
  const xtest::HostLogits forward_b = b;
  const float same = 0.5f;
  xent::backward(g, b.view(), tg.view(), nullptr, &same, scaled);
  EXPECT_TRUE(xtest::same_bytes(b, forward_b)) << "grad_output == grad_scale: nothing to do";
  xent::backward(g, b.view(), tg.view(), nullptr, nullptr, scaled);
  EXPECT_TRUE(xtest::same_bytes(b, a)) << "grad_output 1: the plain gradient";
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
