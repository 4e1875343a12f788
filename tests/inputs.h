// Test support shared by tests/ and dist_tests/: random inputs with fixed seeds, bf16/fp16
// rounding, shard slicing with a row stride, targets, and error_of (an expected xent::Error).
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
    const std::string message = e.what();
    // Every error comes out of src/error.h's one module, with its prefix.
    EXPECT_EQ(message.rfind("xent: ", 0), 0u) << "message lacks the \"xent: \" prefix: " << message;
    return message;
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

}  // namespace xtest
