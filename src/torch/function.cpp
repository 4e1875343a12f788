// vocab_parallel_cross_entropy on torch tensors: input checks, leading dimensions flattened, and
// the autograd function. The function's forward and backward call the internal operators
// (ops.cpp) through the dispatcher and keep no state but their arguments, so that torch.compile
// traces it into a graph of those operators (docs/torch.md).
//
// Gradient placement: inplace_grad writes it over the logits (fused: in forward; deferred: in
// backward); otherwise fused writes it into a new tensor in forward (all GPU work is queued by
// the forward call, so backward's host latency never stalls the GPU) and deferred in backward.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>
#include <string>
#include <vector>

#include "internal.h"

namespace xent::torch {
namespace detail {

// ------------------------------------------------------------------------ options, arguments

OpArgs OpArgs::of(c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                  double z_loss, double softcap, c10::string_view reduction, int64_t vocab_start,
                  int64_t vocab_size) {
  OpArgs a;
  a.group_name = std::string(group_name);
  a.ignore_index = ignore_index;
  a.label_smoothing = label_smoothing;
  a.z_loss = z_loss;
  a.softcap = softcap;
  a.reduction = std::string(reduction);
  a.vocab_start = vocab_start;
  a.vocab_size = vocab_size;
  return a;
}

OpArgs OpArgs::of(const CrossEntropyOptions& o, std::string group_name) {
  return of(group_name, o.ignore_index, o.label_smoothing, o.z_loss, o.softcap,
            to_string(o.reduction), o.vocab_start, o.vocab_size);
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
                         double, double, c10::string_view, int64_t, int64_t, bool, bool);
  using SigGrad =
      ForwardOut(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, double, double,
                 double, c10::string_view, int64_t, int64_t, bool, bool, bool);
  if (mode == ForwardMode::fused_inplace) {
    static const auto op = op_handle("xent::_forward_inplace").typed<Sig>();
    return op.call(logits, target, a.group_name, a.ignore_index, a.label_smoothing, a.z_loss,
                   a.softcap, a.reduction, a.vocab_start, a.vocab_size, compute_accuracy,
                   with_stats);
  }
  static const auto op = op_handle("xent::_forward").typed<SigGrad>();
  return op.call(logits, target, a.group_name, a.ignore_index, a.label_smoothing, a.z_loss,
                 a.softcap, a.reduction, a.vocab_start, a.vocab_size, compute_accuracy,
                 mode == ForwardMode::fused, with_stats);
}

namespace {
template <typename R>
using BackwardSig = R(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const std::optional<at::Tensor>&, c10::string_view, int64_t, double, double,
                      double, c10::string_view, int64_t, int64_t);
}  // namespace

at::Tensor call_backward(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                         const at::Tensor& lse, const std::optional<at::Tensor>& grad_output) {
  static const auto op = op_handle("xent::_backward").typed<BackwardSig<at::Tensor>>();
  return op.call(logits, target, lse, grad_output, a.group_name, a.ignore_index, a.label_smoothing,
                 a.z_loss, a.softcap, a.reduction, a.vocab_start, a.vocab_size);
}

void call_backward_inplace(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                           const at::Tensor& lse, const std::optional<at::Tensor>& grad_output) {
  static const auto op = op_handle("xent::_backward_inplace").typed<BackwardSig<void>>();
  op.call(logits, target, lse, grad_output, a.group_name, a.ignore_index, a.label_smoothing,
          a.z_loss, a.softcap, a.reduction, a.vocab_start, a.vocab_size);
}

void call_scale_inplace(const OpArgs& a, const at::Tensor& grad, const at::Tensor& target,
                        const std::optional<at::Tensor>& grad_output) {
  using Sig =
      void(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
           int64_t, double, double, double, c10::string_view, int64_t, int64_t);
  static const auto op = op_handle("xent::_scale_inplace").typed<Sig>();
  op.call(grad, target, grad_output, a.group_name, a.ignore_index, a.label_smoothing, a.z_loss,
          a.softcap, a.reduction, a.vocab_start, a.vocab_size);
}

namespace {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

void check_inputs(const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.defined(), "xent: logits is an undefined tensor");
  TORCH_CHECK(target.defined(), "xent: target is an undefined tensor");
  TORCH_CHECK(logits.dim() >= 1,
              "xent: logits must have a last (vocabulary shard) dimension, got a 0-D tensor");
  const at::ScalarType dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "xent: logits must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(logits.device().is_cpu() || logits.device().is_cuda(),
              "xent: logits must be on a CPU or CUDA device, got ", logits.device());
  TORCH_CHECK(logits.layout() == at::kStrided,
              "xent: logits must be a dense (strided) tensor, got ", logits.layout());
  const int64_t cols = logits.size(-1);
  TORCH_CHECK(cols >= 1,
              "xent: logits must have at least one column (this rank's vocabulary shard), got "
              "shape ",
              logits.sizes());
  TORCH_CHECK(cols == 1 || logits.stride(-1) == 1,
              "xent: logits must be contiguous in the last (vocabulary) dimension, got strides ",
              logits.strides(), " for shape ", logits.sizes(), " (call .contiguous())");
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
              "xent: target must hold int64 or int32 class indices, got ", target.scalar_type());
  TORCH_CHECK(target.sizes() == logits.sizes().slice(0, logits.dim() - 1),
              "xent: target has shape ", target.sizes(), " but logits have shape ", logits.sizes(),
              ": target must have the logits' shape without the last dimension (",
              logits.sizes().slice(0, logits.dim() - 1), "), one class index per row");
  TORCH_CHECK(target.device() == logits.device(), "xent: target is on ", target.device(),
              " but logits are on ", logits.device(), ": both must be on the same device");
}

