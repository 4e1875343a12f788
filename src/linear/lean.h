// The lean schedule's loop, over any backend's steps (lean.cpp).
#pragma once

#include "linear/check.h"
#include "linear/steps.h"

namespace xent::linear {

void run_lean(LeanSteps& s, const Call& call, const Plan& plan, Pass pass);

// A block of rows x cols of the chunk's logits from column v0 of this rank's shard, as the logits
// path sees a shard (`all`: the problem over every row): all columns real (a chunk stops at the
// shard's real columns); a chunk of none has one column that is never read.
core::Problem lean_chunk_problem(const core::Problem& all, int64_t rows, int64_t v0, int64_t cols,
                                 int64_t row_stride);

// Where the lean schedule's finalize writes the per-row outputs of its M rows: the call's own,
// or with sequence parallelism (every rank's rows) `rows` [3][M] (lse, the loss of reduction
// none, z-loss), and `argmax` [M] where argmax is wanted there or for the accuracy alone; each
// backend then copies this rank's rows of them out.
struct LeanRowOutputs {
  float* lse;
  Outputs o;
};
LeanRowOutputs lean_row_outputs(const Call& call, int64_t M, float* rows, int64_t* argmax);

// The backends' steps, run by run_lean: cpu_lean.cpp, cuda_lean.cpp.
void run_lean_cpu(const Group& group, const Call& call, const Plan& plan, Pass pass,
                  const float* lse, const float* grad_output);
void run_lean_cuda(const Group& group, const Call& call, const Plan& plan, Pass pass,
                   const float* lse, const float* grad_output, cudaStream_t stream);

}  // namespace xent::linear
