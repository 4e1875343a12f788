// The kernels of the internal operators torch.ops.xent._forward, _forward_inplace, _backward,
// _backward_inplace, _backward_fused and _scale_inplace (schemas in op.cpp): each one call into
// the core on 2-D logits and 1-D targets, outputs allocated with torch on the logits' device,
// the current CUDA stream. The callers (function.cpp) have checked shapes and types; the core
// checks the rest.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>

#include <initializer_list>
#include <optional>
#include <string>

#include "internal.h"

namespace xent::torch::detail {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: return DType::f32;
  }
}

LogitsView view_of(const at::Tensor& t) {
  LogitsView v;
  v.data = t.numel() > 0 ? t.data_ptr() : nullptr;
  v.dtype = dtype_of(t);
  v.rows = t.size(0);
  v.cols = t.size(1);
  v.row_stride = t.size(0) > 1 ? t.stride(0) : t.size(1);
  return v;
}

TargetsView view_of_targets(const at::Tensor& t) {
  TargetsView v;
  v.data = t.numel() > 0 ? t.data_ptr() : nullptr;
  v.type = t.scalar_type() == at::kInt ? IndexType::i32 : IndexType::i64;
  v.rows = t.size(0);
  return v;
}

cudaStream_t stream_of(const at::Device& d) {
  return d.is_cuda() ? at::cuda::getCurrentCUDAStream(d.index()).stream() : nullptr;
}

CrossEntropyOptions options_of(c10::string_view group_name, int64_t ignore_index,
                               double label_smoothing, double z_loss, double softcap,
                               c10::string_view reduction, int64_t vocab_start, int64_t vocab_size,
                               double grad_scale) {
  return OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                    vocab_start, vocab_size, grad_scale)
      .options();
}

// The group and core options of one call on `cols`-column tensors on `device`. Every other
// tensor of the call must be there too (checked here, without a driver call; torch allocates the
// outputs there), so the core need not ask the driver where each pointer lives.
Setup setup_for_tensors(c10::string_view group_name, c10::Device device, int64_t cols,
                        std::initializer_list<const at::Tensor*> others,
                        const CrossEntropyOptions& o) {
  for (const at::Tensor* t : others)
    XENT_CHECK(!t->defined() || t->numel() == 0 || t->device() == device, "a tensor is on ",
               t->device(), " but the logits are on ", device,
               ": every tensor of a call must be on the logits' device");
  Setup s = setup(resolve_group(std::string(group_name)), device, cols, o);
  s.opt.check_pointers = false;
  return s;
}

// grad_output as the core takes it: float32, contiguous, on the logits' device; null means 1.
const float* grad_output_ptr(const std::optional<at::Tensor>& go) {
  if (!go || !go->defined() || go->numel() == 0) return nullptr;
  XENT_CHECK(go->scalar_type() == at::kFloat && go->is_contiguous(),
             "grad_output must be a contiguous float32 tensor, got ", go->scalar_type());
  return go->data_ptr<float>();
}

