// The fused gradient out of place on the CPU backend (suite OutOfPlaceFused). Forward:
// Outputs::grad takes the gradient into a separate buffer, bitwise the in-place fused one, the
// logits and the buffer's row-stride gap unwritten; misuse refused. Backward: `grad` holds
// forward's gradient (Outputs::grad, for grad_output = grad_scale) and the logits are intact; the
// rows whose grad_output is not grad_scale are recomputed from them, rounded once (within half an
// ulp of the double reference, plus float32 noise; bitwise the deferred gradient where grad_scale
// is 1), the other rows are left as forward wrote them. The in-place fused backward (a rescale:
// rounded twice) is measured beside it. The deferred backward out of place:
// test_outofplace_deferred.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "outofplace_harness.h"

namespace xtest {
namespace {

using ::testing::HasSubstr;

// Outputs::grad: a fused forward that writes the gradient into a separate buffer instead of over
// the logits. The logits stay as they were, the buffer's row-stride gap is not written, and the
// gradient is bitwise the in-place fused one.
TEST(OutOfPlaceFused, ForwardWritesTheGradientElsewhereBitwise) {
  const int64_t N = 29, V = 120, pad = 3;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (Reduction red : {Reduction::mean, Reduction::none}) {
      SCOPED_TRACE(std::string(xtest::dtype_name(dt)) + " " + xent::to_string(red));
      const xtest::Matrix x = xtest::random_logits(N, V + pad, 21, dt);
      const auto t = xtest::random_targets(N, V, 22, 0.2);
      const xtest::HostTargets tg(t, IndexType::i32);
      xent::Group g = xent::Group::local(xent::Backend::cpu);
      xent::Options opt;
      opt.reduction = red;
      opt.vocab_size = V;
      opt.label_smoothing = 0.1f;
      opt.grad_mode = GradMode::fused;
      std::vector<float> loss(red == Reduction::none ? N : 1), loss2(loss.size());

      xtest::HostLogits logits = xtest::make_shard(x, 0, V + pad, dt, V + pad + 2);
      const xtest::HostLogits before = logits;
      const double gap = 1024.0;
      xtest::HostLogits grad = blank_like(logits, V + pad + 5, gap);
      xent::Outputs out;
      out.loss = loss.data();
      out.grad = grad.view();
      xent::forward(g, logits.view(), tg.view(), opt, out);
      EXPECT_TRUE(xtest::same_bytes(logits, before)) << "the logits were written";
      const xtest::RefResult ref = xtest::reference(x, t, xtest::ref_options(opt, V));
      EXPECT_TRUE(xtest::grad_matches(grad, ref, 0, {}, /*check_gap=*/true, gap));

      xtest::HostLogits inplace = logits;
      xent::Outputs out2;
      out2.loss = loss2.data();
      xent::forward(g, inplace.view(), tg.view(), opt, out2);
      int differ = 0;
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < V + pad; ++j)
          differ += std::memcmp(grad.ptr(i, j), inplace.ptr(i, j), xtest::elem_size(dt)) != 0;
      EXPECT_EQ(differ, 0) << "the gradient in a separate buffer differs from the in-place one";
      EXPECT_EQ(loss, loss2);
    }
  }
}

TEST(OutOfPlaceFused, MisuseIsRefused) {
  Misuse f;
  xent::Outputs out;
  std::vector<float> loss(1), lse(f.N);
  out.loss = loss.data();
  out.lse = lse.data();
  out.grad = f.grad.view();
  xent::Options opt = f.d.opt;
  opt.grad_mode = GradMode::deferred;
  std::string msg = error_of([&] { xent::forward(f.d.g, f.logits.view(), f.tg.view(), opt, out); });
  EXPECT_THAT(msg, HasSubstr("outputs.grad"));
  EXPECT_THAT(msg, HasSubstr("grad_mode = deferred"));
  opt.grad_mode = GradMode::fused;
  out.grad = f.logits.view();
  out.grad.row_stride += 1;  // the logits' own storage with another stride: a partial overlap
  msg = error_of([&] { xent::forward(f.d.g, f.logits.view(), f.tg.view(), opt, out); });
  EXPECT_THAT(msg, HasSubstr("overlaps logits"));
}

// --------------------------------------------------------------- the fused backward

