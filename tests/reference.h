// An independent double-precision reference of softmax cross-entropy over the full (unsharded)
// vocabulary, shared by tests/ and dist_tests/ (inputs.h: the inputs; tolerances.h: how close
// the library must come; harness.h: the checks and the single-rank harness).
//
// The reference deliberately does NOT use the library's math (src/core/math.h): it is a plain
// two-pass softmax in double, written from the formulas of docs/design.md and PyTorch's
// definition of label smoothing:
//   z_j   = c * tanh(x_j / c) with a softcap c > 0, else x_j;      only real columns j < V
//   lse   = log sum_{j<V} exp(z_j)
//   loss  = lse - (1 - e) z_y - (e / V) sum_{j<V} z_j + w lse^2      (ignored row: 0)
//   dL/dx = [(1 + 2 w lse) softmax_j - e / V - (1 - e)[j == y]] * (1 - tanh(x_j / c)^2)
//           * scale * grad_output,   scale = 1 / n_valid (mean) or 1 (sum, none)
//   padded columns (j >= V) and ignored rows: gradient 0.
//   mean over an all-ignored batch: loss 0, gradient 0 (the library's documented choice).
#pragma once

#include "inputs.h"

namespace xtest {

// ------------------------------------------------------------------------------------------
// The reference

struct RefOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  double softcap = 0.0;
  xent::Reduction reduction = xent::Reduction::mean;
  int64_t vocab_size = -1;  // -1: all columns are real
};

inline RefOptions ref_options(const xent::Options& o, int64_t vocab_size) {
  RefOptions r;
  r.ignore_index = o.ignore_index;
  r.label_smoothing = o.label_smoothing;
  r.z_loss = o.z_loss;
  r.softcap = o.softcap;
  r.reduction = o.reduction;
  r.vocab_size = vocab_size;
  return r;
}

struct RefResult {
  int64_t n_valid = 0;
  std::vector<double> row_loss;   // [N], 0 for ignored rows
  std::vector<double> row_mag;    // [N], sum of the magnitudes of the loss's terms (tolerance)
  std::vector<double> lse;        // [N], every row
  std::vector<double> zloss;      // [N], w * lse^2, 0 for ignored rows
  std::vector<int64_t> argmax;    // [N], first maximal real column, every row
  double loss = 0.0;              // mean or sum of row_loss (Reduction::none: sum)
  double mag = 0.0;               // magnitude of `loss`, same reduction
  double accuracy = 0.0;          // share of valid rows with argmax == target (0 if none)
  std::vector<double> row_scale;  // [N], scale * grad_output of each row (0 if ignored)
  Matrix grad;                    // [N, cols]: dL/dx times grad_output
};

// grad_output: empty -> 1; one value -> scalar; N values -> per row (Reduction::none).
inline RefResult reference(const Matrix& x, const std::vector<int64_t>& targets,
                           const RefOptions& o, const std::vector<double>& grad_output = {}) {
  const int64_t N = x.rows, C = x.cols;
  const int64_t V = o.vocab_size < 0 ? C : o.vocab_size;
  const double e = o.label_smoothing, w = o.z_loss, c = o.softcap;
  RefResult r;
  r.row_loss.assign(N, 0.0);
  r.row_mag.assign(N, 0.0);
  r.lse.assign(N, 0.0);
  r.zloss.assign(N, 0.0);
  r.argmax.assign(N, -1);
  r.row_scale.assign(N, 0.0);
  r.grad = Matrix(N, C, 0.0);
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] != o.ignore_index) ++r.n_valid;

  auto zf = [&](double v) { return c > 0 ? c * std::tanh(v / c) : v; };
  int64_t correct = 0;
  for (int64_t i = 0; i < N; ++i) {
    // two-pass log-sum-exp in double
    double m = -kInf, best = -kInf;
    int64_t arg = -1;
    for (int64_t j = 0; j < V; ++j) {
      const double z = zf(x.at(i, j));
      m = std::max(m, z);
      if (arg < 0 || z > best) {
        best = z;
        arg = j;
      }
    }
    double s = 0.0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(zf(x.at(i, j)) - m);
    const double lse = m + std::log(s);
    r.lse[i] = lse;
    r.argmax[i] = arg;
    const int64_t y = targets[i];
    if (y == o.ignore_index) continue;
    if (arg == y) ++correct;
    double S = 0.0, Sabs = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      S += zf(x.at(i, j));
      Sabs += std::fabs(zf(x.at(i, j)));
    }
    const double zy = zf(x.at(i, y));
    r.row_loss[i] = lse - (1.0 - e) * zy - (e > 0 ? e * S / V : 0.0) + w * lse * lse;
    r.row_mag[i] =
        std::fabs(lse) + (1.0 - e) * std::fabs(zy) + (e > 0 ? e * Sabs / V : 0.0) + w * lse * lse;
    r.zloss[i] = w * lse * lse;
  }
  const bool mean = o.reduction == xent::Reduction::mean;
  for (int64_t i = 0; i < N; ++i) {
    r.loss += r.row_loss[i];
    r.mag += r.row_mag[i];
  }
  if (mean) {
    r.loss = r.n_valid > 0 ? r.loss / r.n_valid : 0.0;
    r.mag = r.n_valid > 0 ? r.mag / r.n_valid : 0.0;
  }
  r.accuracy = r.n_valid > 0 ? static_cast<double>(correct) / r.n_valid : 0.0;

  for (int64_t i = 0; i < N; ++i) {
    const int64_t y = targets[i];
    if (y == o.ignore_index) continue;
    double go = 1.0;
    if (o.reduction == xent::Reduction::none && grad_output.size() == static_cast<size_t>(N))
      go = grad_output[i];
    else if (!grad_output.empty())
      go = grad_output[0];
    const double scale = (mean ? 1.0 / r.n_valid : 1.0) * go;
    r.row_scale[i] = scale;
    const double lse = r.lse[i];
    for (int64_t j = 0; j < V; ++j) {
      const double xv = x.at(i, j);
      const double z = zf(xv);
      double g = (1.0 + 2.0 * w * lse) * std::exp(z - lse) - e / V - (j == y ? 1.0 - e : 0.0);
      if (c > 0) {
        const double t = std::tanh(xv / c);
        g *= 1.0 - t * t;
      }
      r.grad.at(i, j) = g * scale;
    }
  }
  return r;
}

}  // namespace xtest
