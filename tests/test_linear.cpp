// The fused lm head (xent/linear.h) on one rank of the CPU backend, against the float64
// reference of linear_reference.h: every option, both grad modes, chunk sizes (bad input:
// test_linear_errors.cpp; NaN inputs: test_linear_nan.cpp).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xent/linear.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "linear_harness.h"

namespace {

using xent::DType;
using xent::GradMode;
using xent::Reduction;
using xtest::LinearCase;
using xtest::local;
using xtest::on_cuda;
using xtest::run_linear;

using Linear = xtest::LinearTest;

// Chunks of 1 row, of a size that does not divide the rows (16), of all rows and more, and from
// the default budget.
std::vector<xent::LinearOptions> chunkings() {
  std::vector<xent::LinearOptions> all;
  for (int64_t rows : {1, 5, 16, 100, 0}) {
    xent::LinearOptions l;
    l.chunk_rows = rows;
    all.push_back(l);
  }
  return all;
}

// CUDA, 16-bit inputs, the fast schedule: a budget under which chunks of `chunk_rows` rows make
// their fp32 logits sub-chunks of `sub` rows (plan.h: a sub-chunk takes what the budget leaves
// it, at most kSubRows). 0 on the CPU and for f32 inputs (no sub-chunks): the default budget.
size_t budget_for_sub_rows(const xent::Group& g, const LinearCase& c, int64_t sub) {
  if (g.backend() != xent::Backend::cuda || c.dtype == DType::f32) return 0;
  char fake[16];  // linear_plan reads no data
  const int64_t V = c.widths[0];
  const xent::MatrixView h{fake, c.dtype, c.rows, c.H, c.H}, w{fake, c.dtype, V, c.H, c.H};
  xent::Options opt = c.opt;
  opt.vocab_size = c.vocab_size;
  xent::LinearOutputs out;
  out.d_hidden = xent::MatrixView{fake, c.grad_dtype, c.rows, c.H, c.H};
  out.d_weight = xent::MatrixView{fake, c.grad_dtype, V, c.H, c.H};
  xent::LinearOptions l = c.lopt;
  l.schedule = xent::LinearSchedule::fast;
  const xent::LinearPlan p = xent::linear_plan(
      g, h, w, xent::TargetsView{fake, xent::IndexType::i64, c.rows}, opt, l, out);
  // The sub-chunk the plan takes with the default budget: at most 512 rows where there are
  // several chunks (else every row), in whole 128-row tiles.
  int64_t full = p.chunks > 1 ? std::min<int64_t>(512, p.chunk_rows) : p.chunk_rows;
  if (full > 128) full -= full % 128;
  return p.scratch_bytes - static_cast<size_t>((full - sub) * V * 4) + 255;
}

TEST_F(Linear, ChunkSizesFusedAndDeferred) {
  const xent::Group g = local();
  for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
    std::vector<float> first_loss;
    for (const xent::LinearOptions& l : chunkings()) {
      SCOPED_TRACE(std::string(xent::to_string(mode)) + ", chunk_rows " +
                   std::to_string(l.chunk_rows));
      LinearCase c;
      c.opt.grad_mode = mode;
      c.lopt = l;
      c.p_ignore = 0.2;
      const xtest::LinearGot got = run_linear(g, c);
      std::printf("[ measured ] %s chunk_rows %lld: d_hidden %.2e, d_weight %.2e of magnitude\n",
                  xent::to_string(mode), static_cast<long long>(l.chunk_rows), got.worst_dh,
                  got.worst_dw);
      // CPU: rows are summed in order whatever the chunks, the same loss to the bit. CUDA:
      // cuBLASLt picks its GEMM (and the order of its sums) by shape, so the logits of a chunk
      // size may differ from another's in the last bits; each is checked against float64.
      if (first_loss.empty()) first_loss = got.loss;
      if (!on_cuda()) EXPECT_EQ(got.loss, first_loss) << "the loss depends on the chunk size";
    }
  }
}

// Past one of the CPU GEMM's row blocks (host::kRowBlock rows), chunks that start and end
// anywhere in a block: every row's loss and lse the same bits whatever the chunking (CPU).
TEST_F(Linear, RowBitsPastOneGemmBlock) {
  if (on_cuda()) GTEST_SKIP() << "cuBLASLt picks its GEMM by shape: checked against float64 only";
  const xent::Group g = local();
  std::vector<float> first_loss, first_lse;
  for (int64_t rows : {300, 1, 7, 128, 129, 0}) {
    SCOPED_TRACE("chunk_rows " + std::to_string(rows));
    LinearCase c;
    c.rows = 300;
    c.widths = {70};
    c.opt.reduction = Reduction::none;
    c.opt.grad_mode = GradMode::fused;
    c.lopt.chunk_rows = rows;
    c.p_ignore = 0.1;
    const xtest::LinearGot got = run_linear(g, c);
    if (first_loss.empty()) {
      first_loss = got.loss;
      first_lse = got.lse;
    }
    EXPECT_EQ(got.loss, first_loss) << "a row's loss depends on the chunk size";
    EXPECT_EQ(got.lse, first_lse) << "a row's lse depends on the chunk size";
  }
}

