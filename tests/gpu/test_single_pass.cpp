// The single-pass path (one rank, fused, rows held on chip: Options::single_pass) against the
// fp64 reference with the same bounds as the two-pass path, and the two-pass fallback forced
// (single_pass = false) on the same inputs: every statistics variant, row widths on every block
// shape (clusters of blocks for wide rows) and unaligned row strides, the gradient over the logits
// or into a buffer aligned differently, padding columns, ignored and out-of-range targets; and
// forward_path's choice at the edges.
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
using xtest::gpu::OneRankRun;
using xtest::gpu::RowShape;

struct Variant {
  const char* name;
  float softcap, label_smoothing, z_loss;
  xent::Reduction reduction;
  double sigma;
};

const Variant kVariants[] = {
    {"plain-mean", 0.0f, 0.0f, 0.0f, xent::Reduction::mean, 2.0},
    {"plain-none", 0.0f, 0.0f, 0.0f, xent::Reduction::none, 2.0},
    {"capped-30-sum", 30.0f, 0.0f, 0.0f, xent::Reduction::sum, 12.0},
    {"general-cap-50", 50.0f, 0.0f, 0.0f, xent::Reduction::mean, 20.0},
    {"general-smoothing-zloss", 0.0f, 0.1f, 1e-3f, xent::Reduction::mean, 2.0},
};

// x on the single pass and on the two passes forced, each against the fp64 reference; vocab
// below the columns makes the rest padding, whose gradient must be 0.
void expect_both_paths(const xtest::Matrix& x, const std::vector<int64_t>& targets, DType d,
                       const Variant& v, int64_t vocab, const RowShape& s) {
  xent::Options opt;
  opt.softcap = v.softcap;
  opt.label_smoothing = v.label_smoothing;
  opt.z_loss = v.z_loss;
  opt.reduction = v.reduction;
  if (vocab < s.cols) opt.vocab_size = vocab;
  const xtest::RefOptions ro = xtest::ref_options(opt, vocab);
  const xtest::RefResult ref = xtest::reference(x, targets, ro);
  // Capped rows take two passes where xent measured them faster (capped_rows_take_single_pass).
  const int elem_bytes = static_cast<int>(xent::dtype_size(d));
  const bool capped_single =
      v.softcap <= 0.0f || xtest::gpu::capped_rows_take_single_pass(elem_bytes, vocab);
  // Rows past one block's registers need clusters, which code built for sm_80 has not.
  const bool held = xtest::gpu::single_pass_holds(elem_bytes, vocab);
  for (bool single : {true, false}) {
    SCOPED_TRACE(single ? "single-pass" : "two-pass (forced)");
    opt.single_pass = single;
    const OneRankRun r = xtest::gpu::run_one_rank(x, targets, d, opt, s);
    EXPECT_EQ(r.path, single && capped_single && held ? "single-pass" : "two-pass");
    xtest::expect_outputs(r.out, ref, targets, ro);
    EXPECT_TRUE(xtest::grad_matches(r.grad, ref, 0, {}, /*check_gap=*/true, 77.0));
    int64_t nonzero_padding = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(targets.size()); ++i)
      for (int64_t j = vocab; j < s.cols; ++j) nonzero_padding += r.grad.get(i, j) != 0.0;
    EXPECT_EQ(nonzero_padding, 0);
    EXPECT_EQ(r.error, "");
  }
}

