// The kernels of the fused lm head's internal operators torch.ops.xent._linear_forward,
// _linear_backward and _linear_backward_fused (schemas in op.cpp): each one call into the core's
// linear_forward or linear_backward (xent/linear.h) on hidden [rows, H], weight [V_local, H] and
// target [rows], the outputs allocated with torch. The caller (linear.cpp) has checked shapes and
// types; the core checks the rest.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "internal.h"

namespace xent::torch::detail {
namespace {

// A 2-D tensor with a unit column stride (function.cpp's as_rows made it so).
MatrixView matrix_of(const at::Tensor& t) {
  const at::ScalarType s = t.scalar_type();
  MatrixView v;
  v.data = t.numel() > 0 ? t.data_ptr() : nullptr;
  v.dtype = s == at::kBFloat16 ? DType::bf16 : s == at::kHalf ? DType::f16 : DType::f32;
  v.rows = t.size(0);
  v.cols = t.size(1);
  v.row_stride = t.size(0) > 1 ? t.stride(0) : t.size(1);
  return v;
}

TargetsView targets_of(const at::Tensor& t) {
  return {t.numel() > 0 ? t.data_ptr() : nullptr,
          t.scalar_type() == at::kInt ? IndexType::i32 : IndexType::i64, t.size(0)};
}

// A gradient output: [0] (1-D) where it is not computed, else the matrix.
MatrixView gradient_of(const at::Tensor& t) {
  return t.dim() == 2 ? matrix_of(t) : MatrixView{};
}

// The gradient of `input` (contiguous, its dtype: rounded once from fp32), or [0] unless asked.
at::Tensor new_gradient(const at::Tensor& input, bool asked) {
  return asked ? at::empty(input.sizes(), input.options()) : at::empty({0}, input.options());
}

// The group and core options of one call. Every tensor must be on hidden's device (torch
// allocates the outputs there), checked here so that the core need not ask the driver.
Setup linear_setup(const OpArgs& a, const at::Tensor& hidden, const at::Tensor& weight,
                   std::initializer_list<const at::Tensor*> others, GradMode mode) {
  for (const at::Tensor* t : others)
    XENT_CHECK(!t->defined() || t->numel() == 0 || t->device() == hidden.device(),
               "a tensor is on ", t->device(), " but hidden is on ", hidden.device(),
               ": every tensor of a call must be on hidden's device");
  CrossEntropyOptions o = a.options();
  o.grad_mode = mode;
  Setup s = setup(resolve_group(a.group_name), hidden.device(), weight.size(0), o);
  s.opt.check_pointers = false;
  return s;
}

cudaStream_t stream_of(const at::Device& d) {
  return d.is_cuda() ? at::cuda::getCurrentCUDAStream(d.index()).stream() : nullptr;
}

}  // namespace

bool capturing(const at::Device& device) {
  if (!device.is_cuda()) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream_of(device), &capture);
  XENT_CHECK(e == cudaSuccess, "cudaStreamIsCapturing: ", cudaGetErrorString(e));
  return capture != cudaStreamCaptureStatusNone;
}

