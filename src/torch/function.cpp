// vocab_parallel_cross_entropy on torch tensors: input checks, leading dimensions flattened, and
// the hand-written autograd node (VocabParallelCrossEntropyBackward). The forward and the node's
// backward call the internal operators (ops.cpp) through the dispatcher and keep no state but
// their arguments, so that torch.compile traces them into a graph of those operators
// (docs/torch.md).
//
// Gradient placement: inplace_grad writes it over the logits (fused: in forward; deferred: in
// backward); otherwise fused writes it into a new tensor in forward (all GPU work is queued by
// the forward call, so backward's host latency never stalls the GPU) and deferred in backward.
// Every gradient is rounded once to the logits' dtype, grad_output included, except fused in
// place with a scalar grad_output other than grad_scale (the logits are gone: a rescale).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "internal.h"

namespace xent::torch {
namespace detail {

// ------------------------------------------------------------------------ options, arguments

OpArgs OpArgs::of(c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                  double z_loss, double softcap, c10::string_view reduction, int64_t vocab_start,
                  int64_t vocab_size, double grad_scale) {
  OpArgs a;
  a.group_name = std::string(group_name);
  a.ignore_index = ignore_index;
  a.label_smoothing = label_smoothing;
  a.z_loss = z_loss;
  a.softcap = softcap;
  a.reduction = std::string(reduction);
  a.vocab_start = vocab_start;
  a.vocab_size = vocab_size;
  a.grad_scale = grad_scale;
  return a;
}

OpArgs OpArgs::of(const CrossEntropyOptions& o, std::string group_name) {
  return of(group_name, o.ignore_index, o.label_smoothing, o.z_loss, o.softcap,
            to_string(o.reduction), o.vocab_start, o.vocab_size, o.grad_scale);
}

CrossEntropyOptions OpArgs::options() const {
  CrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.label_smoothing = label_smoothing;
  o.z_loss = z_loss;
  o.softcap = softcap;
  o.reduction = parse_reduction(reduction);
  o.vocab_start = vocab_start;
  o.vocab_size = vocab_size;
  o.grad_scale = grad_scale;
  return o;
}

// ------------------------------------------------------------ the internal operators, by name

namespace {
c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}
}  // namespace

ForwardOut call_forward(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                        ForwardMode mode, bool compute_accuracy, bool with_stats) {
  using Sig = ForwardOut(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, double,
                         double, double, c10::string_view, int64_t, int64_t, double, bool, bool);
  using SigGrad =
      ForwardOut(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, double, double,
                 double, c10::string_view, int64_t, int64_t, double, bool, bool, bool);
  if (mode == ForwardMode::fused_inplace) {
    static const auto op = op_handle("xent::_forward_inplace").typed<Sig>();
    return op.call(logits, target, a.group_name, a.ignore_index, a.label_smoothing, a.z_loss,
                   a.softcap, a.reduction, a.vocab_start, a.vocab_size, a.grad_scale,
                   compute_accuracy, with_stats);
  }
  static const auto op = op_handle("xent::_forward").typed<SigGrad>();
  return op.call(logits, target, a.group_name, a.ignore_index, a.label_smoothing, a.z_loss,
                 a.softcap, a.reduction, a.vocab_start, a.vocab_size, a.grad_scale,
                 compute_accuracy, mode == ForwardMode::fused, with_stats);
}

namespace {
template <typename R>
using BackwardSig = R(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const std::optional<at::Tensor>&, c10::string_view, int64_t, double, double,
                      double, c10::string_view, int64_t, int64_t, double);
}  // namespace

at::Tensor call_backward(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                         const at::Tensor& lse, const std::optional<at::Tensor>& grad_output) {
  static const auto op = op_handle("xent::_backward").typed<BackwardSig<at::Tensor>>();
  return op.call(logits, target, lse, grad_output, a.group_name, a.ignore_index, a.label_smoothing,
                 a.z_loss, a.softcap, a.reduction, a.vocab_start, a.vocab_size, a.grad_scale);
}

void call_backward_inplace(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                           const at::Tensor& lse, const std::optional<at::Tensor>& grad_output) {
  static const auto op = op_handle("xent::_backward_inplace").typed<BackwardSig<void>>();
  op.call(logits, target, lse, grad_output, a.group_name, a.ignore_index, a.label_smoothing,
          a.z_loss, a.softcap, a.reduction, a.vocab_start, a.vocab_size, a.grad_scale);
}

void call_backward_fused(const OpArgs& a, const at::Tensor& grad, const at::Tensor& logits,
                         const at::Tensor& target, const at::Tensor& lse,
                         const std::optional<at::Tensor>& grad_output) {
  using Sig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const std::optional<at::Tensor>&, c10::string_view, int64_t, double, double,
                   double, c10::string_view, int64_t, int64_t, double);
  static const auto op = op_handle("xent::_backward_fused").typed<Sig>();
  op.call(grad, logits, target, lse, grad_output, a.group_name, a.ignore_index, a.label_smoothing,
          a.z_loss, a.softcap, a.reduction, a.vocab_start, a.vocab_size, a.grad_scale);
}

