// Exact on whatever code the build holds for this device: the rows that once came out wrong
// when a build for sm_80 ran on an H100 (the host chose clusters and programmatic dependent
// launch, whose device side sm_80 code lacks), against the fp64 reference, on every path the
// library may choose; the path it chose agrees with what the running code can do; and a mean of
// row losses near the float maximum stays finite. The GPU suite runs for every architecture the
// package holds (launch/gpu_check.sh builds for sm_80 too).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda_test.h"
#include "harness.h"
#include "one_rank.h"

namespace {

using xent::DType;
using xent::Reduction;
using xtest::gpu::OneRankRun;
using xtest::gpu::RowShape;

// 129 rows of 131072 columns: the case that returned garbage gradients (fp32, mean) and losses
// 0.3 to 0.8 % off (reduction none) on the H100 from a build for sm_80.
TEST(CudaImage, WideRowsMatchFp64OnEveryPath) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 129, cols = 131072;
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (Reduction red : {Reduction::mean, Reduction::none})
      for (bool single : {true, false}) {
        SCOPED_TRACE(std::string(xent::to_string(d)) + " " + xent::to_string(red) +
                     (single ? " single pass allowed" : " two passes"));
        const xtest::Matrix x = xtest::random_logits(rows, cols, 3 + rows, d, 2.0);
        const std::vector<int64_t> targets = xtest::random_targets(rows, cols, 5, 0.1);
        xent::Options opt;
        opt.reduction = red;
        opt.single_pass = single;
        const xtest::RefOptions ro = xtest::ref_options(opt, cols);
        const xtest::RefResult ref = xtest::reference(x, targets, ro);
        const OneRankRun r = xtest::gpu::run_one_rank(x, targets, d, opt, RowShape{cols, 0, true});
        const bool held =
            xtest::gpu::single_pass_holds(static_cast<int>(xent::dtype_size(d)), cols);
        EXPECT_EQ(r.path, single && held ? "single-pass" : "two-pass");
        xtest::expect_outputs(r.out, ref, targets, ro);
        EXPECT_TRUE(xtest::grad_matches(r.grad, ref, 0, {}, /*check_gap=*/true, 77.0));
        EXPECT_EQ(r.error, "");
      }
}

// The code the library runs and the test's own kernels are of one architecture, and a device of
// 9.0 or newer runs cluster code only from a 9.0 image.
TEST(CudaImage, ClustersFollowTheRunningCode) {
  SKIP_WITHOUT_GPU();
  const int arch = xtest::gpu::kernel_arch();
  EXPECT_GE(arch, 80) << "the library refuses architectures below 8.0";
  const xent::Group g = xent::Group::local(xent::Backend::cuda, 0);
  const std::string path =
      xent::forward_path(g, xent::LogitsView{nullptr, DType::bf16, 8, 65536, 65536}, {});
  EXPECT_EQ(path, xtest::gpu::clusters_available() ? "single-pass" : "two-pass")
      << "kernel architecture " << arch;
}

// Row losses of 3e38 (logits of +-1.5e38): their mean is representable and must be finite; their
// sum is not, and is inf.
TEST(CudaImage, MeanOfHugeRowLossesIsFinite) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 8, cols = 16;
  xtest::Matrix x(rows, cols, -1.5e38);
  std::vector<int64_t> targets(rows);
  for (int64_t i = 0; i < rows; ++i) {
    x.at(i, (i + 1) % cols) = 1.5e38;
    targets[i] = i % cols;  // a -1.5e38 logit: loss 3e38
  }
  for (DType d : {DType::f32, DType::bf16})
    for (Reduction red : {Reduction::mean, Reduction::sum}) {
      SCOPED_TRACE(std::string(xent::to_string(d)) + " " + xent::to_string(red));
      xtest::Matrix xr = x;
      for (double& v : xr.v) v = xtest::round_to(d, v);
      xent::Options opt;
      opt.reduction = red;
      const xtest::RefResult ref = xtest::reference(xr, targets, xtest::ref_options(opt, cols));
      const OneRankRun r = xtest::gpu::run_one_rank(xr, targets, d, opt, RowShape{cols, 0, false});
      if (red == Reduction::mean) {
        ASSERT_TRUE(std::isfinite(r.out.loss[0])) << r.out.loss[0];
        EXPECT_NEAR(r.out.loss[0], ref.loss, 1e-6 * ref.loss);
      } else {
        EXPECT_TRUE(std::isinf(r.out.loss[0]) && r.out.loss[0] > 0) << r.out.loss[0];
      }
    }
}

}  // namespace
