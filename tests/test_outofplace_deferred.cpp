// The out-of-place deferred backward, backward(group, logits, grad, ...), on the CPU backend
// (suite OutOfPlace): against the double reference, bitwise equal to the in-place deferred
// backward, the logits left untouched, its own row stride, exact aliasing allowed, and misuse
// (other gradient modes, shapes, dtypes, overlapping buffers) refused with a message that names
// the argument, the value and the rule. The fused backward out of place: test_outofplace_fused.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "outofplace_harness.h"

namespace xtest {
namespace {

using ::testing::HasSubstr;

TEST(OutOfPlace, MatchesReferenceAndInPlaceBitwise) {
  const int64_t N = 37, V = 203, pad = 5;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
      for (int64_t in_extra : {0, 3}) {
        for (int64_t out_extra : {0, 1, 7}) {
          SCOPED_TRACE(std::string(xtest::dtype_name(dt)) + " " + xent::to_string(red) +
                       " in stride +" + std::to_string(in_extra) + " out stride +" +
                       std::to_string(out_extra));
          const xtest::Matrix x = xtest::random_logits(N, V + pad, 11, dt);
          const auto t = xtest::random_targets(N, V, 12, 0.2);
          std::vector<double> go(red == Reduction::none ? N : 1);
          for (size_t i = 0; i < go.size(); ++i) go[i] = 0.75 + 0.125 * static_cast<double>(i % 5);
          std::vector<float> gof(go.begin(), go.end());

          Forward d;
          d.opt.reduction = red;
          d.opt.vocab_size = V;
          d.opt.label_smoothing = 0.05f;
          d.opt.z_loss = 1e-3f;
          d.opt.softcap = 20.0f;
          xtest::HostLogits logits = xtest::make_shard(x, 0, V + pad, dt, V + pad + in_extra);
          const xtest::HostLogits before = logits;
          const xtest::HostTargets tg(t, IndexType::i64);
          d.forward(logits, tg);

          const double gap = 1024.0;  // exact in every dtype
          xtest::HostLogits grad = blank_like(logits, V + pad + out_extra, gap);
          xent::backward(d.g, logits.view(), grad.view(), tg.view(), d.lse.data(), gof.data(),
                         d.opt);
          EXPECT_TRUE(xtest::same_bytes(logits, before)) << "the logits were written";

          xtest::RefOptions ro = xtest::ref_options(d.opt, V);
          const xtest::RefResult ref = xtest::reference(x, t, ro, go);
          EXPECT_TRUE(xtest::grad_matches(grad, ref, 0, {}, /*check_gap=*/true, gap));

          // The in-place deferred backward on the same logits: the same bits.
          xtest::HostLogits inplace = logits;
          xent::backward(d.g, inplace.view(), tg.view(), d.lse.data(), gof.data(), d.opt);
          int differ = 0;
          for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < V + pad; ++j)
              differ += std::memcmp(grad.ptr(i, j), inplace.ptr(i, j), xtest::elem_size(dt)) != 0;
          EXPECT_EQ(differ, 0) << "out-of-place and in-place gradients differ in bits";
        }
      }
    }
  }
}

TEST(OutOfPlace, NullGradOutputMeansOneAndRepeats) {
  // Backward reads the logits only: it can run twice (e.g. retain_graph) with the same result.
  const int64_t N = 9, V = 50;
  const xtest::Matrix x = xtest::random_logits(N, V, 3, DType::bf16);
  const auto t = xtest::random_targets(N, V, 4);
  Forward d;
  xtest::HostLogits logits = xtest::make_shard(x, 0, V, DType::bf16);
  const xtest::HostLogits before = logits;
  const xtest::HostTargets tg(t, IndexType::i32);
  d.forward(logits, tg);
  xtest::HostLogits g1 = blank_like(logits, V, 0.0), g2 = blank_like(logits, V + 2, -1.0);
  xent::backward(d.g, logits.view(), g1.view(), tg.view(), d.lse.data(), nullptr, d.opt);
  xent::backward(d.g, logits.view(), g2.view(), tg.view(), d.lse.data(), nullptr, d.opt);
  EXPECT_TRUE(xtest::same_bytes(logits, before));
  const xtest::RefResult ref = xtest::reference(x, t, xtest::ref_options(d.opt, V));
  EXPECT_TRUE(xtest::grad_matches(g1, ref, 0));
  EXPECT_TRUE(xtest::grad_matches(g2, ref, 0, {}, true, -1.0));
}