void call_scale_inplace(const OpArgs& a, const at::Tensor& grad, const at::Tensor& target,
                        const std::optional<at::Tensor>& grad_output) {
  using Sig =
      void(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
           int64_t, double, double, double, c10::string_view, int64_t, int64_t, double);
  static const auto op = op_handle("xent::_scale_inplace").typed<Sig>();
  op.call(grad, target, grad_output, a.group_name, a.ignore_index, a.label_smoothing, a.z_loss,
          a.softcap, a.reduction, a.vocab_start, a.vocab_size, a.grad_scale);
}

// [..., cols] as [rows, cols] with a unit column stride and rows that do not overlap, as the
// core's views take it: a view where the tensor is one already (any contiguous tensor, a column
// slice of a wider one), else a copy (the transpose of [seq, batch, cols], an expanded tensor),
// made once here (autograd tracks both, so a gradient flows back to the caller's tensor).
at::Tensor as_rows(const at::Tensor& t) {
  const at::Tensor m = t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
  const bool unit = m.size(1) == 1 || m.stride(1) == 1;
  const bool apart = m.size(0) <= 1 || m.stride(0) >= m.size(1);
  return unit && apart ? m : m.contiguous();
}

void check_targets(const at::Tensor& target, const at::Tensor& input, const char* input_has,
                   const char* inputs) {
  XENT_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
             "target must hold int64 or int32 class indices, got ", target.scalar_type());
  const at::IntArrayRef rows = input.sizes().slice(0, input.dim() - 1);
  XENT_CHECK(target.sizes() == rows, "target has shape ", target.sizes(), " but ", input_has,
             " shape ", input.sizes(), ": target must have ", inputs,
             " shape without the last dimension (", rows, "), one class index per row");
}

namespace {

using ::torch::autograd::Node;
using ::torch::autograd::SavedVariable;
using ::torch::autograd::variable_list;

void check_inputs(const at::Tensor& logits, const at::Tensor& target) {
  XENT_CHECK(logits.defined(), "logits is an undefined tensor");
  XENT_CHECK(target.defined(), "target is an undefined tensor");
  XENT_CHECK(logits.dim() >= 1,
             "logits must have a last (vocabulary shard) dimension, got a 0-D tensor");
  const at::ScalarType dt = logits.scalar_type();
  XENT_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
             "logits must be float32, bfloat16 or float16, got ", dt);
  XENT_CHECK(logits.device().is_cpu() || logits.device().is_cuda(),
             "logits must be on a CPU or CUDA device, got ", logits.device());
  XENT_CHECK(logits.layout() == at::kStrided, "logits must be a dense (strided) tensor, got ",
             logits.layout());
  const int64_t cols = logits.size(-1);
  XENT_CHECK(cols >= 1,
             "logits must have at least one column (this rank's vocabulary shard), got "
             "shape ",
             logits.sizes());
  XENT_CHECK(cols == 1 || logits.stride(-1) == 1,
             "logits must be contiguous in the last (vocabulary) dimension, got strides ",
             logits.strides(), " for shape ", logits.sizes(), " (call .contiguous())");
  check_targets(target, logits, "logits have", "the logits'");
  XENT_CHECK(target.device() == logits.device(), "target is on ", target.device(),
             " but logits are on ", logits.device(), ": both must be on the same device");
}

