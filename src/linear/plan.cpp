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

ChunkPlan plan_chunks(const LinearOptions& lopt, int64_t rows, int ranks, int64_t widest) {
  check_options(lopt);
  ChunkPlan plan;
  plan.ranks = lopt.sequence_parallel ? ranks : 1;
  if (lopt.chunk_rows > 0) {
    plan.rows = lopt.chunk_rows;
  } else {
    // A row of logits and a row of their gradient, fp32, of the widest shard: every rank's
    // chunk then fits, and every rank computes the same rows.
    const size_t row_bytes = 2 * sizeof(float) * static_cast<size_t>(widest) * plan.ranks;
    plan.rows = static_cast<int64_t>(lopt.max_chunk_bytes / row_bytes);
    if (plan.rows < 1)
      fail("LinearOptions::max_chunk_bytes = " + std::to_string(lopt.max_chunk_bytes) +
           ": must hold at least one row of logits and their gradient in fp32 (" +
           std::to_string(row_bytes) + " bytes: 8 x " + std::to_string(widest) +
           " columns of the widest shard" +
           (plan.ranks > 1 ? " x " + std::to_string(plan.ranks) + " ranks" : std::string()) +
           "), or set chunk_rows");
  }
  plan.rows = std::min(plan.rows, std::max<int64_t>(rows, 1));
  plan.chunks = (rows + plan.rows - 1) / plan.rows;
  return plan;
}

}  // namespace xent::linear