namespace {

// grad_output as the core takes it: float32, contiguous, one value (mean, sum) or one per row of
// this rank (none); null (absent or empty) means 1.
const float* grad_output_ptr(const std::optional<at::Tensor>& go, const OpArgs& a, int64_t rows) {
  if (!go || !go->defined() || go->numel() == 0) return nullptr;
  XENT_CHECK(go->scalar_type() == at::kFloat && go->is_contiguous(),
             "grad_output must be a contiguous float32 tensor, got ", go->scalar_type());
  const int64_t want = a.reduction == "none" ? rows : 1;
  XENT_CHECK(go->numel() == want, "grad_output has ", go->numel(),
             " elements with reduction = ", a.reduction, ": must have ", want,
             a.reduction == "none" ? " (one per row)" : "");
  return go->data_ptr<float>();
}

// Whether forward's gradients (computed for grad_output = grad_scale) are final: grad_output
// (undefined: 1) equals grad_scale in every element, on every rank. The recompute is a
// collective, so the ranks agree first (an all-gather of one byte each). CUDA tensors are
// compared on the device and the verdict read back (on the current stream of `device`): one
// synchronisation, in backward. While that stream is captured into a CUDA graph nothing can be
// read back (capture refuses the synchronisation): not final, so the gradients are recomputed
// with grad_output on the device, exact whatever its value in each replay (every rank of a
// captured step is capturing alike).
bool forward_gradients_final(const Group& g, const at::Tensor& go, float grad_scale,
                             const at::Device& device) {
  if (capturing(device)) return false;
  const cudaStream_t stream = stream_of(device);
  const uint8_t mine =
      !go.defined() || go.numel() == 0 ? grad_scale == 1.0f : go.eq(grad_scale).all().item<bool>();
  if (g.size() == 1) return mine != 0;
  std::vector<uint8_t> all(static_cast<size_t>(g.size()));
  if (g.backend() == Backend::cpu) {
    core_call([&] { g.comm().all_gather(&mine, all.data(), 1, nullptr); });
  } else {  // the communicator moves device memory
    const at::Tensor d = at::full({1 + g.size()}, mine, go.options().dtype(at::kByte));
    core_call([&] { g.comm().all_gather(d.data_ptr(), d.data_ptr<uint8_t>() + 1, 1, stream); });
    const at::Tensor h = d.cpu();  // the stream's order: torch's current stream is `stream`
    std::copy(h.data_ptr<uint8_t>() + 1, h.data_ptr<uint8_t>() + 1 + g.size(), all.begin());
  }
  return std::all_of(all.begin(), all.end(), [](uint8_t v) { return v != 0; });
}

// The core's deferred backward into d_hidden and d_weight ([0]: not computed). fused: they hold
// _linear_forward's gradients, kept as they are where grad_output is grad_scale on every rank,
// else recomputed (never rescaled: rounded once).
void backward_into(const at::Tensor& d_hidden, const at::Tensor& d_weight, const at::Tensor& hidden,
                   const at::Tensor& weight, const at::Tensor& target, const at::Tensor& lse,
                   const std::optional<at::Tensor>& grad_output, const OpArgs& a,
                   const LinearArgs& l, bool fused) {
  const at::OptionalDeviceGuard guard(hidden.device());
  const at::Tensor go = grad_output.value_or(at::Tensor());
  const Setup s = linear_setup(a, hidden, weight, {&d_hidden, &d_weight, &target, &lse, &go},
                               GradMode::deferred);  // deferred: what a recompute is
  const float* go_ptr = grad_output_ptr(grad_output, a, hidden.size(0));
  if (fused && forward_gradients_final(s.group, go_ptr != nullptr ? go : at::Tensor(),
                                       static_cast<float>(a.grad_scale), hidden.device()))
    return;
  LinearOutputs out;
  out.d_hidden = gradient_of(d_hidden);
  out.d_weight = gradient_of(d_weight);
  const float* lse_ptr = lse.numel() > 0 ? lse.data_ptr<float>() : nullptr;
  core_call([&] {
    xent::linear_backward(s.group, matrix_of(hidden), matrix_of(weight), targets_of(target),
                          lse_ptr, go_ptr, s.opt, l.options(hidden.is_cuda()), out,
                          stream_of(hidden.device()));
  });
}

LinearForwardOut forward_op(const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& target, c10::string_view group_name,
                            int64_t ignore_index, double label_smoothing, double z_loss,
                            double softcap, c10::string_view reduction, int64_t vocab_start,
                            int64_t vocab_size, double grad_scale, bool sequence_parallel,
                            int64_t chunk_rows, int64_t max_scratch_bytes,
                            c10::string_view schedule, bool d_hidden, bool d_weight) {
  const at::OptionalDeviceGuard guard(hidden.device());
  const OpArgs a = OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                              vocab_start, vocab_size, grad_scale);
  const LinearArgs l{sequence_parallel, chunk_rows, max_scratch_bytes, std::string(schedule)};
  const bool fused = d_hidden || d_weight;
  const Setup s =
      linear_setup(a, hidden, weight, {&target}, fused ? GradMode::fused : GradMode::none);
  const int64_t n = hidden.size(0);
  const auto f32 = hidden.options().dtype(at::kFloat);
  LinearForwardOut f;
  auto& [loss, lse, dh, dw] = f;
  loss = s.opt.reduction == Reduction::none ? at::empty({n}, f32) : at::empty({}, f32);
  lse = at::empty({n}, f32);
  dh = new_gradient(hidden, d_hidden);
  dw = new_gradient(weight, d_weight);
  LinearOutputs out;
  out.loss = loss.data_ptr<float>();
  out.lse = n > 0 ? lse.data_ptr<float>() : nullptr;
  out.d_hidden = gradient_of(dh);
  out.d_weight = gradient_of(dw);
  core_call([&] {
    xent::linear_forward(s.group, matrix_of(hidden), matrix_of(weight), targets_of(target), s.opt,
                         l.options(hidden.is_cuda()), out, stream_of(hidden.device()));
  });
  return f;
}