// The forward. Inplace: the gradient (for grad_output = grad_scale) over the logits. Otherwise,
// with_grad: the gradient into a new contiguous tensor (the last output), and lse (which the core
// computes anyway) for the backward that recomputes rows; neither: the logits only read.
template <bool Inplace>
ForwardOut forward_kernel(const at::Tensor& logits, const at::Tensor& target,
                          c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                          double z_loss, double softcap, c10::string_view reduction,
                          int64_t vocab_start, int64_t vocab_size, double grad_scale,
                          bool compute_accuracy, bool with_grad, bool with_stats) {
  const at::Device device = logits.device();
  const at::OptionalDeviceGuard guard(device);
  CrossEntropyOptions o = options_of(group_name, ignore_index, label_smoothing, z_loss, softcap,
                                     reduction, vocab_start, vocab_size, grad_scale);
  o.grad_mode = Inplace || with_grad ? GradMode::fused : GradMode::none;
  o.compute_accuracy = compute_accuracy;
  const Setup s = setup_for_tensors(group_name, device, logits.size(1), {&target}, o);

  const int64_t n = logits.size(0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  ForwardOut f;
  auto& [loss, lse, zl, argmax, accuracy, grad] = f;
  // Allocated once the first kernels are queued (the core calls back): the GPU starts sooner.
  // Only what the kernels write: the one-pass path waits for them before its kernel.
  const auto make_outputs = [&] {
    loss = s.opt.reduction == Reduction::none ? at::empty({n}, f32) : at::empty({}, f32);
    Outputs out;
    out.loss = loss.data_ptr<float>();
    if (with_stats || (!Inplace && with_grad)) {
      lse = at::empty({n}, f32);
      out.lse = lse.data_ptr<float>();
    }
    if (with_stats) {
      zl = at::empty({n}, f32);
      out.z_loss = zl.data_ptr<float>();
    }
    if (compute_accuracy) {
      argmax = at::empty({n}, f32.dtype(at::kLong));
      accuracy = at::empty({}, f32);
      out.argmax = argmax.data_ptr<int64_t>();
      out.accuracy = accuracy.data_ptr<float>();
    }
    if (!Inplace && with_grad) {
      grad = at::empty(logits.sizes(), logits.options());  // contiguous, as view_of needs
      out.grad = view_of(grad);
    }
    return out;
  };
  core_call([&] {
    xent::forward(s.group, view_of(logits), view_of_targets(target), s.opt, make_outputs,
                  stream_of(device));
  });
  // The outputs not asked for, empty as the schema's types need, made after every kernel is
  // queued.
  for (at::Tensor* t : {&lse, &zl, &accuracy})
    if (!t->defined()) *t = at::empty({0}, f32);
  if (!argmax.defined()) argmax = at::empty({0}, f32.dtype(at::kLong));
  if (!grad.defined()) grad = at::empty({0}, logits.options());
  return f;
}

ForwardOut forward_op(const at::Tensor& logits, const at::Tensor& target,
                      c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                      double z_loss, double softcap, c10::string_view reduction,
                      int64_t vocab_start, int64_t vocab_size, double grad_scale,
                      bool compute_accuracy, bool with_grad, bool with_stats) {
  return forward_kernel<false>(logits, target, group_name, ignore_index, label_smoothing, z_loss,
                               softcap, reduction, vocab_start, vocab_size, grad_scale,
                               compute_accuracy, with_grad, with_stats);
}

ForwardOut forward_inplace_op(const at::Tensor& logits, const at::Tensor& target,
                              c10::string_view group_name, int64_t ignore_index,
                              double label_smoothing, double z_loss, double softcap,
                              c10::string_view reduction, int64_t vocab_start, int64_t vocab_size,
                              double grad_scale, bool compute_accuracy, bool with_stats) {
  return forward_kernel<true>(logits, target, group_name, ignore_index, label_smoothing, z_loss,
                              softcap, reduction, vocab_start, vocab_size, grad_scale,
                              compute_accuracy, true, with_stats);
}

// The core's out-of-place backward into `grad`. deferred: a new tensor, or the logits themselves
// (in place); fused: forward's gradient, whose rows with grad_output != grad_scale it recomputes.
void backward_into(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target,
                   const at::Tensor& lse, const std::optional<at::Tensor>& grad_output,
                   const OpArgs& a, GradMode mode) {
  const at::Device device = logits.device();
  const at::OptionalDeviceGuard guard(device);
  CrossEntropyOptions o = a.options();
  o.grad_mode = mode;
  const at::Tensor go = grad_output.value_or(at::Tensor());
  const Setup s =
      setup_for_tensors(a.group_name, device, logits.size(1), {&grad, &target, &lse, &go}, o);
  const float* lse_ptr = lse.numel() > 0 ? lse.data_ptr<float>() : nullptr;
  core_call([&] {
    xent::backward(s.group, view_of(logits), view_of(grad), view_of_targets(target), lse_ptr,
                   grad_output_ptr(grad_output), s.opt, stream_of(device));
  });
}

at::Tensor backward_op(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                       const std::optional<at::Tensor>& grad_output, c10::string_view group_name,
                       int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
                       c10::string_view reduction, int64_t vocab_start, int64_t vocab_size,
                       double grad_scale) {
  const at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
  backward_into(grad, logits, target, lse, grad_output,
                OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                           vocab_start, vocab_size, grad_scale),
                GradMode::deferred);
  return grad;
}

void backward_inplace_op(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                         const std::optional<at::Tensor>& grad_output, c10::string_view group_name,
                         int64_t ignore_index, double label_smoothing, double z_loss,
                         double softcap, c10::string_view reduction, int64_t vocab_start,
                         int64_t vocab_size, double grad_scale) {
  backward_into(logits, logits, target, lse, grad_output,
                OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                           vocab_start, vocab_size, grad_scale),
                GradMode::deferred);
}

// Fused backward out of place: `grad` is forward's gradient (for grad_output = grad_scale), the
// logits intact; rows whose grad_output is not grad_scale are recomputed, rounded once.
void backward_fused_op(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target,
                       const at::Tensor& lse, const std::optional<at::Tensor>& grad_output,
                       c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                       double z_loss, double softcap, c10::string_view reduction,
                       int64_t vocab_start, int64_t vocab_size, double grad_scale) {
  backward_into(grad, logits, target, lse, grad_output,
                OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                           vocab_start, vocab_size, grad_scale),
                GradMode::fused);
}

// Fused backward in place: the gradient is already in `grad` (over the logits, which are gone),
// for grad_output = grad_scale; scale its rows by grad_output / grad_scale (the kernel skips rows
// whose factor is 1). A rescaled row is rounded twice.
void scale_inplace_op(const at::Tensor& grad, const at::Tensor& target,
                      const std::optional<at::Tensor>& grad_output, c10::string_view group_name,
                      int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
                      c10::string_view reduction, int64_t vocab_start, int64_t vocab_size,
                      double grad_scale) {
  const at::Device device = grad.device();
  const at::OptionalDeviceGuard guard(device);
  CrossEntropyOptions o = options_of(group_name, ignore_index, label_smoothing, z_loss, softcap,
                                     reduction, vocab_start, vocab_size, grad_scale);
  o.grad_mode = GradMode::fused;
  const at::Tensor go = grad_output.value_or(at::Tensor());
  const Setup s = setup_for_tensors(group_name, device, grad.size(1), {&target, &go}, o);
  core_call([&] {
    xent::backward(s.group, view_of(grad), view_of_targets(target), nullptr,
                   grad_output_ptr(grad_output), s.opt, stream_of(device));
  });
}

}  // namespace

void register_kernels(::torch::Library& m) {
  m.impl("_forward", &forward_op);
  m.impl("_forward_inplace", &forward_inplace_op);
  m.impl("_backward", &backward_op);
  m.impl("_backward_inplace", &backward_inplace_op);
  m.impl("_backward_fused", &backward_fused_op);
  m.impl("_scale_inplace", &scale_inplace_op);
}

}  // namespace xent::torch::detail