// The loss's autograd node, written as PyTorch's generated nodes are (NllLossBackward0): a
// custom torch::autograd::Function cost about 7 µs more per forward call (its context, hash maps
// and output wrapping), on the path to the first kernel. Only the loss takes a gradient, for the
// logits only. Compiled autograd does not take it (nor did it take the custom Function).
struct VocabParallelCrossEntropyBackward final : Node {
  OpArgs args;
  bool fused = false, inplace = false;
  bool consumed = false;  // the gradient was finished in place: there is no second backward
  // logits: the logits (fused in place: holding forward's gradient, for grad_output =
  // grad_scale). grad: fused out of place, forward's gradient in a new tensor. lse: all but fused
  // in place (what recomputes a gradient from the logits).
  SavedVariable logits, grad, target, lse;

  std::string name() const override { return "VocabParallelCrossEntropyBackward"; }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    logits.reset_data();
    grad.reset_data();
    target.reset_data();
    lse.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    XENT_CHECK(!consumed,
               "backward through vocab_parallel_cross_entropy a second time, but the "
               "first one finished the gradient in place (grad_mode = ",
               fused ? "fused" : "deferred", ", inplace_grad = ", inplace,
               "); to backward more than once use grad_mode = \"deferred\" with inplace_grad = "
               "false");
    // No gradient reached the loss (it was not used): the logits' gradient is zero.
    if (!grads[0].defined()) return {at::Tensor()};
    // Unpacking checks the versions: a later in-place change to a saved tensor fails here.
    const at::Tensor saved_target = target.unpack();
    const at::Tensor x = logits.unpack().detach();
    const std::optional<at::Tensor> go =
        grads[0].to(x.device(), at::kFloat).contiguous().view({-1});
    at::Tensor result;
    {
      // Straight to the kernels: autograd has nothing to do for the internal operators.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      if (fused && inplace) {
        result = x;
        call_scale_inplace(args, result, saved_target, go);
      } else if (fused) {
        result = grad.unpack().detach();
        call_backward_fused(args, result, x, saved_target, lse.unpack(), go);
      } else if (inplace) {
        result = x;
        call_backward_inplace(args, result, saved_target, lse.unpack(), go);
      } else {
        result = call_backward(args, x, saved_target, lse.unpack(), go);
      }
    }
    if (fused || inplace) {
      consumed = true;
      ::torch::autograd::impl::bump_version(result);  // shares the saved tensor's version counter
    }
    if (::torch::autograd::GradMode::is_enabled()) {
      // create_graph: the gradient is not itself differentiable; fail if that is ever needed.
      result = ::torch::autograd::DelayedError(
                   "xent: vocab_parallel_cross_entropy is differentiable once only (its gradient "
                   "has no gradient)",
                   1)
                   .apply({result.detach().requires_grad_()})[0];
    }
    return {result};
  }
};

}  // namespace