TEST(OutOfPlace, ExactAliasIsTheInPlaceBackward) {
  const int64_t N = 8, V = 31;
  const xtest::Matrix x = xtest::random_logits(N, V, 5, DType::f32);
  const auto t = xtest::random_targets(N, V, 6, 0.25);
  Forward d;
  xtest::HostLogits a = xtest::make_shard(x, 0, V, DType::f32, V + 4);
  const xtest::HostTargets tg(t, IndexType::i64);
  d.forward(a, tg);
  xtest::HostLogits b = a;
  xent::backward(d.g, a.view(), a.view(), tg.view(), d.lse.data(), nullptr, d.opt);
  xent::backward(d.g, b.view(), tg.view(), d.lse.data(), nullptr, d.opt);
  EXPECT_TRUE(xtest::same_bytes(a, b));
  EXPECT_TRUE(xtest::grad_matches(a, xtest::reference(x, t, xtest::ref_options(d.opt, V)), 0));
}

TEST(OutOfPlace, EmptyBatch) {
  Forward d;
  xtest::HostLogits logits = xtest::make_shard(xtest::Matrix(0, 7), 0, 7, DType::f32);
  const xtest::HostTargets tg({}, IndexType::i64);
  d.forward(logits, tg);
  xent::LogitsView gv = logits.view();
  gv.data = nullptr;
  xent::backward(d.g, logits.view(), gv, tg.view(), nullptr, nullptr, d.opt);  // nothing to do
}

TEST(OutOfPlace, NoneAndFusedOverTheLogitsAreRefused) {
  // Fused into a separate buffer is the fused backward out of place (test_outofplace_fused.cpp).
  for (GradMode m : {GradMode::fused, GradMode::none}) {
    Misuse f;
    f.d.opt.grad_mode = m;
    const std::string msg = f.error_with(m == GradMode::fused ? f.logits.view() : f.grad.view());
    EXPECT_THAT(msg, HasSubstr("grad_mode"));
    EXPECT_THAT(msg, HasSubstr(xent::to_string(m)));
    if (m == GradMode::fused) EXPECT_THAT(msg, HasSubstr("backward(logits, ...)"));
  }
}

