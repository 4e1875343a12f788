#include "linear/plan.h"

#include <algorithm>
#include <string>

#include "error.h"

namespace xent::linear {

void check_options(const LinearOptions& lopt) {
  if (lopt.chunk_rows < 0)
    fail("LinearOptions::chunk_rows = " + std::to_string(lopt.chunk_rows) +
         ": must be >= 1, or 0 (rows from max_chunk_bytes)");
}

ChunkCost chunk_cost(Backend backend, DType inputs) {
  if (backend == Backend::cpu) return ChunkCost{2 * sizeof(float), 0};
  if (inputs == DType::f32) return ChunkCost{sizeof(float), 0};
  return ChunkCost{dtype_size(inputs), sizeof(float)};
}

ChunkPlan plan_chunks(const LinearOptions& lopt, int64_t rows, int ranks, int64_t widest,
                      ChunkCost cost) {
  check_options(lopt);
  ChunkPlan plan;
  plan.ranks = lopt.sequence_parallel ? ranks : 1;
  // Counted for the widest shard: every rank's chunk then fits, and every rank computes the same
  // rows.
  const size_t w = static_cast<size_t>(widest);
  size_t fixed = 0;
  if (cost.sub_logit > 0) {
    plan.sub_rows =
        std::max<int64_t>(1, static_cast<int64_t>(lopt.max_chunk_bytes / 4 / (cost.sub_logit * w)));
    // Whole tiles of the GEMM's rows (128): 130 rows would take a second row of tiles for 2.
    if (plan.sub_rows > 128) plan.sub_rows -= plan.sub_rows % 128;
    fixed = static_cast<size_t>(plan.sub_rows) * cost.sub_logit * w;
  }
  if (lopt.chunk_rows > 0) {
    plan.rows = lopt.chunk_rows;
  } else {
    const size_t row_bytes = cost.per_logit * w * plan.ranks;
    plan.rows = lopt.max_chunk_bytes > fixed
                    ? static_cast<int64_t>((lopt.max_chunk_bytes - fixed) / row_bytes)
                    : 0;
    if (plan.rows < 1)
      fail("LinearOptions::max_chunk_bytes = " + std::to_string(lopt.max_chunk_bytes) +
           ": must hold at least one row of logits and their gradient (" +
           std::to_string(row_bytes + fixed) +
           " bytes on this backend: " + std::to_string(cost.per_logit) + " x " +
           std::to_string(widest) + " columns of the widest shard" +
           (plan.ranks > 1 ? " x " + std::to_string(plan.ranks) + " ranks" : std::string()) +
           (fixed > 0 ? " + " + std::to_string(fixed) + " for the fp32 logits of a sub-chunk"
                      : std::string()) +
           "), or set chunk_rows");
  }
  plan.rows = std::min(plan.rows, std::max<int64_t>(rows, 1));
  plan.chunks = (rows + plan.rows - 1) / plan.rows;
  return plan;
}

}  // namespace xent::linear
