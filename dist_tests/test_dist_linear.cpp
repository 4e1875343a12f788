// The fused lm head (xent/linear.h) on 2 to 4 ranks of the group dist_main.cpp sets up (CPU over
// MPI, or CUDA: ranks sharing a GPU, or NCCL): uneven shards, padding on the last rank, with and
// without sequence parallelism, fused and deferred, each rank's outputs against the float64
// reference of the whole problem (tests/linear_harness.h, which stages CUDA buffers).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xent/linear.h>

#include <string>
#include <vector>

#include "dist_harness.h"
#include "linear_harness.h"

namespace xdist {
namespace {

using xtest::LinearCase;
using xtest::run_linear;

// Every backend: on CUDA (ranks sharing a GPU through xent::mpi::cuda_group, or one GPU each
// over NCCL) run_linear stages its buffers on the device.
using DistLinear = Dist;

// 12 rows per rank (chunks of 5: the last holds 2), uneven shards of 90 columns, the last
// rank's last 5 are padding.
LinearCase make(int ranks, bool sp, GradMode mode, uint64_t seed) {
  LinearCase c;
  c.rows = 12;
  c.H = 20;
  c.widths = xtest::uneven_widths(90, ranks);
  c.vocab_size = 85;
  c.lopt.sequence_parallel = sp;
  c.lopt.chunk_rows = 5;
  c.opt.grad_mode = mode;
  c.p_ignore = 0.2;
  c.seed = seed;
  return c;
}

std::string name(bool sp, GradMode mode) {
  return std::string(sp ? "sequence parallel, " : "") + xent::to_string(mode);
}

// What every rank holds alike is the same to the bit on each: the reduced loss, and without
// sequence parallelism every row's loss, lse and d_hidden.
void expect_same_bits(const LinearCase& c, const xtest::LinearGot& got) {
  const bool sp = c.lopt.sequence_parallel;
  if (c.opt.reduction != Reduction::none || !sp)
    EXPECT_TRUE(same_on_all_ranks(got.loss)) << "the ranks' losses differ (bitwise)";
  if (sp) return;
  EXPECT_TRUE(same_on_all_ranks(got.lse)) << "the ranks' lse differ (bitwise)";
  EXPECT_TRUE(same_on_all_ranks(got.d_hidden)) << "the ranks' d_hidden differ (bitwise)";
}

TEST_F(DistLinear, UnevenShardsWithPadding) {
  for (bool sp : {false, true})
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      SCOPED_TRACE(name(sp, mode));
      const LinearCase c = make(size(), sp, mode, 301);
      expect_same_bits(c, run_linear(g(), c));
    }
}

TEST_F(DistLinear, AllOptionsReductionNone) {
  for (bool sp : {false, true})
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      SCOPED_TRACE(name(sp, mode));
      LinearCase c = make(size(), sp, mode, 302);
      c.opt.reduction = Reduction::none;
      c.opt.label_smoothing = 0.1f;
      c.opt.z_loss = 0.01f;
      c.opt.softcap = 4.0f;
      c.opt.compute_accuracy = true;
      if (mode == GradMode::deferred)  // one per row of the whole problem
        for (int64_t i = 0; i < c.rows * (sp ? size() : 1); ++i)
          c.grad_output.push_back(0.2 + 0.25 * (i % 4));
      expect_same_bits(c, run_linear(g(), c));
    }
}

TEST_F(DistLinear, Bf16SumGradScaleAccumulate) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(name(sp, GradMode::fused));
    LinearCase c = make(size(), sp, GradMode::fused, 303);
    c.dtype = DType::bf16;
    c.grad_dtype = DType::bf16;
    c.opt.reduction = Reduction::sum;
    c.opt.grad_scale = 0.25f;
    // 16-bit d_hidden's sum over the ranks (CUDA: reduce-scatter, rounding, all-gather where the
    // rows split evenly, else all-reduce): chunks of 5 rows and of 4, strided and contiguous rows.
    for (int64_t chunk_rows : {5, 4})
      for (int64_t stride_extra : {3, 0}) {
        SCOPED_TRACE("chunk_rows " + std::to_string(chunk_rows) + ", stride_extra " +
                     std::to_string(stride_extra));
        c.lopt.chunk_rows = chunk_rows;
        c.stride_extra = stride_extra;
        expect_same_bits(c, run_linear(g(), c));
      }
    c.grad_dtype = DType::f32;  // the accumulation of Megatron's main_grad
    c.lopt.accumulate_d_weight = true;
    run_linear(g(), c);
  }
}

TEST_F(DistLinear, ChunksFromBytesAndTheLossBitwise) {
  // Chunks of 3 rows (fast; lean: blocks of 3 rows), then of 100: the reduced loss is the same to
  // the bit.
  for (bool sp : {false, true}) {
    SCOPED_TRACE(name(sp, GradMode::deferred));
    LinearCase c = make(size(), sp, GradMode::deferred, 304);
    c.grad_output = {0.5};
    c.lopt.chunk_rows = 3;
    const std::vector<float> chunked = run_linear(g(), c).loss;
    c.lopt.chunk_rows = 100;
    EXPECT_EQ(run_linear(g(), c).loss, chunked) << "the loss depends on the chunk size";
  }
}

TEST_F(DistLinear, ARankOfPaddingOnly) {
  // The last rank's shard lies wholly past vocab_size: no logits of its own, zero d_weight.
  for (bool sp : {false, true}) {
    SCOPED_TRACE(name(sp, GradMode::fused));
    LinearCase c = make(size(), sp, GradMode::fused, 305);
    c.vocab_size = 90 - c.widths.back();
    expect_same_bits(c, run_linear(g(), c));
  }
}

// Where the ranks' calls disagree, every rank throws (none hangs), naming what differs.
TEST_F(DistLinear, RanksDisagree) {
  const auto message_of = [&](const LinearCase& c) {
    try {
      run_linear(g(), c);
    } catch (const xent::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  LinearCase c = make(size(), true, GradMode::fused, 306);
  c.rows = rank() == size() - 1 ? 11 : 12;
  EXPECT_THAT(message_of(c),
              HasSubstr("with sequence_parallel every rank must hold the same number of rows"));
  c = make(size(), false, GradMode::fused, 306);
  c.lopt.chunk_rows = rank() == 0 ? 4 : 5;
  EXPECT_THAT(message_of(c), HasSubstr("every rank must make the same chunks"));
  // d_hidden's sum over the ranks takes its collectives from its dtype: one dtype on every rank.
  c = make(size(), false, GradMode::fused, 306);
  c.dtype = DType::bf16;
  c.grad_dtype = rank() == 0 ? DType::f32 : DType::bf16;
  EXPECT_THAT(message_of(c), HasSubstr("every rank gives it the same dtype"));
  run_linear(g(), make(size(), true, GradMode::deferred, 307));  // the group still works
}

}  // namespace
}  // namespace xdist
