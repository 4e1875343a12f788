#include "core/problem.h"

#include <cmath>
#include <sstream>
#include <utility>

#include "core/dtype.h"
#include "error.h"

namespace xent::core {

namespace {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

}  // namespace

Problem make_problem(LogitsView logits, TargetsView targets, const Options& opt) {
  if (logits.rows < 0) fail(cat("logits.rows = ", logits.rows, ": must be >= 0"));
  if (logits.cols < 1) fail(cat("logits.cols = ", logits.cols, ": must be >= 1"));
  if (logits.row_stride < logits.cols)
    fail(
        cat("logits.row_stride = ", logits.row_stride, ": must be >= logits.cols = ", logits.cols));
  if (logits.rows > 0 && logits.data == nullptr)
    fail(cat("logits.data is null with logits.rows = ", logits.rows));
  if (targets.rows != logits.rows)
    fail(cat("targets.rows = ", targets.rows, ": must equal logits.rows = ", logits.rows));
  if (targets.rows > 0 && targets.data == nullptr)
    fail(cat("targets.data is null with targets.rows = ", targets.rows));
  if (!(opt.label_smoothing >= 0.0f && opt.label_smoothing < 1.0f))
    fail(cat("label_smoothing = ", opt.label_smoothing, ": must be in [0, 1)"));
  if (!(opt.z_loss >= 0.0f) || std::isinf(opt.z_loss))
    fail(cat("z_loss = ", opt.z_loss, ": must be a finite weight >= 0"));
  if (!(opt.softcap >= 0.0f) || std::isinf(opt.softcap))
    fail(cat("softcap = ", opt.softcap, ": must be > 0 when given (0 turns it off)"));
  if (!(opt.grad_scale > 0.0f) || std::isinf(opt.grad_scale))
    fail(cat("grad_scale = ", opt.grad_scale, ": must be finite and > 0"));
  if (opt.grad_scale != 1.0f && opt.grad_mode != GradMode::fused)
    fail(cat("grad_scale = ", opt.grad_scale, " with grad_mode = ", to_string(opt.grad_mode),
             ": grad_scale applies to grad_mode = fused only (deferred applies grad_output in its "
             "one gradient pass; leave grad_scale at 1)"));
  if (opt.vocab_start < 0) fail(cat("vocab_start = ", opt.vocab_start, ": must be >= 0"));
  const int64_t vocab = opt.vocab_size < 0 ? opt.vocab_start + logits.cols : opt.vocab_size;
  if (vocab < 1) fail(cat("vocab_size = ", opt.vocab_size, ": must be >= 1 (or -1)"));
  if (vocab > INT32_MAX) fail(cat("vocab_size = ", vocab, ": must be < 2^31"));

  Problem p;
  p.rows = logits.rows;
  p.cols = logits.cols;
  p.row_stride = logits.row_stride;
  p.vocab_start = opt.vocab_start;
  p.vocab_size = vocab;
  p.real_cols = std::max<int64_t>(0, std::min(logits.cols, vocab - opt.vocab_start));
  p.inv_vocab = static_cast<float>(1.0 / static_cast<double>(vocab));
  p.smoothing = opt.label_smoothing;
  p.z_loss = opt.z_loss;
  p.softcap = opt.softcap;
  p.ignore_index = opt.ignore_index;
  p.reduction = opt.reduction;
  p.grad_scale = opt.grad_scale;
  p.programmatic_launch = opt.programmatic_launch;
  p.layout = RecordLayout::make(opt.label_smoothing > 0.0f, opt.compute_accuracy);
  return p;
}

void check_outputs(const Problem& p, const Options& opt, const Outputs& out) {
  if (out.loss == nullptr) fail("outputs.loss is null: the loss output is required");
  if (opt.grad_mode == GradMode::deferred && out.lse == nullptr && p.rows > 0)
    fail("outputs.lse is null with grad_mode = deferred: backward needs forward's lse");
  if ((out.argmax != nullptr || out.accuracy != nullptr) && !opt.compute_accuracy)
    fail("outputs.argmax/accuracy given with compute_accuracy = false: set it to true");
}

void check_grad(const Problem& p, LogitsView logits, LogitsView grad) {
  if (grad.dtype != logits.dtype)
    fail(cat("grad.dtype = ", to_string(grad.dtype),
             ": must equal logits.dtype = ", to_string(logits.dtype)));
  if (grad.rows != logits.rows)
    fail(cat("grad.rows = ", grad.rows, ": must equal logits.rows = ", logits.rows));
  if (grad.cols != logits.cols)
    fail(cat("grad.cols = ", grad.cols, ": must equal logits.cols = ", logits.cols));
  if (grad.row_stride < grad.cols)
    fail(cat("grad.row_stride = ", grad.row_stride, ": must be >= grad.cols = ", grad.cols));
  if (p.rows == 0) return;
  if (grad.data == nullptr) fail(cat("grad.data is null with grad.rows = ", grad.rows));
  if (grad.data == logits.data && grad.row_stride == logits.row_stride) return;  // in place
  // [first, last] byte of each: rows and strides as given (conservative for interleaved rows).
  const auto range = [&](const LogitsView& v) {
    const auto first = reinterpret_cast<uintptr_t>(v.data);
    const auto elems = static_cast<uintptr_t>((v.rows - 1) * v.row_stride + v.cols);
    return std::pair<uintptr_t, uintptr_t>{first, first + elems * dtype_size(v.dtype) - 1};
  };
  const auto [g0, g1] = range(grad);
  const auto [l0, l1] = range(logits);
  if (g0 <= l1 && l0 <= g1)
    fail(cat("grad (data = ", grad.data, ", row_stride = ", grad.row_stride,
             ") overlaps logits (data = ", logits.data, ", row_stride = ", logits.row_stride,
             ") partially: grad must either be exactly the logits (same data and row_stride, the "
             "in-place backward) or not overlap their address range at all"));
}

LayoutHeader make_header(const Problem& p, const Options& opt, DType dtype) {
  // Options that change the loss must match on every rank, or each would report its own loss.
  // Unsigned: the multiplication wraps by definition (signed overflow would be undefined).
  auto mix = [](uint64_t h, int64_t v) { return h * 1000003u ^ static_cast<uint64_t>(v); };
  uint64_t h = 17;
  h = mix(h, opt.ignore_index);
  h = mix(h, static_cast<int64_t>(std::llround(opt.label_smoothing * 1e9)));
  h = mix(h, static_cast<int64_t>(std::llround(opt.z_loss * 1e9)));
  h = mix(h, static_cast<int64_t>(std::llround(opt.softcap * 1e6)));
  h = mix(h, static_cast<int64_t>(opt.reduction));
  h = mix(h, static_cast<int64_t>(opt.grad_mode));
  h = mix(h, opt.compute_accuracy ? 1 : 0);
  LayoutHeader header;
  header.rows = p.rows;
  header.vocab_start = p.vocab_start;
  header.width = p.cols;
  header.vocab_size = p.vocab_size;
  header.options_hash = static_cast<int64_t>(h);
  header.dtype = static_cast<int64_t>(dtype);
  return header;
}

int64_t hash_targets(const Problem& p, TargetsView targets) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the 8 bytes of each value
  for (int64_t r = 0; r < p.rows; ++r) {
    auto v = static_cast<uint64_t>(load_target(targets.data, targets.type, r));
    for (int b = 0; b < 8; ++b, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

void check_headers(const LayoutHeader* all, int ranks, bool check_tiling) {
  const LayoutHeader& r0 = all[0];
  int64_t next = 0;
  for (int k = 0; k < ranks; ++k) {
    const LayoutHeader& h = all[k];
    if (h.rows != r0.rows)
      fail(cat("rows = ", h.rows, " on rank ", k, " but ", r0.rows,
               " on rank 0: every rank must pass the same rows (tokens)"));
    if (h.vocab_size != r0.vocab_size)
      fail(cat("vocab_size = ", h.vocab_size, " on rank ", k, " but ", r0.vocab_size,
               " on rank 0: every rank must pass the same vocab_size"));
    if (h.options_hash != r0.options_hash)
      fail(cat("options differ between rank ", k,
               " and rank 0: ignore_index, label_smoothing, z_loss, softcap, reduction, "
               "grad_mode and compute_accuracy must match on every rank"));
    if (h.dtype != r0.dtype)
      fail(cat("logits.dtype = ", to_string(static_cast<DType>(h.dtype)), " on rank ", k, " but ",
               to_string(static_cast<DType>(r0.dtype)),
               " on rank 0: every rank must pass logits of the same dtype"));
    if (h.targets_hash != r0.targets_hash)
      fail(cat("targets differ between rank ", k,
               " and rank 0 (a hash of their values): every rank must pass the same targets"));
    if (check_tiling && h.vocab_start != next)
      fail(cat("vocab_start = ", h.vocab_start, " on rank ", k,
               ": shards must tile the "
               "vocabulary in rank order, so it must be ",
               next, " (the sum of the widths of ranks below it)"));
    next += h.width;
    if (h.bad_row >= 0)
      fail(cat("targets[", h.bad_row, "] = ", h.bad_target,
               ": must be in [0, vocab_size = ", h.vocab_size, ") or equal ignore_index"));
  }
  if (check_tiling && next < r0.vocab_size)
    fail(cat("the shards' widths sum to ", next, ": they must cover vocab_size = ", r0.vocab_size));
}

}  // namespace xent::core
