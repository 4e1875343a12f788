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
#include "one_rank.h"

namespace {

using xent::DType;

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
        const xtest::gpu::OneRankRun r =
            xtest::gpu::run_one_rank(x, targets, d, opt, {cols, 0, false});
        xtest::expect_outputs(r.out, ref, targets, xtest::ref_options(opt, cols));
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
        const xtest::gpu::OneRankRun r =
            xtest::gpu::run_one_rank(x, targets, d, opt, {cols, 0, false});
        for (int64_t i = 0; i < rows; ++i) {
          const bool poisoned = i == 2 || i == 5;
          EXPECT_EQ(std::isnan(r.out.lse[i]), poisoned) << "row " << i << " lse " << r.out.lse[i];
          EXPECT_EQ(std::isnan(r.out.loss[i]), poisoned)
              << "row " << i << " loss " << r.out.loss[i];
        }
      }
}

}  // namespace
