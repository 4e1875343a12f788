// Shared by the adapter's sources: the core's errors as LibTorch errors, the arguments every
// operator of torch.ops.xent takes, and the internal operators that the autograd node calls.
//
// The internal operators (torch.ops.xent._forward and friends, docs/torch.md) are functional
// steps on 2-D logits [rows, cols] and 1-D targets [rows]; every piece of state they need is an
// argument (the group by its c10d name, the options), so that torch.compile can trace the
// forward and the autograd node into a graph of them. Their fake kernels live in
// python/xent/_fake.py.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <utility>

#include "xent/linear.h"
#include "xent/torch.h"

// The adapter's own argument checks: a c10::Error (RuntimeError in Python) whose message starts
// "xent: " as the core's errors do (src/error.h). The rest of the arguments are TORCH_CHECK's.
#define XENT_CHECK(cond, ...) TORCH_CHECK(cond, "xent: ", __VA_ARGS__)

namespace xent::torch::detail {

// Runs a call into the core; its xent::Error (std::runtime_error) becomes a c10::Error, as the
// adapter's own checks are, so that C++ callers catch one type and Python sees a RuntimeError.
template <typename F>
decltype(auto) core_call(F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const xent::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// What describes the problem, as every operator's schema lists it after the tensors:
//   str group_name, int ignore_index, float label_smoothing, float z_loss, float softcap,
//   str reduction, int vocab_start, int vocab_size, float grad_scale
struct OpArgs {
  std::string group_name;  // "" is one rank, no process group
  int64_t ignore_index = -100;
  double label_smoothing = 0.0, z_loss = 0.0, softcap = 0.0;
  std::string reduction = "mean";
  int64_t vocab_start = -1, vocab_size = -1;
  double grad_scale = 1.0;

  // The operator arguments, as the schemas list them (op.cpp, ops.cpp).
  static OpArgs of(c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                   double z_loss, double softcap, c10::string_view reduction, int64_t vocab_start,
                   int64_t vocab_size, double grad_scale);
  // From the C++ API's options (the group by its c10d name).
  static OpArgs of(const CrossEntropyOptions& o, std::string group_name);
  // The C++ API's options that these arguments describe (the rest at their defaults).
  CrossEntropyOptions options() const;
};
#define XENT_OP_ARGS_SCHEMA                                                                    \
  "str group_name, int ignore_index, float label_smoothing, float z_loss, float softcap, str " \
  "reduction, int vocab_start, int vocab_size, float grad_scale"

// (loss, lse, z_loss, argmax, accuracy, grad): loss [rows] for reduction "none", else []; lse
// [rows] with with_stats or where _forward wrote a gradient (with_grad: the fused backward
// recomputes rows from it), else [0]; z_loss [rows] with with_stats, else [0]; argmax [rows] and
// accuracy [] with compute_accuracy, else both [0]; grad the gradient [rows, cols] (contiguous)
// where _forward wrote one (with_grad), else [0].
using ForwardOut =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Registers the internal operators' CPU and CUDA kernels (ops.cpp).
void register_kernels(::torch::Library& m);

// The internal operators, called through the dispatcher (so that fake tensors and tracing reach
// their fake kernels).
// mode none: the logits only read; fused: the gradient into a new tensor; fused_inplace: over
// the logits (their storage, which the caller has bumped the version of).
enum class ForwardMode { none, fused, fused_inplace };
ForwardOut call_forward(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                        ForwardMode mode, bool compute_accuracy, bool with_stats);
at::Tensor call_backward(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                         const at::Tensor& lse, const std::optional<at::Tensor>& grad_output);
void call_backward_inplace(const OpArgs& a, const at::Tensor& logits, const at::Tensor& target,
                           const at::Tensor& lse, const std::optional<at::Tensor>& grad_output);
void call_scale_inplace(const OpArgs& a, const at::Tensor& grad, const at::Tensor& target,
                        const std::optional<at::Tensor>& grad_output);
// The fused backward out of place: `grad` is _forward's gradient (for grad_output = grad_scale);
// the rows whose grad_output is not grad_scale are recomputed into it from the intact logits.
void call_backward_fused(const OpArgs& a, const at::Tensor& grad, const at::Tensor& logits,
                         const at::Tensor& target, const at::Tensor& lse,
                         const std::optional<at::Tensor>& grad_output);

// The process group registered under `name` in c10d ("" gives null: one rank).
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name);
// A c10d name under which `group` resolves: its own, or (a group made in C++ and never
// registered) one that xent registers for it. "" for null.
std::string name_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// PyTorch's CUDA caching allocator as an xent::Allocator, on the call's stream (raw_alloc_with_
// stream / raw_delete): every CUDA call's scratch comes from it.
Allocator* caching_allocator();

// The xent::Group and the core options of one call, planned (and cached) as core_options says.
struct Setup {
  Group group;
  Options opt;
};
Setup setup(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device device, int64_t cols,
            const CrossEntropyOptions& o);

// The public operators torch.ops.xent.vocab_parallel_cross_entropy and _stats, as their schemas
// (op.cpp) list the arguments; also called directly by xent._C (python.cpp).
at::Tensor loss_entry(const at::Tensor& logits, const at::Tensor& target,
                      c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                      double z_loss, double softcap, c10::string_view reduction,
                      int64_t vocab_start, int64_t vocab_size, c10::string_view grad_mode,
                      bool inplace_grad, double grad_scale);
// (loss, lse, z_loss, argmax, accuracy)
using StatsOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
StatsOut stats_entry(const at::Tensor& logits, const at::Tensor& target,
                     c10::string_view group_name, int64_t ignore_index, double label_smoothing,
                     double z_loss, double softcap, c10::string_view reduction, int64_t vocab_start,
                     int64_t vocab_size, c10::string_view grad_mode, bool inplace_grad,
                     bool compute_accuracy, double grad_scale);

// [..., cols] as [rows, cols] with a unit column stride and rows that do not overlap (what the
// core's views take): a view where possible, else one copy (function.cpp).
at::Tensor as_rows(const at::Tensor& t);
// target's checks against the input whose rows it labels: int64 or int32, and input's shape
// without the last dimension. input_has / inputs name it in the message ("logits have", "the
// logits'").
void check_targets(const at::Tensor& target, const at::Tensor& input, const char* input_has,
                   const char* inputs);

// The whole call on N-D logits (every public entry point ends here): shapes and types checked,
// leading dimensions flattened, the autograd node attached when a gradient is wanted.
CrossEntropyResult run(const at::Tensor& logits, const at::Tensor& target, const OpArgs& args,
                       const CrossEntropyOptions& o);

// ------------------------------------------------------------------------- the fused lm head

// Its own arguments, as its schemas list them after the OpArgs:
//   bool sequence_parallel, int chunk_rows, int max_scratch_bytes, str schedule
struct LinearArgs {
  bool sequence_parallel = false;
  int64_t chunk_rows = 0;         // 0: from the budget
  int64_t max_scratch_bytes = 0;  // LinearOptions::max_scratch_bytes; 0: the default budget
  std::string schedule = "auto";  // LinearOptions::schedule: "auto", "fast" or "lean"

