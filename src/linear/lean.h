// The lean schedule's loop, over any backend's steps (lean.cpp).
#pragma once

#include "linear/check.h"
#include "linear/steps.h"

namespace xent::linear {

void run_lean(LeanSteps& s, const Call& call, const Plan& plan, Pass pass);

// Where the lean schedule's finalize writes the per-row outputs of its M rows: the call's own,
// or with sequence parallelism (every rank's rows) `rows` [3][M] (lse, the loss of reduction
// none, z-loss), and `argmax` [M] where argmax is wanted there or for the accuracy alone; each
// backend then copies this rank's rows of them out.
struct LeanRowOutputs {
  float* lse;
  Outputs o;
};
LeanRowOutputs lean_row_outputs(const Call& call, int64_t M, float* rows, int64_t* argmax);

// The backends' steps, run by run_lean: cpu_steps.cpp, cuda_steps.cpp.
void run_lean_cpu(const Group& group, const Call& call, const Plan& plan, Pass pass,
                  const float* lse, const float* grad_output);
void run_lean_cuda(const Group& group, const Call& call, const Plan& plan, Pass pass,
                   const float* lse, const float* grad_output, cudaStream_t stream);

}  // namespace xent::linear
