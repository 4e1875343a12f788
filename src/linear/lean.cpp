// The lean schedule (docs/linear.md, "Schedules"): forward keeps each row's statistics only,
// made chunk by chunk of the vocabulary (each chunk's records merged with the other chunks' and
// ranks' as the logits path merges ranks); the gradient sweeps the vocabulary again, making each
// chunk's logits anew over every row, so that the chunk's d_weight rows are complete (rounded
// once, no [V, H] accumulator) and its part of d_hidden goes into an fp32 [rows, H] accumulator.
// Four GEMMs. The same steps on every backend (steps.h).
#include "linear/lean.h"

#include <algorithm>

namespace xent::linear {

void run_lean(LeanSteps& s, const Call& call, const Plan& plan, Pass pass) {
  const int64_t rows = call.p.rows * (call.sequence_parallel ? plan.ranks_in_chunk : 1);
  const int64_t rb = std::max<int64_t>(plan.info.chunk_rows, 1);
  const int64_t vc = plan.info.chunk_cols, real = call.p.real_cols;
  // Chunk c's columns of this rank's shard: none past its real columns (the ranks make the same
  // chunks, counted for the widest shard).
  const auto columns = [&](int64_t c) { return std::clamp<int64_t>(real - c * vc, 0, vc); };
  s.begin();
  if (pass == Pass::forward) {
    // The statistics in their own chunks (plan.h: as wide as the sweep's buffers allow).
    const int64_t sc = plan.stats_cols, sr = std::max<int64_t>(plan.stats_rows, 1);
    s.phase(/*stats=*/true);
    for (int64_t c = 0; c < plan.stats_chunks; ++c) {
      const int64_t v0 = c * sc, cols = std::clamp<int64_t>(real - v0, 0, sc);
      for (int64_t r0 = 0; r0 < rows; r0 += sr) {
        const int64_t n = std::min(sr, rows - r0);
        if (cols > 0) s.logits(r0, n, v0, cols);
        s.stats(c, r0, n, v0, cols);
      }
    }
    s.finalize();
  }
  if (!call.gradients) return;
  s.phase(/*stats=*/false);
  bool first = true;
  for (int64_t c = 0; c < plan.info.chunks; ++c) {
    const int64_t v0 = c * vc, cols = columns(c);
    if (cols == 0) break;
    for (int64_t r0 = 0; r0 < rows; r0 += rb) {
      const int64_t n = std::min(rb, rows - r0);
      s.logits(r0, n, v0, cols);
      s.gradient(r0, n, v0, cols);
    }
    if (call.out.d_weight.data != nullptr) s.d_weight(v0, cols);
    if (call.out.d_hidden.data != nullptr) s.d_hidden(v0, cols, first);
    first = false;
  }
  s.end(!first);
}

core::Problem lean_chunk_problem(const core::Problem& all, int64_t rows, int64_t v0, int64_t cols,
                                 int64_t row_stride) {
  core::Problem pc = all;
  pc.rows = rows;
  pc.cols = std::max<int64_t>(cols, 1);
  pc.row_stride = row_stride;
  pc.vocab_start = all.vocab_start + v0;
  pc.real_cols = cols;
  return pc;
}

LeanRowOutputs lean_row_outputs(const Call& call, int64_t M, float* rows, int64_t* argmax) {
  const LinearOutputs& out = call.out;
  const bool sp = call.sequence_parallel, none = call.p.reduction == Reduction::none;
  LeanRowOutputs r;
  r.lse = sp || out.lse == nullptr ? rows : out.lse;
  r.o.loss = none && sp ? rows + M : out.loss;
  r.o.z_loss = out.z_loss == nullptr ? nullptr : sp ? rows + 2 * M : out.z_loss;
  r.o.argmax = sp || out.argmax == nullptr ? argmax : out.argmax;
  r.o.accuracy = out.accuracy;
  return r;
}

}  // namespace xent::linear