// The spacing of the dtype's values at |x| (subnormals included).
double ulp_of(DType d, double x) {
  const int digits = d == DType::bf16 ? 7 : (d == DType::f16 ? 10 : 23);  // stored mantissa bits
  const int emin = d == DType::f16 ? -14 : -126;                          // smallest normal 2^emin
  int e = emin + 1;
  if (x != 0.0) std::frexp(std::fabs(x), &e);  // |x| = m 2^e, m in [0.5, 1)
  return std::ldexp(1.0, std::max(e - 1, emin) - digits);
}

// How far a gradient shard is from the double reference, in ulps of its dtype at the reference
// value: `raw` as measured, `excess` after the float32 noise allowance. A gradient computed in
// float32 and rounded once is within excess 0.5; rescaling a rounded gradient rounds it again
// (a mean loss times 2.5: 1.12 in bf16, 1.75 in fp16, whose small values are subnormal). The
// allowance: the float32 arithmetic before the rounding (the exponential,
// z - lse, the lse itself, terms that cancel) is off by a few dozen float32 ulps of the terms'
// magnitude |g| + 2 |row scale| (e / V + (1 - e) at the target); 64 float32 ulps of it is 0.002
// bf16 ulps and 0.016 fp16 ulps of |g| (for float32 gradients it is the whole tolerance).
struct Ulps {
  double raw = 0.0, excess = 0.0;
  int64_t row = -1, col = -1;
};
Ulps ulps_from_reference(const xtest::HostLogits& got, const xtest::RefResult& ref,
                         const std::vector<int64_t>& targets, double smoothing, int64_t vocab) {
  Ulps w;
  for (int64_t i = 0; i < got.rows; ++i) {
    for (int64_t j = 0; j < got.cols; ++j) {
      const double want = ref.grad.at(i, j);
      const double terms = std::fabs(want) + 2.0 * std::fabs(ref.row_scale[i]) *
                                                 (smoothing / static_cast<double>(vocab) +
                                                  (j == targets[i] ? 1.0 - smoothing : 0.0));
      const double u = ulp_of(got.dtype, want);
      const double err = std::fabs(got.get(i, j) - want);
      const double excess = (err - 64.0 * 0x1p-23 * terms) / u;
      if (!(excess <= w.excess)) w = {err / u, excess, i, j};  // NaN is kept as the worst
      w.raw = std::max(w.raw, err / u);
    }
  }
  return w;
}

// The rows whose grad_output is exactly grad_scale: backward leaves them as forward wrote them.
bool row_kept(const std::vector<float>& go, int64_t i, float grad_scale) {
  return go[go.size() == 1 ? 0 : static_cast<size_t>(i)] / grad_scale == 1.0f;
}

// Whether row i of two buffers of one shape differs in bits (the stride gap aside).
bool row_differs(const xtest::HostLogits& a, const xtest::HostLogits& b, int64_t i) {
  return std::memcmp(a.ptr(i, 0), b.ptr(i, 0), a.cols * xtest::elem_size(a.dtype)) != 0;
}

struct Variant {
  const char* name;
  float smoothing, z_loss, softcap;
  int64_t pad;
  double p_ignore;
};
const Variant kVariants[] = {
    {"plain", 0.0f, 0.0f, 0.0f, 0, 0.0},
    {"smoothing+zloss+softcap+padding+ignored", 0.1f, 1e-3f, 15.0f, 5, 0.2}};

// grad_output of a case: per row for none (some rows exactly grad_scale, one 0), else one value.
std::vector<float> grad_output_of(Reduction red, int64_t rows, float grad_scale) {
  if (red != Reduction::none) return {2.5f * grad_scale};
  std::vector<float> go(rows);
  xtest::Rng r(77);
  for (int64_t i = 0; i < rows; ++i)
    go[i] = i % 4 == 0 ? grad_scale : (i == 5 ? 0.0f : static_cast<float>(0.01 + r.uniform()));
  return go;
}