TEST(SinglePass, MatchesFp64AndTheTwoPassPath) {
  SKIP_WITHOUT_GPU();
  for (DType d : {DType::bf16, DType::f16, DType::f32}) {
    const bool wide = d != DType::f32;  // 8 or 4 elements per 16-byte pack
    // Each shape (a block of 256 or 512 threads holding the row in registers; 512 threads with
    // part of it in shared memory, alone and in clusters of 2, 3 and 4), near its end and part
    // filled, with unaligned strides and a separate gradient buffer.
    const RowShape setups[] = {
        {wide ? 4105 : 2053, 0, false},    {wide ? 9000 : 4500, 3, false},
        {wide ? 32760 : 16380, 1, true},   {wide ? 20000 : 10000, 0, true},
        {wide ? 40000 : 20000, 1, false},  {wide ? 65530 : 32765, 0, true},
        {wide ? 100000 : 50000, 3, true},  {wide ? 128256 : 64128, 0, true},
        {wide ? 151936 : 75968, 1, true},  {wide ? 262141 : 131069, 3, false},
        {wide ? 200000 : 100000, 0, false}};
    for (const RowShape& s : setups)
      for (const Variant& v : kVariants) {
        SCOPED_TRACE(std::string(v.name) + " " + xent::to_string(d) + " cols " +
                     std::to_string(s.cols) + " stride +" + std::to_string(s.stride_extra) +
                     (s.separate_grad ? " separate grad" : " in place"));
        const int64_t rows = s.cols > 50000 ? 6 : 24;
        xtest::Matrix x = xtest::random_logits(rows, s.cols, 5 + s.cols, d, v.sigma);
        x.at(1, 3) = xtest::round_to(d, 6e4);
        x.at(2, s.cols - 1) = xtest::round_to(d, 5.0 * v.sigma);
        std::vector<int64_t> targets = xtest::random_targets(rows, s.cols, 9 + s.cols, 0.15);
        targets[4] = s.cols - 1;  // the last column, in the tail or the last pack
        expect_both_paths(x, targets, d, v, s.cols, s);
      }
  }
}

// Padding columns (vocab_size below the columns, as GPT-2's 50257 classes padded to 50304): the
// single pass holds the real columns only and writes 0 into the padding's gradient, over the
// logits (which held garbage there) or into a separate buffer; the same as fp64 and as two passes.
TEST(SinglePass, PaddingColumns) {
  SKIP_WITHOUT_GPU();
  struct Case {
    DType dtype;
    int64_t cols, vocab;
    RowShape shape;
  };
  const Case cases[] = {
      {DType::bf16, 50304, 50257, {50304, 0, false}},    // one block, padding inside a pack
      {DType::bf16, 50304, 50257, {50304, 3, true}},     // unaligned rows, separate gradient
      {DType::f16, 131072, 128000, {131072, 0, false}},  // a cluster of 2, 3072 padding columns
      {DType::f32, 24100, 20004, {24100, 1, true}},      // 4096 padding columns, the most
  };
  const Variant variants[] = {kVariants[0], kVariants[2], kVariants[4]};
  for (const Case& c : cases)
    for (const Variant& v : variants) {
      SCOPED_TRACE(std::string(v.name) + " " + xent::to_string(c.dtype) + " cols " +
                   std::to_string(c.cols) + " vocab " + std::to_string(c.vocab) + " stride +" +
                   std::to_string(c.shape.stride_extra) +
                   (c.shape.separate_grad ? " separate grad" : " in place"));
      const int64_t rows = 8;
      xtest::Matrix x = xtest::random_logits(rows, c.cols, 7 + c.cols, c.dtype, v.sigma);
      for (int64_t r = 0; r < rows; ++r)  // padding logits larger than any real one
        for (int64_t j = c.vocab; j < c.cols; ++j) x.at(r, j) = xtest::round_to(c.dtype, 4e3);
      std::vector<int64_t> targets = xtest::random_targets(rows, c.vocab, 11, 0.15);
      targets[1] = c.vocab - 1;
      expect_both_paths(x, targets, c.dtype, v, c.vocab, c.shape);
    }
}

// Out-of-range targets on the single-pass path: the row's loss is NaN, its gradient 0, and
// check_errors names the smallest such row, as on the two-pass path.
TEST(SinglePass, BadTargetIsReported) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 300, cols = 9000;
  const xtest::Matrix x = xtest::random_logits(rows, cols, 3, DType::bf16, 2.0);
  std::vector<int64_t> targets = xtest::random_targets(rows, cols, 4, 0.1);
  for (int64_t r = 41; r < rows; r += 7) targets[r] = (r % 2) ? cols + r : -3 - r;
  xent::Options opt;
  opt.reduction = xent::Reduction::none;
  const OneRankRun r =
      xtest::gpu::run_one_rank(x, targets, DType::bf16, opt, RowShape{cols, 0, false});
  ASSERT_EQ(r.path, "single-pass");
  EXPECT_NE(r.error.find("targets[41] = " + std::to_string(cols + 41)), std::string::npos)
      << "message: " << r.error;
  for (int64_t i = 0; i < rows; ++i) {
    const bool bad = i >= 41 && (i - 41) % 7 == 0;
    EXPECT_EQ(std::isnan(r.out.loss[i]), bad) << "row " << i << " loss " << r.out.loss[i];
    if (bad || targets[i] == opt.ignore_index) {
      int nonzero = 0;
      for (int64_t j = 0; j < cols; ++j) nonzero += r.grad.get(i, j) != 0.0;
      EXPECT_EQ(nonzero, 0) << "row " << i;
    }
  }
}

