// Every option and their combinations, every dtype, every reduction, every grad mode and both
// index types, single rank (Group::local, CPU backend), against the double-precision reference.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <utility>

#include "harness.h"

namespace {

using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;
using xtest::LocalRun;

enum class Opts { plain, ignore, smoothing, zloss, softcap, padded, all };

const char* name(Opts o) {
  switch (o) {
    case Opts::plain: return "plain";
    case Opts::ignore: return "ignore";
    case Opts::smoothing: return "smoothing";
    case Opts::zloss: return "zloss";
    case Opts::softcap: return "softcap";
    case Opts::padded: return "padded";
    case Opts::all: return "all";
  }
  return "?";
}

struct OptSet {
  xent::Options opt;
  double p_ignore = 0.0;
  int64_t pad = 0;  // padded columns past the real vocabulary
};

OptSet setup(Opts o, Reduction red) {
  OptSet s;
  s.opt.reduction = red;
  switch (o) {
    case Opts::plain: break;
    case Opts::ignore:
      s.p_ignore = 0.3;
      s.opt.compute_accuracy = true;
      break;
    case Opts::smoothing: s.opt.label_smoothing = 0.1f; break;
    case Opts::zloss: s.opt.z_loss = 0.01f; break;
    case Opts::softcap: s.opt.softcap = 3.0f; break;
    case Opts::padded:
      s.pad = 13;
      s.opt.label_smoothing = 0.05f;
      break;
    case Opts::all:
      s.opt.ignore_index = -1;
      s.p_ignore = 0.25;
      s.opt.label_smoothing = 0.2f;
      s.opt.z_loss = 0.02f;
      s.opt.softcap = 4.0f;
      s.opt.compute_accuracy = true;
      s.pad = 5;
      break;
  }
  return s;
}

using Param = std::tuple<DType, Opts, Reduction>;

class OptionSweep : public ::testing::TestWithParam<Param> {};

// One test = one (dtype, option set, reduction); inside, all three grad modes (fused also with a
// grad_scale of 0.25), and int32 and int64 targets, with a row stride wider than the row (NaN in
// the gap).
TEST_P(OptionSweep, MatchesReference) {
  const auto [dtype, opts, red] = GetParam();
  const OptSet s = setup(opts, red);
  const int64_t N = 16, V = 96;
  const uint64_t seed = 1000 + static_cast<int>(opts) * 10 + static_cast<int>(dtype);
  xtest::Matrix x = xtest::random_logits(N, V + s.pad, seed, dtype);
  const auto targets = xtest::random_targets(N, V, seed, s.p_ignore, s.opt.ignore_index);

  const std::pair<GradMode, float> modes[] = {{GradMode::fused, 1.0f},
                                              {GradMode::fused, 0.25f},
                                              {GradMode::deferred, 1.0f},
                                              {GradMode::none, 1.0f}};
  for (const auto& [mode, grad_scale] : modes) {
    for (IndexType it : {IndexType::i64, IndexType::i32}) {
      SCOPED_TRACE(std::string("grad_mode=") + xent::to_string(mode) +
                   " grad_scale=" + std::to_string(grad_scale) +
                   (it == IndexType::i32 ? " targets=int32" : " targets=int64"));
      xent::Options opt = s.opt;
      opt.grad_mode = mode;
      opt.grad_scale = grad_scale;
      if (s.pad > 0) opt.vocab_size = V;
      LocalRun run;
      run.dtype = dtype;
      run.itype = it;
      run.stride_extra = 3;
      // fused: powers of two (the rescale of the rounded gradient is exact), grad_scale itself
      // among them (rows left as forward wrote them); deferred: arbitrary (applied before the
      // single rounding)
      if (red == Reduction::none) {
        run.grad_output.resize(N);
        for (int64_t i = 0; i < N; ++i)
          run.grad_output[i] = mode == GradMode::fused
                                   ? (i % 3 == 0 ? 0.5 : (i % 3 == 1 ? 1.0 : 0.25))
                                   : 0.3 + 0.1 * (i % 7);
      } else {
        run.grad_output = {mode != GradMode::fused ? 0.37 : grad_scale == 1.0f ? 0.5 : 0.25};
      }
      xtest::run_local(x, targets, opt, run);
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto [dtype, opts, red] = info.param;
  const char* r = red == Reduction::mean ? "mean" : (red == Reduction::sum ? "sum" : "none");
  return std::string(xtest::dtype_name(dtype)) + "_" + name(opts) + "_" + r;
}

INSTANTIATE_TEST_SUITE_P(
    Single, OptionSweep,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                       ::testing::Values(Opts::plain, Opts::ignore, Opts::smoothing, Opts::zloss,
                                         Opts::softcap, Opts::padded, Opts::all),
                       ::testing::Values(Reduction::mean, Reduction::sum, Reduction::none)),
    param_name);

}  // namespace