LinearGrads backward_op(const at::Tensor& hidden, const at::Tensor& weight,
                        const at::Tensor& target, const at::Tensor& lse,
                        const std::optional<at::Tensor>& grad_output, c10::string_view group_name,
                        int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
                        c10::string_view reduction, int64_t vocab_start, int64_t vocab_size,
                        double grad_scale, bool sequence_parallel, int64_t chunk_rows,
                        int64_t max_scratch_bytes, c10::string_view schedule, bool d_hidden,
                        bool d_weight) {
  const at::Tensor dh = new_gradient(hidden, d_hidden), dw = new_gradient(weight, d_weight);
  backward_into(dh, dw, hidden, weight, target, lse, grad_output,
                OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                           vocab_start, vocab_size, grad_scale),
                LinearArgs{sequence_parallel, chunk_rows, max_scratch_bytes, std::string(schedule)},
                /*fused=*/false);
  return {dh, dw};
}

void backward_fused_op(const at::Tensor& d_hidden, const at::Tensor& d_weight,
                       const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                       const at::Tensor& lse, const std::optional<at::Tensor>& grad_output,
                       c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                       double z_loss, double softcap, c10::string_view reduction,
                       int64_t vocab_start, int64_t vocab_size, double grad_scale,
                       bool sequence_parallel, int64_t chunk_rows, int64_t max_scratch_bytes,
                       c10::string_view schedule) {
  backward_into(d_hidden, d_weight, hidden, weight, target, lse, grad_output,
                OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                           vocab_start, vocab_size, grad_scale),
                LinearArgs{sequence_parallel, chunk_rows, max_scratch_bytes, std::string(schedule)},
                /*fused=*/true);
}

// The plan _linear_forward (d_hidden or d_weight: fused) would take for these arguments, as
// [schedule (0 fast, 1 lean), budget, scratch bytes, chunk rows, chunk columns, chunks]; a
// collective as the forward is, computing nothing.
std::vector<int64_t> plan_op(const at::Tensor& hidden, const at::Tensor& weight,
                             const at::Tensor& target, c10::string_view group_name,
                             int64_t ignore_index, double label_smoothing, double z_loss,
                             double softcap, c10::string_view reduction, int64_t vocab_start,
                             int64_t vocab_size, double grad_scale, bool sequence_parallel,
                             int64_t chunk_rows, int64_t max_scratch_bytes,
                             c10::string_view schedule, bool d_hidden, bool d_weight) {
  const at::OptionalDeviceGuard guard(hidden.device());
  const OpArgs a = OpArgs::of(group_name, ignore_index, label_smoothing, z_loss, softcap, reduction,
                              vocab_start, vocab_size, grad_scale);
  const LinearArgs l{sequence_parallel, chunk_rows, max_scratch_bytes, std::string(schedule)};
  const bool fused = d_hidden || d_weight;
  const Setup s =
      linear_setup(a, hidden, weight, {&target}, fused ? GradMode::fused : GradMode::none);
  LinearOutputs out;
  // The gradients' shapes and dtypes, as forward's would be (linear_plan reads no data).
  if (d_hidden) out.d_hidden = matrix_of(hidden);
  if (d_weight) out.d_weight = matrix_of(weight);
  LinearPlan p;
  core_call([&] {
    p = xent::linear_plan(s.group, matrix_of(hidden), matrix_of(weight), targets_of(target), s.opt,
                          l.options(hidden.is_cuda()), out);
  });
  return {p.schedule == LinearSchedule::lean ? 1 : 0,
          static_cast<int64_t>(p.budget),
          static_cast<int64_t>(p.scratch_bytes),
          p.chunk_rows,
          p.chunk_cols,
          p.chunks,
          p.gemm == LinearGemm::epilogue ? 1 : 0};
}

}  // namespace

void register_linear_kernels(::torch::Library& m) {
  m.impl("_linear_plan", &plan_op);
  m.impl("_linear_forward", &forward_op);
  m.impl("_linear_backward", &backward_op);
  m.impl("_linear_backward_fused", &backward_fused_op);
}

}  // namespace xent::torch::detail
