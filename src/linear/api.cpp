// The fused lm head's public entry points: the checks of the call (check.h), the ranks'
// agreement and the plan (plan.h), then the schedule the plan chose, on the group's backend:
// fast (fast.cpp over cpu_fast.cpp or cuda_fast.cpp) or lean (lean.cpp over cpu_lean.cpp or
// cuda_lean.cpp): each schedule's loop is written once, over the backends' steps (steps.h).
#include <utility>

#include "device_scope.h"
#include "error.h"
#include "linear/check.h"
#include "linear/cpu.h"
#include "linear/cuda.h"
#include "linear/lean.h"
#include "xent/linear.h"

namespace xent {

namespace {

// Every buffer a kernel, GEMM or copy of the CUDA backend touches: host memory would fault there.
void check_placements(const Group& group, const Options& opt, MatrixView hidden, MatrixView weight,
                      TargetsView targets, const float* lse, const float* grad_output,
                      const LinearOutputs& out) {
  const std::pair<const void*, const char*> buffers[] = {{hidden.data, "hidden.data"},
                                                         {weight.data, "weight.data"},
                                                         {targets.data, "targets.data"},
                                                         {lse, "lse"},
                                                         {grad_output, "grad_output"},
                                                         {out.loss, "out.loss"},
                                                         {out.lse, "out.lse"},
                                                         {out.z_loss, "out.z_loss"},
                                                         {out.argmax, "out.argmax"},
                                                         {out.accuracy, "out.accuracy"},
                                                         {out.d_hidden.data, "out.d_hidden.data"},
                                                         {out.d_weight.data, "out.d_weight.data"}};
  for (const auto& [ptr, name] : buffers) check_placement(group, opt, ptr, name);
}

void run(const Group& group, linear::Pass pass, MatrixView hidden, MatrixView weight,
         TargetsView targets, const float* lse, const float* grad_output, const Options& opt,
         const LinearOptions& lopt, const LinearOutputs& out, cudaStream_t stream) {
  const linear::Call call = linear::check_call(pass, hidden, weight, targets, opt, lopt, out, lse);
  check_placements(group, opt, hidden, weight, targets, lse, grad_output, out);
  const DeviceScope on_device(group);
  const linear::Agreed agreed = linear::agree(group, call, opt, lopt, stream);
  if (out.plan != nullptr) *out.plan = agreed.plan.info;
  const bool cpu = group.backend() == Backend::cpu;
  if (agreed.plan.info.schedule == LinearSchedule::lean) {
    if (cpu)
      linear::run_lean_cpu(group, call, agreed.plan, pass, lse, grad_output);
    else
      linear::run_lean_cuda(group, call, agreed.plan, pass, lse, grad_output, stream);
  } else if (cpu) {
    linear::run_cpu(group, call, agreed, pass, lse, grad_output);
  } else {
    linear::run_cuda(group, call, agreed, pass, lse, grad_output, stream);
  }
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

LinearPlan linear_plan(const Group& group, MatrixView hidden, MatrixView weight,
                       TargetsView targets, const Options& opt, const LinearOptions& lopt,
                       const LinearOutputs& out) {
  // As forward checks it, minus the outputs' pointers: a deferred backward's plan where the
  // outputs ask for gradients that forward does not compute.
  const bool backward = opt.grad_mode == GradMode::deferred &&
                        (out.d_hidden.data != nullptr || out.d_weight.data != nullptr);
  float dummy = 0.0f;
  LinearOutputs o = out;
  if (o.loss == nullptr) o.loss = &dummy;
  const linear::Pass pass = backward ? linear::Pass::backward : linear::Pass::forward;
  const linear::Call call =
      linear::check_call(pass, hidden, weight, targets, opt, lopt, o, backward ? &dummy : nullptr);
  const DeviceScope on_device(group);
  return linear::agree(group, call, opt, lopt, nullptr).plan.info;
}

}  // namespace xent
