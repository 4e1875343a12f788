// Test support shared by tests/ and dist_tests/: an independent double-precision reference of
// softmax cross-entropy over the full (unsharded) vocabulary, random inputs with fixed seeds,
// bf16/fp16 rounding, shard slicing with a row stride, and per-dtype tolerances.
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

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

namespace xtest {

// Runs f, expects xent::Error, returns its message (empty, and a test failure, otherwise).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const xent::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a " << typeid(e).name() << " that is not xent::Error: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

constexpr double kInf = std::numeric_limits<double>::infinity();

// ------------------------------------------------------------------------------------------
// dtypes

inline size_t elem_size(xent::DType d) {
  return d == xent::DType::f32 ? 4 : 2;
}

inline const char* dtype_name(xent::DType d) {
  switch (d) {
    case xent::DType::bf16: return "bf16";
    case xent::DType::f16: return "f16";
    default: return "f32";
  }
}

// Rounds x (a double) to the dtype (via fp32, round to nearest even) and widens back.
inline double round_to(xent::DType d, double x) {
  const float f = static_cast<float>(x);
  switch (d) {
    case xent::DType::bf16: return static_cast<double>(__bfloat162float(__float2bfloat16_rn(f)));
    case xent::DType::f16: return static_cast<double>(__half2float(__float2half_rn(f)));
    default: return static_cast<double>(f);
  }
}

inline void store_elem(xent::DType d, void* p, double v) {
  const float f = static_cast<float>(v);
  switch (d) {
    case xent::DType::bf16: {
      __nv_bfloat16 b = __float2bfloat16_rn(f);
      std::memcpy(p, &b, 2);
      break;
    }
    case xent::DType::f16: {
      __half h = __float2half_rn(f);
      std::memcpy(p, &h, 2);
      break;
    }
    default: std::memcpy(p, &f, 4);
  }
}

inline double load_elem(xent::DType d, const void* p) {
  switch (d) {
    case xent::DType::bf16: {
      __nv_bfloat16 b;
      std::memcpy(&b, p, 2);
      return __bfloat162float(b);
    }
    case xent::DType::f16: {
      __half h;
      std::memcpy(&h, p, 2);
      return __half2float(h);
    }
    default: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
  }
}

// ------------------------------------------------------------------------------------------
// Inputs

// A dense global matrix [rows, cols] of doubles (values already representable in the dtype).
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Matrix() = default;
  Matrix(int64_t r, int64_t c, double fill = 0.0) : rows(r), cols(c), v(r * c, fill) {}
  double& at(int64_t i, int64_t j) { return v[i * cols + j]; }
  double at(int64_t i, int64_t j) const { return v[i * cols + j]; }
};

