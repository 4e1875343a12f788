// Shared by the LibTorch adapter's tests: the double-precision references (PyTorch's own
// cross_entropy where it has the option, else the formula of docs/design.md written with torch
// ops), tolerances, and process groups made in C++ (Gloo over a FileStore, NCCL).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>
#include <xent/torch.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <vector>

namespace xtt {

namespace F = ::torch::nn::functional;

// Expects a c10::Error whose message contains every one of `parts`.
template <typename F>
void expect_error(F&& f, std::initializer_list<const char*> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning \"" << *parts.begin() << "\"";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const char* p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks \"" << p << "\": " << msg;
  }
}
using xent::torch::CrossEntropyOptions;

inline const char* name_of(xent::Reduction r) {
  return xent::to_string(r);
}

// PyTorch's cross_entropy has ignore_index, label_smoothing and the reductions, but no z-loss,
// softcap or padded columns.
inline bool torch_has_options(const CrossEntropyOptions& o, int64_t vocab, int64_t cols) {
  return o.z_loss == 0.0 && o.softcap == 0.0 && vocab == cols;
}

struct Ref {
  at::Tensor loss;    // double; [] or [rows]
  at::Tensor grad;    // double [rows, cols]: d (sum(loss * weight)) / d logits, 0 on padding
  at::Tensor lse;     // double [rows]
  at::Tensor z_loss;  // double [rows], 0 on ignored rows
  at::Tensor argmax;  // int64 [rows]
  double accuracy = 0;
};

// full: all columns [rows, cols] (columns >= vocab are padding); weight: the gradient that
// flows into the loss (a scalar, or [rows] for Reduction::none).
inline Ref reference(const at::Tensor& full, const at::Tensor& target, const CrossEntropyOptions& o,
                     int64_t vocab, const at::Tensor& weight, bool use_torch) {
  ::torch::AutoGradMode enable(true);
  at::Tensor x = full.detach().to(at::kDouble).cpu().requires_grad_();
  const at::Tensor t = target.cpu().to(at::kLong);
  const at::Tensor real = x.slice(1, 0, vocab);
  Ref r;
  const at::Tensor valid = t != o.ignore_index;
  const int64_t n_valid = valid.sum().item<int64_t>();
  if (use_torch) {
    auto fo = F::CrossEntropyFuncOptions()
                  .ignore_index(o.ignore_index)
                  .label_smoothing(o.label_smoothing);
    if (o.reduction == xent::Reduction::none) fo = fo.reduction(::torch::kNone);
    if (o.reduction == xent::Reduction::sum) fo = fo.reduction(::torch::kSum);
    if (o.reduction == xent::Reduction::mean) fo = fo.reduction(::torch::kMean);
    r.loss = F::cross_entropy(real, t, fo);
  } else {
    const at::Tensor z = o.softcap > 0 ? o.softcap * at::tanh(real / o.softcap) : real;
    const at::Tensor lse = at::logsumexp(z, 1);
    const at::Tensor safe = at::where(valid, t, at::zeros_like(t));
    const at::Tensor zy = z.gather(1, safe.unsqueeze(1)).squeeze(1);
    const double e = o.label_smoothing;
    at::Tensor row = lse - (1.0 - e) * zy - (e / vocab) * z.sum(1) + o.z_loss * lse * lse;
    row = at::where(valid, row, at::zeros_like(row));
    if (o.reduction == xent::Reduction::none)
      r.loss = row;
    else if (o.reduction == xent::Reduction::sum)
      r.loss = row.sum();
    else
      r.loss = row.sum() / static_cast<double>(std::max<int64_t>(n_valid, 1));
  }
  r.grad = ::torch::autograd::grad({(r.loss * weight.to(at::kDouble).cpu()).sum()}, {x})[0];
  {
    ::torch::NoGradGuard ng;
    const at::Tensor z = o.softcap > 0 ? o.softcap * at::tanh(real / o.softcap) : real;
    r.lse = at::logsumexp(z, 1).detach();
    r.z_loss = at::where(valid, o.z_loss * r.lse * r.lse, at::zeros_like(r.lse));
    r.argmax = z.argmax(1);
    r.accuracy = n_valid == 0 ? 0.0
                              : ((r.argmax == t) & valid).sum().item<double>() /
                                    static_cast<double>(n_valid);
    r.loss = r.loss.detach();
  }
  return r;
}

// Relative to the largest reference magnitude: each gradient element is rounded once to the
// logits' dtype (half an ulp: at most 2^-8 relative for bfloat16, 2^-11 for float16), or twice
// (up to 1.75 ulps, float16 subnormals) where rounded_twice says.
inline double grad_rtol(at::ScalarType t, bool rounded_twice = false) {
  const double k = rounded_twice ? 2.0 : 1.0;
  return t == at::kBFloat16 ? 8e-3 * k : t == at::kHalf ? 1.25e-3 * k : 2e-5;
}

