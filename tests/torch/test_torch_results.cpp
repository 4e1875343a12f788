// The LibTorch adapter's results in one process (xent_torch_tests): loss, outputs and gradient
// against PyTorch's cross_entropy (and the double formula where PyTorch has no such option), for
// every option, reduction, gradient mode and in-place choice, row strides and views of a layer's
// output, empty and all-ignored batches (TorchReference, TorchCpu); the fused lm head's C++ entry
// (TorchLinear); the same on CUDA where there is a GPU (TorchCuda). Autograd's rules:
// test_torch_autograd.cpp; bad input, the operators, a one-rank Gloo group:
// test_torch_operator.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "torch_unit.h"

namespace xtt {
namespace {

// ------------------------------------------------------------------------------ references

TEST(TorchReference, FormulaMatchesTorchWhereBothApply) {
  for (auto red : {xent::Reduction::mean, xent::Reduction::sum, xent::Reduction::none}) {
    Case c;
    c.opt.label_smoothing = 0.15;
    c.opt.reduction = red;
    const xtt::Problem p = xtt::make_problem(c);
    const xtt::Ref a = xtt::reference(p.full, p.target, c.opt, p.vocab, p.weight, true);
    const xtt::Ref b = xtt::reference(p.full, p.target, c.opt, p.vocab, p.weight, false);
    EXPECT_TRUE(matches(b.loss, a.loss, 1e-12, "loss"));
    EXPECT_TRUE(matches(b.grad, a.grad, 1e-12, "grad"));
  }
}

// ------------------------------------------------------------------------------ CPU, one rank

TEST(TorchCpu, EveryOptionFloat32) {
  Case base;
  for (const Case& c : xtt::option_matrix(base)) xtt::run_case(c, kNoGroup, 0);
}

TEST(TorchCpu, EveryOptionBfloat16) {
  Case base;
  base.dtype = at::kBFloat16;
  for (const Case& c : xtt::option_matrix(base)) xtt::run_case(c, kNoGroup, 0);
}

TEST(TorchCpu, Float16) {
  Case base;
  base.dtype = at::kHalf;
  for (auto mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
    Case c = base;
    c.opt.grad_mode = mode;
    c.opt.label_smoothing = 0.1;
    xtt::run_case(c, kNoGroup, 0);
  }
}

TEST(TorchCpu, PaddedVocabulary) {
  Case base;
  base.widths = {64};
  base.vocab = 57;  // 7 padding columns holding 40.0: ignored, gradient 0
  for (const Case& c : xtt::option_matrix(base)) xtt::run_case(c, kNoGroup, 0);
}

TEST(TorchCpu, ExplicitLayoutOneRank) {
  Case c;
  c.widths = {40};
  c.opt.vocab_start = 0;
  c.opt.vocab_size = 33;
  c.vocab = 33;
  xtt::run_case(c, kNoGroup, 0);
}

TEST(TorchCpu, RowStrideAndInplaceKeepTheGap) {
  // Logits that are a column slice of a wider buffer: any row stride is fine, and in place the
  // columns outside the slice are never written (their gradient is 0).
  const at::Tensor y = at::randint(0, 40, {16}, at::kLong);
  const at::Tensor w0 = at::randn({16, 48});
  const at::Tensor wd = w0.to(at::kDouble).requires_grad_();
  const at::Tensor want_loss = xtt::F::cross_entropy(wd.slice(1, 0, 40), y);
  want_loss.backward();
  for (bool inplace : {false, true}) {
    for (auto mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
      SCOPED_TRACE(std::string(xent::to_string(mode)) + (inplace ? " in place" : ""));
      const at::Tensor leaf = w0.clone().requires_grad_();
      const at::Tensor wide = leaf * 1.0;  // a non-leaf, as a layer's output is
      const at::Tensor x = wide.slice(1, 0, 40);
      ASSERT_EQ(x.stride(0), 48);
      CrossEntropyOptions o;
      o.grad_mode = mode;
      o.inplace_grad = inplace;
      const at::Tensor loss = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss;
      EXPECT_TRUE(matches_loss(loss, want_loss.detach()));
      loss.backward();
      EXPECT_TRUE(matches(leaf.grad(), wd.grad(), 2e-5, "gradient (0 in the gap)"));
      EXPECT_TRUE(at::equal(wide.detach().slice(1, 40, 48), w0.slice(1, 40, 48)))
          << "the row gap was written";
    }
  }
}

TEST(TorchCpu, TrainingStepThroughAViewOfTheLayerOutput) {
  // The usual use: logits = (hidden @ W^T).view(-1, V), gradient in place, backward to the
  // parameters, against PyTorch's cross_entropy on the same graph.
  const int64_t B = 3, T = 5, H = 8, V = 30;
  const at::Tensor h0 = at::randn({B, T, H}), w0 = at::randn({V, H});
  const at::Tensor y = at::randint(0, V, {B * T}, at::kLong);
  const at::Tensor hd = h0.to(at::kDouble).requires_grad_(),
                   wd = w0.to(at::kDouble).requires_grad_();
  const at::Tensor want =
      xtt::F::cross_entropy(at::matmul(hd, wd.t()).view({-1, V}), y,
                            xtt::F::CrossEntropyFuncOptions().label_smoothing(0.1));
  want.backward();
  for (auto mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
    for (bool inplace : {false, true}) {
      SCOPED_TRACE(std::string(xent::to_string(mode)) + (inplace ? " in place" : ""));
      const at::Tensor h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
      const at::Tensor logits = at::matmul(h, w.t()).view({-1, V});
      ASSERT_TRUE(logits.is_view());
      CrossEntropyOptions o;
      o.grad_mode = mode;
      o.inplace_grad = inplace;
      o.label_smoothing = 0.1;
      const at::Tensor loss = vocab_parallel_cross_entropy(logits, y, kNoGroup, o).loss;
      EXPECT_TRUE(matches_loss(loss, want.detach()));
      loss.backward();
      EXPECT_TRUE(matches(h.grad(), hd.grad(), 1e-5, "d loss / d hidden"));
      EXPECT_TRUE(matches(w.grad(), wd.grad(), 1e-5, "d loss / d weight"));
    }
  }
}

TEST(TorchCpu, Int32AndStridedTargets) {
  const at::Tensor x = at::randn({10, 30}).requires_grad_();
  const at::Tensor y2 = at::randint(0, 30, {10, 2}, at::kLong);
  const at::Tensor y = y2.select(1, 0);  // stride 2
  ASSERT_FALSE(y.is_contiguous());
  const at::Tensor want = xtt::F::cross_entropy(x, y);
  EXPECT_TRUE(matches_loss(vocab_parallel_cross_entropy(x, y, kNoGroup).loss, want));
  EXPECT_TRUE(matches_loss(vocab_parallel_cross_entropy(x, y.to(at::kInt), kNoGroup).loss, want));
}

TEST(TorchCpu, NoAutogradLeavesLogitsAlone) {
  const at::Tensor x = at::randn({12, 20});
  const at::Tensor y = at::randint(0, 20, {12}, at::kLong);
  const at::Tensor before = x.clone();
  CrossEntropyOptions o;
  o.inplace_grad = true;  // nothing asks for a gradient, so nothing is written
  at::Tensor loss = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss;
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_TRUE(matches_loss(loss, xtt::F::cross_entropy(x.to(at::kDouble), y)));
  EXPECT_TRUE(at::equal(x, before));

  const at::Tensor xr = x.clone().requires_grad_();
  {
    ::torch::NoGradGuard ng;
    loss = vocab_parallel_cross_entropy(xr, y, kNoGroup, o).loss;
  }
  EXPECT_FALSE(loss.requires_grad());
  {
    c10::InferenceMode im;
    loss = vocab_parallel_cross_entropy(xr, y, kNoGroup, o).loss;
  }
  EXPECT_TRUE(at::equal(xr.detach(), before));
  o.grad_mode = xent::GradMode::none;
  loss = vocab_parallel_cross_entropy(xr, y, kNoGroup, o).loss;
  EXPECT_FALSE(loss.requires_grad()) << "grad_mode none: no gradient";
  EXPECT_TRUE(at::equal(xr.detach(), before));
}

TEST(TorchCpu, EmptyAndAllIgnored) {
  for (auto mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
    CrossEntropyOptions o;
    o.grad_mode = mode;
    const at::Tensor e = at::randn({0, 8}).requires_grad_();
    const at::Tensor le =
        vocab_parallel_cross_entropy(e, at::zeros({0}, at::kLong), kNoGroup, o).loss;
    EXPECT_EQ(le.item<float>(), 0.0f);
    le.backward();
    EXPECT_EQ(e.grad().sizes(), e.sizes());

    const at::Tensor x = at::randn({5, 8}).requires_grad_();
    const at::Tensor y = at::full({5}, -100, at::kLong);
    const at::Tensor l = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss;
    EXPECT_EQ(l.item<float>(), 0.0f) << "mean over no valid row is 0 (PyTorch: nan)";
    l.backward();
    EXPECT_EQ(x.grad().abs().max().item<float>(), 0.0f);
  }
}

// The fused lm head's C++ entry (xent::torch::linear_cross_entropy, CPU backend) against
// PyTorch's matmul and cross_entropy in float64, with a per-row grad_output, both modes; the
// logits never pass through the caller.
TEST(TorchLinear, MatchesMatmulAndCrossEntropyWithAutograd) {
  const int64_t n = 12, h = 10, v = 23;
  const at::Tensor h0 = at::randn({n, h}, at::kDouble);
  const at::Tensor w0 = at::randn({v, h}, at::kDouble) * 0.5;
  at::Tensor y = at::randint(0, v, {n}, at::kLong);
  y[4] = -100;
  const at::Tensor go = at::rand({n}, at::kDouble);
  const at::Tensor hr = h0.clone().requires_grad_(), wr = w0.clone().requires_grad_();
  const at::Tensor ref = xtt::F::cross_entropy(
      at::matmul(hr, wr.t()), y, xtt::F::CrossEntropyFuncOptions().reduction(::torch::kNone));
  (ref * go).sum().backward();
  for (const xent::GradMode mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
    SCOPED_TRACE(xent::to_string(mode));
    const at::Tensor hx = h0.to(at::kFloat).requires_grad_();
    const at::Tensor wx = w0.to(at::kFloat).requires_grad_();
    xent::torch::LinearCrossEntropyOptions o;
    o.loss.grad_mode = mode;
    o.loss.reduction = xent::Reduction::none;
    o.chunk_rows = 5;  // three chunks, the last one short
    const at::Tensor l = xent::torch::linear_cross_entropy(hx, wx, y, kNoGroup, o);
    EXPECT_TRUE(matches(l, ref.detach(), 1e-5, "loss"));
    (l * go.to(at::kFloat)).sum().backward();
    EXPECT_TRUE(matches(hx.grad(), hr.grad(), 2e-5, "d_hidden"));
    EXPECT_TRUE(matches(wx.grad(), wr.grad(), 2e-5, "d_weight"));
  }
  xent::torch::LinearCrossEntropyOptions o;
  expect_error(
      [&] {
        xent::torch::linear_cross_entropy(h0.to(at::kFloat), w0.to(at::kFloat).t(), y, kNoGroup, o);
      },
      {"hidden", "weight"});
}

// ------------------------------------------------------------------------------ CUDA, one rank

TEST(TorchCuda, EveryOptionBfloat16) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  Case base;
  base.device = at::Device(at::kCUDA, 0);
  base.dtype = at::kBFloat16;
  base.rows = 40;
  base.widths = {300};
  base.vocab = 290;
  for (const Case& c : xtt::option_matrix(base)) xtt::run_case(c, kNoGroup, 0);
}

TEST(TorchCuda, Float32AndFloat16) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  for (auto dt : {at::kFloat, at::kHalf}) {
    Case base;
    base.device = at::Device(at::kCUDA, 0);
    base.dtype = dt;
    base.widths = {1000};
    for (const Case& c : xtt::option_matrix(base))
      if (c.opt.reduction == xent::Reduction::mean) xtt::run_case(c, kNoGroup, 0);
  }
}

