// The operators torch.ops.xent.vocab_parallel_cross_entropy{,_stats}, for Python (load the
// library with torch.ops.load_library, or `import xent`) and TorchScript. The group is named as
// c10d registers it (ProcessGroup.group_name); "" means one rank, no communication.
//
// Kernels: Autograd (builds the graph; the usual path) and CPU/CUDA (reached below autograd,
// e.g. under torch.inference_mode(): forward only, the logits untouched). Also
// torch.ops.xent.check_errors(group_name, device): syncs and reports out-of-range targets.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <tuple>

#include "xent/torch.h"

namespace xent::torch {
namespace {

c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name) {
  if (group_name.empty()) return {};
  return c10d::resolve_process_group(group_name);
}

CrossEntropyOptions make_options(int64_t ignore_index, double label_smoothing, double z_loss,
                                 double softcap, const std::string& reduction, int64_t vocab_start,
                                 int64_t vocab_size, const std::string& grad_mode,
                                 bool inplace_grad) {
  CrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.label_smoothing = label_smoothing;
  o.z_loss = z_loss;
  o.softcap = softcap;
  o.reduction = parse_reduction(reduction);
  o.vocab_start = vocab_start;
  o.vocab_size = vocab_size;
  o.grad_mode = parse_grad_mode(grad_mode);
  o.inplace_grad = inplace_grad;
  return o;
}

template <bool Autograd>
at::Tensor loss_op(const at::Tensor& logits, const at::Tensor& target,
                   const std::string& group_name, int64_t ignore_index, double label_smoothing,
                   double z_loss, double softcap, const std::string& reduction, int64_t vocab_start,
                   int64_t vocab_size, const std::string& grad_mode, bool inplace_grad) {
  const CrossEntropyOptions o =
      make_options(ignore_index, label_smoothing, z_loss, softcap, reduction, vocab_start,
                   vocab_size, grad_mode, inplace_grad);
  std::optional<at::AutoGradMode> no_grad;
  if (!Autograd) no_grad.emplace(false);
  return vocab_parallel_cross_entropy(logits, target, resolve(group_name), o).loss;
}

template <bool Autograd>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> stats_op(
    const at::Tensor& logits, const at::Tensor& target, const std::string& group_name,
    int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
    const std::string& reduction, int64_t vocab_start, int64_t vocab_size,
    const std::string& grad_mode, bool inplace_grad, bool compute_accuracy) {
  CrossEntropyOptions o = make_options(ignore_index, label_smoothing, z_loss, softcap, reduction,
                                       vocab_start, vocab_size, grad_mode, inplace_grad);
  o.return_lse = true;
  o.return_z_loss = true;
  o.compute_accuracy = compute_accuracy;
  std::optional<at::AutoGradMode> no_grad;
  if (!Autograd) no_grad.emplace(false);
  CrossEntropyResult r = vocab_parallel_cross_entropy(logits, target, resolve(group_name), o);
  if (!compute_accuracy) {  // empty tensors, not None, so that the schema's types hold
    r.argmax = at::empty({0}, logits.options().dtype(at::kLong));
    r.accuracy = at::empty({0}, logits.options().dtype(at::kFloat));
  }
  return {r.loss, r.lse, r.z_loss, r.argmax, r.accuracy};
}

// Waits for the current stream of `device`, then raises if a kernel of this group saw a target
// outside [0, vocab_size) that is not ignore_index (the CUDA backend gives such rows a NaN loss
// instead of stopping; the CPU backend raises at once, so there this does nothing).
void check_errors_op(const std::string& group_name, c10::Device device) {
  const Group g = group_for(resolve(group_name), device);
  const at::OptionalDeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  if (device.is_cuda()) stream = at::cuda::getCurrentCUDAStream(g.device()).stream();
  try {
    g.check_errors(stream);
  } catch (const xent::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace
}  // namespace xent::torch

TORCH_LIBRARY(xent, m) {
  m.def("check_errors(str group_name, Device device) -> ()", &xent::torch::check_errors_op);
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, str group_name, "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float softcap=0.0, "
      "str reduction=\"mean\", int vocab_start=-1, int vocab_size=-1, str grad_mode=\"fused\", "
      "bool inplace_grad=False) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_stats(Tensor logits, Tensor target, str group_name, "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float softcap=0.0, "
      "str reduction=\"mean\", int vocab_start=-1, int vocab_size=-1, str grad_mode=\"fused\", "
      "bool inplace_grad=False, bool compute_accuracy=False) "
      "-> (Tensor loss, Tensor lse, Tensor z_loss, Tensor argmax, Tensor accuracy)");
}

TORCH_LIBRARY_IMPL(xent, Autograd, m) {
  m.impl("vocab_parallel_cross_entropy", &xent::torch::loss_op<true>);
  m.impl("vocab_parallel_cross_entropy_stats", &xent::torch::stats_op<true>);
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  m.impl("vocab_parallel_cross_entropy", &xent::torch::loss_op<false>);
  m.impl("vocab_parallel_cross_entropy_stats", &xent::torch::stats_op<false>);
}

TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  m.impl("vocab_parallel_cross_entropy", &xent::torch::loss_op<false>);
  m.impl("vocab_parallel_cross_entropy_stats", &xent::torch::stats_op<false>);
}
