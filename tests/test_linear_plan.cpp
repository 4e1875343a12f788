// The fused lm head's plan (src/linear/plan.h) on the shapes of the GPU benchmarks (8192 tokens,
// hidden 4096, bf16, V 128256 over 1, 2 and 4 ranks): which schedule the default budget takes,
// that every plan stays within its budget, and the refusals. The plan is internal: its effect on
// the numbers is tested in test_linear.cpp and the dist tests (both schedules against float64),
// its effect on speed and memory in xent_dist_bench --hidden and bench/linear_side_by_side.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "linear/plan.h"
#include "linear/sm90/partials.h"

namespace {

using xent::Backend;
using xent::DType;
using xent::LinearOptions;
using xent::LinearSchedule;
using xent::linear::Plan;
using xent::linear::Shape;

constexpr size_t kMiB = size_t(1) << 20;

// A training step's forward (fused) on CUDA: bf16 hidden, weight, d_hidden and d_weight.
Shape step(int ranks, int64_t widest, int64_t rows = 8192, int64_t hidden = 4096) {
  Shape s;
  s.backend = Backend::cuda;
  s.ranks = ranks;
  s.rows = rows;
  s.widest = widest;
  s.hidden = hidden;
  s.inputs = DType::bf16;
  s.gradients = s.d_hidden = s.d_weight = true;
  s.d_hidden_f32 = s.d_weight_f32 = false;
  s.sums = true;
  return s;
}

TEST(LinearPlan, DefaultIsLeanWithinAnEighthOfTheLogitsOrLeansNeed) {
  for (int tp : {1, 2, 4}) {
    const int64_t V = 128256 / tp;
    SCOPED_TRACE("TP " + std::to_string(tp));
    const Shape s = step(tp, V);
    const Plan p = make_plan(s, LinearOptions{});
    EXPECT_EQ(p.info.schedule, LinearSchedule::lean);
    EXPECT_EQ(p.info.budget, xent::linear::default_budget(s));
    EXPECT_LE(p.total, p.info.budget);
    EXPECT_LE(p.info.budget, 256 * kMiB) << "the issue's target: at most 256 MiB of scratch";
    const size_t logits16 = size_t(8192) * size_t(V) * 2;
    if (logits16 / 8 >= 200 * kMiB) EXPECT_EQ(p.info.budget, logits16 / 8);
    EXPECT_GE(p.info.chunk_cols, xent::linear::kLeanCols);
    EXPECT_EQ(p.info.chunk_rows, xent::linear::kLeanRows);
    EXPECT_EQ(p.info.chunks, (V + p.info.chunk_cols - 1) / p.info.chunk_cols);
  }
}

// Hidden 2048 (Llama 3.2 1B): an eighth of the logits would buy lean chunks of about 6500
// columns; the default takes kWideCols and leaves the rest unspent. A budget given is spent, and
// where the default budget holds fast (many rows), fast still takes it.
TEST(LinearPlan, DefaultLeanStopsAtWideChunks) {
  const Shape s = step(1, 128256, 8192, 2048);
  const Plan p = make_plan(s, LinearOptions{});
  const size_t logits16 = size_t(8192) * size_t(128256) * 2;
  EXPECT_EQ(p.info.schedule, LinearSchedule::lean);
  EXPECT_EQ(p.info.budget, logits16 / 8);
  EXPECT_EQ(p.info.chunk_cols, xent::linear::kWideCols);
  EXPECT_LT(p.total, 224 * kMiB) << "the Transformers step peaked at Liger's with 224 MiB";
  LinearOptions given;
  given.max_scratch_bytes = logits16 / 8;
  const Plan q = make_plan(s, given);
  EXPECT_EQ(q.info.schedule, LinearSchedule::lean);
  EXPECT_GT(q.info.chunk_cols, xent::linear::kWideCols) << "a budget given is spent";
  EXPECT_GT(q.total, p.total);
  EXPECT_LE(q.total, q.info.budget);
  const Plan many = make_plan(step(1, 128256, 65536, 2048), LinearOptions{});
  EXPECT_EQ(many.info.schedule, LinearSchedule::fast);
}

TEST(LinearPlan, FastWhereTheBudgetHoldsIt) {
  // 4 GiB holds the whole 16-bit gradient of every row (2 GiB at V 128256): one chunk, and no
  // fp32 accumulator of d_weight.
  LinearOptions big;
  big.max_scratch_bytes = size_t(4) << 30;
  const Plan p = make_plan(step(1, 128256), big);
  EXPECT_EQ(p.info.schedule, LinearSchedule::fast);
  EXPECT_EQ(p.info.chunks, 1);
  EXPECT_EQ(p.bytes[xent::linear::kDWeight], 0u);
  EXPECT_LE(p.total, big.max_scratch_bytes);
  // d_weight in fp32 (Megatron's main_grad): fast needs no accumulator, so a budget that holds
  // its chunks of 1024 rows takes it.
  Shape f32 = step(1, 128256);
  f32.d_weight_f32 = true;
  LinearOptions some;
  some.max_scratch_bytes = 600 * kMiB;
  const Plan q = make_plan(f32, some);
  EXPECT_EQ(q.info.schedule, LinearSchedule::fast);
  EXPECT_GE(q.info.chunk_rows, xent::linear::kFastRows);
  EXPECT_EQ(q.info.chunk_rows % q.sub_rows, 0) << "whole sub-chunks";
  EXPECT_LE(q.total, some.max_scratch_bytes);
}

TEST(LinearPlan, AskedScheduleAndChunks) {
  LinearOptions l;
  l.schedule = LinearSchedule::fast;
  l.max_scratch_bytes = size_t(2) << 30;  // d_weight's fp32 accumulator takes 1 GiB at TP 2
  const Plan p = make_plan(step(2, 64128), l);
  EXPECT_EQ(p.info.schedule, LinearSchedule::fast);
  EXPECT_LE(p.total, l.max_scratch_bytes);
  LinearOptions c;
  c.schedule = LinearSchedule::lean;
  c.chunk_cols = 1000;
  c.chunk_rows = 300;
  const Plan q = make_plan(step(2, 64128), c);
  EXPECT_EQ(q.info.chunk_cols, 1000);
  EXPECT_EQ(q.info.chunk_rows, 300);
  EXPECT_EQ(q.info.chunks, (64128 + 999) / 1000);
}

TEST(LinearPlan, SequenceParallelCountsEveryRanksRows) {
  Shape s = step(4, 32064, 2048);  // 2048 rows a rank, 8192 in all
  s.sequence_parallel = true;
  const Plan p = make_plan(s, LinearOptions{});
  EXPECT_EQ(p.info.schedule, LinearSchedule::lean);
  // The accumulator of d_hidden and the gathered hidden hold every rank's rows.
  EXPECT_EQ(p.bytes[xent::linear::kDHidden], size_t(8192) * 4096 * 4);
  EXPECT_EQ(p.bytes[xent::linear::kHidden], size_t(8192) * 4096 * 2);
  EXPECT_LE(p.total, p.info.budget);
}

TEST(LinearPlan, RefusalNamesWhatEachScheduleNeeds) {
  LinearOptions l;
  l.max_scratch_bytes = 100 * kMiB;  // below the fp32 accumulator of d_hidden alone (128 MiB)
  try {
    make_plan(step(1, 128256), l);
    ADD_FAILURE() << "no refusal";
  } catch (const xent::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("LinearOptions::max_scratch_bytes = 104857600"), std::string::npos) << m;
    EXPECT_NE(m.find("fast needs"), std::string::npos) << m;
    EXPECT_NE(m.find("lean needs"), std::string::npos) << m;
  }
  LinearOptions old;  // the former name names itself
  old.max_chunk_bytes = 1000;
  old.schedule = LinearSchedule::lean;
  try {
    make_plan(step(1, 128256), old);
    ADD_FAILURE() << "no refusal";
  } catch (const xent::Error& e) {
    EXPECT_NE(std::string(e.what()).find("LinearOptions::max_chunk_bytes = 1000"),
              std::string::npos);
  }
  // fast asked for under the default budget (its fp32 accumulator of d_weight, 1 GiB, is more
  // than an eighth of the logits): the message says the budget was the default and what to set.
  LinearOptions fast;
  fast.schedule = LinearSchedule::fast;
  try {
    make_plan(step(2, 64128), fast);
    ADD_FAILURE() << "no refusal";
  } catch (const xent::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("LinearOptions::max_scratch_bytes = 0: the default budget ("),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("too small for schedule fast"), std::string::npos) << m;
    EXPECT_NE(m.find("set max_scratch_bytes to at least "), std::string::npos) << m;
    EXPECT_EQ(m.find("leave it 0"), std::string::npos) << m;  // it is 0
  }
  fast.max_scratch_bytes = 100 * kMiB;  // given: raise it
  try {
    make_plan(step(2, 64128), fast);
    ADD_FAILURE() << "no refusal";
  } catch (const xent::Error& e) {
    EXPECT_NE(std::string(e.what()).find("104857600: too small for schedule fast"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("raise it to at least "), std::string::npos) << e.what();
  }
}

