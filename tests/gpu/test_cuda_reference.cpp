// The CUDA backend against the independent fp64 reference (tests/reference.h) with the bounds
// that the CPU backend meets (tests/tolerances.h: loss and lse within 1e-5 of the magnitude of
// their terms, the gradient within one unit in the last place of its dtype), for each variant of
// the statistics kernel (stats.cu: plain, capped, general) on warp rows and on block rows; and a
// NaN logit gives its row a NaN loss on every variant (never a finite, silently wrong one).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test.h"
#include "harness.h"

namespace {

using xent::DType;
using xtest::gpu::DevBuf;

struct GpuRun {
  xtest::GotOutputs got;
  xtest::HostLogits grad;
};

// forward (fused gradient) of one rank on the GPU; the outputs and the gradient come back.
GpuRun run_cuda(const xtest::Matrix& x, const std::vector<int64_t>& targets, DType dtype,
             const xent::Options& opt) {
  const int64_t n = x.rows;
  const size_t nloss = opt.reduction == xent::Reduction::none ? static_cast<size_t>(n) : 1;
  GpuRun r;
  r.grad = xtest::make_shard(x, 0, x.cols, dtype);
  const xtest::HostTargets tg(targets, xent::IndexType::i64);
  DevBuf d_x(r.grad.bytes.size()), d_t(tg.bytes()), d_loss(nloss * 4), d_lse(n * 4);
  d_x.up(r.grad.bytes.data());
  d_t.up(tg.i64.data());
  d_loss.poison();
  d_lse.poison();
  xent::LogitsView lv = r.grad.view();
  lv.data = d_x.p;
  xent::TargetsView tv = tg.view();
  tv.data = d_t.p;
  xent::Outputs out;
  out.loss = static_cast<float*>(d_loss.p);
  out.lse = static_cast<float*>(d_lse.p);
  xent::Group g = xent::Group::local(xent::Backend::cuda, 0);
  xent::forward(g, lv, tv, opt, out);
  xtest::gpu::ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  r.got.loss.resize(nloss);
  r.got.lse.resize(n);
  d_loss.down(r.got.loss.data());
  d_lse.down(r.got.lse.data());
  d_x.down(r.grad.bytes.data());
  return r;
}

struct Variant {
  const char* name;
  float softcap;
  float label_smoothing;  // > 0 makes the kernel compute the row sum: the general variant
  double sigma;           // of the raw logits
};

// plain; capped (softcap <= 40, nothing else); general (a larger cap, or a row sum).
const Variant kVariants[] = {
    {"plain", 0.0f, 0.0f, 2.0},
    {"capped-30", 30.0f, 0.0f, 12.0},
    {"capped-1", 1.0f, 0.0f, 2.0},
    {"general-cap-50", 50.0f, 0.0f, 20.0},
    {"general-cap-30-smoothing", 30.0f, 0.1f, 12.0},
};

TEST(CudaReference, EveryStatsVariantMatchesFp64) {
  SKIP_WITHOUT_GPU();
  for (const Variant& v : kVariants)
    for (DType d : {DType::bf16, DType::f16, DType::f32})
      for (int64_t cols : {1000, 20000}) {  // a warp per row, a block per row
        SCOPED_TRACE(std::string(v.name) + " " + xent::to_string(d) + " cols " +
                     std::to_string(cols));
        const int64_t rows = 48;
        xtest::Matrix x = xtest::random_logits(rows, cols, 7 + cols, d, v.sigma);
        // The softcap's saturated ends, and columns that are not a multiple of a pack apart.
        x.at(1, 3) = xtest::round_to(d, 6e4);
        x.at(2, 5) = xtest::round_to(d, -6e4);
        x.at(3, cols - 1) = xtest::round_to(d, 5.0 * v.sigma);
        const std::vector<int64_t> targets = xtest::random_targets(rows, cols, 11 + cols, 0.1);
        xent::Options opt;
        opt.softcap = v.softcap;
        opt.label_smoothing = v.label_smoothing;
        opt.reduction = xent::Reduction::none;
        const xtest::RefResult ref = xtest::reference(x, targets, xtest::ref_options(opt, cols));
        const GpuRun r = run_cuda(x, targets, d, opt);
        xtest::expect_outputs(r.got, ref, targets, xtest::ref_options(opt, cols));
        // The reduction of Reduction::none is the caller's; the gradient's row scale is 1.
        EXPECT_TRUE(xtest::grad_matches(r.grad, ref, 0));
      }
}

TEST(CudaReference, NanLogitMakesItsRowNan) {
  SKIP_WITHOUT_GPU();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Variant& v : kVariants)
    for (DType d : {DType::bf16, DType::f32})
      for (int64_t cols : {1000, 20000}) {
        SCOPED_TRACE(std::string(v.name) + " " + xent::to_string(d) + " cols " +
                     std::to_string(cols));
        const int64_t rows = 8;
        xtest::Matrix x = xtest::random_logits(rows, cols, 3, d, v.sigma);
        x.at(2, 17) = nan;        // in a pack of the body
        x.at(5, cols - 1) = nan;  // in the last pack or the tail
        const std::vector<int64_t> targets = xtest::random_targets(rows, cols, 5);
        xent::Options opt;
        opt.softcap = v.softcap;
        opt.label_smoothing = v.label_smoothing;
        opt.reduction = xent::Reduction::none;
        const GpuRun r = run_cuda(x, targets, d, opt);
        for (int64_t i = 0; i < rows; ++i) {
          const bool poisoned = i == 2 || i == 5;
          EXPECT_EQ(std::isnan(r.got.lse[i]), poisoned) << "row " << i << " lse " << r.got.lse[i];
          EXPECT_EQ(std::isnan(r.got.loss[i]), poisoned)
              << "row " << i << " loss " << r.got.loss[i];
        }
      }
}

}  // namespace
