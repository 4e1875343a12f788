// The LibTorch adapter in one process: loss, outputs and gradient against PyTorch's
// cross_entropy (and the double formula where PyTorch has no such option), for every option,
// reduction, gradient mode and in-place choice; autograd's rules (versions, second backward,
// double backward); the operator; bad input. CPU always; CUDA where there is a GPU.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "torch_test_util.h"

namespace {

using xent::torch::CrossEntropyOptions;
using xent::torch::vocab_parallel_cross_entropy;
using xtt::Case;
using xtt::expect_error;
using xtt::matches;
using xtt::matches_loss;

const c10::intrusive_ptr<c10d::ProcessGroup> kNoGroup;

bool have_gpu() {
  return c10::cuda::device_count() > 0;
}

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

// --------------------------------------------------------------------------- autograd's rules

TEST(TorchAutograd, InplaceForwardMakesStaleUsesFail) {
  // Another op saved the logits for its backward; xent then overwrote them in place: autograd
  // must refuse to use the stale values.
  const at::Tensor leaf = at::randn({6, 10}).requires_grad_();
  const at::Tensor x = leaf * 2.0;
  const at::Tensor other = x.pow(2).sum();  // saves x
  CrossEntropyOptions o;
  o.inplace_grad = true;
  const at::Tensor loss =
      vocab_parallel_cross_entropy(x, at::randint(0, 10, {6}, at::kLong), kNoGroup, o).loss;
  expect_error([&] { (loss + other).backward(); }, {"modified by an inplace operation"});
}

TEST(TorchAutograd, ChangingLogitsBeforeDeferredBackwardFails) {
  for (bool inplace : {false, true}) {
    const at::Tensor x = at::randn({6, 10}).requires_grad_() * 1.0;
    CrossEntropyOptions o;
    o.grad_mode = xent::GradMode::deferred;
    o.inplace_grad = inplace;
    const at::Tensor loss =
        vocab_parallel_cross_entropy(x, at::randint(0, 10, {6}, at::kLong), kNoGroup, o).loss;
    {
      ::torch::NoGradGuard ng;
      x.mul_(2.0);
    }
    expect_error([&] { loss.backward(); }, {"modified by an inplace operation"});
  }
}

TEST(TorchAutograd, ChangingTheGradientBufferBeforeFusedBackwardFails) {
  const at::Tensor x = at::randn({6, 10}).requires_grad_() * 1.0;
  CrossEntropyOptions o;
  o.inplace_grad = true;  // x now holds the gradient, which backward will hand out
  const at::Tensor loss =
      vocab_parallel_cross_entropy(x, at::randint(0, 10, {6}, at::kLong), kNoGroup, o).loss;
  {
    ::torch::NoGradGuard ng;
    x.zero_();
  }
  expect_error([&] { loss.backward(); }, {"modified by an inplace operation"});
}

TEST(TorchAutograd, SecondBackward) {
  const at::Tensor y = at::randint(0, 10, {6}, at::kLong);
  for (bool inplace : {false, true}) {
    for (auto mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
      const at::Tensor leaf = at::randn({6, 10}).requires_grad_();
      const at::Tensor x = inplace ? leaf * 1.0 : leaf;
      CrossEntropyOptions o;
      o.grad_mode = mode;
      o.inplace_grad = inplace;
      const at::Tensor loss = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss;
      loss.backward({}, /*retain_graph=*/true);
      // Deferred without inplace_grad reads the logits only: backward can run again. Otherwise
      // the first backward finished the gradient in place (over the logits, or over the new
      // tensor a fused forward wrote).
      if (!inplace && mode == xent::GradMode::deferred) {
        const at::Tensor g1 = leaf.grad().clone();
        loss.backward();
        EXPECT_TRUE(matches(leaf.grad(), 2 * g1, 1e-6, "two backwards accumulate"));
      } else {
        expect_error([&] { loss.backward(); }, {"a second time", "grad_mode = \"deferred\""});
      }
    }
  }
}

TEST(TorchAutograd, NotInPlaceNeverWritesNorCopiesTheLogits) {
  // inplace_grad = false, either mode: the gradient goes into a new contiguous tensor (fused: in
  // forward, its rows then recomputed from the logits in backward, grad_output 0.3 not being
  // grad_scale; deferred: in backward, reading the logits once). The logits stay bit for bit,
  // their version counter never moves (nothing wrote them), and the gradient is bitwise the
  // in-place deferred one (no copy of the logits took part: the same kernels, the same one
  // rounding; fused in place would rescale forward's rounded gradient instead).
  std::vector<at::Device> devices{at::Device(at::kCPU)};
  if (have_gpu()) devices.emplace_back(at::kCUDA, 0);
  for (const at::Device& dev : devices) {
    const auto topt = at::TensorOptions().device(dev);
    const at::Tensor y = at::randint(0, 60, {24}, topt.dtype(at::kLong));
    const at::Tensor w0 = at::randn({24, 67}, topt).to(at::kBFloat16);
    for (auto mode : {xent::GradMode::fused, xent::GradMode::deferred}) {
      SCOPED_TRACE(dev.str() + " " + xent::to_string(mode));
      const at::Tensor leaf = w0.clone().requires_grad_();
      const at::Tensor wide = leaf * 1.0;         // a layer's output
      const at::Tensor x = wide.slice(1, 0, 61);  // row stride 67
      const at::Tensor bits = x.detach().view(at::kShort).clone();
      const auto version = x._version();
      CrossEntropyOptions o;
      o.grad_mode = mode;
      o.vocab_size = 60;  // one padded column
      o.label_smoothing = 0.1;
      const at::Tensor loss = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss;
      EXPECT_EQ(x._version(), version) << "forward wrote the logits";
      EXPECT_TRUE(at::equal(x.detach().view(at::kShort), bits)) << "forward changed the logits";
      const at::Tensor g = ::torch::autograd::grad({loss * 0.3}, {x})[0];
      EXPECT_EQ(x._version(), version) << "backward wrote the logits";
      EXPECT_TRUE(at::equal(x.detach().view(at::kShort), bits)) << "backward changed the logits";
      EXPECT_TRUE(g.is_contiguous());
      EXPECT_EQ(g.sizes(), x.sizes());
      EXPECT_NE(g.data_ptr(), x.data_ptr());
      EXPECT_TRUE(at::equal(wide.detach().slice(1, 61, 67).view(at::kShort),
                            w0.slice(1, 61, 67).view(at::kShort)))
          << "the row gap was written";

      // The in-place deferred gradient on a copy of the same logits: the same bits.
      // (Taken for the wide tensor: a fused in-place forward writes over the view, and autograd
      // then gives the view a new grad_fn, which is not in the loss's graph.)
      const at::Tensor wide_i = w0.clone().requires_grad_() * 1.0;
      const at::Tensor xi = wide_i.slice(1, 0, 61);
      CrossEntropyOptions oi = o;
      oi.grad_mode = xent::GradMode::deferred;
      oi.inplace_grad = true;
      const at::Tensor li = vocab_parallel_cross_entropy(xi, y, kNoGroup, oi).loss;
      const at::Tensor gi = ::torch::autograd::grad({li * 0.3}, {wide_i})[0].slice(1, 0, 61);
      EXPECT_TRUE(at::equal(g.view(at::kShort), gi.contiguous().view(at::kShort)))
          << "out-of-place and in-place gradients differ in bits";
    }
  }
}

TEST(TorchAutograd, DoubleBackwardIsRefused) {
  const at::Tensor x = at::randn({6, 10}).requires_grad_();
  const at::Tensor y = at::randint(0, 10, {6}, at::kLong);
  CrossEntropyOptions o;
  o.grad_mode = xent::GradMode::deferred;
  const at::Tensor loss = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss;
  // create_graph: the first derivative is right, and asking for the second one fails clearly.
  const at::Tensor g = ::torch::autograd::grad({loss}, {x}, {}, true, /*create_graph=*/true)[0];
  const at::Tensor xd = x.detach().to(at::kDouble).requires_grad_();
  const at::Tensor want = ::torch::autograd::grad({xtt::F::cross_entropy(xd, y)}, {xd})[0];
  EXPECT_TRUE(matches(g, want, 2e-5, "first derivative"));
  expect_error([&] { g.sum().backward(); }, {"differentiable once"});
}

TEST(TorchAutograd, InplaceOnALeafIsRefused) {
  const at::Tensor leaf = at::randn({4, 10}).requires_grad_();
  const at::Tensor y = at::randint(0, 10, {4}, at::kLong);
  CrossEntropyOptions o;
  o.inplace_grad = true;
  expect_error([&] { vocab_parallel_cross_entropy(leaf, y, kNoGroup, o); },
               {"inplace_grad", "leaf"});
  expect_error([&] { vocab_parallel_cross_entropy(leaf.slice(1, 0, 5), y, kNoGroup, o); },
               {"inplace_grad", "view of a leaf"});
}

TEST(TorchAutograd, GradientOutputScalesAndNoneReduction) {
  // backward with a non-trivial grad_output, both modes, against PyTorch.
  const at::Tensor x0 = at::randn({9, 21}, at::kDouble);
  const at::Tensor y = at::randint(0, 21, {9}, at::kLong);
  const at::Tensor w = at::rand({9}, at::kDouble);
  const at::Tensor xr = x0.clone().requires_grad_();
  const at::Tensor want = ::torch::autograd::grad(
      {(xtt::F::cross_entropy(xr, y, xtt::F::CrossEntropyFuncOptions().reduction(::torch::kNone)) *
        w)
           .sum()},
      {xr})[0];
  // fused also with grad_scale: a promise about grad_output that does not hold here (w varies by
  // row), so backward recomputes the rows from the logits, exactly as without it.
  const std::pair<xent::GradMode, double> modes[] = {
      {xent::GradMode::fused, 1.0}, {xent::GradMode::fused, 0.3}, {xent::GradMode::deferred, 1.0}};
  for (const auto& [mode, grad_scale] : modes) {
    const at::Tensor x = x0.to(at::kFloat).requires_grad_();
    CrossEntropyOptions o;
    o.grad_mode = mode;
    o.grad_scale = grad_scale;
    o.reduction = xent::Reduction::none;
    const at::Tensor l = vocab_parallel_cross_entropy(x, y, kNoGroup, o).loss;
    (l * w.to(at::kFloat)).sum().backward();
    EXPECT_TRUE(matches(x.grad(), want, 2e-5, "gradient"));
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

// ------------------------------------------------------------------------------ bad input

TEST(TorchErrors, NameTheArgumentAndTheValue) {
  const at::Tensor x = at::randn({4, 10});
  const at::Tensor y = at::randint(0, 10, {4}, at::kLong);
  auto call = [&](const at::Tensor& a, const at::Tensor& b, CrossEntropyOptions o = {}) {
    return [=] { vocab_parallel_cross_entropy(a, b, kNoGroup, o); };
  };
  expect_error(call(x.to(at::kInt), y), {"logits must be float32, bfloat16 or float16", "Int"});
  expect_error(call(x.to(at::kDouble), y), {"logits must be", "Double"});
  expect_error(call(x, y.to(at::kFloat)), {"target must hold int64 or int32", "Float"});
  expect_error(call(x, y.slice(0, 0, 3)),
               {"target has shape [3] but logits have shape [4, 10]", "([4])"});
  expect_error(call(x.reshape({2, 2, 10}), y), {"target has shape [4]", "[2, 2, 10]", "([2, 2])"});
  expect_error(call(x.reshape({40}), y), {"target has shape [4]", "[40]", "([])"});
  expect_error(call(x, y.reshape({2, 2})), {"target has shape [2, 2]", "[4, 10]"});
  expect_error(call(x[0][0], y), {"logits must have a last (vocabulary shard) dimension"});
  expect_error(call(x.t().contiguous().t(), y),
               {"contiguous in the last (vocabulary) dimension", "strides [1, 4]"});
  expect_error(call(x.to(at::kMeta), y.to(at::kMeta)), {"CPU or CUDA device", "meta"});
  CrossEntropyOptions o;
  o.label_smoothing = 1.0;
  expect_error(call(x, y, o), {"label_smoothing = 1", "[0, 1)"});
  o = {};
  o.vocab_start = -2;
  expect_error(call(x, y, o), {"vocab_start = -2"});
  o = {};
  o.vocab_size = 11;  // more than the columns of the only rank
  expect_error(call(x, y, o), {"vocab_size = 11"});
  const at::Tensor bad = at::tensor({1, 2, 10, 3}, at::kLong);
  expect_error(call(x, bad), {"targets[2] = 10", "vocab_size = 10"});
  expect_error([] { xent::torch::parse_reduction("avg"); }, {"reduction = \"avg\""});
  expect_error([] { xent::torch::parse_grad_mode("eager"); }, {"grad_mode = \"eager\""});
}

// ------------------------------------------------------------------------------ the operator

// The arguments the two public operators share (a boxed call passes every argument, defaults
// included: vocab_parallel_cross_entropy's grad_scale comes last, after _stats'
// compute_accuracy).
c10::Stack op_args(const at::Tensor& x, const at::Tensor& y, const std::string& group,
                   const std::string& reduction = "mean", const std::string& mode = "fused",
                   bool inplace = false, double smoothing = 0.0) {
  return {x,   y,         group,       int64_t{-100}, smoothing, 0.0,
          0.0, reduction, int64_t{-1}, int64_t{-1},   mode,      inplace};
}

at::Tensor call_op(c10::Stack stack, double grad_scale = 1.0) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("xent::vocab_parallel_cross_entropy", "");
  stack.push_back(grad_scale);
  op.callBoxed(stack);
  return stack.at(0).toTensor();
}

TEST(TorchOp, MatchesTorchWithAutograd) {
  const at::Tensor x0 = at::randn({8, 30});
  const at::Tensor y = at::randint(0, 30, {8}, at::kLong);
  const at::Tensor xr = x0.clone().requires_grad_();
  const at::Tensor want = xtt::F::cross_entropy(
      xr, y, xtt::F::CrossEntropyFuncOptions().label_smoothing(0.1).reduction(::torch::kSum));
  want.backward();
  for (const char* mode : {"fused", "deferred"}) {
    const at::Tensor x = x0.clone().requires_grad_();
    const at::Tensor l = call_op(op_args(x, y, "", "sum", mode, false, 0.1));
    ASSERT_TRUE(l.requires_grad()) << mode;
    EXPECT_TRUE(matches_loss(l, want.detach()));
    l.backward();
    EXPECT_TRUE(matches(x.grad(), xr.grad(), 2e-5, "gradient"));
  }
  {
    c10::InferenceMode im;  // below autograd: the CPU kernel, forward only
    const at::Tensor l = call_op(op_args(x0, y, "", "sum", "fused", false, 0.1));
    EXPECT_TRUE(matches_loss(l, want.detach()));
  }
}

TEST(TorchOp, StatsOutputs) {
  const at::Tensor x = at::randn({8, 30});
  const at::Tensor y = at::randint(0, 30, {8}, at::kLong);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "xent::vocab_parallel_cross_entropy_stats", "");
  c10::Stack s = op_args(x, y, "");
  s.push_back(true);  // compute_accuracy
  s.push_back(1.0);   // grad_scale
  op.callBoxed(s);
  ASSERT_EQ(s.size(), 5u);
  EXPECT_TRUE(matches_loss(s[1].toTensor(), at::logsumexp(x.to(at::kDouble), 1), "lse"));
  EXPECT_TRUE(at::equal(s[3].toTensor(), x.argmax(1)));
  EXPECT_NEAR(s[4].toTensor().item<double>(),
              (x.argmax(1) == y).to(at::kDouble).mean().item<double>(), 1e-6);
}

TEST(TorchOp, BadArguments) {
  const at::Tensor x = at::randn({4, 10});
  const at::Tensor y = at::randint(0, 10, {4}, at::kLong);
  expect_error([&] { call_op(op_args(x, y, "", "average")); }, {"reduction = \"average\""});
  expect_error([&] { call_op(op_args(x, y, "no_such_group")); }, {"no_such_group"});
  expect_error([&] { call_op(op_args(x, y, ""), -2.0); },
               {"grad_scale = -2", "must be finite and > 0"});
}

// ------------------------------------------------------------------- a one-rank Gloo group

class TorchGloo : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = xtt::temp_store_path("single");
    auto store = c10::make_intrusive<c10d::FileStore>(path_, 1);
    pg_ = xtt::make_gloo_group(store, 0, 1, "xent_test_gloo1");
  }
  static void TearDownTestSuite() {
    c10d::unregister_process_group("xent_test_gloo1");
    pg_.reset();
    std::remove(path_.c_str());
  }
  static inline std::string path_;
  static inline c10::intrusive_ptr<c10d::ProcessGroup> pg_;
};

TEST_F(TorchGloo, ApiAndOperator) {
  Case base;
  base.widths = {45};
  base.vocab = 40;
  for (const Case& c : xtt::option_matrix(base))
    if (c.opt.reduction != xent::Reduction::sum) xtt::run_case(c, pg_, 0);
  const at::Tensor x = at::randn({8, 30}).requires_grad_();
  const at::Tensor y = at::randint(0, 30, {8}, at::kLong);
  const at::Tensor l = call_op(op_args(x, y, "xent_test_gloo1"));
  EXPECT_TRUE(matches_loss(l, xtt::F::cross_entropy(x.detach().to(at::kDouble), y)));
  l.backward();
  EXPECT_TRUE(x.grad().defined());
}

TEST_F(TorchGloo, CudaLogitsNeedNccl) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  const at::Tensor x = at::randn({4, 10}, at::kCUDA);
  const at::Tensor y = at::randint(0, 10, {4}, at::TensorOptions(at::kCUDA).dtype(at::kLong));
  expect_error([&] { vocab_parallel_cross_entropy(x, y, pg_); },
               {"cuda:0", "xent_test_gloo1", "no backend for CUDA tensors", "NCCL"});
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