  static LinearArgs of(const LinearCrossEntropyOptions& o);
  // The core's options, the scratch of CUDA tensors from PyTorch's caching allocator;
  // max_scratch_bytes checked (>= 0) first, the rest is the core's.
  LinearOptions options(bool cuda) const;
};
#define XENT_LINEAR_ARGS_SCHEMA \
  "bool sequence_parallel, int chunk_rows, int max_scratch_bytes, str schedule"

// (loss, lse, d_hidden, d_weight): loss [rows] for reduction "none", else []; lse [rows] (the
// backward recomputes from it); d_hidden [rows, H] and d_weight [V_local, H] (contiguous, their
// input's dtype) where asked, for grad_output = grad_scale, else [0].
using LinearForwardOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// (d_hidden, d_weight), each [0] where not asked.
using LinearGrads = std::tuple<at::Tensor, at::Tensor>;

// Whether torch's current stream on `device` is being captured into a CUDA graph (false for the
// CPU): nothing may then be read back to the host (linear_ops.cpp).
bool capturing(const at::Device& device);

// Registers the CPU and CUDA kernels of _linear_forward, _linear_backward and
// _linear_backward_fused (linear_ops.cpp; CUDA tensors reach the core, which refuses them).
void register_linear_kernels(::torch::Library& m);

// The internal operators through the dispatcher (linear.cpp). hidden [rows, H], weight
// [V_local, H], target [rows]: this rank's rows (every row without sequence parallelism).
// No gradient asked: the loss and lse only.
LinearForwardOut call_linear_forward(const OpArgs& a, const LinearArgs& l, const at::Tensor& hidden,
                                     const at::Tensor& weight, const at::Tensor& target,
                                     bool d_hidden, bool d_weight);
// The deferred backward: the gradients asked for, recomputed from lse with grad_output applied
// before their one rounding.
LinearGrads call_linear_backward(const OpArgs& a, const LinearArgs& l, const at::Tensor& hidden,
                                 const at::Tensor& weight, const at::Tensor& target,
                                 const at::Tensor& lse,
                                 const std::optional<at::Tensor>& grad_output, bool d_hidden,
                                 bool d_weight);
// The fused backward: d_hidden and d_weight are _linear_forward's (for grad_output =
// grad_scale; [0] where not computed); rewritten by the deferred backward unless grad_output
// equals grad_scale on every rank.
void call_linear_backward_fused(const OpArgs& a, const LinearArgs& l, const at::Tensor& d_hidden,
                                const at::Tensor& d_weight, const at::Tensor& hidden,
                                const at::Tensor& weight, const at::Tensor& target,
                                const at::Tensor& lse,
                                const std::optional<at::Tensor>& grad_output);

// The public operator torch.ops.xent.linear_cross_entropy, as its schema (op.cpp) lists the
// arguments: checks, leading dimensions flattened, the autograd node (linear.cpp).
at::Tensor linear_entry(const at::Tensor& hidden, const at::Tensor& weight,
                        const at::Tensor& target, c10::string_view group_name,
                        bool sequence_parallel, int64_t ignore_index, double label_smoothing,
                        double z_loss, double softcap, c10::string_view reduction,
                        int64_t vocab_start, int64_t vocab_size, c10::string_view grad_mode,
                        double grad_scale, int64_t chunk_rows, int64_t max_scratch_bytes,
                        c10::string_view schedule);

}  // namespace xent::torch::detail
