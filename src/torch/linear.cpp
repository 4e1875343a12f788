// linear_cross_entropy on torch tensors, the fused lm head: input checks, leading dimensions
// flattened, and the hand-written autograd node (LinearCrossEntropyBackward). As the logits op
// (function.cpp), the forward and the node call the internal operators (linear_ops.cpp) through
// the dispatcher and keep no state but their arguments, so that torch.compile traces them.
//
// Exactness: every element of d_hidden and d_weight is rounded once to its dtype, for every
// grad_output. Fused, forward computes them for grad_output = grad_scale and backward returns
// them where grad_output is exactly that, else recomputes them (deferred, grad_output applied
// before the one rounding); a rounded gradient is never rescaled.
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
#include <tuple>

#include "internal.h"

namespace xent::torch {
namespace detail {

LinearArgs LinearArgs::of(const LinearCrossEntropyOptions& o) {
  return {o.sequence_parallel, o.chunk_rows,
          o.max_scratch_bytes != 0 ? o.max_scratch_bytes : o.max_chunk_bytes,
          o.schedule == LinearSchedule::automatic ? "auto" : xent::to_string(o.schedule)};
}

LinearOptions LinearArgs::options(bool cuda) const {
  XENT_CHECK(chunk_rows >= 0, "chunk_rows = ", chunk_rows,
             ": must be >= 1, or 0 (rows per chunk from the budget)");
  XENT_CHECK(max_scratch_bytes >= 0, "max_scratch_bytes = ", max_scratch_bytes,
             ": must be >= 0 (0: the default budget)");
  XENT_CHECK(schedule == "auto" || schedule == "fast" || schedule == "lean", "schedule = \"",
             schedule, "\": must be \"auto\", \"fast\" or \"lean\"");
  LinearOptions o;
  o.schedule = schedule == "fast"   ? LinearSchedule::fast
               : schedule == "lean" ? LinearSchedule::lean
                                    : LinearSchedule::automatic;
  o.sequence_parallel = sequence_parallel;
  o.chunk_rows = chunk_rows;
  o.max_scratch_bytes = static_cast<size_t>(max_scratch_bytes);
  if (cuda) o.allocator = caching_allocator();  // CPU tensors: malloc, as PyTorch's CPU allocator
  return o;
}

// ------------------------------------------------------------ the internal operators, by name

namespace {

c10::OperatorHandle linear_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The arguments every internal operator of the lm head takes after its tensors: the OpArgs, the
// LinearArgs (the forward and _linear_backward add two bools).
#define XENT_TAIL_TYPES                                                                          \
  c10::string_view, int64_t, double, double, double, c10::string_view, int64_t, int64_t, double, \
      bool, int64_t, int64_t, c10::string_view
using Tail = std::tuple<XENT_TAIL_TYPES>;
Tail tail(const OpArgs& a, const LinearArgs& l) {
  return {a.group_name, a.ignore_index,      a.label_smoothing, a.z_loss,     a.softcap,
          a.reduction,  a.vocab_start,       a.vocab_size,      a.grad_scale, l.sequence_parallel,
          l.chunk_rows, l.max_scratch_bytes, l.schedule};
}

}  // namespace

LinearForwardOut call_linear_forward(const OpArgs& a, const LinearArgs& l, const at::Tensor& hidden,
                                     const at::Tensor& weight, const at::Tensor& target,
                                     bool d_hidden, bool d_weight) {
  using Sig = LinearForwardOut(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               XENT_TAIL_TYPES, bool, bool);
  static const auto op = linear_op("xent::_linear_forward").typed<Sig>();
  return std::apply(
      [&](auto... t) { return op.call(hidden, weight, target, t..., d_hidden, d_weight); },
      tail(a, l));
}

LinearGrads call_linear_backward(const OpArgs& a, const LinearArgs& l, const at::Tensor& hidden,
                                 const at::Tensor& weight, const at::Tensor& target,
                                 const at::Tensor& lse,
                                 const std::optional<at::Tensor>& grad_output, bool d_hidden,
                                 bool d_weight) {
  using Sig =
      LinearGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const std::optional<at::Tensor>&, XENT_TAIL_TYPES, bool, bool);
  static const auto op = linear_op("xent::_linear_backward").typed<Sig>();
  return std::apply(
      [&](auto... t) {
        return op.call(hidden, weight, target, lse, grad_output, t..., d_hidden, d_weight);
      },
      tail(a, l));
}

void call_linear_backward_fused(const OpArgs& a, const LinearArgs& l, const at::Tensor& d_hidden,
                                const at::Tensor& d_weight, const at::Tensor& hidden,
                                const at::Tensor& weight, const at::Tensor& target,
                                const at::Tensor& lse,
                                const std::optional<at::Tensor>& grad_output) {
  using Sig =
      void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, XENT_TAIL_TYPES);
  static const auto op = linear_op("xent::_linear_backward_fused").typed<Sig>();
  std::apply(
      [&](auto... t) {
        op.call(d_hidden, d_weight, hidden, weight, target, lse, grad_output, t...);
      },
      tail(a, l));
}
#undef XENT_TAIL_TYPES