TEST(OutOfPlace, ShapeAndDtypeMismatchesAreRefused) {
  struct Case {
    void (*spoil)(xent::LogitsView&);
    const char* message;
  };
  const Case cases[] = {
      {[](xent::LogitsView& g) { g.cols = 5; }, "grad.cols = 5: must equal logits.cols = 6"},
      {[](xent::LogitsView& g) { g.rows = 3; }, "grad.rows = 3: must equal logits.rows = 4"},
      {[](xent::LogitsView& g) { g.dtype = DType::bf16; },
       "grad.dtype = bf16: must equal logits.dtype = f32"},
      {[](xent::LogitsView& g) { g.row_stride = 5; },
       "grad.row_stride = 5: must be >= grad.cols = 6"},
      {[](xent::LogitsView& g) { g.data = nullptr; }, "grad.data is null"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    Misuse f;
    xent::LogitsView g = f.grad.view();
    c.spoil(g);
    EXPECT_THAT(f.error_with(g), HasSubstr(c.message));
  }
  {
    Misuse f;  // the lse is still required
    const std::string msg = error_of([&] {
      xent::backward(f.d.g, f.logits.view(), f.grad.view(), f.tg.view(), nullptr, nullptr, f.d.opt);
    });
    EXPECT_THAT(msg, HasSubstr("lse = null"));
  }
}

TEST(OutOfPlace, PartialOverlapIsRefused) {
  const int64_t N = 4, V = 6;
  const std::vector<int64_t> t = {0, 1, 2, 3};
  // One buffer of N + 2 rows of V floats: the logits are its rows 1 to N.
  const xtest::Matrix x = xtest::random_logits(N + 2, V, 2, DType::f32);
  std::vector<float> buf(x.v.begin(), x.v.end());
  const std::vector<float> before = buf;
  float* base = buf.data() + V;
  xent::LogitsView lv;
  lv.data = base;
  lv.dtype = DType::f32;
  lv.rows = N;
  lv.cols = V;
  lv.row_stride = V;
  const xtest::HostTargets tg(t, IndexType::i64);
  Forward d;
  d.forward(lv, tg);

  auto refuse = [&](xent::LogitsView g, const char* what) {
    SCOPED_TRACE(what);
    const std::string msg =
        error_of([&] { xent::backward(d.g, lv, g, tg.view(), d.lse.data(), nullptr, d.opt); });
    EXPECT_THAT(msg, HasSubstr("overlaps logits"));
    EXPECT_THAT(msg, HasSubstr("row_stride"));
    EXPECT_EQ(buf, before) << "a refused call wrote the buffer";
  };
  xent::LogitsView g = lv;
  g.data = base + V;  // a row later: its last row is the buffer's last
  refuse(g, "a row later");
  g.data = base - V;  // a row earlier: its first row is the buffer's first
  refuse(g, "a row earlier");
  g.data = base + 1;
  refuse(g, "an element later");
}

TEST(OutOfPlace, SameDataOtherStrideIsRefused) {
  const int64_t N = 3, V = 5;
  const std::vector<int64_t> t = {0, 1, 2};
  const xtest::Matrix x = xtest::random_logits(N, V + 2, 4, DType::f32);
  xtest::HostLogits logits = xtest::make_shard(x, 0, V, DType::f32, V + 2);
  const xtest::HostLogits before = logits;
  const xtest::HostTargets tg(t, IndexType::i64);
  Forward d;
  d.forward(logits, tg);
  xent::LogitsView g = logits.view();
  g.row_stride = V;  // the same first element, rows at another stride
  const std::string msg = error_of(
      [&] { xent::backward(d.g, logits.view(), g, tg.view(), d.lse.data(), nullptr, d.opt); });
  EXPECT_THAT(msg, HasSubstr("overlaps logits"));
  EXPECT_TRUE(xtest::same_bytes(logits, before));
}

TEST(OutOfPlace, AdjacentBuffersAreDisjoint) {
  // The logits and the gradient back to back in one allocation: the logits' last element is
  // followed by the gradient's first. Not an overlap.
  const int64_t N = 4, V = 6;
  const std::vector<int64_t> t = {5, 4, 3, 2};
  const xtest::Matrix x = xtest::random_logits(N, V, 8, DType::f32);
  std::vector<float> buf(2 * N * V, 0.0f);
  std::copy(x.v.begin(), x.v.end(), buf.begin());
  xent::LogitsView lv{buf.data(), DType::f32, N, V, V};
  xent::LogitsView gv{buf.data() + N * V, DType::f32, N, V, V};
  const xtest::HostTargets tg(t, IndexType::i64);
  Forward d;
  d.forward(lv, tg);
  xent::backward(d.g, lv, gv, tg.view(), d.lse.data(), nullptr, d.opt);
  for (int64_t i = 0; i < N * V; ++i) ASSERT_EQ(buf[i], static_cast<float>(x.v[i]));
  // And the other way round: the gradient first, then the logits.
  std::vector<float> buf2(2 * N * V, 0.0f);
  std::copy(x.v.begin(), x.v.end(), buf2.begin() + N * V);
  xent::LogitsView lv2{buf2.data() + N * V, DType::f32, N, V, V};
  xent::LogitsView gv2{buf2.data(), DType::f32, N, V, V};
  xent::backward(d.g, lv2, gv2, tg.view(), d.lse.data(), nullptr, d.opt);
  for (int64_t i = 0; i < N * V; ++i) ASSERT_EQ(buf2[i], buf[N * V + i]);
}

}  // namespace
}  // namespace xtest