TEST_F(Linear, Reductions) {
  const xent::Group g = local();
  for (Reduction r : {Reduction::none, Reduction::mean, Reduction::sum}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred, GradMode::none}) {
      SCOPED_TRACE(std::string(xent::to_string(r)) + ", " + xent::to_string(mode));
      LinearCase c;
      c.opt.reduction = r;
      c.opt.grad_mode = mode;
      c.p_ignore = 0.25;
      c.lopt.chunk_rows = 7;
      run_linear(g, c);
    }
  }
}

TEST_F(Linear, Bf16Inputs) {
  const xent::Group g = local();
  for (DType out : {DType::bf16, DType::f32}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      SCOPED_TRACE(std::string("gradients in ") + xent::to_string(out) + ", " +
                   xent::to_string(mode));
      LinearCase c;
      c.dtype = DType::bf16;
      c.grad_dtype = out;
      c.opt.grad_mode = mode;
      c.lopt.chunk_rows = 6;
      c.opt.label_smoothing = 0.1f;
      run_linear(g, c);
    }
  }
}

// Chunks of several of the CUDA backend's sub-chunks of fp32 logits of bf16 inputs (plan.h, 40
// columns, the fast schedule, a budget that leaves a sub-chunk 128 or 256 rows): chunks of 200
// rows (sub-chunks of 128 rows: two, the second short) and all 300 rows in one chunk of
// sub-chunks of 256 rows (256 and 44), with per-row outputs and a per-row grad_output across the
// sub-chunks' seams.
TEST_F(Linear, ChunksOfSeveralSubChunks) {
  const xent::Group g = local();
  for (int64_t rows : {200, 0}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      SCOPED_TRACE(std::string(xent::to_string(mode)) + ", chunk_rows " + std::to_string(rows));
      LinearCase c;
      c.rows = 300;
      c.dtype = DType::bf16;
      c.grad_dtype = DType::bf16;
      c.opt.grad_mode = mode;
      c.opt.reduction = Reduction::none;
      c.opt.compute_accuracy = true;
      c.lopt.chunk_rows = rows == 0 ? 300 : rows;
      c.lopt.schedule = xent::LinearSchedule::fast;
      c.lopt.max_scratch_bytes = budget_for_sub_rows(g, c, rows == 0 ? 256 : 128);
      c.p_ignore = 0.1;
      if (mode == GradMode::deferred)
        for (int64_t i = 0; i < c.rows; ++i) c.grad_output.push_back(0.5 + 0.01 * (i % 7));
      run_linear(g, c);
    }
  }
}

// Rows wide enough for the CUDA backend's single pass on one rank (Options::single_pass: more
// than 2048 real columns of fp32 logits): a block's registers (4101: rows in every alignment;
// bf16 in sub-chunks of 7 rows, the gradient stored element by element where a pack cannot be
// one store), its shared memory (20000) and a cluster of 2 blocks (40000, sm_90), with padding
// columns; chunks of 150 rows (bf16 at 20000 and 40000: sub-chunks of 128 and 22), with the
// general statistics (smoothing, z-loss, accuracy), a grad_scale and the plain ones, against the
// two passes and the CPU backend, all checked by the reference. Off sm_90 the wider rows take
// two passes.
TEST_F(Linear, WideRowsSinglePass) {
  const xent::Group g = local();
  for (int64_t width : {4101, 20000, 40000}) {
    for (DType dtype : {DType::bf16, DType::f32}) {
      for (bool single : {true, false}) {
        SCOPED_TRACE(std::to_string(width) + " columns, " + xent::to_string(dtype) +
                     (single ? ", single pass" : ", two passes"));
        LinearCase c;
        c.rows = 200;
        c.H = 16;
        c.widths = {width};
        c.vocab_size = width - 7;
        c.dtype = dtype;
        c.grad_dtype = dtype;
        c.opt.single_pass = single;
        c.lopt.chunk_rows = 150;
        c.p_ignore = 0.1;
        if (width == 20000) {
          c.opt.label_smoothing = 0.1f;
          c.opt.z_loss = 0.01f;
          c.opt.compute_accuracy = true;
        }
        if (width == 4101) {
          c.opt.grad_scale = 0.25f;  // the scale the single pass folds in
          // Sub-chunks of 7 rows: at row s0 of the chunk a 16-bit gradient row sits at element
          // s0 x 4101 of its buffer, so most of them cannot take a pack as one 8-byte store.
          c.lopt.schedule = xent::LinearSchedule::fast;
          c.lopt.max_scratch_bytes = budget_for_sub_rows(g, c, 7);
        }
        run_linear(g, c);
      }
    }
  }
}

TEST_F(Linear, F16Inputs) {
  LinearCase c;
  c.dtype = DType::f16;
  c.grad_dtype = DType::f16;
  c.lopt.chunk_rows = 4;
  run_linear(local(), c);
}