namespace {

using ::torch::autograd::Node;
using ::torch::autograd::SavedVariable;
using ::torch::autograd::variable_list;

void check_linear_inputs(const at::Tensor& hidden, const at::Tensor& weight,
                         const at::Tensor& target) {
  XENT_CHECK(hidden.defined(), "hidden is an undefined tensor");
  XENT_CHECK(weight.defined(), "weight is an undefined tensor");
  XENT_CHECK(target.defined(), "target is an undefined tensor");
  XENT_CHECK(hidden.dim() >= 1,
             "hidden must have a last (hidden size) dimension, got a 0-D tensor");
  const at::ScalarType dt = hidden.scalar_type();
  XENT_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
             "hidden must be float32, bfloat16 or float16, got ", dt);
  XENT_CHECK(weight.scalar_type() == dt, "weight is ", weight.scalar_type(), " but hidden is ", dt,
             ": both must have the same dtype");
  XENT_CHECK(hidden.device().is_cpu() || hidden.device().is_cuda(), "hidden is on ",
             hidden.device(), ": the fused lm head takes CPU or CUDA tensors");
  XENT_CHECK(weight.device() == hidden.device() && target.device() == hidden.device(),
             "weight is on ", weight.device(), " and target on ", target.device(),
             " but hidden is on ", hidden.device(), ": all three must be on the same device");
  XENT_CHECK(hidden.layout() == at::kStrided && weight.layout() == at::kStrided,
             "hidden and weight must be dense (strided) tensors, got ", hidden.layout(), " and ",
             weight.layout());
  XENT_CHECK(hidden.size(-1) >= 1, "hidden has shape ", hidden.sizes(),
             ": its last dimension (the hidden size) must be >= 1");
  XENT_CHECK(weight.dim() == 2, "weight has shape ", weight.sizes(),
             ": must be 2-D, [V_local, H] (this rank's rows of the vocabulary, the hidden size)");
  XENT_CHECK(weight.size(1) == hidden.size(-1), "hidden.shape[-1] = ", hidden.size(-1),
             " but weight.shape[1] = ", weight.size(1),
             ": they must be equal (the hidden size; weight is [V_local, H])");
  XENT_CHECK(weight.size(0) >= 1, "weight.shape[0] = 0: must be >= 1 (this rank's rows of the ",
             "vocabulary)");
  check_targets(target, hidden, "hidden has", "hidden's");
}

// The loss's autograd node, written as PyTorch's generated nodes are (see function.cpp). Edges:
// hidden (flattened), weight.
struct LinearCrossEntropyBackward final : Node {
  OpArgs args;
  LinearArgs largs;
  bool need_d_hidden = false, need_d_weight = false;
  // Fused: forward's gradients (for grad_output = grad_scale), until a backward has used them.
  bool forward_gradients = false;
  SavedVariable hidden, weight, target, lse, d_hidden, d_weight;

  std::string name() const override { return "LinearCrossEntropyBackward"; }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&hidden, &weight, &target, &lse, &d_hidden, &d_weight})
      v->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    // No gradient reached the loss (it was not used): hidden's and weight's are zero.
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    // Unpacking checks the versions: a later in-place change to a saved tensor fails here.
    const at::Tensor h = hidden.unpack().detach(), w = weight.unpack().detach();
    const at::Tensor t = target.unpack();
    const std::optional<at::Tensor> go =
        grads[0].to(h.device(), at::kFloat).contiguous().view({-1});
    at::Tensor dh, dw;
    {
      // Straight to the kernels: autograd has nothing to do for the internal operators.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      if (forward_gradients) {
        dh = d_hidden.unpack().detach();
        dw = d_weight.unpack().detach();
        call_linear_backward_fused(args, largs, dh, dw, h, w, t, lse.unpack(), go);
        // Returned (and maybe rewritten): a second backward (retain_graph) recomputes.
        forward_gradients = false;
        d_hidden.reset_data();
        d_weight.reset_data();
      } else {
        std::tie(dh, dw) = call_linear_backward(args, largs, h, w, t, lse.unpack(), go,
                                                need_d_hidden && task_should_compute_output(0),
                                                need_d_weight && task_should_compute_output(1));
      }
    }
    variable_list out(2);
    for (size_t i = 0; i < 2; ++i) {
      at::Tensor g = i == 0 ? dh : dw;
      if (g.dim() != 2) continue;  // not computed: [0]
      // create_graph: the gradients are not themselves differentiable; fail if that is needed.
      if (::torch::autograd::GradMode::is_enabled())
        g = ::torch::autograd::DelayedError(
                "xent: linear_cross_entropy is differentiable once only (its gradients have no "
                "gradient)",
                1)
                .apply({g.detach().requires_grad_()})[0];
      out[i] = g;
    }
    return out;
  }
};