TEST(OutOfPlaceFused, BackwardRescaledRowsAreRoundedOnceTheRestKept) {
  const int64_t N = 41, V = 150;
  for (const Variant& var : kVariants) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
        for (float gs : {1.0f, 0.25f}) {
          SCOPED_TRACE(std::string(var.name) + " " + xtest::dtype_name(dt) + " " +
                       xent::to_string(red) + " grad_scale " + std::to_string(gs));
          const int64_t C = V + var.pad;
          const xtest::Matrix x = xtest::random_logits(N, C, 31, dt);
          const auto t = xtest::random_targets(N, V, 32, var.p_ignore);
          const xtest::HostTargets tg(t, IndexType::i64);
          Forward f;
          f.opt.reduction = red;
          f.opt.vocab_size = V;
          f.opt.label_smoothing = var.smoothing;
          f.opt.z_loss = var.z_loss;
          f.opt.softcap = var.softcap;
          f.opt.grad_scale = gs;
          xtest::HostLogits logits = xtest::make_shard(x, 0, C, dt, C + 3);
          const xtest::HostLogits before = logits;
          const double gap = 1024.0;  // exact in every dtype
          xtest::HostLogits grad =
              xtest::make_shard(xtest::Matrix(N, C, gap), 0, C, dt, C + 7, gap);
          f.forward(logits, tg, GradMode::fused, &grad);
          const xtest::HostLogits forward_grad = grad;

          const std::vector<float> go = grad_output_of(red, N, gs);
          xent::backward(f.g, logits.view(), grad.view(), tg.view(), f.lse.data(), go.data(),
                         f.opt);
          EXPECT_TRUE(xtest::same_bytes(logits, before)) << "the logits were written";

          const std::vector<double> god(go.begin(), go.end());
          const xtest::RefResult ref = xtest::reference(x, t, xtest::ref_options(f.opt, V), god);
          EXPECT_TRUE(xtest::grad_matches(grad, ref, 0, {}, /*check_gap=*/true, gap));
          const Ulps u = ulps_from_reference(grad, ref, t, var.smoothing, V);
          EXPECT_LE(u.excess, 0.5) << "grad[" << u.row << "][" << u.col << "] is " << u.raw
                                   << " ulps from the double gradient";
          for (int64_t i = 0; i < N; ++i) {
            if (row_kept(go, i, gs))
              EXPECT_FALSE(row_differs(grad, forward_grad, i)) << "kept row " << i << " rewritten";
          }
          if (gs == 1.0f) {  // then the same scale as deferred's, to the bit
            xent::Options d = f.opt;
            d.grad_mode = GradMode::deferred;
            xtest::HostLogits deferred = logits;
            xent::backward(f.g, deferred.view(), tg.view(), f.lse.data(), go.data(), d);
            for (int64_t i = 0; i < N; ++i)
              EXPECT_FALSE(row_differs(grad, deferred, i)) << "row " << i << " is not deferred's";
          }
        }
      }
    }
  }
}

TEST(OutOfPlaceFused, BackwardGradOutputEqualToGradScaleReadsNoLogits) {
  // Backward reads grad_output first and leaves every row whose factor is 1: logits made NaN
  // after forward (every row, or only the kept rows) cannot reach them.
  const int64_t N = 12, V = 40;
  const xtest::Matrix x = xtest::random_logits(N, V, 41, DType::bf16);
  const auto t = xtest::random_targets(N, V, 42, 0.2);
  const xtest::HostTargets tg(t, IndexType::i32);
  for (Reduction red : {Reduction::mean, Reduction::none}) {
    SCOPED_TRACE(xent::to_string(red));
    Forward f;
    f.opt.reduction = red;
    f.opt.grad_scale = 0.25f;
    xtest::HostLogits logits = xtest::make_shard(x, 0, V, DType::bf16);
    xtest::HostLogits grad = xtest::make_shard(xtest::Matrix(N, V, 0.0), 0, V, DType::bf16);
    f.forward(logits, tg, GradMode::fused, &grad);
    const xtest::HostLogits forward_grad = grad;
    std::vector<float> go(red == Reduction::none ? N : 1, 0.25f);
    if (red == Reduction::none) go[3] = 0.75f;  // row 3 alone is recomputed
    for (int64_t i = 0; i < N; ++i)
      if (row_kept(go, i, 0.25f))
        for (int64_t j = 0; j < V; ++j) logits.set(i, j, std::nan(""));
    xent::backward(f.g, logits.view(), grad.view(), tg.view(), f.lse.data(), go.data(), f.opt);
    for (int64_t i = 0; i < N; ++i) {
      EXPECT_EQ(row_differs(grad, forward_grad, i),
                !row_kept(go, i, 0.25f) && t[i] != f.opt.ignore_index)
          << "row " << i;
    }
    // grad_output null with grad_scale 1: forward's gradient is final; nothing is read.
    const xtest::HostLogits after = grad;
    f.opt.grad_scale = 1.0f;
    xent::backward(f.g, logits.view(), grad.view(), tg.view(), f.lse.data(), nullptr, f.opt);
    EXPECT_TRUE(xtest::same_bytes(grad, after));
  }
}

