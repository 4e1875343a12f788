// The operators torch.ops.xent.*, for Python (`import xent`, or torch.ops.load_library) and
// TorchScript. The group is named as c10d registers it (ProcessGroup.group_name); "" means one
// rank, no communication.
//
// Public: vocab_parallel_cross_entropy and vocab_parallel_cross_entropy_stats, CompositeImplicit-
// Autograd: they check, flatten the leading dimensions and attach the autograd node
// (function.cpp), which calls the internal operators _forward, _forward_inplace, _backward,
// _backward_inplace, _backward_fused and _scale_inplace (ops.cpp: CPU and CUDA kernels; fake
// kernels for torch.compile in python/xent/_fake.py). linear_cross_entropy, the fused lm head, is
// the same pattern over _linear_forward, _linear_backward and _linear_backward_fused (linear.cpp,
// linear_ops.cpp). check_errors(group_name, device) syncs and reports out-of-range targets.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "internal.h"

namespace xent::torch {
namespace {

CrossEntropyOptions options_of(const detail::OpArgs& a, c10::string_view grad_mode,
                               bool inplace_grad) {
  CrossEntropyOptions o = a.options();
  o.grad_mode = parse_grad_mode(std::string(grad_mode));
  o.inplace_grad = inplace_grad;
  return o;
}

// Waits for the current stream of `device`, then raises if a kernel of this group saw a target
// outside [0, vocab_size) that is not ignore_index (the CUDA backend gives such rows a NaN loss
// instead of stopping; the CPU backend raises at once, so there this does nothing).
void check_errors_op(c10::string_view group_name, c10::Device device) {
  const Group g = group_for(detail::resolve_group(std::string(group_name)), device);
  const at::OptionalDeviceGuard guard(device);
  cudaStream_t stream = nullptr;
  if (device.is_cuda()) stream = at::cuda::getCurrentCUDAStream(g.device()).stream();
  detail::core_call([&] { g.check_errors(stream); });
}

}  // namespace

namespace detail {

at::Tensor loss_entry(const at::Tensor& logits, const at::Tensor& target,
                      c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                      double z_loss, double softcap, c10::string_view reduction,
                      int64_t vocab_start, int64_t vocab_size, c10::string_view grad_mode,
                      bool inplace_grad, double grad_scale) {
  const OpArgs a = OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                              vocab_start, vocab_size, grad_scale);
  return run(logits, target, a, options_of(a, grad_mode, inplace_grad)).loss;
}

StatsOut stats_entry(const at::Tensor& logits, const at::Tensor& target,
                     c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                     double z_loss, double softcap, c10::string_view reduction, int64_t vocab_start,
                     int64_t vocab_size, c10::string_view grad_mode, bool inplace_grad,
                     bool compute_accuracy, double grad_scale) {
  const OpArgs a = OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                              vocab_start, vocab_size, grad_scale);
  CrossEntropyOptions o = options_of(a, grad_mode, inplace_grad);
  o.return_lse = true;
  o.return_z_loss = true;
  o.compute_accuracy = compute_accuracy;
  CrossEntropyResult r = run(logits, target, a, o);
  if (!compute_accuracy) {  // empty tensors, not None, so that the schema's types hold
    r.argmax = at::empty({0}, logits.options().dtype(at::kLong));
    r.accuracy = at::empty({0}, logits.options().dtype(at::kFloat));
  }
  return {r.loss, r.lse, r.z_loss, r.argmax, r.accuracy};
}

}  // namespace detail
}  // namespace xent::torch