// The whole call (every public entry point ends here).
at::Tensor run_linear(const at::Tensor& hidden_in, const at::Tensor& weight_in,
                      const at::Tensor& target_in, const OpArgs& args, const LinearArgs& largs,
                      GradMode mode) {
  check_linear_inputs(hidden_in, weight_in, target_in);
  const Reduction reduction = parse_reduction(args.reduction);  // a bad name fails before work
  largs.options(false);                                         // so do bad chunk options
  XENT_CHECK(std::isfinite(args.grad_scale) && args.grad_scale > 0.0,
             "grad_scale = ", args.grad_scale, ": must be finite and > 0");
  XENT_CHECK(args.grad_scale == 1.0 || mode == GradMode::fused, "grad_scale = ", args.grad_scale,
             " with grad_mode = ", to_string(mode),
             ": grad_scale applies to grad_mode = fused only; leave it at 1");
  const at::Tensor hidden = as_rows(hidden_in), weight = as_rows(weight_in);
  const at::Tensor target = target_in.reshape({-1}).contiguous();
  const bool grad_on = mode != GradMode::none && ::torch::autograd::GradMode::is_enabled();
  const bool need_dh = grad_on && hidden.requires_grad();
  const bool need_dw = grad_on && weight.requires_grad();
  // Captured into a CUDA graph, backward cannot read on the host whether grad_output equals
  // grad_scale (forward_gradients_final), so it always recomputes: forward computes no
  // gradients there, only what deferred's does.
  const bool fused = mode == GradMode::fused && !capturing(hidden.device());
  at::Tensor loss, lse, dh, dw;
  {
    // Straight to the kernel (see function.cpp).
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(loss, lse, dh, dw) = call_linear_forward(args, largs, hidden, weight, target,
                                                      fused && need_dh, fused && need_dw);
  }
  if (need_dh || need_dw) {
    std::shared_ptr<LinearCrossEntropyBackward> node(new LinearCrossEntropyBackward(),
                                                     ::torch::autograd::deleteNode);
    node->set_next_edges(::torch::autograd::collect_next_edges(hidden, weight));
    node->args = args;
    node->largs = largs;
    node->need_d_hidden = need_dh;
    node->need_d_weight = need_dw;
    node->forward_gradients = fused;
    // hidden and weight are kept for a recompute (references, no copies).
    node->hidden = SavedVariable(hidden, /*is_output=*/false);
    node->weight = SavedVariable(weight, false);
    node->target = SavedVariable(target, false);
    node->lse = SavedVariable(lse, false);
    if (fused) {
      node->d_hidden = SavedVariable(dh, false);
      node->d_weight = SavedVariable(dw, false);
    }
    ::torch::autograd::set_history(loss, node);
  }
  return reduction == Reduction::none ? loss.view(target_in.sizes()) : loss;
}

}  // namespace

at::Tensor linear_entry(const at::Tensor& hidden, const at::Tensor& weight,
                        const at::Tensor& target, c10::string_view group_name,
                        bool sequence_parallel, int64_t ignore_index, double label_smoothing,
                        double z_loss, double softcap, c10::string_view reduction,
                        int64_t vocab_start, int64_t vocab_size, c10::string_view grad_mode,
                        double grad_scale, int64_t chunk_rows, int64_t max_scratch_bytes,
                        c10::string_view schedule) {
  return run_linear(
      hidden, weight, target,
      OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction, vocab_start,
                 vocab_size, grad_scale),
      LinearArgs{sequence_parallel, chunk_rows, max_scratch_bytes, std::string(schedule)},
      parse_grad_mode(std::string(grad_mode)));
}

}  // namespace detail

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& target,
                                const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                const LinearCrossEntropyOptions& o) {
  const CrossEntropyOptions& l = o.loss;
  XENT_CHECK(!l.inplace_grad && !l.return_lse && !l.return_z_loss && !l.compute_accuracy,
             "LinearCrossEntropyOptions::loss: inplace_grad, return_lse, return_z_loss and "
             "compute_accuracy do not apply to the fused lm head; leave them false");
  return detail::run_linear(hidden, weight, target, detail::OpArgs::of(l, detail::name_of(group)),
                            detail::LinearArgs::of(o), l.grad_mode);
}

}  // namespace xent::torch
