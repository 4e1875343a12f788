// The fused lm head (xent/linear.h) on one rank with a NaN among its inputs: NaN comes out where
// it must, and nowhere else.
#include <gtest/gtest.h>
#include <xent/linear.h>

#include <cmath>
#include <vector>

#include "linear_harness.h"

namespace {

using xent::DType;
using xent::Reduction;
using xtest::local;
using Linear = xtest::LinearTest;

// A NaN among the inputs is never dropped: a NaN in a row of hidden makes that row's logits NaN,
// so its loss is NaN (its lse not finite) and no other row's; a NaN in one (real) row of the weight
// makes one column NaN in every row, so every loss is. On the epilogue engine the statistics GEMM
// finds the NaN from its sum of exp (sm90/stats_gemm.cu: the max passes over a NaN) in the first
// case through a row whose every column is NaN, in the second through one NaN column in a tile.
TEST_F(Linear, NaNInputsPropagate) {
  const xent::Group g = local();
  const int64_t N = 300, H = 64, V = 1100, ld = H + 8;
  for (int which : {0, 1}) {
    SCOPED_TRACE(which == 0 ? "NaN in hidden row 7" : "NaN in weight row 600");
    xtest::Matrix hidden = xtest::random_logits(N, H, 5, DType::bf16, 1.0);
    xtest::Matrix weight = xtest::random_logits(V, H, 6, DType::bf16, 0.25);
    if (which == 0) hidden.at(7, 3) = std::nan("");
    if (which == 1) weight.at(600, 0) = std::nan("");
    xtest::HostLogits hb = xtest::make_shard(hidden, 0, H, DType::bf16, ld);
    xtest::HostLogits wb = xtest::make_shard(weight, 0, H, DType::bf16, ld);
    xtest::HostLogits dh = xtest::make_shard(xtest::Matrix(N, H, 0.0), 0, H, DType::bf16, ld);
    xtest::HostLogits dw = xtest::make_shard(xtest::Matrix(V, H, 0.0), 0, H, DType::bf16, ld);
    xtest::HostTargets tg(xtest::random_targets(N, V, 7, 0.0, -100), xent::IndexType::i64);
    std::vector<float> loss(N, 0.0f), lse(N, 0.0f);
    xent::Options opt;
    opt.reduction = Reduction::none;
    xent::LinearOptions lopt;
    lopt.chunk_cols = 600;
    lopt = xtest::with_test_schedule(lopt, V);
    xtest::Staging dev(g.backend() == xent::Backend::cuda);
    xent::LinearOutputs out;
    out.loss = dev(loss.data(), sizeof(float) * N);
    out.lse = dev(lse.data(), sizeof(float) * N);
    out.d_hidden = dev(xtest::matrix_view(dh), dh);
    out.d_weight = dev(xtest::matrix_view(dw), dw);
    xent::TargetsView tv = tg.view();
    tv.data = dev(tv.data, tg.bytes());
    xent::linear_forward(g, dev(xtest::matrix_view(hb), hb), dev(xtest::matrix_view(wb), wb), tv,
                         opt, lopt, out);
    dev.copy_back();
    for (int64_t i = 0; i < N; ++i) {
      const bool want_nan = which == 1 || i == 7;
      EXPECT_EQ(std::isnan(loss[i]), want_nan) << "row " << i << ": loss " << loss[i];
      // A row whose every logit is NaN has no max: its lse is -inf on the logits path's
      // statistics and NaN from the epilogue's, never a finite number.
      EXPECT_EQ(!std::isfinite(lse[i]), want_nan) << "row " << i << ": lse " << lse[i];
      if (which == 1) EXPECT_TRUE(std::isnan(lse[i])) << "row " << i << ": lse " << lse[i];
    }
  }
}

}  // namespace
