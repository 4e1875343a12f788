// The scenario and comparison harness of the CudaBackend tests (test_cuda_backend.cpp,
// test_cuda_out_of_place.cpp, test_cuda_error_and_graph.cpp, test_cuda_two_ranks.cpp): a Case
// (shape, dtype, options), its inputs, a run through the public API (forward/backward) on either
// backend, and the GPU's result compared with the CPU's on the same host inputs. Those files put
// their tests in this namespace (inside an anonymous one) and name it all unqualified.
//
// Tolerances (both backends compute in fp32 from the same dtype values; they differ only in
// summation order, in __expf/__logf versus std::exp/std::log, and in the final rounding):
//   - lse, per-row loss, z-loss term: |gpu - cpu| <= 2e-5 * max(1, |cpu|) (1e-4 with a softcap,
//     whose tanh goes through exp as well); the reduced loss and accuracy: the same relative bound.
//   - gradient, per row: |gpu - cpu| <= 1e-5 * max_j |cpu_j| (the row's scale, ~1/N for a mean)
//     + 2e-5 * |cpu| (1e-4 / 1e-4 with a softcap), plus, for bf16 and fp16, one ulp of the dtype
//     at the larger of the two values (the fp32 values may round to neighbouring codes).
//   - argmax: equal, except where the two columns' logits are within 1e-4 of each other (a
//     near-tie that fp32 rounding may decide either way); accuracy may move by such flips only.
//   - everything not written (row-stride gaps, the logits in GradMode::none) is bitwise unchanged.
// Determinism: two GPU runs on the same inputs give bitwise equal outputs and gradients.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test.h"
#include "inputs.h"  // element loads and stores of each dtype

namespace xtest::gpu::compare {

// ck and DevBuf come from the enclosing xtest::gpu (cuda_test.h).
using xent::Backend;
using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;

inline size_t esize(DType d) {
  return xtest::elem_size(d);
}
inline float load_as_float(DType d, const uint8_t* p) {
  return static_cast<float>(xtest::load_elem(d, p));
}

// One unit in the last place of the dtype at |v| (fp32: 0, the fp32 tolerance covers it).
inline double ulp(DType d, double v) {
  if (d == DType::f32) return 0.0;
  const int mant = d == DType::bf16 ? 7 : 10;
  const double min_ulp = d == DType::bf16 ? std::ldexp(1.0, -133) : std::ldexp(1.0, -24);
  v = std::fabs(v);
  if (v == 0.0 || !std::isfinite(v)) return min_ulp;
  int e = 0;
  std::frexp(v, &e);  // v = m * 2^e, m in [0.5, 1)
  return std::max(std::ldexp(1.0, e - 1 - mant), min_ulp);
}

// ----------------------------------------------------------------------------- one scenario

struct Case {
  std::string name;
  DType dtype = DType::f32;
  IndexType itype = IndexType::i64;
  int64_t rows = 0, cols = 1, stride_extra = 0;
  int64_t vocab_start = 0, vocab_size = -1;
  xent::Options opt;
  double ignore_frac = 0.1;
  int go_kind = 0;  // backward's grad_output: 0 nullptr, 1 all ones, 2 random (some exactly 1)
  float logit_scale = 2.0f;
  uint64_t seed = 1;