TEST(LinearPlan, NoRowsAndNoGradients) {
  EXPECT_LE(make_plan(step(1, 128256, 0), LinearOptions{}).total,
            xent::linear::default_budget(step(1, 128256, 0)));
  Shape eval = step(1, 128256);
  eval.gradients = false;  // grad_mode none: statistics only
  const Plan p = make_plan(eval, LinearOptions{});
  EXPECT_EQ(p.bytes[xent::linear::kGrad], 0u);
  EXPECT_EQ(p.bytes[xent::linear::kDHidden], 0u);
  EXPECT_LE(p.total, p.info.budget);
}

}  // namespace

namespace {

// The epilogue engine (every rank can run it): lean takes it, with no fp32 logits in the sweep:
// one gradient GEMM over every row per chunk (chunk_rows = rows) and wider chunks within the same
// budget; forward's fp32 logits over every row in the sweep's idle buffers. Fast, a forward
// without gradients, and a shape whose ranks cannot run it keep cuBLASLt; gemm = cublaslt is
// honoured.
TEST(LinearPlan, EpilogueEngineTakesLeanWithoutFp32Logits) {
  for (int tp : {1, 2, 4}) {
    SCOPED_TRACE("TP " + std::to_string(tp));
    Shape s = step(tp, 128256 / tp);
    const Plan cublaslt = make_plan(s, LinearOptions{});
    EXPECT_EQ(cublaslt.info.gemm, xent::LinearGemm::cublaslt) << "no rank can run the epilogue";
    s.epilogue = true;
    const Plan p = make_plan(s, LinearOptions{});
    EXPECT_EQ(p.info.schedule, LinearSchedule::lean);
    EXPECT_EQ(p.info.gemm, xent::LinearGemm::epilogue);
    EXPECT_EQ(p.info.budget, cublaslt.info.budget);
    EXPECT_LE(p.total, p.info.budget);
    EXPECT_EQ(p.info.chunk_rows, s.rows_all());
    EXPECT_EQ(p.stats_rows, s.rows_all());
    EXPECT_GE(p.stats_cols, p.info.chunk_cols) << "forward's partials in the sweep's buffers";
    EXPECT_GE(p.info.chunk_cols, cublaslt.info.chunk_cols) << "the fp32 block's bytes freed";
    EXPECT_EQ(p.info.chunk_cols % xent::linear::kEpilogueCols, 0)
        << "no chunk ends inside the gradient GEMM's tiles";
    if (tp == 1) EXPECT_EQ(p.info.chunk_cols, xent::linear::kWideCols) << "the budget holds them";
    EXPECT_LT(p.bytes[xent::linear::kLogits], cublaslt.bytes[xent::linear::kLogits]);
    LinearOptions forced;
    forced.gemm = xent::LinearGemm::cublaslt;
    EXPECT_EQ(make_plan(s, forced).info.gemm, xent::LinearGemm::cublaslt);
    Shape forward_only = s;
    forward_only.gradients = false;
    EXPECT_EQ(make_plan(forward_only, LinearOptions{}).info.gemm, xent::LinearGemm::cublaslt);
    LinearOptions fast;
    fast.schedule = LinearSchedule::fast;
    fast.max_scratch_bytes = size_t(8) << 30;
    EXPECT_EQ(make_plan(s, fast).info.gemm, xent::LinearGemm::cublaslt);
  }
}

// The statistics GEMM writes a partial record per row and 256-column tile, no logits: the
// buffers hold them at a few columns too (d_weight alone: no d_hidden accumulator to borrow), and
// the whole shard's at once at 8192 rows.
TEST(LinearPlan, EpilogueForwardHoldsThePartials) {
  for (int64_t widest : {1, 5, 200, 300, 128256})
    for (bool dh : {true, false}) {
      SCOPED_TRACE("widest " + std::to_string(widest) + (dh ? "" : ", d_weight alone"));
      Shape s = step(1, widest, 1000, 64);
      s.epilogue = true;
      s.d_hidden = dh;
      LinearOptions lopt;
      lopt.gemm = xent::LinearGemm::epilogue;
      const Plan p = make_plan(s, lopt);
      ASSERT_EQ(p.info.gemm, xent::LinearGemm::epilogue);
      using xent::linear::kDHidden, xent::linear::kGrad, xent::linear::kLogits;
      namespace sm90 = xent::linear::sm90;
      const size_t region = p.bytes[kLogits] + p.bytes[kGrad] + p.bytes[kDHidden];
      EXPECT_GE(region,
                size_t(sm90::stats_tiles(p.stats_cols)) * sm90::Partial::kFields * 4 * 1000);
      EXPECT_LE(p.total, p.info.budget);
    }
  Shape s = step(1, 128256);  // 8192 rows, hidden 4096: the whole shard's partials, 94 MiB
  s.epilogue = true;
  const Plan p = make_plan(s, LinearOptions{});
  EXPECT_EQ(p.stats_cols, 128256);
  EXPECT_EQ(p.stats_chunks, 1);
}

// gemm = epilogue with automatic schedule takes lean even where the budget holds fast; with
// schedule fast it is refused by name.
TEST(LinearPlan, EpilogueAskedFor) {
  Shape s = step(1, 128256);
  s.epilogue = true;
  LinearOptions l;
  l.gemm = xent::LinearGemm::epilogue;
  l.max_scratch_bytes = size_t(8) << 30;  // holds fast
  const Plan p = make_plan(s, l);
  EXPECT_EQ(p.info.schedule, LinearSchedule::lean);
  EXPECT_EQ(p.info.gemm, xent::LinearGemm::epilogue);
  l.schedule = LinearSchedule::fast;
  try {
    make_plan(s, l);
    ADD_FAILURE() << "gemm = epilogue with schedule = fast was planned";
  } catch (const xent::Error& e) {
    EXPECT_NE(std::string(e.what()).find("LinearOptions::gemm = epilogue with schedule = fast"),
              std::string::npos)
        << e.what();
  }
  LinearOptions bad;
  bad.gemm = static_cast<xent::LinearGemm>(7);
  EXPECT_THROW(make_plan(s, bad), xent::Error);
}

// A small hidden width (TorchTitan's Llama 3 debug model: H 256, V 128256 over 2 ranks, 8 x 2048
// tokens): d_weight's fp32 accumulator is small, so the default budget held fast's chunks of
// 1251 rows, but only with sub-chunks of one row, each a GEMM, a statistics pass and an
// all-gather of its own (17514 of them a step: 500 ms on two H200). The plan keeps sub-chunks of
// kSubRows rows, or of the whole chunk, and takes fewer rows a chunk instead.
TEST(LinearPlan, FastKeepsWholeSubChunks) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "replicated rows");
    Shape s = step(2, 64128, sp ? 8192 : 16384, 256);
    s.sequence_parallel = sp;
    s.epilogue = true;
    const auto whole = [&](const Plan& p) {
      const int64_t m = p.info.chunk_rows * (sp ? 2 : 1);
      EXPECT_GE(p.sub_rows, std::min(xent::linear::kSubRows, m))
          << "chunks of " << p.info.chunk_rows << " rows";
      EXPECT_LE(p.total, p.info.budget);
    };
    const Plan p = make_plan(s, LinearOptions{});
    if (p.info.schedule == LinearSchedule::fast) whole(p);
    LinearOptions fast;
    fast.schedule = LinearSchedule::fast;
    const Plan q = make_plan(s, fast);
    EXPECT_EQ(q.info.schedule, LinearSchedule::fast);
    whole(q);
    // A budget that holds no sub-chunk of kSubRows rows: chunks of one sub-chunk each.
    fast.max_scratch_bytes = 110 * kMiB;
    const Plan tight = make_plan(s, fast);
    EXPECT_EQ(tight.info.schedule, LinearSchedule::fast);
    EXPECT_LT(tight.sub_rows, xent::linear::kSubRows);
    whole(tight);
  }
}

}  // namespace
