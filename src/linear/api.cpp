// The fused lm head's public entry points: the checks of the call (check.h), the ranks'
// agreement and the chunk plan, then the backend's chunk loop (the CPU's, for now).
#include <string>

#include "error.h"
#include "linear/check.h"
#include "linear/cpu.h"
#include "xent/linear.h"

namespace xent {

namespace {

void run(const Group& group, linear::Pass pass, MatrixView hidden, MatrixView weight,
         TargetsView targets, const float* lse, const float* grad_output, const Options& opt,
         const LinearOptions& lopt, const LinearOutputs& out) {
  const char* name = pass == linear::Pass::forward ? "linear_forward" : "linear_backward";
  if (group.backend() != Backend::cpu)
    fail(std::string(name) +
         ": the fused lm head is not yet on the CUDA backend (CPU groups only, for now)");
  const linear::Call call = linear::check_call(pass, hidden, weight, targets, opt, lopt, out, lse);
  const linear::Agreed agreed = linear::agree(group, call, opt, lopt);
  linear::run_cpu(group, call, agreed, pass, lse, grad_output);
}

}  // namespace

void linear_forward(const Group& group, MatrixView hidden, MatrixView weight, TargetsView targets,
                    const Options& opt, const LinearOptions& lopt, const LinearOutputs& out,
                    cudaStream_t) {
  run(group, linear::Pass::forward, hidden, weight, targets, nullptr, nullptr, opt, lopt, out);
}

void linear_backward(const Group& group, MatrixView hidden, MatrixView weight, TargetsView targets,
                     const float* lse, const float* grad_output, const Options& opt,
                     const LinearOptions& lopt, const LinearOutputs& out, cudaStream_t) {
  run(group, linear::Pass::backward, hidden, weight, targets, lse, grad_output, opt, lopt, out);
}

}  // namespace xent