  int64_t stride() const { return cols + stride_extra; }
  int64_t vocab() const { return vocab_size < 0 ? vocab_start + cols : vocab_size; }
  int64_t real_cols() const { return std::max<int64_t>(0, std::min(cols, vocab() - vocab_start)); }
  float tol_loss() const { return opt.softcap > 0.0f ? 1e-4f : 2e-5f; }
  float tol_grad_rel() const { return opt.softcap > 0.0f ? 1e-4f : 2e-5f; }
  float tol_grad_row() const { return opt.softcap > 0.0f ? 1e-4f : 1e-5f; }
};

inline std::string describe(const Case& c) {
  std::ostringstream s;
  s << c.name << " [" << xent::to_string(c.dtype) << (c.itype == IndexType::i32 ? " i32" : " i64")
    << " N=" << c.rows << " cols=" << c.cols << " stride=" << c.stride()
    << " vocab=" << c.vocab_start << "+" << c.vocab() << " " << xent::to_string(c.opt.reduction)
    << " " << xent::to_string(c.opt.grad_mode) << " e=" << c.opt.label_smoothing
    << " w=" << c.opt.z_loss << " cap=" << c.opt.softcap << " acc=" << c.opt.compute_accuracy
    << " go=" << c.go_kind << " grad_scale=" << c.opt.grad_scale << "]";
  return s.str();
}

struct Inputs {
  std::vector<uint8_t> logits;   // rows * stride elements
  std::vector<uint8_t> targets;  // rows * index size
  std::vector<int64_t> t64;
  std::vector<float> grad_output;  // empty: nullptr
};

inline Inputs make_inputs(const Case& c) {
  Inputs in;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> normal(0.0f, c.logit_scale);
  const size_t es = esize(c.dtype);
  in.logits.resize(static_cast<size_t>(c.rows * c.stride()) * es);
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t j = 0; j < c.stride(); ++j) {
      // Row-stride gaps hold a sentinel that must survive untouched.
      const float v = j < c.cols ? normal(rng) : 1234.5f;
      xtest::store_elem(c.dtype, &in.logits[static_cast<size_t>(r * c.stride() + j) * es], v);
    }
  // Targets this rank owns (a single rank must own them, or the loss is +inf).
  const int64_t lo = c.vocab_start, hi = c.vocab_start + std::max<int64_t>(1, c.real_cols());
  std::uniform_int_distribution<int64_t> pick(lo, hi - 1);
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  in.t64.resize(c.rows);
  for (int64_t r = 0; r < c.rows; ++r)
    in.t64[r] = u01(rng) < c.ignore_frac ? c.opt.ignore_index : pick(rng);
  const size_t is = c.itype == IndexType::i32 ? 4 : 8;
  in.targets.resize(static_cast<size_t>(c.rows) * is);
  for (int64_t r = 0; r < c.rows; ++r) {
    if (is == 4) {
      const int32_t v = static_cast<int32_t>(in.t64[r]);
      std::memcpy(&in.targets[r * 4], &v, 4);
    } else {
      std::memcpy(&in.targets[r * 8], &in.t64[r], 8);
    }
  }
  if (c.go_kind != 0) {
    const size_t n = c.opt.reduction == Reduction::none ? static_cast<size_t>(c.rows) : 1;
    in.grad_output.assign(n, 1.0f);
    if (c.go_kind == 2)
      for (size_t i = 0; i < n; ++i)
        in.grad_output[i] = (i % 3 == 1) ? 1.0f : 0.37f + 0.1f * (i % 7);
  }
  return in;
}

struct Result {
  std::vector<float> loss, lse, zl;
  std::vector<int64_t> argmax;
  float accuracy = 0.0f;
  std::vector<uint8_t> logits;  // after forward (+ backward): the gradient, or the logits
};

