// The finalize step's formulas, once for both backends: a row's global statistics from the
// gathered records, its per-row outputs, and the reduction of all rows' totals. How the rows
// are spread and their totals summed is each backend's own (both in a fixed order).
#pragma once

#include <limits>

#include "core/dtype.h"
#include "core/math.h"
#include "core/problem.h"
#include "core/record.h"

namespace xent::core {

// What one row adds to the totals.
struct RowTotal {
  float loss = 0.0f;
  bool valid = false;    // its target is not ignore_index
  bool correct = false;  // and its argmax is the target
};

// Row `row`: writes lse[row], and out.loss[row] (reduction none), out.z_loss[row] and
// out.argmax[row] where asked. A target outside [0, vocab_size) gets a NaN loss (the CUDA
// backend's statistics kernel reported it; the CPU backend refused the call before).
XENT_HD RowTotal finalize_row(const Problem& p, const void* targets, IndexType ttype,
                              const float* gathered, int ranks, int64_t row, const Outputs& out,
                              float* lse) {
  const int64_t target = load_target(targets, ttype, row);
  const RowStats g = merge_records(gathered, ranks, p.layout, p.rows, row);
  lse[row] = g.lse;
  RowTotal r;
  float zterm = 0.0f;
  if (target != p.ignore_index) {
    r.loss = target_in_range(target, p.vocab_size)
                 ? row_loss(g.lse, g.target_z, g.sum_z, p.smoothing, p.inv_vocab, p.z_loss)
                 : std::numeric_limits<float>::quiet_NaN();
    zterm = p.z_loss * g.lse * g.lse;
    r.valid = true;
    r.correct = g.best.index == target;
  }
  if (p.reduction == Reduction::none) out.loss[row] = r.loss;
  if (out.z_loss != nullptr) out.z_loss[row] = zterm;
  if (out.argmax != nullptr) out.argmax[row] = g.best.index;
  return r;
}

// From the totals of all rows: the reduced loss (mean or sum) and the accuracy where asked.
// Returns the gradient's scale of every row (gradient_scale: the reduction's, times grad_scale).
XENT_HD float finalize_totals(const Problem& p, double loss_sum, float valid, float correct,
                              const Outputs& out) {
  const bool mean = p.reduction == Reduction::mean;
  // In double until the one rounding: a mean of row losses near the float maximum (3e38 each)
  // stays finite, as a sum that fits does.
  if (p.reduction != Reduction::none)
    out.loss[0] = static_cast<float>(mean ? (valid > 0.0f ? loss_sum / valid : 0.0) : loss_sum);
  if (out.accuracy != nullptr) out.accuracy[0] = valid > 0.0f ? correct / valid : 0.0f;
  return gradient_scale(mean, valid, p.grad_scale);
}

}  // namespace xent::core