TORCH_LIBRARY(xent, m) {
  // The fake kernels (torch.compile, FakeTensor) are registered by this Python module.
  m.set_python_module("xent._fake");
  m.def("check_errors(str group_name, Device device) -> ()", &xent::torch::check_errors_op);
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, str group_name, "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float softcap=0.0, "
      "str reduction=\"mean\", int vocab_start=-1, int vocab_size=-1, str grad_mode=\"fused\", "
      "bool inplace_grad=False, float grad_scale=1.0) -> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_stats(Tensor logits, Tensor target, str group_name, "
      "int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float softcap=0.0, "
      "str reduction=\"mean\", int vocab_start=-1, int vocab_size=-1, str grad_mode=\"fused\", "
      "bool inplace_grad=False, bool compute_accuracy=False, float grad_scale=1.0) "
      "-> (Tensor loss, Tensor lse, Tensor z_loss, Tensor argmax, Tensor accuracy)");
  // Internal: 2-D logits [rows, cols], 1-D target [rows] (docs/torch.md).
  m.def("_forward(Tensor logits, Tensor target, " XENT_OP_ARGS_SCHEMA
        ", bool compute_accuracy, bool with_grad, bool with_stats) -> (Tensor, Tensor, Tensor, "
        "Tensor, Tensor, Tensor)");
  m.def("_forward_inplace(Tensor(a!) logits, Tensor target, " XENT_OP_ARGS_SCHEMA
        ", bool compute_accuracy, bool with_stats) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor)");
  m.def(
      "_backward(Tensor logits, Tensor target, Tensor lse, Tensor? "
      "grad_output, " XENT_OP_ARGS_SCHEMA ") -> Tensor");
  m.def(
      "_backward_inplace(Tensor(a!) logits, Tensor target, Tensor lse, Tensor? "
      "grad_output, " XENT_OP_ARGS_SCHEMA ") -> ()");
  m.def("_scale_inplace(Tensor(a!) grad, Tensor target, Tensor? grad_output, " XENT_OP_ARGS_SCHEMA
        ") -> ()");
  m.def(
      "_backward_fused(Tensor(a!) grad, Tensor logits, Tensor target, Tensor lse, Tensor? "
      "grad_output, " XENT_OP_ARGS_SCHEMA ") -> ()");
  // The fused lm head (linear.cpp; docs/torch.md).
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, str group_name, "
      "bool sequence_parallel=False, int ignore_index=-100, float label_smoothing=0.0, "
      "float z_loss=0.0, float softcap=0.0, str reduction=\"mean\", int vocab_start=-1, "
      "int vocab_size=-1, str grad_mode=\"fused\", float grad_scale=1.0, int chunk_rows=0, "
      "int max_scratch_bytes=0, str schedule=\"auto\") -> Tensor");
  // Internal: hidden [rows, H], weight [V_local, H], target [rows].
  m.def("_linear_plan(Tensor hidden, Tensor weight, Tensor target, " XENT_OP_ARGS_SCHEMA
        ", " XENT_LINEAR_ARGS_SCHEMA ", bool d_hidden, bool d_weight) -> int[]");
  m.def("_linear_forward(Tensor hidden, Tensor weight, Tensor target, " XENT_OP_ARGS_SCHEMA
        ", " XENT_LINEAR_ARGS_SCHEMA
        ", bool d_hidden, bool d_weight) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "_linear_backward(Tensor hidden, Tensor weight, Tensor target, Tensor lse, "
      "Tensor? grad_output, " XENT_OP_ARGS_SCHEMA ", " XENT_LINEAR_ARGS_SCHEMA
      ", bool d_hidden, bool d_weight) -> (Tensor, Tensor)");
  m.def(
      "_linear_backward_fused(Tensor(a!) d_hidden, Tensor(b!) d_weight, Tensor hidden, "
      "Tensor weight, Tensor target, Tensor lse, Tensor? grad_output, " XENT_OP_ARGS_SCHEMA
      ", " XENT_LINEAR_ARGS_SCHEMA ") -> ()");
}

TORCH_LIBRARY_IMPL(xent, CompositeImplicitAutograd, m) {
  m.impl("vocab_parallel_cross_entropy", &xent::torch::detail::loss_entry);
  m.impl("vocab_parallel_cross_entropy_stats", &xent::torch::detail::stats_entry);
  m.impl("linear_cross_entropy", &xent::torch::detail::linear_entry);
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  xent::torch::detail::register_kernels(m);
  xent::torch::detail::register_linear_kernels(m);
}

TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  xent::torch::detail::register_kernels(m);
  xent::torch::detail::register_linear_kernels(m);
}