// `group`: a CUDA group to reuse (its workspace carries over between calls), else a new one.
inline Result run(Backend backend, const Case& c, const Inputs& in, cudaStream_t stream = nullptr,
                  const xent::Group* group = nullptr) {
  xent::Group g = group != nullptr          ? *group
                  : backend == Backend::cpu ? xent::Group::local(Backend::cpu)
                                            : xent::Group::local(Backend::cuda, 0);
  const bool none = c.opt.reduction == Reduction::none;
  // At least one slot, so that Reduction::none over 0 rows still passes a non-null pointer.
  const size_t nloss = none ? std::max<size_t>(1, static_cast<size_t>(c.rows)) : 1;
  const size_t rows = static_cast<size_t>(c.rows);
  xent::Options opt = c.opt;
  opt.vocab_start = c.vocab_start;
  opt.vocab_size = c.vocab_size;
  Result r;
  r.loss.assign(nloss, 0.0f);
  r.lse.assign(rows, 0.0f);
  r.zl.assign(rows, 0.0f);
  r.argmax.assign(rows, 0);
  r.logits = in.logits;
  // Poison every output (0x7f bytes: 3.4e38, or a huge argmax) before the run.
  std::memset(r.loss.data(), 0x7f, nloss * 4);
  std::memset(r.lse.data(), 0x7f, rows * 4);
  std::memset(r.zl.data(), 0x7f, rows * 4);
  std::memset(r.argmax.data(), 0x7f, rows * 8);
  std::memset(&r.accuracy, 0x7f, 4);

  xent::LogitsView lv;
  lv.dtype = c.dtype;
  lv.rows = c.rows;
  lv.cols = c.cols;
  lv.row_stride = c.stride();
  xent::TargetsView tv;
  tv.type = c.itype;
  tv.rows = c.rows;
  xent::Outputs out;
  const float* go = nullptr;

  if (backend == Backend::cpu) {
    lv.data = r.logits.empty() ? nullptr : r.logits.data();
    tv.data = in.targets.empty() ? nullptr : in.targets.data();
    out.loss = r.loss.data();
    out.lse = rows ? r.lse.data() : nullptr;
    out.z_loss = rows ? r.zl.data() : nullptr;
    if (opt.compute_accuracy) {
      out.argmax = rows ? r.argmax.data() : nullptr;
      out.accuracy = &r.accuracy;
    }
    go = in.grad_output.empty() ? nullptr : in.grad_output.data();
    xent::forward(g, lv, tv, opt, out);
    if (opt.grad_mode != GradMode::none) xent::backward(g, lv, tv, out.lse, go, opt);
    return r;
  }

  DevBuf d_logits(r.logits.size()), d_targets(in.targets.size()), d_loss(nloss * 4),
      d_lse(rows * 4), d_zl(rows * 4), d_argmax(rows * 8), d_acc(4),
      d_go(in.grad_output.size() * 4);
  d_logits.up(r.logits.data());
  d_targets.up(in.targets.data());
  d_go.up(in.grad_output.data());
  for (DevBuf* b : {&d_loss, &d_lse, &d_zl, &d_argmax, &d_acc}) b->poison();
  lv.data = d_logits.p;
  tv.data = d_targets.p;
  out.loss = static_cast<float*>(d_loss.p);
  out.lse = static_cast<float*>(d_lse.p);
  out.z_loss = static_cast<float*>(d_zl.p);
  if (opt.compute_accuracy) {
    out.argmax = static_cast<int64_t*>(d_argmax.p);
    out.accuracy = static_cast<float*>(d_acc.p);
  }
  go = static_cast<const float*>(d_go.p);
  xent::forward(g, lv, tv, opt, out, stream);
  if (opt.grad_mode != GradMode::none) xent::backward(g, lv, tv, out.lse, go, opt, stream);
  g.check_errors(stream);
  ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  d_logits.down(r.logits.data());
  d_loss.down(r.loss.data());
  if (rows) {
    d_lse.down(r.lse.data());
    d_zl.down(r.zl.data());
    if (opt.compute_accuracy) d_argmax.down(r.argmax.data());
  }
  if (opt.compute_accuracy) d_acc.down(&r.accuracy);
  return r;
}

inline bool close(double a, double b, double lim) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= lim;
}

