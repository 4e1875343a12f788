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

ChunkCost chunk_cost(Backend backend, DType inputs, size_t accumulator) {
  if (backend == Backend::cpu) return ChunkCost{2 * sizeof(float), 0, 0};
  if (inputs == DType::f32) return ChunkCost{sizeof(float), 0, 0};
  return ChunkCost{dtype_size(inputs), sizeof(float), accumulator};
}

namespace {

// The most rows of `row_bytes` each in `bytes`, at most `most`, in whole 128-row tiles where
// there are more.
int64_t rows_in(size_t bytes, size_t row_bytes, int64_t most) {
  int64_t r = std::min<int64_t>(most, static_cast<int64_t>(bytes / row_bytes));
  if (r > 128) r -= r % 128;
  return r;
}

// Where max_chunk_bytes holds no row: the bytes one row takes, the chunk's (`chunk`: 16-bit
// gradient or fp32 logits, times the ranks with sequence parallelism) and a sub-chunk's. Built
// only on failure: the plan runs on every call.
[[noreturn]] void no_row(const LinearOptions& lopt, ChunkCost cost, int64_t widest, int64_t ranks,
                         bool chunk) {
  const std::string w = std::to_string(widest);
  const size_t per_row =
      static_cast<size_t>(widest) *
      ((chunk ? cost.per_logit * static_cast<size_t>(ranks) : 0) + cost.sub_logit);
  std::string what;
  if (chunk)
    what = std::to_string(cost.per_logit) + " x " + w + " columns of the widest shard" +
           (ranks > 1 ? " x " + std::to_string(ranks) + " ranks" : std::string());
  if (cost.sub_logit > 0)
    what += (chunk ? " + " : "") + std::to_string(cost.sub_logit) + " x " + w +
            " for the fp32 logits of a sub-chunk";
  fail("LinearOptions::max_chunk_bytes = " + std::to_string(lopt.max_chunk_bytes) +
       ": must hold at least one row of logits and their gradient (" + std::to_string(per_row) +
       " bytes on this backend: " + what + "), or set chunk_rows");
}

}  // namespace

ChunkPlan plan_chunks(const LinearOptions& lopt, int64_t rows, int ranks, int64_t widest,
                      ChunkCost cost) {
  check_options(lopt);
  ChunkPlan plan;
  plan.ranks = lopt.sequence_parallel ? ranks : 1;
  // Counted for the widest shard: every rank's chunk then fits, and every rank computes the same
  // rows.
  const size_t w = static_cast<size_t>(widest);
  const size_t row_bytes = cost.per_logit * w * static_cast<size_t>(plan.ranks);
  const size_t sub_row_bytes = cost.sub_logit * w;
  const size_t budget = lopt.max_chunk_bytes;
  const int64_t most = std::max<int64_t>(rows, 1);
  if (lopt.chunk_rows > 0) {
    plan.rows = std::min(lopt.chunk_rows, most);
    if (cost.sub_logit > 0)
      plan.sub_rows = std::max<int64_t>(
          1, rows_in(budget, sub_row_bytes, std::min(kSubRows, plan.logits_rows())));
  } else if (cost.sub_logit > 0 && cost.accumulator > 0 &&
             row_bytes * static_cast<size_t>(most) <= cost.accumulator) {
    plan.rows = most;
    plan.sub_rows = rows_in(budget, sub_row_bytes, plan.logits_rows());
    if (plan.sub_rows < 1) no_row(lopt, cost, widest, plan.ranks, /*chunk=*/false);
  } else {
    if (cost.sub_logit > 0)
      plan.sub_rows = rows_in(budget, sub_row_bytes + cost.per_logit * w,
                              std::min(kSubRows, most * plan.ranks));
    const size_t fixed = static_cast<size_t>(plan.sub_rows) * sub_row_bytes;
    plan.rows = budget > fixed ? static_cast<int64_t>((budget - fixed) / row_bytes) : 0;
    if (plan.rows < 1 || (cost.sub_logit > 0 && plan.sub_rows < 1))
      no_row(lopt, cost, widest, plan.ranks, /*chunk=*/true);
    plan.rows = std::min(plan.rows, most);
    // Whole sub-chunks where there are several chunks: a short one rereads the whole weight for
    // a few rows.
    const int64_t m = plan.logits_rows();
    if (plan.sub_rows > 0 && plan.rows < most && m > plan.sub_rows)
      plan.rows = std::max<int64_t>(1, (m - m % plan.sub_rows) / plan.ranks);
  }
  plan.chunks = (rows + plan.rows - 1) / plan.rows;
  return plan;
}

}  // namespace xent::linear