TEST(TorchCuda, RunsOnTheCurrentStream) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  auto stream = c10::cuda::getStreamFromPool();
  const c10::cuda::CUDAStreamGuard sg(stream);
  const at::Tensor x = at::randn({64, 5000}, at::kCUDA).requires_grad_();
  const at::Tensor y = at::randint(0, 5000, {64}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  const at::Tensor l = vocab_parallel_cross_entropy(x, y, kNoGroup).loss;
  l.backward();
  const at::Tensor xd = x.detach().to(at::kDouble).requires_grad_();
  const at::Tensor want = xtt::F::cross_entropy(xd, y);
  want.backward();
  EXPECT_TRUE(matches_loss(l, want.detach()));
  EXPECT_TRUE(matches(x.grad(), xd.grad(), 2e-5, "gradient"));
}

TEST(TorchCuda, BadTargetIsReportedByCheckErrors) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  // The CUDA backend does not stop on a target out of range: that row's loss is NaN and
  // torch.ops.xent.check_errors reports it.
  const at::Tensor x = at::randn({4, 10}, at::kCUDA);
  const at::Tensor y = at::tensor({1, 2, 10, 3}, at::kLong).cuda();
  CrossEntropyOptions o;
  o.reduction = xent::Reduction::none;
  const at::Tensor l = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss.cpu();
  EXPECT_TRUE(std::isnan(l[2].item<float>()));
  EXPECT_FALSE(std::isnan(l[1].item<float>()));
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("xent::check_errors", "");
  c10::Stack s{std::string(""), x.device()};
  expect_error([&] { op.callBoxed(s); }, {"targets[2] = 10"});
}

TEST(TorchCuda, DeviceMismatch) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  const at::Tensor x = at::randn({4, 10}, at::kCUDA);
  const at::Tensor y = at::randint(0, 10, {4}, at::kLong);
  expect_error([&] { vocab_parallel_cross_entropy(x, y, kNoGroup); },
               {"target is on cpu but logits are on cuda:0"});
  expect_error([&] { vocab_parallel_cross_entropy(x.cpu(), y.cuda(), kNoGroup); },
               {"target is on cuda:0 but logits are on cpu"});
}

}  // namespace
}  // namespace xtt
