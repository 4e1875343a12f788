// The fast schedule (docs/linear.md, "Schedules"): chunks of rows; each chunk's logits made
// once, a sub-chunk of rows at a time (16-bit inputs on CUDA), their statistics exchanged and
// finalized as the logits path's (forward), their gradient made from the lse, and the chunk's
// gradient consumed by the d_hidden and d_weight GEMMs at once. Three GEMMs. The same steps on
// every backend (steps.h).
#include "linear/fast.h"

#include <algorithm>

namespace xent::linear {

void run_fast(FastSteps& s, const Call& call, const Plan& plan, Pass pass) {
  // CPU and fp32 inputs: one sub-chunk of the whole chunk (plan.h).
  const int64_t sub = plan.sub_rows > 0 ? plan.sub_rows : std::max<int64_t>(plan.logits_rows(), 1);
  s.begin();
  for (int64_t i = 0; i < plan.info.chunks; ++i) {
    const int64_t r0 = plan.first(i), c = plan.count(i, call.p.rows);
    const int64_t m = c * plan.ranks_in_chunk;
    s.rows(r0, c);
    for (int64_t s0 = 0; s0 < m; s0 += sub) {
      const int64_t k = std::min(sub, m - s0);
      s.logits(s0, k);
      if (pass == Pass::forward) s.finalize(s0, k);
      if (call.gradients) s.gradient(s0, k);
    }
    if (pass == Pass::forward) s.own_rows(r0, c);
    if (!call.gradients) continue;
    if (call.out.d_hidden.data != nullptr) s.d_hidden(i, r0, c);
    if (call.out.d_weight.data != nullptr) s.d_weight(i);
  }
  s.end();
}

}  // namespace xent::linear