// [..., cols] as [rows, cols]: a view where the leading dimensions collapse into one row stride
// (any contiguous tensor, a column slice of a wider one), else a copy (e.g. the transpose of
// [seq, batch, cols]), made once here.
at::Tensor as_rows(const at::Tensor& logits) {
  if (logits.dim() == 2) {
    if (logits.size(0) <= 1 || logits.stride(0) >= logits.size(1)) return logits;
    return logits.contiguous();  // rows overlap (e.g. an expanded tensor)
  }
  const at::Tensor flat = logits.reshape({-1, logits.size(-1)});
  if (flat.size(0) <= 1 || flat.stride(0) >= flat.size(1)) return flat;
  return flat.contiguous();
}

// What backward needs besides the saved tensors, in one saved_data entry (a map entry per field
// cost a microsecond of the forward call).
void save_args(AutogradContext* ctx, const OpArgs& a, bool fused, bool inplace) {
  c10::impl::GenericList list(c10::AnyType::get());
  list.reserve(10);
  for (c10::IValue v :
       {c10::IValue(a.group_name), c10::IValue(a.ignore_index), c10::IValue(a.label_smoothing),
        c10::IValue(a.z_loss), c10::IValue(a.softcap), c10::IValue(a.reduction),
        c10::IValue(a.vocab_start), c10::IValue(a.vocab_size), c10::IValue(fused),
        c10::IValue(inplace)})
    list.push_back(std::move(v));
  ctx->saved_data["args"] = std::move(list);
}

struct SavedArgs {
  OpArgs args;
  bool fused = false, inplace = false;
};

SavedArgs load_args(AutogradContext* ctx) {
  const c10::impl::GenericList e = ctx->saved_data["args"].toList();
  SavedArgs s;
  OpArgs& a = s.args;
  a.group_name = e.get(0).toStringRef();
  a.ignore_index = e.get(1).toInt();
  a.label_smoothing = e.get(2).toDouble();
  a.z_loss = e.get(3).toDouble();
  a.softcap = e.get(4).toDouble();
  a.reduction = e.get(5).toStringRef();
  a.vocab_start = e.get(6).toInt();
  a.vocab_size = e.get(7).toInt();
  s.fused = e.get(8).toBool();
  s.inplace = e.get(9).toBool();
  return s;
}

