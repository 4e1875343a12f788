// The fused lm head's bad input (xent/linear.h): each argument refused with its name, value and
// rule, on one rank of the CPU backend (or of one GPU under XENT_TEST_BACKEND=cuda, where host
// buffers meet the placement check first); and its scratch from the caller's allocator.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xent/linear.h>

#include <string>
#include <vector>

#include "counting_allocator.h"
#include "linear_harness.h"

namespace {

using ::testing::HasSubstr;
using xent::DType;
using xent::GradMode;
using xtest::error_of;
using xtest::local;

// ------------------------------------------------------------------------------ bad input

// A valid call that each test breaks in one way.
struct Call {
  xtest::Matrix x = xtest::random_logits(4, 6, 1, DType::f32);
  xtest::Matrix w = xtest::random_logits(10, 6, 2, DType::f32);
  xtest::HostLogits hb = xtest::make_shard(x, 0, 6, DType::f32);
  xtest::HostLogits wb = xtest::make_shard(w, 0, 6, DType::f32);
  xtest::HostLogits dh = xtest::make_shard(x, 0, 6, DType::f32);
  xtest::HostLogits dw = xtest::make_shard(w, 0, 6, DType::f32);
  std::vector<int64_t> t = {1, 2, 3, 4};
  xtest::HostTargets tg{t, xent::IndexType::i64};
  std::vector<float> loss = std::vector<float>(4), lse = std::vector<float>(4);
  xent::Options opt;
  xent::LinearOptions lopt;
  xent::LinearOutputs out;
  xent::MatrixView hv = xtest::matrix_view(hb), wv = xtest::matrix_view(wb);
  xent::Group g = local();
  Call() {
    out.loss = loss.data();
    out.lse = lse.data();
    out.d_hidden = xtest::matrix_view(dh);
    out.d_weight = xtest::matrix_view(dw);
  }
  std::string forward() {
    return error_of([&] { xent::linear_forward(g, hv, wv, tg.view(), opt, lopt, out); });
  }
  std::string backward(const float* l) {
    return error_of(
        [&] { xent::linear_backward(g, hv, wv, tg.view(), l, nullptr, opt, lopt, out); });
  }
  // Its buffers are host memory: a test whose error (or result) comes after the placement check
  // runs on the CPU backend only (XENT_TEST_BACKEND=cuda refuses them by name first).
  bool host_only() const { return g.backend() != xent::Backend::cpu; }
};
#define SKIP_UNLESS_HOST(c)                                                \
  if ((c).host_only())                                                     \
  GTEST_SKIP() << "host buffers on a " << xent::to_string((c).g.backend()) \
               << " group: the placement check refuses them first (CudaHost.* covers that)"

TEST(LinearErrors, HiddenSizeMismatch) {
  Call c;
  c.wv.cols = 5;
  const std::string msg = c.forward();
  EXPECT_THAT(msg, HasSubstr("weight.cols = 5"));
  EXPECT_THAT(msg, HasSubstr("hidden.cols = 6"));
}

TEST(LinearErrors, TargetsRows) {
  Call c;
  xent::TargetsView tv = c.tg.view();
  tv.rows = 3;
  EXPECT_THAT(error_of([&] { xent::linear_forward(c.g, c.hv, c.wv, tv, c.opt, c.lopt, c.out); }),
              HasSubstr("targets.rows = 3: must equal hidden.rows = 4"));
}

TEST(LinearErrors, GradientShapesAndDtypes) {
  Call c;
  c.out.d_hidden.rows = 3;
  EXPECT_THAT(c.forward(), HasSubstr("out.d_hidden.rows = 3: must equal hidden.rows = 4"));
  Call d;
  d.out.d_weight.cols = 5;
  EXPECT_THAT(d.forward(), HasSubstr("out.d_weight.cols = 5: must equal weight.cols = 6"));
  Call e;
  e.out.d_weight.dtype = DType::bf16;  // weight is f32: f32 only
  EXPECT_THAT(e.forward(), HasSubstr("out.d_weight.dtype = bf16: must be weight's (f32) or f32"));
  Call f;
  f.out.d_hidden.row_stride = 5;
  EXPECT_THAT(f.forward(), HasSubstr("out.d_hidden.row_stride = 5: must be >= out.d_hidden.cols"));
}

TEST(LinearErrors, AccumulateNeedsF32) {
  Call c;
  c.wv.dtype = DType::bf16;  // the data is not read: the check comes first
  c.out.d_weight.dtype = DType::bf16;
  c.lopt.accumulate_d_weight = true;
  EXPECT_THAT(c.forward(), HasSubstr("out.d_weight.dtype = bf16 with accumulate_d_weight"));
}

TEST(LinearErrors, ChunkOptions) {
  Call c;
  SKIP_UNLESS_HOST(c);
  c.lopt.chunk_rows = -2;
  EXPECT_THAT(c.forward(), HasSubstr("LinearOptions::chunk_rows = -2: must be >= 1, or 0"));
  Call d;
  d.lopt.max_scratch_bytes = 79;
  const std::string msg = d.forward();
  EXPECT_THAT(msg, HasSubstr("LinearOptions::max_scratch_bytes = 79: too small for either"));
  EXPECT_THAT(msg, HasSubstr("fast needs"));
  EXPECT_THAT(msg, HasSubstr("lean needs"));
  Call e;
  e.lopt.chunk_cols = -1;
  EXPECT_THAT(e.forward(), HasSubstr("LinearOptions::chunk_cols = -1: must be >= 1, or 0"));
}

TEST(LinearErrors, GemmEngine) {
  Call c;
  SKIP_UNLESS_HOST(c);
  c.lopt.gemm = xent::LinearGemm::epilogue;
  EXPECT_THAT(c.forward(),
              HasSubstr("LinearOptions::gemm = epilogue: the group's backend is cpu; leave gemm "
                        "automatic"));
  Call d;
  d.lopt.gemm = static_cast<xent::LinearGemm>(9);
  EXPECT_THAT(d.forward(),
              HasSubstr("LinearOptions::gemm = 9: must be automatic, cublaslt or epilogue"));
  Call e;
  e.lopt.gemm = xent::LinearGemm::cublaslt;
  EXPECT_NO_THROW(xent::linear_forward(e.g, e.hv, e.wv, e.tg.view(), e.opt, e.lopt, e.out));
}

TEST(LinearErrors, GradientsAndGradModes) {
  Call c;
  c.opt.grad_mode = GradMode::deferred;
  EXPECT_THAT(c.forward(), HasSubstr("out.d_hidden is set with grad_mode = deferred"));
  Call d;
  d.out.d_hidden = {};
  d.out.d_weight = {};
  EXPECT_THAT(d.forward(), HasSubstr("out.d_hidden and out.d_weight are both null"));
  Call e;
  EXPECT_THAT(e.backward(e.lse.data()), HasSubstr("linear_backward with grad_mode = fused"));
  Call f;
  f.opt.grad_mode = GradMode::deferred;
  EXPECT_THAT(f.backward(nullptr), HasSubstr("linear_backward(lse = null)"));
  Call h;
  h.opt.grad_mode = GradMode::none;
  EXPECT_THAT(h.backward(h.lse.data()), HasSubstr("grad_mode = none"));
}

TEST(LinearErrors, TargetOutOfRange) {
  Call c;
  SKIP_UNLESS_HOST(c);
  c.tg = xtest::HostTargets({1, 2, 10, 4}, xent::IndexType::i64);
  EXPECT_THAT(c.forward(), HasSubstr("targets[2] = 10: must be in [0, vocab_size = 10)"));
}

TEST(LinearErrors, OptionsOfTheLogitsPath) {
  Call c;
  c.opt.label_smoothing = 1.0f;
  EXPECT_THAT(c.forward(), HasSubstr("label_smoothing = 1"));
  Call d;
  d.wv.rows = 0;
  EXPECT_THAT(d.forward(), HasSubstr("weight.rows = 0: must be >= 1"));
}

// ------------------------------------------------------------------------------ scratch

// The call's scratch comes from LinearOptions::allocator, else from Options::allocator (one
// allocator in Options serves the lm head and the logits path), and goes back to it before the
// call returns; the results are those of the default scratch, bit for bit.
TEST(LinearScratch, FromTheCallersAllocator) {
  const auto run = [](Call& c) {
    xent::linear_forward(c.g, c.hv, c.wv, c.tg.view(), c.opt, c.lopt, c.out);
  };
  Call plain;
  SKIP_UNLESS_HOST(plain);
  run(plain);
  const auto same_as_plain = [&](const Call& c) {
    EXPECT_EQ(c.loss, plain.loss);
    EXPECT_EQ(c.lse, plain.lse);
    EXPECT_TRUE(xtest::same_bytes(c.dh, plain.dh)) << "d_hidden";
    EXPECT_TRUE(xtest::same_bytes(c.dw, plain.dw)) << "d_weight";
  };
  {
    xtest::CountingAllocator mine;
    Call c;
    c.lopt.allocator = &mine;
    run(c);
    EXPECT_GE(mine.allocations, 1);
    EXPECT_EQ(mine.releases, mine.allocations);
    same_as_plain(c);
  }
  {
    xtest::CountingAllocator shared;
    Call c;
    c.opt.allocator = &shared;
    run(c);
    EXPECT_GE(shared.allocations, 1) << "Options::allocator where LinearOptions has none";
    EXPECT_EQ(shared.releases, shared.allocations);
    same_as_plain(c);
  }
  {
    xtest::CountingAllocator mine, shared;
    Call c;
    c.lopt.allocator = &mine;
    c.opt.allocator = &shared;
    run(c);
    EXPECT_GE(mine.allocations, 1);
    EXPECT_EQ(mine.releases, mine.allocations);
    EXPECT_EQ(shared.allocations, 0) << "LinearOptions::allocator comes first";
    same_as_plain(c);
  }
}

}  // namespace
