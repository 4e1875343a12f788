// The fused lm head's public entry points: the checks of the call (check.h), the ranks'
// agreement and the chunk plan, then the backend's chunk loop.
#include "device_scope.h"
#include "error.h"
#include "linear/check.h"
#include "linear/cpu.h"
#include "linear/cuda.h"
#include "xent/linear.h"

namespace xent {

namespace {

void run(const Group& group, linear::Pass pass, MatrixView hidden, MatrixView weight,
         TargetsView targets, const float* lse, const float* grad_output, const Options& opt,
         const LinearOptions& lopt, const LinearOutputs& out, cudaStream_t stream) {
  const linear::Call call = linear::check_call(pass, hidden, weight, targets, opt, lopt, out, lse);
  const DeviceScope on_device(group);
  const linear::Agreed agreed = linear::agree(group, call, opt, lopt);
  if (group.backend() == Backend::cpu)
    linear::run_cpu(group, call, agreed, pass, lse, grad_output);
  else
    linear::run_cuda(group, call, agreed, pass, lse, grad_output, stream);
}

}  // namespace

void linear_forward(const Group& group, MatrixView hidden, MatrixView weight, TargetsView targets,
                    const Options& opt, const LinearOptions& lopt, const LinearOutputs& out,
                    cudaStream_t stream) {
  run(group, linear::Pass::forward, hidden, weight, targets, nullptr, nullptr, opt, lopt, out,
      stream);
}

void linear_backward(const Group& group, MatrixView hidden, MatrixView weight, TargetsView targets,
                     const float* lse, const float* grad_output, const Options& opt,
                     const LinearOptions& lopt, const LinearOutputs& out, cudaStream_t stream) {
  run(group, linear::Pass::backward, hidden, weight, targets, lse, grad_output, opt, lopt, out,
      stream);
}

}  // namespace xent
