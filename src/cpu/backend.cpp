// The reference backend: plain loops over core/math.h, the same steps as the CUDA kernels.
#include "backend.h"

#include <algorithm>

#include "core/dtype.h"

namespace xent::cpu {
namespace {

bool ignored(const core::Problem& p, int64_t target) {
  return target == p.ignore_index;
}

float grad_output_of(const core::Problem& p, const float* grad_output, int64_t row) {
  if (grad_output == nullptr) return 1.0f;
  return p.reduction == Reduction::none ? grad_output[row] : grad_output[0];
}

}  // namespace

void stats(const core::Problem& p, LogitsView logits, TargetsView targets, float* record) {
  // Columns go in chunks, each with its own accumulator, merged afterwards: a single running
  // fp32 sum over 256k columns would lose ~1e-4 of the lse to rounding.
  constexpr int64_t kChunk = 512;
  core::dispatch_dtype(logits.dtype, [&](auto e) {
    using E = decltype(e);
    const auto* base = static_cast<const typename E::type*>(logits.data);
    for (int64_t r = 0; r < p.rows; ++r) {
      const auto* row = base + r * p.row_stride;
      const int64_t target = core::load_target(targets.data, targets.type, r);
      core::LocalStats st;
      for (int64_t j0 = 0; j0 < p.real_cols; j0 += kChunk) {
        core::LseAcc chunk;
        float chunk_sum = 0.0f;
        for (int64_t j = j0; j < std::min(p.real_cols, j0 + kChunk); ++j) {
          const float z = core::softcap(E::load(row[j]), p.softcap);
          chunk.add(z);
          if (p.vocab_start + j == target) st.target_z = z;
          if (p.layout.sum_field >= 0) chunk_sum += z;
          if (p.layout.max_field >= 0) st.best.add(z, p.vocab_start + j);
        }
        st.lse.merge(chunk);
        st.sum_z += chunk_sum;
      }
      core::write_record(st, p.layout, record, p.rows, r);
    }
  });
}

void finalize(const core::Problem& p, TargetsView targets, const float* gathered, int ranks,
              const Outputs& out, float* lse, float* scalars) {
  float total = 0.0f;  // fp32 like the device; rows in order
  int64_t valid = 0, correct = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t target = core::load_target(targets.data, targets.type, r);
    const core::RowStats g = core::merge_records(gathered, ranks, p.layout, p.rows, r);
    lse[r] = g.lse;
    float loss = 0.0f, zterm = 0.0f;
    if (!ignored(p, target)) {
      loss = core::row_loss(g.lse, g.target_z, g.sum_z, p.smoothing, p.inv_vocab, p.z_loss);
      zterm = p.z_loss * g.lse * g.lse;
      total += loss;
      ++valid;
      if (g.best.index == target) ++correct;
    }
    if (p.reduction == Reduction::none) out.loss[r] = loss;
    if (out.z_loss) out.z_loss[r] = zterm;
    if (out.argmax) out.argmax[r] = g.best.index;
  }
  const float scale =
      core::reduction_scale(p.reduction == Reduction::mean, static_cast<float>(valid));
  if (p.reduction != Reduction::none) out.loss[0] = total * scale;
  if (out.accuracy)
    out.accuracy[0] = valid > 0 ? static_cast<float>(correct) / static_cast<float>(valid) : 0.0f;
  scalars[Workspace::kScale] = scale;
  scalars[Workspace::kValid] = static_cast<float>(valid);
}

void gradient(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
              const float* lse, const float* scalars, const float* grad_output) {
  core::dispatch_dtype(in.dtype, [&](auto e) {
    using E = decltype(e);
    using T = typename E::type;
    const auto* src = static_cast<const T*>(in.data);
    auto* dst = static_cast<T*>(out.data);
    for (int64_t r = 0; r < p.rows; ++r) {
      const T* x = src + r * in.row_stride;
      T* g = dst + r * out.row_stride;
      const int64_t target = core::load_target(targets.data, targets.type, r);
      if (ignored(p, target)) {
        std::fill(g, g + p.cols, E::store(0.0f));
        continue;
      }
      const float scale = scalars[Workspace::kScale] * grad_output_of(p, grad_output, r);
      const core::GradCoef c = core::grad_coef(lse[r], scale, p.smoothing, p.inv_vocab, p.z_loss);
      for (int64_t j = 0; j < p.real_cols; ++j) {
        const float z = core::softcap(E::load(x[j]), p.softcap);
        g[j] = E::store(core::grad_x(z, p.vocab_start + j == target, c, p.softcap));
      }
      std::fill(g + p.real_cols, g + p.cols, E::store(0.0f));
    }
  });
}

void scale_rows(const core::Problem& p, LogitsView grad, const float* grad_output) {
  core::dispatch_dtype(grad.dtype, [&](auto e) {
    using E = decltype(e);
    auto* base = static_cast<typename E::type*>(grad.data);
    for (int64_t r = 0; r < p.rows; ++r) {
      const float g = grad_output_of(p, grad_output, r);
      if (g == 1.0f) continue;
      auto* row = base + r * p.row_stride;
      for (int64_t j = 0; j < p.cols; ++j) row[j] = E::store(E::load(row[j]) * g);
    }
  });
}

void count_valid(const core::Problem& p, TargetsView targets, float* scalars) {
  int64_t valid = 0;
  for (int64_t r = 0; r < p.rows; ++r)
    valid += ignored(p, core::load_target(targets.data, targets.type, r)) ? 0 : 1;
  scalars[Workspace::kValid] = static_cast<float>(valid);
  scalars[Workspace::kScale] =
      core::reduction_scale(p.reduction == Reduction::mean, static_cast<float>(valid));
}

}  // namespace xent::cpu
