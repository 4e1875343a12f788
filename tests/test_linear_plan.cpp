// The fused lm head's chunk plan (src/linear/plan.h), on the shapes of the H100 bench: where one
// chunk of every row beats d_weight's fp32 accumulator, what a sub-chunk holds, and that a chunk
// and its sub-chunk stay within max_chunk_bytes. The plan is internal: its effect on the numbers
// is tested in test_linear.cpp (chunk sizes never change the loss bits), its effect on speed in
// bench/linear_side_by_side.py.
#include <gtest/gtest.h>

#include <string>

#include "linear/plan.h"

namespace {

using xent::Backend;
using xent::DType;
using xent::LinearOptions;
using xent::linear::chunk_cost;
using xent::linear::ChunkCost;
using xent::linear::ChunkPlan;
using xent::linear::kSubRows;
using xent::linear::plan_chunks;

constexpr int64_t kH = 4096;

// 16-bit inputs on CUDA with a 16-bit d_weight over a [V, kH] shard: its fp32 accumulator.
ChunkCost bf16_cost(int64_t V) {
  return chunk_cost(Backend::cuda, DType::bf16, sizeof(float) * static_cast<size_t>(V * kH));
}

// Bytes of a chunk of 16-bit gradient and its fp32 sub-chunk, for the widest shard.
size_t chunk_bytes(const ChunkPlan& p, int64_t V) {
  return static_cast<size_t>(p.logits_rows() * V * 2 + p.sub_rows * V * 4);
}

TEST(LinearPlan, OneChunkWhereTheWholeGradientFitsTheAccumulator) {
  // 8192 rows of a 16-bit gradient take 2 x 8192 x V bytes, the accumulator 4 x 4096 x V: equal.
  for (int64_t V : {16032, 64128, 128256}) {
    SCOPED_TRACE("V " + std::to_string(V));
    const ChunkPlan p = plan_chunks(LinearOptions{}, 8192, 1, V, bf16_cost(V));
    EXPECT_EQ(p.chunks, 1);
    EXPECT_EQ(p.rows, 8192);
    // The sub-chunk takes the whole budget, in whole 128-row tiles.
    const int64_t fit = static_cast<int64_t>((size_t(1) << 30) / (4 * V));
    EXPECT_EQ(p.sub_rows, std::min<int64_t>(8192, fit - fit % 128));
  }
}

TEST(LinearPlan, SeveralChunksPastTheAccumulator) {
  const int64_t V = 128256;
  for (int64_t rows : {2 * kH + 1, int64_t(32768)}) {
    SCOPED_TRACE("rows " + std::to_string(rows));
    const LinearOptions lopt{};
    const ChunkPlan p = plan_chunks(lopt, rows, 1, V, bf16_cost(V));
    EXPECT_GT(p.chunks, 1);
    EXPECT_LE(chunk_bytes(p, V), lopt.max_chunk_bytes);
    EXPECT_LE(p.sub_rows, kSubRows);
    EXPECT_EQ(p.sub_rows % 128, 0);
    EXPECT_EQ(p.rows % p.sub_rows, 0) << "a short sub-chunk in every chunk";
    EXPECT_EQ(p.chunks, (rows + p.rows - 1) / p.rows);
  }
}

TEST(LinearPlan, NoAccumulatorNoWholeChunk) {
  // d_weight in f32 (or not computed): chunks of the budget, however few the rows.
  const int64_t V = 128256;
  const ChunkPlan p =
      plan_chunks(LinearOptions{}, 8192, 1, V, chunk_cost(Backend::cuda, DType::bf16, 0));
  EXPECT_GT(p.chunks, 1);
  EXPECT_LE(chunk_bytes(p, V), LinearOptions{}.max_chunk_bytes);
  // The CPU backend: fp32 logits and gradient, 8 bytes per logit, no sub-chunk.
  const ChunkPlan c =
      plan_chunks(LinearOptions{}, 8192, 1, V, chunk_cost(Backend::cpu, DType::bf16, 0));
  EXPECT_EQ(c.sub_rows, 0);
  EXPECT_EQ(c.rows, static_cast<int64_t>((size_t(1) << 30) / (8 * V)));
}

TEST(LinearPlan, ChunkRowsAndSequenceParallelism) {
  const int64_t V = 16032;
  LinearOptions lopt;
  lopt.chunk_rows = 300;  // asked for: kept, even where one chunk would be leaner
  const ChunkPlan p = plan_chunks(lopt, 8192, 1, V, bf16_cost(V));
  EXPECT_EQ(p.rows, 300);
  EXPECT_EQ(p.sub_rows, 256);  // whole tiles: 256 + 44
  // Sequence parallelism over 4 ranks: a chunk holds every rank's rows, in the budget.
  lopt = LinearOptions{};
  lopt.sequence_parallel = true;
  const ChunkPlan s = plan_chunks(lopt, 8192, 4, V, bf16_cost(V));
  EXPECT_EQ(s.ranks, 4);
  EXPECT_GT(s.chunks, 1);  // 4 x 8192 rows: past the accumulator
  EXPECT_LE(chunk_bytes(s, V), lopt.max_chunk_bytes);
  // No rows: no chunk.
  EXPECT_EQ(plan_chunks(LinearOptions{}, 0, 1, V, bf16_cost(V)).chunks, 0);
}

}  // namespace