// Compares the GPU's result with the CPU's. Returns a failure naming the first few differences.
inline ::testing::AssertionResult matches(const Case& c, const Inputs& in, const Result& gpu,
                                          const Result& cpu) {
  std::ostringstream err;
  int bad = 0;
  auto note = [&](const std::string& what) {
    if (bad++ < 8) err << "\n  " << what;
  };
  const double tl = c.tol_loss();
  for (size_t i = 0; i < cpu.loss.size(); ++i)
    if (!close(gpu.loss[i], cpu.loss[i], tl * std::max(1.0, std::fabs((double)cpu.loss[i]))))
      note("loss[" + std::to_string(i) + "] gpu " + std::to_string(gpu.loss[i]) + " cpu " +
           std::to_string(cpu.loss[i]));
  for (size_t i = 0; i < cpu.lse.size(); ++i) {
    if (!close(gpu.lse[i], cpu.lse[i], tl * std::max(1.0, std::fabs((double)cpu.lse[i]))))
      note("lse[" + std::to_string(i) + "] gpu " + std::to_string(gpu.lse[i]) + " cpu " +
           std::to_string(cpu.lse[i]));
    if (!close(gpu.zl[i], cpu.zl[i], 2 * tl * std::max(1e-6, std::fabs((double)cpu.zl[i]))))
      note("z_loss[" + std::to_string(i) + "] gpu " + std::to_string(gpu.zl[i]) + " cpu " +
           std::to_string(cpu.zl[i]));
  }
  const size_t es = esize(c.dtype);
  const int64_t S = c.stride();
  auto x_at = [&](int64_t r, int64_t global_col) {
    return load_as_float(c.dtype,
                         &in.logits[static_cast<size_t>(r * S + global_col - c.vocab_start) * es]);
  };
  int flips = 0;
  if (c.opt.compute_accuracy) {
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t a = gpu.argmax[r], b = cpu.argmax[r];
      if (a == b) continue;
      const bool valid_a = a >= c.vocab_start && a < c.vocab_start + c.real_cols();
      if (valid_a &&
          std::fabs(x_at(r, a) - x_at(r, b)) <= 1e-4 * std::max(1.0f, std::fabs(x_at(r, b)))) {
        ++flips;
        continue;
      }
      note("argmax[" + std::to_string(r) + "] gpu " + std::to_string(a) + " cpu " +
           std::to_string(b));
    }
    int64_t valid = 0;
    for (int64_t r = 0; r < c.rows; ++r) valid += in.t64[r] != c.opt.ignore_index;
    const double lim = (valid ? static_cast<double>(flips) / valid : 0.0) + 1e-6;
    if (!close(gpu.accuracy, cpu.accuracy, lim))
      note("accuracy gpu " + std::to_string(gpu.accuracy) + " cpu " + std::to_string(cpu.accuracy));
  }
  // The logits buffer: the gradient (with tolerance), or unchanged; gaps always unchanged.
  const bool grad = c.opt.grad_mode != GradMode::none;
  for (int64_t r = 0; r < c.rows; ++r) {
    double rowmax = 0.0;
    for (int64_t j = 0; j < c.cols; ++j)
      rowmax = std::max(rowmax,
                        std::fabs((double)load_as_float(c.dtype, &cpu.logits[(r * S + j) * es])));
    for (int64_t j = 0; j < S; ++j) {
      const size_t off = static_cast<size_t>(r * S + j) * es;
      const bool gap = j >= c.cols;
      if (gap || !grad) {
        if (std::memcmp(&gpu.logits[off], &cpu.logits[off], es) != 0 ||
            std::memcmp(&gpu.logits[off], &in.logits[off], es) != 0)
          note("row " + std::to_string(r) + " col " + std::to_string(j) + " changed (" +
               (gap ? "row-stride gap" : "grad_mode none") + ")");
        continue;
      }
      const double a = load_as_float(c.dtype, &gpu.logits[off]);
      const double b = load_as_float(c.dtype, &cpu.logits[off]);
      const double lim = c.tol_grad_row() * rowmax + c.tol_grad_rel() * std::fabs(b) +
                         1.01 * ulp(c.dtype, std::max(std::fabs(a), std::fabs(b)));
      if (!close(a, b, lim)) {
        std::ostringstream s;
        s << "grad[" << r << "][" << j << "] gpu " << a << " cpu " << b << " (lim " << lim
          << ", target " << in.t64[r] << ")";
        note(s.str());
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " mismatches in " << describe(c) << err.str();
}

inline bool bitwise_equal(const Result& a, const Result& b) {
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  };
  return same(a.loss, b.loss) && same(a.lse, b.lse) && same(a.zl, b.zl) &&
         same(a.argmax, b.argmax) && std::memcmp(&a.accuracy, &b.accuracy, 4) == 0 &&
         same(a.logits, b.logits);
}

inline Case base(const char* name, DType d, int64_t rows, int64_t cols) {
  Case c;
  c.name = name;
  c.dtype = d;
  c.rows = rows;
  c.cols = cols;
  c.seed = static_cast<uint64_t>(rows * 1000003 + cols * 31 + static_cast<int>(d));
  return c;
}

}  // namespace xtest::gpu::compare
