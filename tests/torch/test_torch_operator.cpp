// The LibTorch adapter's checks and operators in one process (xent_torch_tests): bad input refused
// with a message that names the argument and the value (TorchErrors); the boxed operators
// xent::vocab_parallel_cross_entropy and _stats against PyTorch (TorchOp); a one-rank Gloo group
// through the C++ API and the operator, and CUDA logits on it refused (TorchGloo).
#include <ATen/core/dispatch/Dispatcher.h>

#include "torch_unit.h"

namespace xtt {
namespace {

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

}  // namespace
}  // namespace xtt
