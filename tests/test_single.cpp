// Single-rank scenarios (Group::local, CPU backend): padding, extreme logits, argmax ties,
// ignored rows, empty batches, medium sizes, determinism, grad modes' contracts.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "harness.h"

namespace {

using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;
using xtest::LocalRun;
using xtest::Matrix;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Padded columns (global column >= vocab_size) hold garbage (huge values, +-inf, NaN): they must
// not enter the loss, the lse or the argmax, and their gradient must be exactly 0.
TEST(Single, PaddedColumnsHoldingGarbageAreExcluded) {
  const int64_t N = 12, V = 40, pad = 8;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      Matrix x = xtest::random_logits(N, V + pad, 7, dt);
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = V; j < V + pad; ++j)
          x.at(i, j) = (j % 4 == 0)   ? 1e4
                       : (j % 4 == 1) ? kInf
                       : (j % 4 == 2) ? -kInf
                                      : std::nan("");
      auto t = xtest::random_targets(N, V, 7);
      t[0] = V - 1;  // the last real column
      xent::Options opt;
      opt.vocab_size = V;
      opt.label_smoothing = 0.1f;
      opt.compute_accuracy = true;
      opt.grad_mode = mode;
      LocalRun run;
      run.dtype = dt;
      SCOPED_TRACE(std::string(xtest::dtype_name(dt)) +
                   (mode == GradMode::fused ? " fused" : " deferred"));
      // run_local's reference knows the padding; the gradient comparison requires 0 there
      // (within atol); exact zeros are checked below on a separate run.
      xtest::run_local(x, t, opt, run);

      xent::Group g = xent::Group::local();
      xtest::HostLogits buf = xtest::make_shard(x, 0, V + pad, dt);
      xtest::HostTargets tg(t, IndexType::i64);
      float loss = 0, one = 1;
      std::vector<float> lse(N);
      xent::Outputs out;
      out.loss = &loss;
      out.lse = lse.data();
      xent::forward(g, buf.view(), tg.view(), opt, out);
      if (mode == GradMode::deferred)
        xent::backward(g, buf.view(), tg.view(), lse.data(), &one, opt);
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = V; j < V + pad; ++j)
          EXPECT_EQ(buf.get(i, j), 0.0) << "padded column " << j << " of row " << i;
    }
  }
}

// +-1e4 and -inf logits: no overflow, no NaN, exact limits.
TEST(Single, ExtremeLogits) {
  const int64_t N = 6, V = 24;
  Matrix x = xtest::random_logits(N, V, 11, DType::f32);
  std::vector<int64_t> t(N);
  // row 0: one logit 1e4 on the target: loss ~0
  for (int64_t j = 0; j < V; ++j) x.at(0, j) = 0.0;
  x.at(0, 3) = 1e4;
  t[0] = 3;
  // row 1: two near 1e4, the rest -1e4
  for (int64_t j = 0; j < V; ++j) x.at(1, j) = -1e4;
  x.at(1, 5) = 1e4;
  x.at(1, 6) = 1e4 - 1;
  t[1] = 6;
  // row 2: half the columns -inf
  for (int64_t j = 0; j < V; j += 2) x.at(2, j) = -kInf;
  t[2] = 7;
  // row 3: everything -inf but the target: loss 0, gradient 0
  for (int64_t j = 0; j < V; ++j) x.at(3, j) = -kInf;
  x.at(3, 10) = 0.5;
  t[3] = 10;
  // row 4: the target at -1e4, the others 0: loss ~ 1e4 + log(V - 1)
  for (int64_t j = 0; j < V; ++j) x.at(4, j) = 0.0;
  x.at(4, 0) = -1e4;
  t[4] = 0;
  // row 5: ordinary
  t[5] = 17;
  for (Reduction red : {Reduction::none, Reduction::mean}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      SCOPED_TRACE(red == Reduction::none ? "none" : "mean");
      xent::Options opt;
      opt.reduction = red;
      opt.grad_mode = mode;
      opt.compute_accuracy = true;
      LocalRun run;
      // fp32 resolution of z - lse near |lse| = 1e4 is ~5e-4: softmax values carry that
      // relative error (an fp32 property of the inputs, not of the algorithm)
      run.tol.scale_atol = 1e-3;
      xtest::run_local(x, t, opt, run);
    }
  }
  // With a softcap, smoothing and z-loss: -inf becomes -c (finite), +-1e4 saturate at +-c.
  xent::Options opt;
  opt.softcap = 30.0f;
  opt.label_smoothing = 0.1f;
  opt.z_loss = 1e-3f;
  opt.compute_accuracy = false;
  SCOPED_TRACE("softcap 30 + smoothing + z-loss");
  LocalRun run;
  xtest::run_local(x, t, opt, run);
}