CrossEntropyResult run(const at::Tensor& logits_in, const at::Tensor& target_in,
                       const OpArgs& args_in, const CrossEntropyOptions& o_in) {
  check_inputs(logits_in, target_in);
  parse_reduction(args_in.reduction);  // a bad name fails here, before any work
  XENT_CHECK(std::isfinite(o_in.grad_scale) && o_in.grad_scale > 0.0,
             "grad_scale = ", o_in.grad_scale, ": must be finite and > 0");
  XENT_CHECK(o_in.grad_scale == 1.0 || o_in.grad_mode != GradMode::deferred,
             "grad_scale = ", o_in.grad_scale,
             " with grad_mode = deferred: grad_scale applies to grad_mode = fused only (deferred "
             "applies grad_output in its one gradient pass; leave grad_scale at 1)");
  // In place with a per-row grad_output (reduction none), a fused forward's gradient could only
  // be rescaled row by row in backward (the logits are gone): rounded twice, and 5 passes over
  // the logits. Deferred applies grad_output before its one rounding, in 3 passes: take it, and
  // grad_scale (a promise about grad_output that deferred does not need) goes back to 1.
  CrossEntropyOptions o = o_in;
  std::optional<OpArgs> deferred_args;  // copied only then (two strings)
  if (o.inplace_grad && o.grad_mode == GradMode::fused && o.reduction == Reduction::none) {
    o.grad_mode = GradMode::deferred;
    o.grad_scale = 1.0;
    deferred_args = args_in;
    deferred_args->grad_scale = 1.0;
  }
  const OpArgs& args = deferred_args ? *deferred_args : args_in;
  const at::Tensor logits = as_rows(logits_in);
  const at::Tensor target = target_in.dim() == 1 && target_in.is_contiguous()
                                ? target_in
                                : target_in.reshape({-1}).contiguous();
  const bool autograd = o.grad_mode != GradMode::none && logits.requires_grad() &&
                        ::torch::autograd::GradMode::is_enabled();
  if (autograd && o.inplace_grad) {
    XENT_CHECK(!logits_in.is_leaf(),
               "inplace_grad = true but the logits are a leaf tensor that requires grad: "
               "their storage cannot hold their own gradient (use inplace_grad = false, or pass "
               "the output of the layer that made them)");
    XENT_CHECK(!(logits_in.is_view() && logits_in._base().is_leaf()),
               "inplace_grad = true but the logits are a view of a leaf tensor that "
               "requires grad: their storage cannot hold the gradient (use inplace_grad = false)");
  }
  // lse and z_loss as outputs of their own only where asked (the fused loss needs neither; the
  // fused out-of-place forward returns lse with its gradient, for the backward's recomputation).
  const bool with_stats = o.return_lse || o.return_z_loss;
  const bool fused = autograd && o.grad_mode == GradMode::fused;
  const ForwardMode mode = !fused
                               ? ForwardMode::none
                               : (o.inplace_grad ? ForwardMode::fused_inplace : ForwardMode::fused);
  at::Tensor loss, lse, zl, argmax, accuracy, grad;
  {
    // Straight to the kernel: autograd's fallback for operators without an autograd kernel
    // (boxed, a few microseconds) has nothing to do here, and the version bump is ours.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Deferred needs lse for its backward, whether or not it is returned.
    const bool need_lse = with_stats || (autograd && !fused);
    std::tie(loss, lse, zl, argmax, accuracy, grad) =
        call_forward(args, logits, target, mode, o.compute_accuracy, need_lse);
  }
  // The node after the kernels are queued: its host time is then off the GPU's path.
  if (autograd) {
    std::shared_ptr<VocabParallelCrossEntropyBackward> node(new VocabParallelCrossEntropyBackward(),
                                                            ::torch::autograd::deleteNode);
    node->set_next_edges(::torch::autograd::collect_next_edges(logits));
    node->args = args;
    node->fused = fused;
    node->inplace = o.inplace_grad;
    if (mode == ForwardMode::fused_inplace) ::torch::autograd::impl::bump_version(logits);
    // Saved after the bump: the version check then catches any later in-place change.
    node->logits = SavedVariable(logits, /*is_output=*/false);
    node->target = SavedVariable(target, false);
    if (mode == ForwardMode::fused) node->grad = SavedVariable(grad, false);
    if (mode != ForwardMode::fused_inplace) node->lse = SavedVariable(lse, false);
    ::torch::autograd::set_history(loss, node);
  }
  // Per-row outputs take the target's shape.
  const at::IntArrayRef shape = target_in.sizes();
  CrossEntropyResult r;
  r.loss = o.reduction == Reduction::none ? loss.view(shape) : loss;
  if (o.return_lse) r.lse = lse.view(shape);
  if (o.return_z_loss) r.z_loss = zl.view(shape);
  if (o.compute_accuracy) {
    r.argmax = argmax.view(shape);
    r.accuracy = accuracy;
  }
  return r;
}

}  // namespace detail

CrossEntropyResult vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                                const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                const CrossEntropyOptions& o) {
  return detail::run(logits, target, detail::OpArgs::of(o, detail::name_of(pg)), o);
}

at::Tensor vocab_parallel_cross_entropy_loss(const at::Tensor& logits, const at::Tensor& target,
                                             const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             const CrossEntropyOptions& options) {
  return vocab_parallel_cross_entropy(logits, target, group, options).loss;
}

}  // namespace xent::torch