TEST(OutOfPlaceFused, BackwardInPlaceRescaleIsRoundedTwice) {
  // The documented limit: over the logits (gone once forward wrote the gradient) a grad_output
  // that is not grad_scale is applied by a rescale, a second rounding, which the half-ulp check
  // above catches; out of place the same case is rounded once.
  const int64_t N = 64, V = 500;
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(xtest::dtype_name(dt));
    const xtest::Matrix x = xtest::random_logits(N, V, 51, dt);
    const auto t = xtest::random_targets(N, V, 52);
    const xtest::HostTargets tg(t, IndexType::i64);
    const std::vector<float> go = {2.5f};  // a mean loss times 2.5
    Forward f;
    xtest::HostLogits inplace = xtest::make_shard(x, 0, V, dt);
    f.forward(inplace, tg, GradMode::fused);
    xent::backward(f.g, inplace.view(), tg.view(), f.lse.data(), go.data(), f.opt);
    xtest::HostLogits logits = xtest::make_shard(x, 0, V, dt);
    xtest::HostLogits grad = xtest::make_shard(xtest::Matrix(N, V, 0.0), 0, V, dt);
    f.forward(logits, tg, GradMode::fused, &grad);
    xent::backward(f.g, logits.view(), grad.view(), tg.view(), f.lse.data(), go.data(), f.opt);

    const xtest::RefResult ref = xtest::reference(x, t, xtest::ref_options(f.opt, V), {2.5});
    const Ulps twice = ulps_from_reference(inplace, ref, t, 0.0, V);
    const Ulps once = ulps_from_reference(grad, ref, t, 0.0, V);
    std::printf(
        "[ ulps     ] %s, mean loss times 2.5: in place (rescaled) %.3f, out of place "
        "(recomputed) %.3f\n",
        xtest::dtype_name(dt), twice.raw, once.raw);
    EXPECT_GT(twice.excess, 0.5) << "the rescale no longer rounds twice: update the docs";
    EXPECT_LE(once.excess, 0.5);
  }
}

TEST(OutOfPlaceFused, BackwardEmptyBatch) {
  Forward f;
  xtest::HostLogits logits = xtest::make_shard(xtest::Matrix(0, 7), 0, 7, DType::f32);
  xtest::HostLogits grad = logits;
  const xtest::HostTargets tg({}, IndexType::i64);
  f.forward(logits, tg, GradMode::fused, &grad);
  const float go = 3.0f;
  xent::backward(f.g, logits.view(), grad.view(), tg.view(), nullptr, &go, f.opt);
}

TEST(OutOfPlaceFused, BackwardMisuseIsRefused) {
  const int64_t N = 4, V = 6;
  const xtest::Matrix x = xtest::random_logits(N, V, 1, DType::f32);
  const std::vector<int64_t> t = {1, 2, 3, 4};
  const xtest::HostTargets tg(t, IndexType::i64);
  Forward f;
  xtest::HostLogits logits = xtest::make_shard(x, 0, V, DType::f32);
  xtest::HostLogits grad = xtest::make_shard(xtest::Matrix(N, V, 0.0), 0, V, DType::f32);
  f.forward(logits, tg, GradMode::fused, &grad);
  const float go = 2.0f;
  const auto error_with = [&](xent::LogitsView g, const float* lse) {
    return error_of([&] { xent::backward(f.g, logits.view(), g, tg.view(), lse, &go, f.opt); });
  };
  std::string msg = error_with(logits.view(), f.lse.data());
  EXPECT_THAT(msg, HasSubstr("grad_mode = fused and grad = logits"));
  EXPECT_THAT(msg, HasSubstr("backward(logits, ...)"));
  msg = error_with(grad.view(), nullptr);
  EXPECT_THAT(msg, HasSubstr("lse = null"));
  EXPECT_THAT(msg, HasSubstr("grad_mode = fused"));
  xent::LogitsView g = grad.view();
  g.rows = N - 1;
  EXPECT_THAT(error_with(g, f.lse.data()), HasSubstr("grad.rows = 3"));
  g = logits.view();  // the logits' storage an element later: an overlap
  g.data = logits.ptr(0, 1);
  EXPECT_THAT(error_with(g, f.lse.data()), HasSubstr("overlaps logits"));
}

}  // namespace
}  // namespace xtest