inline ::testing::AssertionResult matches(const at::Tensor& got, const at::Tensor& want,
                                          double rtol, const char* what) {
  if (!got.defined()) return ::testing::AssertionFailure() << what << ": undefined";
  if (got.sizes() != want.sizes())
    return ::testing::AssertionFailure()
           << what << ": shape " << got.sizes() << ", want " << want.sizes();
  if (got.numel() == 0) return ::testing::AssertionSuccess();
  const at::Tensor g = got.detach().cpu().to(at::kDouble), w = want.detach().cpu().to(at::kDouble);
  const double scale = std::max(w.abs().max().item<double>(), 1e-30);
  const at::Tensor err = (g - w).abs();
  const double worst = err.max().item<double>();
  if (!(worst <= rtol * scale)) {  // NaN fails too
    const int64_t at_ = err.reshape(-1).argmax().item<int64_t>();
    return ::testing::AssertionFailure()
           << what << ": max |error| " << worst << " > " << rtol << " * " << scale
           << " at flat index " << at_ << " (got " << g.reshape(-1)[at_].item<double>() << ", want "
           << w.reshape(-1)[at_].item<double>() << ")";
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult matches_loss(const at::Tensor& got, const at::Tensor& want,
                                               const char* what = "loss") {
  // fp32 arithmetic on logits exactly representable in it: a few ulps of the loss's terms.
  return matches(got, want, 2e-5, what);
}

// ------------------------------------------------------------------------------- one case

struct Case {
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  int64_t rows = 24;
  std::vector<int64_t> widths{50};  // every rank's columns, rank order (sum: total columns)
  int64_t vocab = -1;               // real classes; -1: the sum of the widths
  CrossEntropyOptions opt;
  double weight = 1.0;  // d total / d loss for mean/sum (1: the fused no-rescale path)
  uint64_t seed = 1;
  std::string label() const {
    std::ostringstream s;
    s << c10::toString(dtype) << " " << device << " rows=" << rows
      << " widths=" << c10::IntArrayRef(widths) << " vocab=" << vocab
      << " grad_mode=" << xent::to_string(opt.grad_mode) << " inplace=" << opt.inplace_grad
      << " reduction=" << name_of(opt.reduction) << " ignore_index=" << opt.ignore_index
      << " smoothing=" << opt.label_smoothing << " z_loss=" << opt.z_loss
      << " softcap=" << opt.softcap << " weight=" << weight;
    return s.str();
  }
};

// The whole problem, the same on every rank: logits [rows, total] (padding columns hold large
// values that must be ignored), targets with some ignore_index rows, the loss weights.
struct Problem {
  at::Tensor full;    // in the case's dtype, CPU
  at::Tensor target;  // int64, CPU
  at::Tensor weight;  // double, [] or [rows]
  int64_t vocab = 0;
};

inline Problem make_problem(const Case& c) {
  Problem p;
  int64_t total = 0;
  for (int64_t w : c.widths) total += w;
  p.vocab = c.vocab < 0 ? total : c.vocab;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed);
  at::Tensor full = at::randn({c.rows, total}, gen, at::TensorOptions().dtype(at::kDouble)) * 2.0;
  if (p.vocab < total) full.slice(1, p.vocab, total).fill_(40.0);
  p.full = full.to(c.dtype);
  p.target = at::randint(0, p.vocab, {c.rows}, gen, at::TensorOptions().dtype(at::kLong));
  for (int64_t i = 3; i < c.rows; i += 7) p.target[i] = c.opt.ignore_index;
  p.weight = c.opt.reduction == xent::Reduction::none
                 ? at::rand({c.rows}, gen, at::TensorOptions().dtype(at::kDouble)) + 0.5
                 : at::scalar_tensor(c.weight, at::kDouble);
  return p;
}

// Whether scaling by v is exact (a power of two): a rescale by it does not round again.
inline bool is_pow2(double v) {
  int e = 0;
  return std::frexp(std::fabs(v), &e) == 0.5;
}

// Runs the case on `rank` (its shard of the columns) and checks its loss, outputs and gradient
// shard against the reference on the full logits. Returns the reference for further checks.
inline void run_case(const Case& c, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int rank) {
  SCOPED_TRACE(c.label());
  const Problem p = make_problem(c);
  int64_t start = 0;
  for (int r = 0; r < rank; ++r) start += c.widths[r];
  const int64_t width = c.widths[rank];
  const int64_t total = p.full.size(1);
  const bool use_torch = torch_has_options(c.opt, p.vocab, total);
  const Ref ref = reference(p.full, p.target, c.opt, p.vocab, p.weight, use_torch);

  const at::Tensor leaf =
      p.full.slice(1, start, start + width).clone().to(c.device).requires_grad_();
  // In place needs a non-leaf (the output of some layer); otherwise use the leaf itself.
  const at::Tensor logits = c.opt.inplace_grad ? leaf.clone() : leaf;
  const at::Tensor before = logits.detach().clone();
  const int64_t version = logits._version();
  const at::Tensor target = p.target.to(c.device);

  CrossEntropyOptions opt = c.opt;
  if (c.vocab >= 0 && opt.vocab_size < 0) opt.vocab_size = c.vocab;
  const xent::torch::CrossEntropyResult r =
      xent::torch::vocab_parallel_cross_entropy(logits, target, pg, opt);
  ASSERT_TRUE(r.loss.requires_grad());
  EXPECT_EQ(r.loss.scalar_type(), at::kFloat);
  EXPECT_TRUE(matches_loss(r.loss, ref.loss));
  if (c.opt.return_lse) EXPECT_TRUE(matches_loss(r.lse, ref.lse, "lse"));
  if (c.opt.return_z_loss) EXPECT_TRUE(matches(r.z_loss, ref.z_loss, 2e-5, "z_loss"));
  if (c.opt.compute_accuracy) {
    EXPECT_TRUE(at::equal(r.argmax.cpu(), ref.argmax)) << "argmax";
    EXPECT_NEAR(r.accuracy.item<double>(), ref.accuracy, 1e-6) << "accuracy";
  }
  // In place, fused writes over the logits in forward, except for reduction none (which takes
  // the deferred path: it applies the per-row grad_output before its one rounding).
  const bool overwritten = c.opt.inplace_grad && c.opt.grad_mode == xent::GradMode::fused &&
                           c.opt.reduction != xent::Reduction::none;
  if (overwritten) {
    EXPECT_GT(logits._version(), version) << "in-place forward must bump the logits' version";
  } else {
    EXPECT_TRUE(at::equal(logits.detach(), before)) << "forward must leave the logits alone";
    EXPECT_EQ(logits._version(), version);
  }

  const at::Tensor total_loss = (r.loss * p.weight.to(at::kFloat).to(c.device)).sum();
  const at::Tensor grad = ::torch::autograd::grad({total_loss}, {logits})[0];
  EXPECT_EQ(grad.scalar_type(), c.dtype);
  EXPECT_EQ(grad.device(), c.device);
  EXPECT_TRUE(matches(grad, ref.grad.slice(1, start, start + width),
                      grad_rtol(c.dtype, overwritten && !is_pow2(c.weight / c.opt.grad_scale)),
                      "gradient shard"));
  if (c.opt.inplace_grad) {
    EXPECT_EQ(grad.data_ptr(), logits.data_ptr()) << "inplace_grad: the gradient is the logits";
  } else {
    EXPECT_NE(grad.data_ptr(), logits.data_ptr());
    EXPECT_TRUE(at::equal(logits.detach(), before)) << "backward must leave the logits alone";
  }
}

// Every option set x reduction x grad mode x in place, for one dtype/device/layout.
inline std::vector<Case> option_matrix(const Case& base) {
  std::vector<CrossEntropyOptions> sets;
  {
    CrossEntropyOptions o;  // PyTorch's defaults (ignore_index -100 rows present)
    sets.push_back(o);
    o.label_smoothing = 0.1;  // PyTorch's label smoothing, another ignore_index
    o.ignore_index = -1;
    sets.push_back(o);
    CrossEntropyOptions z;  // beyond PyTorch: z-loss and softcap, with outputs
    z.z_loss = 1e-3;
    z.softcap = 3.0;
    z.return_lse = z.return_z_loss = z.compute_accuracy = true;
    sets.push_back(z);
    CrossEntropyOptions s;
    s.label_smoothing = 0.2;
    s.z_loss = 1e-2;
    sets.push_back(s);
  }
  std::vector<Case> out;
  for (const CrossEntropyOptions& o : sets)
    for (auto red : {xent::Reduction::mean, xent::Reduction::sum, xent::Reduction::none})
      for (auto mode : {xent::GradMode::fused, xent::GradMode::deferred})
        for (bool inplace : {false, true}) {
          Case c = base;
          c.opt = o;
          c.opt.reduction = red;
          c.opt.grad_mode = mode;
          c.opt.inplace_grad = inplace;
          c.weight = red == xent::Reduction::sum ? 0.75 : 1.0;
          c.seed = base.seed + out.size();
          out.push_back(c);
        }
  return out;
}

// ----------------------------------------------------------------------------- process groups

// A fresh FileStore path (rank 0 makes it; the ranks of one run must share it).
inline std::string temp_store_path(const char* tag) {
  char tmpl[] = "/tmp/xent_torch_store_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd >= 0) ::close(fd);
  std::remove(tmpl);
  return std::string(tmpl) + "_" + tag;
}

// A c10d ProcessGroup whose CPU backend is Gloo (on the loopback interface), registered under
// `name` so that the operator can resolve it.
inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const std::string& name) {
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  pg->setGroupName(name);
  c10d::register_process_group(name, pg);
  return pg;
}

}  // namespace xtt
