// xent_dist_bench: host data generation and the fp64 reference (CPU backend, and the small-size
// cross-check of the GPU reference).
#include <algorithm>
#include <cmath>

#include "reference.h"

namespace xb {

void host_fill_logits(const Problem& p, void* data) {
  const float pad = pad_logit(p);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t j = 0; j < p.width; ++j) {
      const int64_t col = p.start + j;
      store_elem(p.dtype, data, r * p.width + j, col < p.vocab ? gen_logit(p, r, col) : pad);
    }
  }
}

std::vector<int64_t> host_targets(const Problem& p) {
  std::vector<int64_t> t(static_cast<size_t>(p.rows));
  for (int64_t r = 0; r < p.rows; ++r) t[static_cast<size_t>(r)] = gen_target(p, r);
  return t;
}

std::vector<RefRow> host_ref_rows(const Problem& p) {
  std::vector<RefRow> rows(static_cast<size_t>(p.rows));
  for (int64_t r = 0; r < p.rows; ++r) {
    RefRow& row = rows[static_cast<size_t>(r)];
    row.target = gen_target(p, r);
    row.ignored = row.target == p.ignore_index ? 1 : 0;
    if (!row.ignored) {
      double m = -INFINITY, sum_z = 0.0;
      for (int64_t c = 0; c < p.vocab; ++c) {
        const double z = ref_z(p, gen_logit(p, r, c));
        m = std::max(m, z);
        sum_z += z;
      }
      double s = 0.0;
      for (int64_t c = 0; c < p.vocab; ++c) s += std::exp(ref_z(p, gen_logit(p, r, c)) - m);
      row.lse = m + std::log(s);
      row.sum_z = sum_z;
      row.target_z = ref_z(p, gen_logit(p, r, row.target));
    }
    ref_finish_row(p, row);
  }
  return rows;
}

double inv_valid_rows(const std::vector<RefRow>& rows) {
  int64_t valid = 0;
  for (const RefRow& r : rows) valid += r.ignored ? 0 : 1;
  return valid > 0 ? 1.0 / static_cast<double>(valid) : 0.0;
}

int64_t host_check_grad(const Problem& p, const void* grad, const std::vector<RefRow>& rows,
                        double inv_valid, Mismatch* first) {
  const double row_scale = ref_row_scale(p, inv_valid);
  int64_t wrong = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    const RefRow& ref = rows[static_cast<size_t>(r)];
    for (int64_t j = 0; j < p.width; ++j) {
      const int64_t col = p.start + j;
      const double x = col < p.vocab ? gen_logit(p, r, col) : pad_logit(p);
      const double got = load_elem(p.dtype, grad, r * p.width + j);
      double want, tol;
      if (!check_grad_elem(p, ref, col, x, got, row_scale, &want, &tol)) {
        if (wrong++ == 0 && first && first->kind == 0)
          *first = Mismatch{1, 0, r, col, got, want, tol};
      }
    }
  }
  return wrong;
}

int64_t check_outputs(const Problem& p, const std::vector<RefRow>& rows, const float* loss,
                      const float* lse, Mismatch* first) {
  int64_t wrong = 0;
  auto bad = [&](int kind, int64_t row, double got, double want, double tol) {
    if (wrong++ == 0 && first && first->kind == 0)
      *first = Mismatch{kind, 0, row, -1, got, want, tol};
  };
  if (p.reduction == kNone) {
    for (int64_t r = 0; r < p.rows; ++r) {
      const RefRow& ref = rows[static_cast<size_t>(r)];
      const double tol = ref.ignored ? 0.0 : kLossRtol * ref.loss_mag;
      if (!(std::fabs(loss[r] - ref.loss) <= tol)) bad(2, r, loss[r], ref.loss, tol);
    }
  } else {
    double sum = 0.0, mag = 0.0;
    for (const RefRow& ref : rows) {
      sum += ref.loss;
      mag += ref.loss_mag;
    }
    const double inv = p.reduction == kMean ? inv_valid_rows(rows) : 1.0;
    const double want = sum * inv, tol = kLossRtol * mag * inv;
    if (!(std::fabs(loss[0] - want) <= tol)) bad(2, -1, loss[0], want, tol);
  }
  if (lse) {
    for (int64_t r = 0; r < p.rows; ++r) {
      const RefRow& ref = rows[static_cast<size_t>(r)];
      if (ref.ignored) continue;
      const double tol = kLossRtol * (1.0 + std::fabs(ref.lse));
      if (!(std::fabs(lse[r] - ref.lse) <= tol)) bad(3, r, lse[r], ref.lse, tol);
    }
  }
  return wrong;
}

}  // namespace xb
