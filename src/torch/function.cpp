// vocab_parallel_cross_entropy on torch tensors: input checks, the autograd function (in place
// only when asked: fused or deferred over the logits; otherwise a deferred forward and a backward
// that writes the gradient into a new tensor), the outputs allocated with torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>
#include <vector>

#include "internal.h"
#include "xent/torch.h"

namespace xent::torch {
namespace {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

void check_inputs(const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.defined(), "xent: logits is an undefined tensor");
  TORCH_CHECK(target.defined(), "xent: target is an undefined tensor");
  TORCH_CHECK(logits.dim() == 2, "xent: logits must be 2-D [tokens, vocabulary shard], got a ",
              logits.dim(), "-D tensor of shape ", logits.sizes(),
              " (flatten the leading dimensions: logits.view(-1, logits.size(-1)))");
  const at::ScalarType dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "xent: logits must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(logits.device().is_cpu() || logits.device().is_cuda(),
              "xent: logits must be on a CPU or CUDA device, got ", logits.device());
  TORCH_CHECK(logits.layout() == at::kStrided,
              "xent: logits must be a dense (strided) tensor, got ", logits.layout());
  TORCH_CHECK(logits.size(1) >= 1,
              "xent: logits must have at least one column (this rank's vocabulary shard), got "
              "shape ",
              logits.sizes());
  TORCH_CHECK(logits.size(1) == 1 || logits.stride(1) == 1,
              "xent: logits must be contiguous in the last (vocabulary) dimension, got strides ",
              logits.strides(), " for shape ", logits.sizes(),
              " (call .contiguous(); any row stride is fine)");
  TORCH_CHECK(logits.size(0) <= 1 || logits.stride(0) >= logits.size(1),
              "xent: logits rows overlap: stride(0) = ", logits.stride(0),
              " < size(1) = ", logits.size(1), " (call .contiguous())");
  TORCH_CHECK(target.dim() == 1, "xent: target must be 1-D [tokens], got a ", target.dim(),
              "-D tensor of shape ", target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
              "xent: target must hold int64 or int32 class indices, got ", target.scalar_type());
  TORCH_CHECK(target.size(0) == logits.size(0), "xent: target has ", target.size(0),
              " rows but logits have ", logits.size(0), " (shape ", logits.sizes(),
              "): one target per row");
  TORCH_CHECK(target.device() == logits.device(), "xent: target is on ", target.device(),
              " but logits are on ", logits.device(), ": both must be on the same device");
}

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

struct Forward {
  at::Tensor loss, lse, z_loss, argmax, accuracy;
};