// Row losses of 3e38 (logits of +-1.5e38): their mean is representable and must come out finite
// (the reduction accumulates and divides in double, rounding once); their sum is not, and is inf.
TEST(Single, MeanOfHugeRowLossesIsFinite) {
  const int64_t N = 8, V = 16;
  Matrix x(N, V, -1.5e38);
  std::vector<int64_t> t(N);
  for (int64_t i = 0; i < N; ++i) {
    x.at(i, (i + 1) % V) = 1.5e38;
    t[i] = i % V;  // a -1.5e38 logit
  }
  for (DType dt : {DType::f32, DType::bf16}) {
    Matrix xr = x;
    for (double& v : xr.v) v = xtest::round_to(dt, v);
    for (Reduction red : {Reduction::mean, Reduction::sum}) {
      SCOPED_TRACE(std::string(xtest::dtype_name(dt)) +
                   (red == Reduction::mean ? " mean" : " sum"));
      xent::Options opt;
      opt.reduction = red;
      const xtest::RefResult ref = xtest::reference(xr, t, xtest::ref_options(opt, V));
      xent::Group g = xent::Group::local();
      xtest::HostLogits buf = xtest::make_shard(xr, 0, V, dt);
      xtest::HostTargets tg(t, IndexType::i64);
      float loss = 0;
      xent::Outputs out;
      out.loss = &loss;
      xent::forward(g, buf.view(), tg.view(), opt, out);
      if (red == Reduction::mean) {
        ASSERT_TRUE(std::isfinite(loss)) << loss;
        EXPECT_NEAR(loss, ref.loss, 1e-6 * ref.loss);
      } else {
        EXPECT_TRUE(std::isinf(loss) && loss > 0) << loss;
      }
    }
  }
}

// Argmax: ties go to the smallest column (torch.argmax); accuracy counts non-ignored rows only.
TEST(Single, ArgmaxTiesAndAccuracy) {
  const int64_t N = 5, V = 10;
  Matrix x(N, V, 0.0);
  std::vector<int64_t> t = {2, 7, 4, -100, 9};
  x.at(0, 2) = 3.0;
  x.at(0, 7) = 3.0;  // tie: argmax 2 == target: correct
  x.at(1, 2) = 3.0;
  x.at(1, 7) = 3.0;  // tie: argmax 2 != target 7: wrong
  x.at(2, 4) = 1.0;  // correct
  x.at(3, 1) = 5.0;  // ignored
  x.at(4, 0) = 2.0;  // wrong
  xent::Options opt;
  opt.compute_accuracy = true;
  LocalRun run;
  xtest::run_local(x, t, opt, run);

  xent::Group g = xent::Group::local();
  xtest::HostLogits buf = xtest::make_shard(x, 0, V, DType::f32);
  xtest::HostTargets tg(t, IndexType::i64);
  float loss, acc = -1;
  std::vector<int64_t> am(N, -7);
  xent::Outputs out;
  out.loss = &loss;
  out.argmax = am.data();
  out.accuracy = &acc;
  opt.grad_mode = GradMode::none;
  xent::forward(g, buf.view(), tg.view(), opt, out);
  EXPECT_EQ(am, (std::vector<int64_t>{2, 2, 4, 1, 0}));
  EXPECT_FLOAT_EQ(acc, 2.0f / 4.0f);
}

// Mean over a batch whose every row is ignored: loss 0 and gradient 0 (documented choice).
TEST(Single, AllIgnoredBatch) {
  const int64_t N = 8, V = 30;
  Matrix x = xtest::random_logits(N, V, 3, DType::f32);
  std::vector<int64_t> t(N, -100);
  for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      xent::Options opt;
      opt.reduction = red;
      opt.grad_mode = mode;
      opt.compute_accuracy = true;
      opt.label_smoothing = 0.1f;
      opt.z_loss = 1e-2f;
      LocalRun run;
      xtest::run_local(x, t, opt, run);  // reference: loss 0, gradient 0, accuracy 0
    }
  }
}

// N = 0 rows (null data pointers allowed): the loss of mean/sum is 0, nothing crashes.
TEST(Single, ZeroRows) {
  Matrix x(0, 50);
  std::vector<int64_t> t;
  for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred, GradMode::none}) {
      xent::Options opt;
      opt.reduction = red;
      opt.grad_mode = mode;
      opt.compute_accuracy = true;
      LocalRun run;
      xtest::run_local(x, t, opt, run);
    }
  }
}

// ignore_index is any value: a positive one past the vocabulary is not an out-of-range target,
// and one inside [0, V) ignores the rows of that class (as in PyTorch).
TEST(Single, IgnoreIndexValues) {
  const int64_t N = 20, V = 32;
  Matrix x = xtest::random_logits(N, V, 5, DType::f32);
  for (int64_t ignore : {V + 7, int64_t{3}, int64_t{0}}) {
    SCOPED_TRACE("ignore_index = " + std::to_string(ignore));
    auto t = xtest::random_targets(N, V, 5, 0.3, ignore);
    t[1] = 3;
    t[2] = 0;
    xent::Options opt;
    opt.ignore_index = ignore;
    opt.label_smoothing = 0.1f;
    opt.compute_accuracy = true;
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      opt.grad_mode = mode;
      xtest::run_local(x, t, opt, LocalRun{});
    }
  }
}

