// The runner that checks one rank's call of the fused lm head against the float64 reference
// (linear_reference.h), shared by tests/test_linear*.cpp (one rank) and
// dist_tests/test_dist_linear.cpp (2 to 4 ranks, with and without sequence parallelism).
#pragma once

#include <gtest/gtest.h>
#include <xent/linear.h>

#include <cstdlib>
#include <string>

#include "harness.h"
#include "linear_reference.h"

namespace xtest {

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

// The Linear suite's fixture (test_linear.cpp, test_linear_nan.cpp): on the CUDA backend a
// machine without a GPU skips it.
class LinearTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (on_cuda() && (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)) GTEST_SKIP() << "no GPU";
  }
};

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
