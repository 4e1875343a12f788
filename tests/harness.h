// The checks the suites share (forward's outputs against the reference), uneven shard widths,
// and the single-rank harness (CPU backend) that runs forward and backward against the reference.
#pragma once

#include "tolerances.h"

namespace xtest {

// ------------------------------------------------------------------------------------------
// Shards

// Widths that differ by rank and sum to `total` (every width >= 1 when total >= ranks):
// rank r gets roughly proportional to (r + 1).
inline std::vector<int64_t> uneven_widths(int64_t total, int ranks) {
  std::vector<int64_t> w(ranks, 1);
  const int64_t weight = static_cast<int64_t>(ranks) * (ranks + 1) / 2;
  int64_t left = total - ranks;
  int64_t given = 0;
  for (int r = 0; r < ranks; ++r) {
    const int64_t extra = left * (r + 1) / weight;
    w[r] += extra;
    given += extra;
  }
  w[ranks - 1] += left - given;
  return w;
}

inline std::vector<int64_t> starts_of(const std::vector<int64_t>& widths) {
  std::vector<int64_t> s(widths.size(), 0);
  for (size_t r = 1; r < widths.size(); ++r) s[r] = s[r - 1] + widths[r - 1];
  return s;
}

// ------------------------------------------------------------------------------------------
// Checking forward's outputs (host copies) against the reference

struct GotOutputs {
  std::vector<float> loss;      // [1] or [N] (Reduction::none)
  std::vector<float> lse;       // [N] or empty (not asked)
  std::vector<float> zloss;     // [N] or empty
  std::vector<int64_t> argmax;  // [N] or empty
  std::vector<float> accuracy;  // [1] or empty
};

inline void expect_outputs(const GotOutputs& got, const RefResult& ref,
                           const std::vector<int64_t>& targets, const RefOptions& o,
                           double lse_extra_tol = 0.0) {
  const int64_t N = static_cast<int64_t>(targets.size());
  if (o.reduction == xent::Reduction::none) {
    ASSERT_EQ(got.loss.size(), static_cast<size_t>(N));
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      if (targets[i] == o.ignore_index) {
        if (got.loss[i] != 0.0f) ++bad;
        EXPECT_EQ(got.loss[i], 0.0f) << "ignored row " << i << " must have loss 0";
      } else {
        const bool ok = std::fabs(got.loss[i] - ref.row_loss[i]) <= loss_tol(ref.row_mag[i]);
        if (!ok) ++bad;
        EXPECT_NEAR(got.loss[i], ref.row_loss[i], loss_tol(ref.row_mag[i])) << "loss row " << i;
      }
    }
  } else {
    ASSERT_GE(got.loss.size(), 1u);
    EXPECT_NEAR(got.loss[0], ref.loss, loss_tol(ref.mag))
        << (o.reduction == xent::Reduction::mean ? "mean" : "sum") << " loss over " << ref.n_valid
        << " valid rows";
  }
  if (!got.lse.empty()) {
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      const double tol = loss_tol(std::fabs(ref.lse[i])) + lse_extra_tol;
      if (!(std::fabs(got.lse[i] - ref.lse[i]) <= tol)) ++bad;
      EXPECT_NEAR(got.lse[i], ref.lse[i], tol) << "lse row " << i;
    }
  }
  if (!got.zloss.empty()) {
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      const double want = targets[i] == o.ignore_index ? 0.0 : ref.zloss[i];
      const double tol = 1e-5 * std::max(1.0, std::fabs(want)) + 1e-7;
      if (!(std::fabs(got.zloss[i] - want) <= tol)) ++bad;
      EXPECT_NEAR(got.zloss[i], want, tol)
          << "z_loss row " << i << (targets[i] == o.ignore_index ? " (ignored row)" : "");
    }
  }
  if (!got.argmax.empty()) {
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      if (got.argmax[i] != ref.argmax[i]) ++bad;
      EXPECT_EQ(got.argmax[i], ref.argmax[i]) << "argmax row " << i;
    }
  }
  if (!got.accuracy.empty()) {
    EXPECT_NEAR(got.accuracy[0], ref.accuracy, 1e-6)
        << "accuracy over " << ref.n_valid << " valid rows";
  }
}