// Deterministic on every platform: mt19937_64 is fully specified, and the normal variates come
// from our own Box-Muller (std::normal_distribution is implementation-defined).
class Rng {
 public:
  explicit Rng(uint64_t seed) : g_(seed) {}
  double uniform() { return (static_cast<double>(g_() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double normal() {
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(g_() % static_cast<uint64_t>(n)); }

 private:
  std::mt19937_64 g_;
};

// Random logits N(mean, sigma^2), rounded to the dtype (so the reference sees what the library
// reads).
inline Matrix random_logits(int64_t rows, int64_t cols, uint64_t seed, xent::DType d,
                            double sigma = 2.0, double mean = 0.0) {
  Matrix m(rows, cols);
  Rng r(seed);
  for (auto& x : m.v) x = round_to(d, mean + sigma * r.normal());
  return m;
}

// Random targets in [0, vocab); each row ignored with probability p_ignore.
inline std::vector<int64_t> random_targets(int64_t rows, int64_t vocab, uint64_t seed,
                                           double p_ignore = 0.0, int64_t ignore_index = -100) {
  std::vector<int64_t> t(rows);
  Rng r(seed ^ 0x9e3779b97f4a7c15ULL);
  for (auto& y : t) {
    y = r.below(vocab);
    if (p_ignore > 0 && r.uniform() < p_ignore) y = ignore_index;
  }
  return t;
}

// The logits of one shard in the library's layout: rows x cols at row_stride, in the dtype.
// The stride gap (columns cols..row_stride-1) is filled with `gap` so that tests can check
// it is neither read (NaN there would poison the loss) nor written.
struct HostLogits {
  xent::DType dtype = xent::DType::f32;
  int64_t rows = 0, cols = 0, stride = 0;
  std::vector<unsigned char> bytes;

  void* ptr(int64_t i, int64_t j) { return bytes.data() + (i * stride + j) * elem_size(dtype); }
  const void* ptr(int64_t i, int64_t j) const {
    return bytes.data() + (i * stride + j) * elem_size(dtype);
  }
  double get(int64_t i, int64_t j) const { return load_elem(dtype, ptr(i, j)); }
  void set(int64_t i, int64_t j, double v) { store_elem(dtype, ptr(i, j), v); }
  xent::LogitsView view() {
    xent::LogitsView v;
    v.data = rows > 0 ? bytes.data() : nullptr;
    v.dtype = dtype;
    v.rows = rows;
    v.cols = cols;
    v.row_stride = stride;
    return v;
  }
};

// Slices columns [col0, col0 + width) of the global matrix into a shard with the given stride.
inline HostLogits make_shard(const Matrix& g, int64_t col0, int64_t width, xent::DType d,
                             int64_t stride = -1, double gap = std::nan("")) {
  HostLogits h;
  h.dtype = d;
  h.rows = g.rows;
  h.cols = width;
  h.stride = stride < 0 ? width : stride;
  h.bytes.assign(static_cast<size_t>(std::max<int64_t>(1, h.rows * h.stride)) * elem_size(d), 0);
  for (int64_t i = 0; i < h.rows; ++i) {
    for (int64_t j = 0; j < width; ++j) h.set(i, j, g.at(i, col0 + j));
    for (int64_t j = width; j < h.stride; ++j) h.set(i, j, gap);
  }
  return h;
}

// Targets in the library's index type.
struct HostTargets {
  xent::IndexType type = xent::IndexType::i64;
  std::vector<int64_t> i64;
  std::vector<int32_t> i32;
  HostTargets(const std::vector<int64_t>& t, xent::IndexType ty) : type(ty), i64(t) {
    for (int64_t y : t) i32.push_back(static_cast<int32_t>(y));
  }
  xent::TargetsView view() const {
    xent::TargetsView v;
    v.type = type;
    v.rows = static_cast<int64_t>(i64.size());
    v.data = v.rows == 0 ? nullptr
                         : (type == xent::IndexType::i32 ? static_cast<const void*>(i32.data())
                                                         : static_cast<const void*>(i64.data()));
    return v;
  }
  size_t bytes() const { return i64.size() * (type == xent::IndexType::i32 ? 4 : 8); }
};

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

// ------------------------------------------------------------------------------------------
// Tolerances
//
// Loss (every dtype): the library accumulates in fp32, the reference in double, both on the
//   same rounded inputs, so |loss - ref| <= 1e-5 * max(1, magnitude), where magnitude is the
//   sum of the absolute values of the loss's terms (|lse| + |z_y| + ...): a relative error of
//   ~1e-5 on the terms before they cancel. lse: the same with magnitude |lse|.
// Gradient: fp32 -> relative 3e-5 (a few fp32 roundings in exp/log/sums of up to 5000 terms);
//   bf16 -> 1 ulp relative (2^-7: the library rounds once from fp32, an error <= 1/2 ulp);
//   fp16 -> 1 ulp relative (2^-10) plus 6e-8 (one fp16 subnormal ulp, gradients ~1/(N V) are
//   subnormal in fp16). Plus an absolute 2e-6 * |row scale|: values that cancel to ~0 in fp32
//   (the target column, p_y - 1 with p_y ~ 1) carry an absolute fp32 error of the row's scale.
//   `ulps` > 1 where the gradient is rounded twice (fused forward, then backward by a
//   grad_output that is not a power of two).

inline double loss_tol(double magnitude) {
  return 1e-5 * std::max(1.0, magnitude);
}

inline double grad_rtol(xent::DType d) {
  switch (d) {
    case xent::DType::bf16: return 0.0078125;    // 2^-7
    case xent::DType::f16: return 0.0009765625;  // 2^-10
    default: return 3e-5;
  }
}
inline double grad_atol(xent::DType d) {
  return d == xent::DType::f16 ? 6e-8 : 0.0;
}

struct GradTol {
  double ulps = 1.0;         // multiplies the dtype's relative tolerance
  double scale_atol = 2e-6;  // times |row scale|
};

// Compares a shard's gradient (columns [col0, col0 + cols) of the global reference gradient)
// and checks that the stride gap still holds `gap` (NaN: checks it is still NaN).
inline ::testing::AssertionResult grad_matches(const HostLogits& got, const RefResult& ref,
                                               int64_t col0, GradTol tol = {},
                                               bool check_gap = true, double gap = std::nan("")) {
  int bad = 0;
  double worst = 0.0;
  std::ostringstream msg;
  for (int64_t i = 0; i < got.rows; ++i) {
    const double atol = grad_atol(got.dtype) + tol.scale_atol * std::fabs(ref.row_scale[i]);
    for (int64_t j = 0; j < got.cols; ++j) {
      const double want = ref.grad.at(i, col0 + j);
      const double have = got.get(i, j);
      const double lim = tol.ulps * grad_rtol(got.dtype) * std::fabs(want) + atol;
      const double err = std::fabs(have - want);
      if (!(err <= lim)) {  // NaN-safe
        if (bad < 8)
          msg << "\n  grad[" << i << "][" << col0 + j << "] = " << have << ", want " << want
              << " (err " << err << " > tol " << lim << ")";
        ++bad;
        worst = std::max(worst, err);
      }
    }
    if (check_gap) {
      for (int64_t j = got.cols; j < got.stride; ++j) {
        const double have = got.get(i, j);
        const bool same = std::isnan(gap) ? std::isnan(have) : have == gap;
        if (!same) {
          if (bad < 8) msg << "\n  stride gap [" << i << "][" << j << "] was written: " << have;
          ++bad;
        }
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " gradient elements wrong (" << dtype_name(got.dtype) << ", shard at column "
         << col0 << ", worst abs err " << worst << "):" << msg.str();
}

// Bitwise equality of two shards' storage (e.g. "forward left the logits untouched").
inline bool same_bytes(const HostLogits& a, const HostLogits& b) {
  return a.bytes == b.bytes;
}

// ------------------------------------------------------------------------------------------
// Shards

// Widths that differ by rank and sum to `total` (every width >= 1 when total >= ranks):
// rank r gets roughly proportional to (r + 1).
inline std::vector<int64_t> uneven_widths(int64_t total, int ranks) {
  std::vector<int64_t> w(ranks, 1);
  const int64_t weight = static_cast<int64_t>(ranks) * (ranks + 1) / 2;
  int64_t left = total - ranks;
  int64_t given = 0;
  for (int r = 0; r < ranks; ++r) {
    const int64_t extra = left * (r + 1) / weight;
    w[r] += extra;
    given += extra;
  }
  w[ranks - 1] += left - given;
  return w;
}

inline std::vector<int64_t> starts_of(const std::vector<int64_t>& widths) {
  std::vector<int64_t> s(widths.size(), 0);
  for (size_t r = 1; r < widths.size(); ++r) s[r] = s[r - 1] + widths[r - 1];
  return s;
}

// ------------------------------------------------------------------------------------------
// Checking forward's outputs (host copies) against the reference

struct GotOutputs {
  std::vector<float> loss;      // [1] or [N] (Reduction::none)
  std::vector<float> lse;       // [N] or empty (not asked)
  std::vector<float> zloss;     // [N] or empty
  std::vector<int64_t> argmax;  // [N] or empty
  std::vector<float> accuracy;  // [1] or empty
};

inline void expect_outputs(const GotOutputs& got, const RefResult& ref,
                           const std::vector<int64_t>& targets, const RefOptions& o,
                           double lse_extra_tol = 0.0) {
  const int64_t N = static_cast<int64_t>(targets.size());
  if (o.reduction == xent::Reduction::none) {
    ASSERT_EQ(got.loss.size(), static_cast<size_t>(N));
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      if (targets[i] == o.ignore_index) {
        if (got.loss[i] != 0.0f) ++bad;
        EXPECT_EQ(got.loss[i], 0.0f) << "ignored row " << i << " must have loss 0";
      } else {
        const bool ok = std::fabs(got.loss[i] - ref.row_loss[i]) <= loss_tol(ref.row_mag[i]);
        if (!ok) ++bad;
        EXPECT_NEAR(got.loss[i], ref.row_loss[i], loss_tol(ref.row_mag[i])) << "loss row " << i;
      }
    }
  } else {
    ASSERT_GE(got.loss.size(), 1u);
    EXPECT_NEAR(got.loss[0], ref.loss, loss_tol(ref.mag))
        << (o.reduction == xent::Reduction::mean ? "mean" : "sum") << " loss over " << ref.n_valid
        << " valid rows";
  }
  if (!got.lse.empty()) {
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      const double tol = loss_tol(std::fabs(ref.lse[i])) + lse_extra_tol;
      if (!(std::fabs(got.lse[i] - ref.lse[i]) <= tol)) ++bad;
      EXPECT_NEAR(got.lse[i], ref.lse[i], tol) << "lse row " << i;
    }
  }
  if (!got.zloss.empty()) {
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      const double want = targets[i] == o.ignore_index ? 0.0 : ref.zloss[i];
      const double tol = 1e-5 * std::max(1.0, std::fabs(want)) + 1e-7;
      if (!(std::fabs(got.zloss[i] - want) <= tol)) ++bad;
      EXPECT_NEAR(got.zloss[i], want, tol)
          << "z_loss row " << i << (targets[i] == o.ignore_index ? " (ignored row)" : "");
    }
  }
  if (!got.argmax.empty()) {
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 8; ++i) {
      if (got.argmax[i] != ref.argmax[i]) ++bad;
      EXPECT_EQ(got.argmax[i], ref.argmax[i]) << "argmax row " << i;
    }
  }
  if (!got.accuracy.empty()) {
    EXPECT_NEAR(got.accuracy[0], ref.accuracy, 1e-6)
        << "accuracy over " << ref.n_valid << " valid rows";
  }
}

// A power of two (or 1): the library's second rounding (fused backward) is then exact.
inline bool is_pow2_all(const std::vector<double>& v) {
  for (double x : v) {
    int e;
    if (std::frexp(std::fabs(x), &e) != 0.5) return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------
// Single-rank harness (CPU backend, Group::local): forward, the outputs, then the gradient of
// the grad mode, against the reference.

struct LocalRun {
  xent::DType dtype = xent::DType::f32;
  xent::IndexType itype = xent::IndexType::i64;
  int64_t stride_extra = 0;         // row_stride = cols + stride_extra (gap filled with NaN)
  std::vector<double> grad_output;  // backward's grad_output; empty: backward with 1
  bool want_lse = true, want_zloss = true;
  GradTol tol = {};
  double lse_extra_tol = 0.0;
};

// x: the logits as the library will read them (already rounded to run.dtype), all columns of
// the single rank (columns >= opt.vocab_size are padding). opt.vocab_size is taken as is.
inline void run_local(const Matrix& x, const std::vector<int64_t>& targets,
                      const xent::Options& opt, const LocalRun& run) {
  const int64_t N = x.rows;
  const int64_t V = opt.vocab_size < 0 ? x.cols : opt.vocab_size;
  const RefOptions ro = ref_options(opt, V);
  std::vector<double> go = run.grad_output;
  if (go.empty()) go.assign(opt.reduction == xent::Reduction::none ? N : 1, 1.0);
  const RefResult ref = reference(x, targets, ro);
  const RefResult ref_go = reference(x, targets, ro, go);

  xent::Group g = xent::Group::local(xent::Backend::cpu);
  HostLogits buf = make_shard(x, 0, x.cols, run.dtype, x.cols + run.stride_extra);
  const HostLogits orig = buf;
  HostTargets tg(targets, run.itype);

  const size_t nloss = opt.reduction == xent::Reduction::none ? static_cast<size_t>(N) : 1;
  const float nan = std::nanf("");
  GotOutputs got;
  got.loss.assign(std::max<size_t>(nloss, 1), nan);
  std::vector<float> lse(std::max<int64_t>(N, 1), nan), zl(std::max<int64_t>(N, 1), nan);
  std::vector<int64_t> am(std::max<int64_t>(N, 1), -7);
  std::vector<float> acc(1, nan);
  xent::Outputs out;
  out.loss = got.loss.data();
  if (run.want_lse || opt.grad_mode == xent::GradMode::deferred) out.lse = lse.data();
  if (run.want_zloss) out.z_loss = zl.data();
  if (opt.compute_accuracy) {
    out.argmax = am.data();
    out.accuracy = acc.data();
  }
  xent::forward(g, buf.view(), tg.view(), opt, out);
  got.loss.resize(nloss);
  if (out.lse) got.lse.assign(lse.begin(), lse.begin() + N);
  if (out.z_loss) got.zloss.assign(zl.begin(), zl.begin() + N);
  if (out.argmax) got.argmax.assign(am.begin(), am.begin() + N);
  if (out.accuracy) got.accuracy = acc;
  {
    SCOPED_TRACE("forward outputs");
    expect_outputs(got, ref, targets, ro, run.lse_extra_tol);
  }

  std::vector<float> gof(go.begin(), go.end());
  GradTol tol2 = run.tol;
  switch (opt.grad_mode) {
    case xent::GradMode::fused: {
      EXPECT_TRUE(grad_matches(buf, ref, 0, run.tol)) << "fused forward's gradient";
      xent::backward(g, buf.view(), tg.view(), out.lse, gof.data(), opt);
      // fused: the gradient was rounded once by forward and again after the rescale, unless
      // grad_output is a power of two (exact), or fp32
      if (!is_pow2_all(go)) tol2.ulps *= 2;
      EXPECT_TRUE(grad_matches(buf, ref_go, 0, tol2)) << "fused backward (grad_output applied)";
      break;
    }
    case xent::GradMode::deferred: {
      EXPECT_TRUE(same_bytes(buf, orig)) << "deferred forward must leave the logits untouched";
      xent::backward(g, buf.view(), tg.view(), lse.data(), gof.data(), opt);
      EXPECT_TRUE(grad_matches(buf, ref_go, 0, run.tol)) << "deferred backward";
      break;
    }
    case xent::GradMode::none: {
      EXPECT_TRUE(same_bytes(buf, orig)) << "GradMode::none must leave the logits untouched";
      EXPECT_THROW(xent::backward(g, buf.view(), tg.view(), out.lse, gof.data(), opt), xent::Error);
      break;
    }
  }
}

}  // namespace xtest