// Medium size, every option at once, fp32 and bf16 and fp16.
TEST(Single, MediumAllOptions) {
  const int64_t N = 64, V = 5000, pad = 24;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(xtest::dtype_name(dt));
    Matrix x = xtest::random_logits(N, V + pad, 21, dt, 3.0);
    auto t = xtest::random_targets(N, V, 21, 0.1);
    xent::Options opt;
    opt.vocab_size = V;
    opt.label_smoothing = 0.1f;
    opt.z_loss = 1e-2f;
    opt.softcap = 15.0f;
    opt.compute_accuracy = true;
    opt.grad_mode = dt == DType::f32 ? GradMode::fused : GradMode::deferred;
    LocalRun run;
    run.dtype = dt;
    run.itype = dt == DType::bf16 ? IndexType::i32 : IndexType::i64;
    run.stride_extra = 8;
    run.grad_output = {0.5};
    xtest::run_local(x, t, opt, run);
  }
}

// Two identical calls give bitwise identical losses and gradients.
TEST(Single, Deterministic) {
  const int64_t N = 32, V = 777;
  Matrix x = xtest::random_logits(N, V, 9, DType::bf16);
  auto t = xtest::random_targets(N, V, 9, 0.2);
  xent::Options opt;
  opt.label_smoothing = 0.1f;
  opt.z_loss = 1e-3f;
  xent::Group g = xent::Group::local();
  xtest::HostTargets tg(t, IndexType::i64);
  xtest::HostLogits a = xtest::make_shard(x, 0, V, DType::bf16), b = a;
  float la = 0, lb = 1;
  xent::Outputs oa, ob;
  oa.loss = &la;
  ob.loss = &lb;
  xent::forward(g, a.view(), tg.view(), opt, oa);
  xent::forward(g, b.view(), tg.view(), opt, ob);
  EXPECT_EQ(std::memcmp(&la, &lb, sizeof la), 0) << la << " vs " << lb;
  EXPECT_TRUE(xtest::same_bytes(a, b));
}

// Group::reserve up front, then calls of up to that many rows; only the required output.
TEST(Single, ReserveAndOnlyLossOutput) {
  const int64_t N = 24, V = 64;
  xent::Options opt;
  opt.label_smoothing = 0.1f;
  opt.compute_accuracy = false;
  xent::Group g = xent::Group::local();
  g.reserve(N, opt);
  for (int64_t n : {N, int64_t{5}, int64_t{1}}) {
    Matrix x = xtest::random_logits(n, V, 40 + n, DType::f32);
    auto t = xtest::random_targets(n, V, 40 + n);
    LocalRun run;
    run.want_lse = false;
    run.want_zloss = false;
    xtest::run_local(x, t, opt, run);
  }
}

// Fused: backward by grad_output = 1 leaves forward's gradient bitwise as it is.
TEST(Single, FusedBackwardByOneIsIdentity) {
  const int64_t N = 10, V = 50;
  Matrix x = xtest::random_logits(N, V, 13, DType::f16);
  auto t = xtest::random_targets(N, V, 13, 0.2);
  for (Reduction red : {Reduction::mean, Reduction::none}) {
    xent::Options opt;
    opt.reduction = red;
    xent::Group g = xent::Group::local();
    xtest::HostTargets tg(t, IndexType::i64);
    xtest::HostLogits buf = xtest::make_shard(x, 0, V, DType::f16);
    std::vector<float> loss(N), lse(N), ones(N, 1.0f);
    xent::Outputs out;
    out.loss = loss.data();
    out.lse = lse.data();
    xent::forward(g, buf.view(), tg.view(), opt, out);
    const xtest::HostLogits grad = buf;
    xent::backward(g, buf.view(), tg.view(), lse.data(), ones.data(), opt);
    EXPECT_TRUE(xtest::same_bytes(buf, grad));
  }
}

// Deferred: the gradient comes from the saved lse, with grad_output applied per row
// (Reduction::none), including 0 and negative values.
TEST(Single, DeferredPerRowGradOutput) {
  const int64_t N = 9, V = 70;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    Matrix x = xtest::random_logits(N, V, 17, dt);
    auto t = xtest::random_targets(N, V, 17, 0.2);
    xent::Options opt;
    opt.reduction = Reduction::none;
    opt.grad_mode = GradMode::deferred;
    opt.z_loss = 0.05f;
    LocalRun run;
    run.dtype = dt;
    run.grad_output = {0.0, -1.0, 3.7, 0.001, 1.0, 2.0, -0.25, 10.0, 0.5};
    xtest::run_local(x, t, opt, run);
  }
}

// One real class (V = 1): the loss is 0 whatever the logit, the gradient 0.
TEST(Single, SingleClassVocabulary) {
  Matrix x(4, 1, 0.0);
  x.at(0, 0) = 5;
  x.at(1, 0) = -3;
  x.at(2, 0) = 1e4;
  std::vector<int64_t> t = {0, 0, 0, -100};
  xent::Options opt;
  xtest::run_local(x, t, opt, LocalRun{});
}

}  // namespace