TEST_F(Linear, SmoothingZLossAccuracy) {
  const xent::Group g = local();
  for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
    LinearCase c;
    c.opt.grad_mode = mode;
    c.opt.label_smoothing = 0.15f;
    c.opt.z_loss = 0.01f;
    c.opt.compute_accuracy = true;
    c.p_ignore = 0.2;
    c.lopt.chunk_rows = 3;
    run_linear(g, c);
  }
}

TEST_F(Linear, Softcap) {
  LinearCase c;
  c.opt.softcap = 3.0f;
  c.opt.z_loss = 0.02f;
  c.lopt.chunk_rows = 5;
  run_linear(local(), c);
}

// Chunks of several of the epilogue engine's 256-column tiles: whole tiles (every column real and
// inside the chunk) and ragged ones, rows not a multiple of its 128 and some without a gradient,
// with and without a softcap, the sum and argmax wanted or not, an even and an odd row stride of
// the chunk's gradient: each path of its epilogues (sm90/grad_gemm.cu, and stats_gemm.cu for the
// forward's statistics; lean's chunks end at the last real column, so no padding reaches the
// gradient's), and on every other engine and backend the same cases, the weight's padding rows
// included, against the reference.
TEST_F(Linear, WholeAndRaggedTiles) {
  const xent::Group g = local();
  for (int64_t cols : {600, 601}) {
    for (float cap : {0.0f, 3.0f}) {
      for (bool extras : {false, true}) {
        SCOPED_TRACE(std::to_string(cols) + "-column chunks, softcap " + std::to_string(cap) +
                     (extras ? ", sum and argmax" : ""));
        LinearCase c;
        c.rows = 300;
        c.H = 64;
        c.widths = {1100};
        c.vocab_size = 1093;
        c.p_ignore = 0.1;
        c.opt.softcap = cap;
        if (extras) {
          c.opt.label_smoothing = 0.1f;
          c.opt.compute_accuracy = true;
        }
        c.lopt.chunk_cols = cols;  // lean: two whole tiles and a ragged one, then the rest
        run_linear(g, c);
      }
    }
  }
}

TEST_F(Linear, GradScaleFused) {
  LinearCase c;
  c.opt.grad_scale = 0.125f;
  c.opt.reduction = Reduction::sum;
  c.lopt.chunk_rows = 5;
  run_linear(local(), c);
}

TEST_F(Linear, PaddingRowsOfTheWeight) {
  // 40 rows of weight, 33 real classes: rows 33..39 are NaN and must not be read; their
  // d_weight rows are 0 (bf16: rounded from the fp32 accumulator; f32: written directly).
  const xent::Group g = local();
  for (DType out : {DType::f32, DType::bf16}) {
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      LinearCase c;
      c.vocab_size = 33;
      c.dtype = out;
      c.grad_dtype = out;
      c.opt.grad_mode = mode;
      c.opt.label_smoothing = 0.1f;
      c.opt.compute_accuracy = true;
      c.lopt.chunk_rows = 6;
      run_linear(g, c);
    }
  }
}

TEST_F(Linear, DeferredGradOutput) {
  const xent::Group g = local();
  {
    LinearCase c;  // a scalar
    c.opt.grad_mode = GradMode::deferred;
    c.opt.reduction = Reduction::sum;
    c.grad_output = {0.37};
    c.lopt.chunk_rows = 5;
    run_linear(g, c);
  }
  for (DType out : {DType::f32, DType::bf16}) {
    LinearCase c;  // one per row
    c.opt.grad_mode = GradMode::deferred;
    c.opt.reduction = Reduction::none;
    c.dtype = out;
    c.grad_dtype = out;
    c.p_ignore = 0.2;
    for (int64_t i = 0; i < c.rows; ++i) c.grad_output.push_back(0.1 + 0.3 * (i % 5));
    c.lopt.chunk_rows = 5;
    run_linear(g, c);
  }
}

TEST_F(Linear, AccumulateDWeight) {
  const xent::Group g = local();
  for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
    LinearCase c;
    c.opt.grad_mode = mode;
    c.vocab_size = 35;  // padding rows keep their values
    c.dtype = DType::bf16;
    c.lopt.accumulate_d_weight = true;
    c.lopt.chunk_rows = 4;
    run_linear(g, c);
  }
}

TEST_F(Linear, OneGradientOnly) {
  const xent::Group g = local();
  for (bool dh : {true, false}) {
    LinearCase c;
    c.want_d_hidden = dh;
    c.want_d_weight = !dh;
    c.lopt.chunk_rows = 5;
    run_linear(g, c);
  }
}

TEST_F(Linear, AllIgnoredAndNoRows) {
  const xent::Group g = local();
  LinearCase c;
  c.p_ignore = 1.0;  // mean over no row: loss 0, gradients 0
  c.opt.compute_accuracy = true;
  run_linear(g, c);
  c.rows = 0;
  run_linear(g, c);
}

}  // namespace
