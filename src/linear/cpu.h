// The CPU backend of the fused lm head's fast schedule: its steps over host memory (cpu_fast.cpp,
// run by fast.cpp; docs/linear.md).
#pragma once

#include "linear/check.h"

namespace xent::linear {

// Forward: each chunk's logits, statistics, exchange and finalize, and with grad_mode fused its
// gradient and the two GEMMs that consume it. Backward (deferred): each chunk's logits again and
// its gradient from forward's `lse`, grad_output folded in, and the two GEMMs.
void run_cpu(const Group& group, const Call& call, const Agreed& agreed, Pass pass,
             const float* lse, const float* grad_output);

}  // namespace xent::linear