// A power of two (or 1): the library's second rounding (fused backward) is then exact.
inline bool is_pow2_all(const std::vector<double>& v) {
  for (double x : v) {
    int e;
    if (std::frexp(std::fabs(x), &e) != 0.5) return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------
// Single-rank harness (CPU backend, Group::local): forward, the outputs, then the gradient of
// the grad mode, against the reference.

struct LocalRun {
  xent::DType dtype = xent::DType::f32;
  xent::IndexType itype = xent::IndexType::i64;
  int64_t stride_extra = 0;         // row_stride = cols + stride_extra (gap filled with NaN)
  std::vector<double> grad_output;  // backward's grad_output; empty: backward with 1
  bool want_lse = true, want_zloss = true;
  GradTol tol = {};
  double lse_extra_tol = 0.0;
};

// x: the logits as the library will read them (already rounded to run.dtype), all columns of
// the single rank (columns >= opt.vocab_size are padding). opt.vocab_size is taken as is.
inline void run_local(const Matrix& x, const std::vector<int64_t>& targets,
                      const xent::Options& opt, const LocalRun& run) {
  const int64_t N = x.rows;
  const int64_t V = opt.vocab_size < 0 ? x.cols : opt.vocab_size;
  const RefOptions ro = ref_options(opt, V);
  std::vector<double> go = run.grad_output;
  if (go.empty()) go.assign(opt.reduction == xent::Reduction::none ? N : 1, 1.0);
  const RefResult ref = reference(x, targets, ro);
  const RefResult ref_go = reference(x, targets, ro, go);

  xent::Group g = xent::Group::local(xent::Backend::cpu);
  HostLogits buf = make_shard(x, 0, x.cols, run.dtype, x.cols + run.stride_extra);
  const HostLogits orig = buf;
  HostTargets tg(targets, run.itype);

  const size_t nloss = opt.reduction == xent::Reduction::none ? static_cast<size_t>(N) : 1;
  const float nan = std::nanf("");
  GotOutputs got;
  got.loss.assign(std::max<size_t>(nloss, 1), nan);
  std::vector<float> lse(std::max<int64_t>(N, 1), nan), zl(std::max<int64_t>(N, 1), nan);
  std::vector<int64_t> am(std::max<int64_t>(N, 1), -7);
  std::vector<float> acc(1, nan);
  xent::Outputs out;
  out.loss = got.loss.data();
  if (run.want_lse || opt.grad_mode == xent::GradMode::deferred) out.lse = lse.data();
  if (run.want_zloss) out.z_loss = zl.data();
  if (opt.compute_accuracy) {
    out.argmax = am.data();
    out.accuracy = acc.data();
  }
  xent::forward(g, buf.view(), tg.view(), opt, out);
  got.loss.resize(nloss);
  if (out.lse) got.lse.assign(lse.begin(), lse.begin() + N);
  if (out.z_loss) got.zloss.assign(zl.begin(), zl.begin() + N);
  if (out.argmax) got.argmax.assign(am.begin(), am.begin() + N);
  if (out.accuracy) got.accuracy = acc;
  {
    SCOPED_TRACE("forward outputs");
    expect_outputs(got, ref, targets, ro, run.lse_extra_tol);
  }

  std::vector<float> gof(go.begin(), go.end());
  GradTol tol2 = run.tol;
  switch (opt.grad_mode) {
    case xent::GradMode::fused: {
      // Forward's gradient is for grad_output = grad_scale; backward applies grad_output /
      // grad_scale, leaving the rows where that is 1 as forward wrote them.
      const double gs = opt.grad_scale;
      const RefResult ref_fwd = gs == 1.0 ? ref : reference(x, targets, ro, {gs});
      EXPECT_TRUE(grad_matches(buf, ref_fwd, 0, run.tol)) << "fused forward's gradient";
      xent::backward(g, buf.view(), tg.view(), out.lse, gof.data(), opt);
      // fused: the gradient was rounded once by forward and again after the rescale, unless
      // the factor is a power of two (exact), or fp32
      std::vector<double> factor = go;
      for (double& f : factor) f /= gs;
      if (!is_pow2_all(factor)) tol2.ulps *= 2;
      EXPECT_TRUE(grad_matches(buf, ref_go, 0, tol2)) << "fused backward (grad_output applied)";
      break;
    }
    case xent::GradMode::deferred: {
      EXPECT_TRUE(same_bytes(buf, orig)) << "deferred forward must leave the logits untouched";
      xent::backward(g, buf.view(), tg.view(), lse.data(), gof.data(), opt);
      EXPECT_TRUE(grad_matches(buf, ref_go, 0, run.tol)) << "deferred backward";
      break;
    }
    case xent::GradMode::none: {
      EXPECT_TRUE(same_bytes(buf, orig)) << "GradMode::none must leave the logits untouched";
      EXPECT_THROW(xent::backward(g, buf.view(), tg.view(), out.lse, gof.data(), opt), xent::Error);
      break;
    }
  }
}

}  // namespace xtest
