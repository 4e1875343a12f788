// The lean schedule's loop, over any backend's steps (lean.cpp).
#pragma once

#include "linear/check.h"
#include "linear/steps.h"

namespace xent::linear {

void run_lean(LeanSteps& s, const Call& call, const Plan& plan, Pass pass);

// The backends' steps, run by run_lean: cpu_steps.cpp, cuda_steps.cpp.
void run_lean_cpu(const Group& group, const Call& call, const Plan& plan, Pass pass,
                  const float* lse, const float* grad_output);
void run_lean_cuda(const Group& group, const Call& call, const Plan& plan, Pass pass,
                   const float* lse, const float* grad_output, cudaStream_t stream);

}  // namespace xent::linear