class VocabParallelCrossEntropy : public ::torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  // Outputs: loss, lse, z_loss, argmax, accuracy (only the loss is differentiable).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const at::Tensor& target, const OpArgs& args, GradMode grad_mode,
                               bool inplace, bool compute_accuracy, bool with_stats) {
    const bool fused = grad_mode == GradMode::fused;
    const ForwardMode mode = !fused    ? ForwardMode::none
                             : inplace ? ForwardMode::fused_inplace
                                       : ForwardMode::fused;
    ForwardOut out;
    {
      // Straight to the kernel: autograd's fallback for operators without an autograd kernel
      // (boxed, a few microseconds) has nothing to do here, and the version bump is ours.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = call_forward(args, logits, target, mode, compute_accuracy, with_stats || !fused);
    }
    auto& [loss, lse, zl, argmax, accuracy, grad] = out;
    if (mode == ForwardMode::fused_inplace) ::torch::autograd::impl::bump_version(logits);

    // Only the loss takes a gradient: no zeros for the other outputs on every backward.
    ctx->set_materialize_grads(false);
    save_args(ctx, args, fused, inplace);
    // Saved after the bump: autograd's version check then catches any later in-place change.
    if (mode == ForwardMode::fused_inplace)
      ctx->save_for_backward({logits, target});
    else if (mode == ForwardMode::fused)
      ctx->save_for_backward({grad, target});
    else
      ctx->save_for_backward({logits, target, lse});
    ctx->mark_non_differentiable({lse, zl, argmax, accuracy});
    return {loss, lse, zl, argmax, accuracy};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedArgs saved_args = load_args(ctx);
    const OpArgs& args = saved_args.args;
    const bool fused = saved_args.fused, inplace = saved_args.inplace;
    TORCH_CHECK(ctx->saved_data.find("consumed") == ctx->saved_data.end(),
                "xent: backward through vocab_parallel_cross_entropy a second time, but the "
                "first one finished the gradient in place (grad_mode = ",
                fused ? "fused" : "deferred", ", inplace_grad = ", inplace,
                "); to backward more than once use grad_mode = \"deferred\" with inplace_grad = "
                "false");
    // No gradient reached the loss (it was not used): the logits' gradient is zero.
    if (!grads[0].defined())
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();  // checks the versions
    const at::Tensor& target = saved[1];
    const std::optional<at::Tensor> go =
        grads[0].to(saved[0].device(), at::kFloat).contiguous().view({-1});

    // The gradient for grad_output = 1 is in saved[0] when fused (the logits, or forward's new
    // tensor); deferred in place writes it there too.
    at::Tensor grad = saved[0].detach();
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;  // as in forward
      if (fused)
        call_scale_inplace(args, grad, target, go);
      else if (inplace)
        call_backward_inplace(args, grad, target, saved[2], go);
      else
        grad = call_backward(args, grad, target, saved[2], go);
    }
    if (fused || inplace) {
      ctx->saved_data["consumed"] = true;           // its presence says so
      ::torch::autograd::impl::bump_version(grad);  // shares saved[0]'s version counter
    }
    if (::torch::autograd::GradMode::is_enabled()) {
      // create_graph: the gradient is not itself differentiable; fail if that is ever needed.
      grad = ::torch::autograd::DelayedError(
                 "xent: vocab_parallel_cross_entropy is differentiable once only (its gradient "
                 "has no gradient)",
                 1)
                 .apply({grad.detach().requires_grad_()})[0];
    }
    return {grad,         at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CrossEntropyResult run(const at::Tensor& logits_in, const at::Tensor& target_in, const OpArgs& args,
                       const CrossEntropyOptions& o) {
  check_inputs(logits_in, target_in);
  parse_reduction(args.reduction);  // a bad name fails here, before any work
  const at::Tensor logits = as_rows(logits_in);
  const at::Tensor target = target_in.dim() == 1 && target_in.is_contiguous()
                                ? target_in
                                : target_in.reshape({-1}).contiguous();
  const bool autograd = o.grad_mode != GradMode::none && logits.requires_grad() &&
                        ::torch::autograd::GradMode::is_enabled();
  if (autograd && o.inplace_grad) {
    TORCH_CHECK(!logits_in.is_leaf(),
                "xent: inplace_grad = true but the logits are a leaf tensor that requires grad: "
                "their storage cannot hold their own gradient (use inplace_grad = false, or pass "
                "the output of the layer that made them)");
    TORCH_CHECK(!(logits_in.is_view() && logits_in._base().is_leaf()),
                "xent: inplace_grad = true but the logits are a view of a leaf tensor that "
                "requires grad: their storage cannot hold the gradient (use inplace_grad = false)");
  }
  // lse and z_loss as outputs of their own only where asked (the fused loss needs neither).
  const bool with_stats = o.return_lse || o.return_z_loss;
  at::Tensor loss, lse, zl, argmax, accuracy;
  if (autograd) {
    variable_list out = VocabParallelCrossEntropy::apply(
        logits, target, args, o.grad_mode, o.inplace_grad, o.compute_accuracy, with_stats);
    loss = out[0], lse = out[1], zl = out[2], argmax = out[3], accuracy = out[4];
  } else {
    // Nothing will ask for a gradient: the logits are only read.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(loss, lse, zl, argmax, accuracy, std::ignore) =
        call_forward(args, logits, target, ForwardMode::none, o.compute_accuracy, with_stats);
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