TEST(SinglePass, PathChoice) {
  SKIP_WITHOUT_GPU();
  const xent::Group g = xent::Group::local(xent::Backend::cuda, 0);
  const auto path = [&](DType d, int64_t cols, xent::Options opt = {}) {
    return std::string(xent::forward_path(g, xent::LogitsView{nullptr, d, 8, cols, cols}, opt));
  };
  // Rows that a warp takes on the two-pass path stay there; rows past the largest block shape
  // take the two-pass path. Rows past one block's registers need clusters: where the code that
  // runs has none (a build for sm_80, on any device), they take two passes.
  const char* cluster_rows = xtest::gpu::clusters_available() ? "single-pass" : "two-pass";
  EXPECT_EQ(path(DType::bf16, 4096), "two-pass");
  EXPECT_EQ(path(DType::bf16, 4104), "single-pass");
  EXPECT_EQ(path(DType::bf16, 32768), "single-pass");  // one block's registers, the most
  EXPECT_EQ(path(DType::f16, 32776), cluster_rows);    // a cluster of blocks
  EXPECT_EQ(path(DType::bf16, 262144), cluster_rows);
  EXPECT_EQ(path(DType::bf16, 262152), "two-pass");
  EXPECT_EQ(path(DType::f32, 2048), "two-pass");
  EXPECT_EQ(path(DType::f32, 2052), "single-pass");
  EXPECT_EQ(path(DType::f32, 16384), "single-pass");
  EXPECT_EQ(path(DType::f32, 131072), cluster_rows);
  EXPECT_EQ(path(DType::f32, 131076), "two-pass");
  xent::Options opt;
  opt.softcap = 30.0f;  // a softcap: the same widths, but for 2-byte rows past the smallest shape
  // where the memory is fast (H200: two passes measured faster there)
  const bool wide_capped = xtest::gpu::capped_rows_take_single_pass(2, 16392);
  EXPECT_EQ(path(DType::bf16, 16384, opt), "single-pass");
  EXPECT_EQ(path(DType::bf16, 16392, opt), wide_capped ? "single-pass" : "two-pass");
  const char* wide_capped_rows = wide_capped ? cluster_rows : "two-pass";
  EXPECT_EQ(path(DType::bf16, 32768, opt), wide_capped ? "single-pass" : "two-pass");
  EXPECT_EQ(path(DType::f16, 32776, opt), wide_capped_rows);
  EXPECT_EQ(path(DType::bf16, 262144, opt), wide_capped_rows);
  EXPECT_EQ(path(DType::bf16, 262152, opt), "two-pass");
  EXPECT_EQ(path(DType::f32, 131072, opt), cluster_rows);
  opt = {};
  opt.single_pass = false;
  EXPECT_EQ(path(DType::bf16, 16032, opt), "two-pass");
  opt = {};
  opt.grad_mode = xent::GradMode::deferred;
  EXPECT_EQ(path(DType::bf16, 16032, opt), "two-pass");
  opt = {};
  opt.vocab_size = 16000;  // padding columns: up to 4096 of them, the single pass zeroes them
  EXPECT_EQ(path(DType::bf16, 16032, opt), "single-pass");
  opt.vocab_size = 20000;
  EXPECT_EQ(path(DType::bf16, 24096, opt), "single-pass");
  EXPECT_EQ(path(DType::bf16, 24097, opt), "two-pass");
  opt.vocab_size = 4096;  // real columns that a warp takes
  EXPECT_EQ(path(DType::bf16, 4104, opt), "two-pass");
  const xent::Group cpu = xent::Group::local(xent::Backend::cpu);
  EXPECT_STREQ(xent::forward_path(cpu, xent::LogitsView{nullptr, DType::bf16, 8, 16032, 16032},
                                  xent::Options{}),
               "two-pass");
}

}  // namespace
