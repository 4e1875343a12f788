// xent._C: the public operators called straight from Python, for `import xent` in eager mode.
//
// torch.ops.xent.vocab_parallel_cross_entropy(...) parses its 13 arguments against the schema
// into a stack of IValues and calls the operator boxed: host time on every call that this direct
// call does not spend (bench/host_call.py; figures in docs/torch.md), and more when the step
// starts from an idle GPU, where every microsecond before the first kernel is a microsecond on
// the GPU's clock. The functions here take the same arguments and end in the same code (op.cpp's
// loss_entry and stats_entry), so the two paths cannot differ.
// python/xent/__init__.py calls them only where the operator would do nothing else: plain
// tensors, no torch.compile tracing and no __torch_function__ mode (those take torch.ops).
#include <ATen/record_function.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "internal.h"

namespace {

namespace py = pybind11;
namespace detail = xent::torch::detail;

at::Tensor loss(const at::Tensor& logits, const at::Tensor& target, const std::string& group_name,
                int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
                const std::string& reduction, int64_t vocab_start, int64_t vocab_size,
                const std::string& grad_mode, bool inplace_grad, double grad_scale) {
  // Errors and warnings reach Python as torch.ops delivers them (RuntimeError without the C++
  // backtrace, TORCH_SHOW_CPP_STACKTRACES honoured); the GIL is released during the call, as
  // torch.ops does (a Python kernel or mode that the internal operators reach takes it again).
  HANDLE_TH_ERRORS
  const py::gil_scoped_release no_gil;
  // Profiler traces show the call under the operator's own name, as through torch.ops.
  RECORD_FUNCTION("xent::vocab_parallel_cross_entropy", std::vector<c10::IValue>());
  return detail::loss_entry(logits, target, group_name, ignore_index, label_smoothing, z_loss,
                            softcap, reduction, vocab_start, vocab_size, grad_mode, inplace_grad,
                            grad_scale);
  END_HANDLE_TH_ERRORS_PYBIND
}

detail::StatsOut stats(const at::Tensor& logits, const at::Tensor& target,
                       const std::string& group_name, int64_t ignore_index, double label_smoothing,
                       double z_loss, double softcap, const std::string& reduction,
                       int64_t vocab_start, int64_t vocab_size, const std::string& grad_mode,
                       bool inplace_grad, bool compute_accuracy, double grad_scale) {
  HANDLE_TH_ERRORS
  const py::gil_scoped_release no_gil;
  RECORD_FUNCTION("xent::vocab_parallel_cross_entropy_stats", std::vector<c10::IValue>());
  return detail::stats_entry(logits, target, group_name, ignore_index, label_smoothing, z_loss,
                             softcap, reduction, vocab_start, vocab_size, grad_mode, inplace_grad,
                             compute_accuracy, grad_scale);
  END_HANDLE_TH_ERRORS_PYBIND
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "xent's public operators without torch.ops' boxing (python/xent/__init__.py)";
  m.def("vocab_parallel_cross_entropy", &loss);
  m.def("vocab_parallel_cross_entropy_stats", &stats);
}
