// The LibTorch adapter under autograd's rules in one process (xent_torch_tests, suite
// TorchAutograd): version counters that catch stale logits or a changed gradient buffer, a second
// backward, double backward refused, inplace_grad on a leaf refused, the logits never written nor
// copied when not in place (CPU, and CUDA where there is a GPU), and a non-trivial grad_output.
#include "torch_unit.h"

namespace xtt {
namespace {

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

}  // namespace
}  // namespace xtt