// One forward over `buf` (the logits) with outputs allocated on its device.
Forward run_forward(const Group& group, const at::Tensor& buf, const at::Tensor& target,
                    const Options& opt, bool want_lse, bool want_z_loss) {
  const int64_t n = buf.size(0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(buf.device());
  Forward f;
  f.loss = opt.reduction == Reduction::none ? at::empty({n}, f32) : at::empty({}, f32);
  if (want_lse || opt.grad_mode == GradMode::deferred) f.lse = at::empty({n}, f32);
  if (want_z_loss) f.z_loss = at::empty({n}, f32);
  if (opt.compute_accuracy) {
    f.argmax = at::empty({n}, f32.dtype(at::kLong));
    f.accuracy = at::empty({}, f32);
  }
  Outputs out;
  out.loss = f.loss.data_ptr<float>();
  if (f.lse.defined()) out.lse = f.lse.data_ptr<float>();
  if (f.z_loss.defined()) out.z_loss = f.z_loss.data_ptr<float>();
  if (f.argmax.defined()) {
    out.argmax = f.argmax.data_ptr<int64_t>();
    out.accuracy = f.accuracy.data_ptr<float>();
  }
  detail::core_call([&] {
    xent::forward(group, view_of(buf), view_of_targets(target), opt, out, stream_of(buf.device()));
  });
  return f;
}

// What backward needs besides the saved tensors.
struct Call : ::torch::CustomClassHolder {
  Group group;
  Options opt;  // grad_mode as run: deferred whenever inplace is false
  bool inplace = false;
  bool want_lse = false, want_z_loss = false;
  bool consumed = false;  // the logits now hold the final gradient (in place only)
  explicit Call(Group g) : group(std::move(g)) {}
};

class VocabParallelCrossEntropy : public ::torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  // Outputs: loss, then lse, z_loss, argmax, accuracy where asked (in that order).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const at::Tensor& target, const c10::intrusive_ptr<Call>& call) {
    // fused (only in place): forward writes the gradient over the logits. deferred: forward
    // only reads them, and backward writes the gradient over them (in place) or into a new
    // tensor (the out-of-place backward: no copy of the logits, which stay as they are).
    const bool fused = call->opt.grad_mode == GradMode::fused;
    Forward f =
        run_forward(call->group, logits, target, call->opt, call->want_lse, call->want_z_loss);
    if (fused) ::torch::autograd::impl::bump_version(logits);

    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    // Saved after the bump: autograd's version check then catches any later in-place change.
    if (fused)
      ctx->save_for_backward({logits, target});
    else
      ctx->save_for_backward({logits, target, f.lse});

    variable_list out{f.loss};
    variable_list extra;
    if (call->want_lse) extra.push_back(f.lse);
    if (call->want_z_loss) extra.push_back(f.z_loss);
    if (call->opt.compute_accuracy) {
      extra.push_back(f.argmax);
      extra.push_back(f.accuracy);
    }
    if (!extra.empty()) ctx->mark_non_differentiable(extra);
    out.insert(out.end(), extra.begin(), extra.end());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto call = c10::static_intrusive_pointer_cast<Call>(ctx->saved_data["call"].toCapsule());
    TORCH_CHECK(!call->consumed,
                "xent: backward through vocab_parallel_cross_entropy a second time, but the "
                "first one turned the logits into the gradient (grad_mode = ",
                to_string(call->opt.grad_mode), ", inplace_grad = ", call->inplace,
                "); to backward more than once use inplace_grad = false");
    const variable_list saved = ctx->get_saved_variables();  // checks the versions
    const at::Tensor& target = saved[1];
    const at::Device device = saved[0].device();
    const at::OptionalDeviceGuard guard(device);
    at::Tensor go = grads[0];  // undefined means 1 (passed as null)
    if (go.defined()) go = go.to(device, at::kFloat).contiguous();  // e.g. an expanded [rows] of 1
    const float* go_ptr = go.defined() && go.numel() > 0 ? go.data_ptr<float>() : nullptr;

    at::Tensor grad;
    if (call->opt.grad_mode == GradMode::fused) {
      grad = saved[0].detach();  // the logits, holding the gradient
      detail::core_call([&] {
        xent::backward(call->group, view_of(grad), view_of_targets(target), nullptr, go_ptr,
                       call->opt, stream_of(device));
      });
      call->consumed = true;
      ::torch::autograd::impl::bump_version(grad);
    } else {
      const at::Tensor logits = saved[0].detach();
      const at::Tensor& lse = saved[2];
      const float* lse_ptr = lse.numel() > 0 ? lse.data_ptr<float>() : nullptr;
      if (call->inplace) {
        grad = logits;
        detail::core_call([&] {
          xent::backward(call->group, view_of(grad), view_of_targets(target), lse_ptr, go_ptr,
                         call->opt, stream_of(device));
        });
        call->consumed = true;
        ::torch::autograd::impl::bump_version(grad);  // shares the logits' version counter
      } else {
        // A new contiguous tensor, written once; the logits are only read.
        grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
        detail::core_call([&] {
          xent::backward(call->group, view_of(logits), view_of(grad), view_of_targets(target),
                         lse_ptr, go_ptr, call->opt, stream_of(device));
        });
      }
    }
    if (::torch::autograd::GradMode::is_enabled()) {
      // create_graph: the gradient is not itself differentiable; fail if that is ever needed.
      grad = ::torch::autograd::DelayedError(
                 "xent: vocab_parallel_cross_entropy is differentiable once only (its gradient "
                 "has no gradient)",
                 1)
                 .apply({grad.detach().requires_grad_()})[0];
    }
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CrossEntropyResult vocab_parallel_cross_entropy(const at::Tensor& logits,
                                                const at::Tensor& target_in,
                                                const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                const CrossEntropyOptions& o) {
  check_inputs(logits, target_in);
  const at::Tensor target = target_in.contiguous();
  const at::Device device = logits.device();
  const at::OptionalDeviceGuard guard(device);

  Options opt = core_options(pg, device, logits.size(1), o);  // (creates the group if new)
  const Group group = group_for(pg, device);                  // (then only looks it up)
  const bool autograd = o.grad_mode != GradMode::none && logits.requires_grad() &&
                        ::torch::autograd::GradMode::is_enabled();
  CrossEntropyResult r;
  if (!autograd) {
    opt.grad_mode = GradMode::none;  // nothing will ask for a gradient: leave the logits alone
    Forward f = run_forward(group, logits, target, opt, o.return_lse, o.return_z_loss);
    r.loss = f.loss;
    if (o.return_lse) r.lse = f.lse;
    r.z_loss = f.z_loss;
    r.argmax = f.argmax;
    r.accuracy = f.accuracy;
    return r;
  }
  if (o.inplace_grad) {
    TORCH_CHECK(!logits.is_leaf(),
                "xent: inplace_grad = true but the logits are a leaf tensor that requires grad: "
                "their storage cannot hold their own gradient (use inplace_grad = false, or pass "
                "the output of the layer that made them)");
    TORCH_CHECK(!(logits.is_view() && logits._base().is_leaf()),
                "xent: inplace_grad = true but the logits are a view of a leaf tensor that "
                "requires grad: their storage cannot hold the gradient (use inplace_grad = false)");
  }
  auto call = c10::make_intrusive<Call>(group);
  call->opt = opt;
  // Not in place: a deferred forward (nothing written) and an out-of-place backward, whichever
  // mode was asked for; the gradient is the same up to rounding (one rounding, not two).
  if (!o.inplace_grad) call->opt.grad_mode = GradMode::deferred;
  call->inplace = o.inplace_grad;
  call->want_lse = o.return_lse;
  call->want_z_loss = o.return_z_loss;
  variable_list out = VocabParallelCrossEntropy::apply(logits, target, call);
  size_t k = 0;
  r.loss = out[k++];
  if (o.return_lse) r.lse = out[k++];
  if (o.return_z_loss) r.z_loss = out[k++];
  if (o.compute_accuracy) {
    r.argmax = out[k++];
    r.accuracy = out[k++];
  }
  return r;
}

at::Tensor vocab_parallel_cross_entropy_loss(const at::Tensor& logits, const at::Tensor& target,
                                             const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             const CrossEntropyOptions& options) {
  return vocab_parallel_cross_entropy(logits, target, group, options).loss;
}

}  // namespace xent::torch
