// The fused lm head's float64 reference and the runner that checks one rank's call against it,
// shared by tests/test_linear.cpp (one rank) and dist_tests/test_dist_linear.cpp (2 to 4 ranks,
// with and without sequence parallelism).
//
// The reference: logits = hidden @ weight^T in double over the real vocabulary (rows of the
// weight past vocab_size never enter), reference() of reference.h on them (loss, lse, the
// gradient dL/dlogits times grad_output), then d_hidden = grad @ weight and d_weight = grad^T @
// hidden in double. None of the library's code is used.
#pragma once

#include <xent/linear.h>

#include <cstdlib>
#include <string>

#include "harness.h"

namespace xtest {

// ------------------------------------------------------------------------------------------
// Tolerances of d_hidden and d_weight
//
// Each element is a sum of products, d_hidden[i][h] = sum_j g_ij w_jh (over the shard's real
// columns, then over the ranks) and d_weight[j][h] = sum_i g_ij x_ih (over the rows), and its
// magnitude is the sum of the absolute values of those products (computed by the reference).
// The library's error, relative to that magnitude, comes from
//   - the fp32 GEMM of the logits (a sum over H): an error of about sqrt(H) 2^-24 relative to
//     sum_h |x_ih w_jh| in z_ij, which moves g_ij by about g_ij times that (softmax), a few 1e-7
//     with these inputs (|z| of a few units);
//   - the fp32 gradient itself (exp, lse: a few ulp, tolerances.h);
//   - the fp32 GEMMs of d_hidden and d_weight (a sum over V or over N, at most 300 terms here):
//     about sqrt(terms) 2^-24, a worst case of terms x 2^-24 = 1.8e-5;
// so 5e-6 of the magnitude (measured: 8e-7 at most here, 1e-6 at 64 rows, H = 48 and 300
// classes: docs/linear.md). An output in bf16 (or f16) is rounded once from fp32: at most half an
// ulp, and the tolerance allows one (2^-7 or 2^-10 relative to the value) on top.
constexpr double kLinearRtol = 5e-6;

// The CUDA backend rounds the gradient of the logits to the inputs' dtype before the two GEMMs
// that consume it (16-bit tensor-core GEMMs, as the unfused path's): each g_ij then carries a
// relative error of at most half an ulp (2^-8 in bf16, 2^-11 in f16), or an absolute one of half
// the subnormal spacing where it is tiny (2^-134, 2^-25), which adds g_rtol x the magnitude and
// g_atol x sum_j |w_jh| (or sum_i |x_ih|) to an element's error. 0 where the gradient is fp32.
struct GradRounding {
  double rtol = 0.0, atol = 0.0;
};
inline GradRounding grad_rounding(xent::Backend b, xent::DType inputs) {
  if (b == xent::Backend::cpu || inputs == xent::DType::f32) return {};
  if (inputs == xent::DType::bf16) return {std::ldexp(1.0, -8), std::ldexp(1.0, -134)};
  return {std::ldexp(1.0, -11), std::ldexp(1.0, -25)};
}

inline double out_rtol(xent::DType d) {
  return d == xent::DType::f32 ? 0.0 : grad_rtol(d);
}

// ------------------------------------------------------------------------------------------
// The reference

struct LinearRef {
  RefResult r;      // loss, lse, ..., grad [rows, Vpad] (times grad_output)
  Matrix d_hidden;  // [rows, H]
  Matrix d_weight;  // [Vpad, H]; rows past vocab_size 0
  Matrix dh_mag;    // [rows, H]: sum_j |g_ij w_jh|
  Matrix dw_mag;    // [Vpad, H]: sum_i |g_ij x_ih|
  Matrix dh_abs;    // [rows, H]: sum_j |w_jh| over the rows with a gradient
  Matrix dw_abs;    // [Vpad, H]: sum_i |x_ih| over the rows with a gradient
};

inline LinearRef linear_reference(const Matrix& hidden, const Matrix& weight,
                                  const std::vector<int64_t>& targets, const RefOptions& o,
                                  const std::vector<double>& grad_output) {
  const int64_t N = hidden.rows, H = hidden.cols, Vpad = weight.rows;
  const int64_t V = o.vocab_size < 0 ? Vpad : o.vocab_size;
  Matrix logits(N, Vpad, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      double s = 0.0;
      for (int64_t h = 0; h < H; ++h) s += hidden.at(i, h) * weight.at(j, h);
      logits.at(i, j) = s;
    }
  LinearRef ref;
  ref.r = reference(logits, targets, o, grad_output);
  ref.d_hidden = Matrix(N, H, 0.0);
  ref.dh_mag = Matrix(N, H, 0.0);
  ref.d_weight = Matrix(Vpad, H, 0.0);
  ref.dw_mag = Matrix(Vpad, H, 0.0);
  ref.dh_abs = Matrix(N, H, 0.0);
  ref.dw_abs = Matrix(Vpad, H, 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      const double g = ref.r.grad.at(i, j);
      for (int64_t h = 0; h < H; ++h) {
        ref.d_hidden.at(i, h) += g * weight.at(j, h);
        ref.dh_mag.at(i, h) += std::fabs(g * weight.at(j, h));
        ref.d_weight.at(j, h) += g * hidden.at(i, h);
        ref.dw_mag.at(j, h) += std::fabs(g * hidden.at(i, h));
        ref.dh_abs.at(i, h) += std::fabs(weight.at(j, h));
        ref.dw_abs.at(j, h) += std::fabs(hidden.at(i, h));
      }
    }
  return ref;
}

// Rows [r0, r0 + n) of m.
inline Matrix rows_of(const Matrix& m, int64_t r0, int64_t n) {
  Matrix out(n, m.cols);
  std::copy(m.v.begin() + r0 * m.cols, m.v.begin() + (r0 + n) * m.cols, out.v.begin());
  return out;
}

// The per-row results of rows [r0, r0 + n) (the reduced loss, accuracy and grad as they are).
inline RefResult rows_of(const RefResult& r, int64_t r0, int64_t n) {
  RefResult s = r;
  const auto cut = [&](auto& v) { v.assign(v.begin() + r0, v.begin() + r0 + n); };
  cut(s.row_loss);
  cut(s.row_mag);
  cut(s.lse);
  cut(s.zloss);
  cut(s.argmax);
  cut(s.row_scale);
  return s;
}

// got (a [rows, cols] buffer in its dtype, its stride gap NaN) against want's rows [row0, ...):
// |got - want| <= out_rtol |want| + kLinearRtol * mag, and the gap left NaN. `worst`, if given,
// receives the largest |got - want| / mag seen (where mag > 0).
inline ::testing::AssertionResult matrix_matches(const char* what, const HostLogits& got,
                                                 const Matrix& want, const Matrix& mag,
                                                 int64_t row0, double* worst = nullptr,
                                                 const Matrix* abs_mag = nullptr,
                                                 GradRounding gr = {}) {
  int bad = 0;
  std::ostringstream msg;
  for (int64_t i = 0; i < got.rows; ++i) {
    for (int64_t j = 0; j < got.cols; ++j) {
      const double w = want.at(row0 + i, j), m = mag.at(row0 + i, j), have = got.get(i, j);
      const double err = std::fabs(have - w);
      const double lim = out_rtol(got.dtype) * std::fabs(w) + (kLinearRtol + gr.rtol) * m +
                         (abs_mag != nullptr ? gr.atol * abs_mag->at(row0 + i, j) : 0.0);
      if (worst != nullptr && m > 0.0 && got.dtype == xent::DType::f32)
        *worst = std::max(*worst, err / m);
      if (!(err <= lim)) {  // NaN-safe
        if (bad < 8)
          msg << "\n  " << what << "[" << row0 + i << "][" << j << "] = " << have << ", want " << w
              << " (err " << err << " > tol " << lim << ", magnitude " << m << ")";
        ++bad;
      }
    }
    for (int64_t j = got.cols; j < got.stride; ++j)
      if (!std::isnan(got.get(i, j))) {
        if (bad < 8) msg << "\n  " << what << " stride gap [" << i << "][" << j << "] written";
        ++bad;
      }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " elements of " << what << " wrong ("
                                       << dtype_name(got.dtype) << "):" << msg.str();
}

inline xent::MatrixView matrix_view(HostLogits& m) {
  return xent::MatrixView{m.rows > 0 ? m.bytes.data() : nullptr, m.dtype, m.rows, m.cols, m.stride};
}

// ------------------------------------------------------------------------------------------
// The CUDA backend's buffers: each host buffer copied to the device once (the same device copy
// for the same host pointer), the call made on device pointers, every buffer copied back.

class Staging {
 public:
  explicit Staging(bool on) : on_(on) {}
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() {
    for (const Buf& b : bufs_) cudaFree(b.dev);
  }
  template <typename T>
  T* operator()(T* host, size_t bytes) {
    if (!on_ || host == nullptr) return host;
    for (const Buf& b : bufs_)
      if (b.host == host) return static_cast<T*>(b.dev);
    Buf b{const_cast<void*>(static_cast<const void*>(host)), nullptr, bytes};
    EXPECT_EQ(cudaMalloc(&b.dev, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(b.dev, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    bufs_.push_back(b);
    return static_cast<T*>(b.dev);
  }
  xent::MatrixView operator()(xent::MatrixView v, HostLogits& m) {
    v.data = (*this)(v.data, m.bytes.size());
    return v;
  }
  void copy_back() {
    if (!on_) return;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (const Buf& b : bufs_)
      EXPECT_EQ(cudaMemcpy(b.host, b.dev, b.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }

 private:
  struct Buf {
    void* host;
    void* dev;
    size_t bytes;
  };
  bool on_;
  std::vector<Buf> bufs_;
};

// ------------------------------------------------------------------------------------------
// One rank's call against the reference

struct LinearCase {
  int64_t rows = 16;  // this rank's rows (with sequence parallelism: each rank's)
  int64_t H = 24;
  std::vector<int64_t> widths = {40};         // one per rank; their sum is the padded vocabulary
  int64_t vocab_size = -1;                    // -1: all columns real
  xent::DType dtype = xent::DType::f32;       // hidden and weight
  xent::DType grad_dtype = xent::DType::f32;  // d_hidden and d_weight
  xent::Options opt;                          // layout fields filled from plan_shard
  xent::LinearOptions lopt;
  double p_ignore = 0.0;
  std::vector<double> grad_output;  // deferred: empty -> 1, one value, or one per global row
  bool want_d_hidden = true, want_d_weight = true;
  uint64_t seed = 1;
  int64_t stride_extra = 3;  // every matrix's row stride is cols + stride_extra (gap NaN)
};

struct LinearGot {
  std::vector<float> loss, lse;
  std::vector<float> d_hidden;            // this rank's d_hidden, row-major [rows, H] (if computed)
  double worst_dh = 0.0, worst_dw = 0.0;  // max |error| / magnitude (f32 outputs)
  xent::LinearPlan plan;                  // forward's
};

// XENT_TEST_BACKEND=cuda (ctest linear_cuda): the linear suites' cases on one GPU, buffers staged
// on the device by run_linear; skipped where there is no GPU.
inline bool on_cuda() {
  const char* b = std::getenv("XENT_TEST_BACKEND");
  return b != nullptr && std::string(b) == "cuda";
}
inline xent::Group local() {
  return xent::Group::local(on_cuda() ? xent::Backend::cuda : xent::Backend::cpu);
}

// XENT_TEST_LINEAR_SCHEDULE=fast or lean (ctest runs the linear suites under both): the schedule
// every case takes where it asks for none (automatic), so that each case checks both. Under lean
// a case that sets no chunk_cols takes chunks of 7 columns, or a sixth of the widest shard where
// that is more (several chunks, a short last one; as many as a vocabulary of 128256 in chunks of
// 3072 makes at most), and its chunk_rows become lean's blocks of rows.
inline xent::LinearOptions with_test_schedule(xent::LinearOptions l, int64_t widest) {
  const char* e = std::getenv("XENT_TEST_LINEAR_SCHEDULE");
  if (e == nullptr || l.schedule != xent::LinearSchedule::automatic) return l;
  const std::string s = e;
  if (s == "fast") l.schedule = xent::LinearSchedule::fast;
  if (s == "lean") {
    l.schedule = xent::LinearSchedule::lean;
    if (l.chunk_cols == 0) l.chunk_cols = std::max<int64_t>(7, widest / 6);
  }
  return l;
}

// XENT_TEST_LINEAR_BF16=1: the inputs of every case of f32 inputs in bf16 (f16 cases stay f16),
// every row stride a multiple of 8 elements (stride_extra 8, the gap still NaN), so that the cases
// can run on the epilogue engine (the CUDA suites; the CPU's fp32 tolerances are for f32 inputs).
// XENT_TEST_LINEAR_GEMM (ctest runs the CUDA lean suites under both): cublaslt sets
// LinearOptions::gemm; epilogue leaves it automatic and requires the plan to take the epilogue
// engine wherever it can (lean with gradients in forward, bf16 inputs, H a multiple of 8): a build
// or device that silently fell back would fail.
inline std::string test_env(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr ? std::string() : std::string(e);
}
inline void with_test_engine(LinearCase& c) {
  if (test_env("XENT_TEST_LINEAR_BF16") == "1") {
    if (c.dtype == xent::DType::f32) c.dtype = xent::DType::bf16;
    c.stride_extra = 8;
  }
  if (test_env("XENT_TEST_LINEAR_GEMM") == "cublaslt") c.lopt.gemm = xent::LinearGemm::cublaslt;
}
inline bool wants_epilogue(const xent::Group& g, const LinearCase& c,
                           const xent::LinearPlan& plan) {
  return test_env("XENT_TEST_LINEAR_GEMM") == "epilogue" && g.backend() == xent::Backend::cuda &&
         plan.schedule == xent::LinearSchedule::lean && c.dtype == xent::DType::bf16 &&
         c.opt.grad_mode == xent::GradMode::fused && (c.want_d_hidden || c.want_d_weight) &&
         c.H % 8 == 0 && (c.H + c.stride_extra) % 8 == 0;
}

// Runs linear_forward (and linear_backward for deferred) on this rank of `g` and checks every
// output against the reference of the whole problem.
inline LinearGot run_linear(const xent::Group& g, const LinearCase& case_in) {
  LinearCase c = case_in;
  c.lopt = with_test_schedule(c.lopt, *std::max_element(c.widths.begin(), c.widths.end()));
  with_test_engine(c);
  using xent::DType;
  using xent::Reduction;
  LinearGot got;
  const int rank = g.rank(), ranks = g.size();
  EXPECT_EQ(c.widths.size(), static_cast<size_t>(ranks));
  const bool sp = c.lopt.sequence_parallel;
  const int64_t N = sp ? c.rows * ranks : c.rows, H = c.H;
  const int64_t r0 = sp ? c.rows * rank : 0, Nk = c.rows;
  const std::vector<int64_t> starts = starts_of(c.widths);
  const int64_t Vpad = starts.back() + c.widths.back();
  const int64_t V = c.vocab_size < 0 ? Vpad : c.vocab_size;

  // Inputs: hidden ~ N(0, 1), weight ~ N(0, 4 / H) (logits ~ N(0, 4)), rounded to the dtype.
  Matrix hidden = random_logits(N, H, c.seed, c.dtype, 1.0);
  Matrix weight = random_logits(Vpad, H, c.seed + 1, c.dtype, 2.0 / std::sqrt(double(H)));
  std::vector<int64_t> targets = random_targets(N, V, c.seed, c.p_ignore, c.opt.ignore_index);

  const xent::Shard shard = xent::plan_shard(g, c.widths[rank], c.vocab_size);
  xent::Options opt = c.opt;
  xent::apply(shard, opt);
  const RefOptions ro = ref_options(opt, V);
  const bool deferred = opt.grad_mode == xent::GradMode::deferred;
  const bool grads = opt.grad_mode != xent::GradMode::none;
  // Fused: the gradients are for grad_output = grad_scale.
  const std::vector<double> go_ref =
      deferred ? c.grad_output : std::vector<double>{double(opt.grad_scale)};
  const LinearRef ref = linear_reference(hidden, weight, targets, ro, go_ref);

  // This rank's buffers: its rows of hidden, its shard of the weight (padding rows NaN: they
  // must never be read), outputs filled with NaN (each must be written, or left alone).
  const double nan = std::nan("");
  HostLogits hb = make_shard(rows_of(hidden, r0, Nk), 0, H, c.dtype, H + c.stride_extra);
  Matrix wk = rows_of(weight, shard.start, shard.width);
  for (int64_t j = 0; j < shard.width; ++j)
    if (shard.start + j >= V)
      for (int64_t h = 0; h < H; ++h) wk.at(j, h) = nan;
  HostLogits wb = make_shard(wk, 0, H, c.dtype, H + c.stride_extra);
  const std::vector<int64_t> my_targets(targets.begin() + r0, targets.begin() + r0 + Nk);
  HostTargets tg(my_targets, xent::IndexType::i64);
  const size_t nloss = opt.reduction == Reduction::none ? static_cast<size_t>(Nk) : 1;
  got.loss.assign(std::max<size_t>(nloss, 1), std::nanf(""));
  got.lse.assign(std::max<int64_t>(Nk, 1), std::nanf(""));
  std::vector<float> zl(std::max<int64_t>(Nk, 1), std::nanf("")), acc(1, std::nanf(""));
  std::vector<int64_t> am(std::max<int64_t>(Nk, 1), -7);
  HostLogits dh = make_shard(Matrix(Nk, H, nan), 0, H, c.grad_dtype, H + c.stride_extra);
  HostLogits dw = make_shard(Matrix(shard.width, H, nan), 0, H, c.grad_dtype, H + c.stride_extra);
  Matrix dw_want = ref.d_weight, dw_mag = ref.dw_mag;
  if (c.lopt.accumulate_d_weight) {  // d_weight starts with values that it must add to
    const Matrix init = random_logits(shard.width, H, c.seed + 2, c.grad_dtype, 0.01);
    for (int64_t j = 0; j < shard.width; ++j)
      for (int64_t h = 0; h < H; ++h) {
        dw.set(j, h, init.at(j, h));
        dw_want.at(shard.start + j, h) += init.at(j, h);
        dw_mag.at(shard.start + j, h) += std::fabs(init.at(j, h));
      }
  }

  xent::LinearOutputs out;
  out.loss = got.loss.data();
  out.lse = got.lse.data();
  out.z_loss = zl.data();
  if (opt.compute_accuracy) {
    out.argmax = am.data();
    out.accuracy = acc.data();
  }
  xent::LinearOutputs grads_out;
  if (c.want_d_hidden) grads_out.d_hidden = matrix_view(dh);
  if (c.want_d_weight) grads_out.d_weight = matrix_view(dw);
  if (opt.grad_mode == xent::GradMode::fused) {
    out.d_hidden = grads_out.d_hidden;
    out.d_weight = grads_out.d_weight;
  }
  // CUDA: the same buffers on the device.
  const bool cuda = g.backend() == xent::Backend::cuda;
  Staging dev(cuda);
  const auto floats = [](const std::vector<float>& v) { return sizeof(float) * v.size(); };
  out.loss = dev(out.loss, floats(got.loss));
  out.lse = dev(out.lse, floats(got.lse));
  out.z_loss = dev(out.z_loss, floats(zl));
  out.argmax = dev(out.argmax, sizeof(int64_t) * am.size());
  out.accuracy = dev(out.accuracy, floats(acc));
  for (xent::LinearOutputs* o : {&out, &grads_out}) {
    if (o->d_hidden.data != nullptr) o->d_hidden = dev(o->d_hidden, dh);
    if (o->d_weight.data != nullptr) o->d_weight = dev(o->d_weight, dw);
  }
  xent::TargetsView tv = tg.view();
  tv.data = dev(tv.data, tg.bytes());
  const xent::MatrixView hv = dev(matrix_view(hb), hb), wv = dev(matrix_view(wb), wb);
  xent::LinearPlan plan;
  out.plan = &plan;
  xent::linear_forward(g, hv, wv, tv, opt, c.lopt, out);
  // The plan stays within its budget, and takes the schedule asked for.
  EXPECT_LE(plan.scratch_bytes, plan.budget);
  if (c.lopt.schedule != xent::LinearSchedule::automatic) EXPECT_EQ(plan.schedule, c.lopt.schedule);
  if (wants_epilogue(g, c, plan)) EXPECT_EQ(plan.gemm, xent::LinearGemm::epilogue);
  if (c.lopt.gemm == xent::LinearGemm::cublaslt) EXPECT_EQ(plan.gemm, xent::LinearGemm::cublaslt);
  got.plan = plan;
  std::vector<float> go(c.grad_output.begin(), c.grad_output.end());
  if (deferred) {
    if (go.size() == static_cast<size_t>(N)) go.assign(go.begin() + r0, go.begin() + r0 + Nk);
    xent::linear_backward(g, hv, wv, tv, dev(got.lse.data(), floats(got.lse)),
                          go.empty() ? nullptr : dev(go.data(), floats(go)), opt, c.lopt,
                          grads_out);
  }
  dev.copy_back();
  got.loss.resize(nloss);
  got.lse.resize(Nk);

  const GradRounding gr = grad_rounding(g.backend(), c.dtype);
  const std::string where = "rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                            (sp ? ", sequence parallel" : "");
  GotOutputs o;
  o.loss = got.loss;
  o.lse = got.lse;
  o.zloss.assign(zl.begin(), zl.begin() + Nk);
  if (opt.compute_accuracy) {
    o.argmax.assign(am.begin(), am.begin() + Nk);
    o.accuracy = acc;
  }
  {
    SCOPED_TRACE(where + ": forward outputs");
    expect_outputs(o, rows_of(ref.r, r0, Nk), my_targets, ro);
  }
  if (!grads || (!c.want_d_hidden && !c.want_d_weight)) {
    if (Nk > 0) EXPECT_TRUE(std::isnan(dh.get(0, 0))) << where << ": d_hidden written";
    EXPECT_TRUE(std::isnan(dw.get(0, 0))) << where << ": d_weight written";
    return got;
  }
  if (c.want_d_hidden) {
    EXPECT_TRUE(matrix_matches("d_hidden", dh, ref.d_hidden, ref.dh_mag, r0, &got.worst_dh,
                               &ref.dh_abs, gr))
        << where;
    for (int64_t i = 0; i < Nk; ++i)
      for (int64_t h = 0; h < H; ++h) got.d_hidden.push_back(static_cast<float>(dh.get(i, h)));
  }
  if (c.want_d_weight)
    EXPECT_TRUE(matrix_matches("d_weight", dw, dw_want, dw_mag, shard.start, &got.worst_dw,
                               &ref.dw_abs, gr))
        << where << ", shard [" << shard.start << ", " << shard.start + shard.width << ")";
  return got;
}

}  // namespace xtest
