// The CUDA backend against the CPU backend, through the public API (forward/backward), on the
// same host inputs. Every test skips itself when no CUDA device is visible (CI has none).
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
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test.h"
#include "inputs.h"  // element loads and stores of each dtype

namespace {

using xent::Backend;
using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;

using xtest::gpu::ck;
using xtest::gpu::DevBuf;

size_t esize(DType d) {
  return xtest::elem_size(d);
}
float load_as_float(DType d, const uint8_t* p) {
  return static_cast<float>(xtest::load_elem(d, p));
}

// One unit in the last place of the dtype at |v| (fp32: 0, the fp32 tolerance covers it).
double ulp(DType d, double v) {
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

std::string describe(const Case& c) {
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

Inputs make_inputs(const Case& c) {
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
Result run(Backend backend, const Case& c, const Inputs& in, cudaStream_t stream = nullptr,
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

bool close(double a, double b, double lim) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= lim;
}

// Compares the GPU's result with the CPU's. Returns a failure naming the first few differences.
::testing::AssertionResult matches(const Case& c, const Inputs& in, const Result& gpu,
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

bool bitwise_equal(const Result& a, const Result& b) {
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0);
  };
  return same(a.loss, b.loss) && same(a.lse, b.lse) && same(a.zl, b.zl) &&
         same(a.argmax, b.argmax) && std::memcmp(&a.accuracy, &b.accuracy, 4) == 0 &&
         same(a.logits, b.logits);
}

void check_case(const Case& c, bool determinism = true) {
  SCOPED_TRACE(describe(c));
  const Inputs in = make_inputs(c);
  const Result cpu = run(Backend::cpu, c, in);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const Result gpu = run(Backend::cuda, c, in, s);
  EXPECT_TRUE(matches(c, in, gpu, cpu));
  if (determinism) {
    const Result again = run(Backend::cuda, c, in, s);
    EXPECT_TRUE(bitwise_equal(gpu, again)) << "two GPU runs differ: " << describe(c);
  }
  ck(cudaStreamDestroy(s), "cudaStreamDestroy");
}

Case base(const char* name, DType d, int64_t rows, int64_t cols) {
  Case c;
  c.name = name;
  c.dtype = d;
  c.rows = rows;
  c.cols = cols;
  c.seed = static_cast<uint64_t>(rows * 1000003 + cols * 31 + static_cast<int>(d));
  return c;
}

// ---------------------------------------------------------------------------------- tests

TEST(CudaBackend, DeviceCount) {
  SKIP_WITHOUT_GPU();
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  EXPECT_GT(n, 0);
}

// Every V_local shape, both launch shapes (warp per row, block per row), all dtypes.
TEST(CudaBackend, VocabSweepAllDtypes) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {8192, 1},   {8192, 7},   {3, 1000},   {1000, 1000}, {1, 16032}, {3, 32064},
      {3, 128256}, {1, 262144}, {2, 262150}, {0, 1000},    {50, 4096}, {50, 4104}};
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (auto [n, v] : shapes) {
      Case c = base("sweep", d, n, v);
      check_case(c, /*determinism=*/n * v < 5000000);
    }
}

// The benchmark shape, bf16, both grad modes (mean): large enough to cross many blocks.
TEST(CudaBackend, LargeBf16) {
  SKIP_WITHOUT_GPU();
  for (GradMode m : {GradMode::fused, GradMode::deferred}) {
    Case c = base("large", DType::bf16, 8192, 16032);
    c.opt.grad_mode = m;
    check_case(c);
  }
  Case c = base("large-f16-unaligned", DType::f16, 257, 32064);
  c.stride_extra = 3;
  c.opt.label_smoothing = 0.05f;
  c.opt.compute_accuracy = true;
  check_case(c);
}

// Each option, unaligned row strides, padded vocabularies, both index types, both grad modes.
TEST(CudaBackend, Options) {
  SKIP_WITHOUT_GPU();
  std::vector<Case> cases;
  {
    Case c = base("all-options-warp", DType::bf16, 300, 1000);
    c.stride_extra = 3;
    c.vocab_size = 990;
    c.itype = IndexType::i32;
    c.opt.label_smoothing = 0.1f;
    c.opt.z_loss = 1e-3f;
    c.opt.softcap = 30.0f;
    c.opt.compute_accuracy = true;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("all-options-block", DType::bf16, 120, 20000);
    c.stride_extra = 3;
    c.vocab_size = 19990;
    c.opt.label_smoothing = 0.1f;
    c.opt.z_loss = 1e-4f;
    c.opt.softcap = 15.0f;
    c.opt.compute_accuracy = true;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("none-per-row-go", DType::f32, 200, 5000);
    c.stride_extra = 1;
    c.opt.reduction = Reduction::none;
    c.ignore_frac = 0.3;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("none-per-row-go-deferred", DType::bf16, 333, 777);
    c.stride_extra = 5;
    c.opt.reduction = Reduction::none;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    c.itype = IndexType::i32;
    cases.push_back(c);
  }
  {
    Case c = base("sum-softcap-deferred", DType::f16, 77, 3001);
    c.stride_extra = 5;
    c.opt.reduction = Reduction::sum;
    c.opt.softcap = 20.0f;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    // One rank's shard is the whole vocabulary (offsets need several ranks: TwoRanksMatchCpu);
    // here its last columns are padding.
    Case c = base("padded-one-rank", DType::f32, 1000, 33);
    c.stride_extra = 3;
    c.vocab_size = 30;
    c.opt.reduction = Reduction::none;
    c.opt.label_smoothing = 0.2f;
    c.opt.compute_accuracy = true;
    c.opt.grad_mode = GradMode::deferred;
    cases.push_back(c);
  }
  {
    Case c = base("grad-none-accuracy", DType::bf16, 50, 4104);
    c.opt.grad_mode = GradMode::none;
    c.opt.compute_accuracy = true;
    c.opt.z_loss = 1e-2f;
    cases.push_back(c);
  }
  {
    Case c = base("fused-go-one", DType::bf16, 64, 9000);
    c.stride_extra = 7;
    c.go_kind = 1;
    cases.push_back(c);
  }
  {
    Case c = base("fused-go-scalar", DType::f32, 64, 9000);
    c.opt.reduction = Reduction::sum;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    // grad_scale: per-row factors grad_output / 0.37, exactly 1 on some rows (left alone).
    Case c = base("fused-grad-scale-per-row", DType::bf16, 300, 3001);
    c.opt.reduction = Reduction::none;
    c.opt.grad_scale = 0.37f;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    // One rank, 9000 bf16 columns: the single-pass path; backward with grad_output null (1).
    Case c = base("fused-grad-scale-single-pass", DType::bf16, 64, 9000);
    c.opt.grad_scale = 0.25f;
    c.go_kind = 0;
    cases.push_back(c);
  }
  {
    Case c = base("fused-grad-scale-two-pass-scalar", DType::f16, 64, 9000);
    c.opt.reduction = Reduction::sum;
    c.opt.single_pass = false;
    c.opt.grad_scale = 0.47f;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("all-ignored", DType::bf16, 100, 2000);
    c.ignore_frac = 1.0;
    c.opt.compute_accuracy = true;
    cases.push_back(c);
  }
  {
    Case c = base("ignore-index-is-a-class", DType::f32, 500, 64);
    c.opt.ignore_index = 5;
    c.ignore_frac = 0.2;
    c.opt.compute_accuracy = true;
    cases.push_back(c);
  }
  {
    Case c = base("softcap-plain-large", DType::f32, 40, 70000);
    c.opt.softcap = 30.0f;
    c.logit_scale = 10.0f;
    cases.push_back(c);
  }
  {
    Case c = base("padding-only-shard-rows", DType::bf16, 16, 64);
    c.vocab_size = 60;
    c.stride_extra = 1;
    c.opt.label_smoothing = 0.3f;
    cases.push_back(c);
  }
  for (const Case& c : cases) check_case(c);
}

// finalize reduces over many blocks through the workspace's partials and a counter that the last
// block resets: one group, calls of different row counts (one block, several, the cap of 256
// blocks with rows left over), each matching the CPU and repeatable bit for bit.
TEST(CudaBackend, FinalizeBlocksReuseOneGroup) {
  SKIP_WITHOUT_GPU();
  xent::Group g = xent::Group::local(Backend::cuda, 0);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int64_t rows : {300, 70001, 1, 8192, 257, 70001}) {
    Case c = base("finalize-blocks", DType::bf16, rows, 96);
    c.opt.compute_accuracy = true;
    c.opt.z_loss = 1e-3f;
    c.ignore_frac = 0.2;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c);
    const Result cpu = run(Backend::cpu, c, in);
    const Result gpu = run(Backend::cuda, c, in, s, &g);
    EXPECT_TRUE(matches(c, in, gpu, cpu));
    const Result again = run(Backend::cuda, c, in, s, &g);
    EXPECT_TRUE(bitwise_equal(gpu, again)) << "two GPU runs differ: " << describe(c);
  }
  ck(cudaStreamDestroy(s), "cudaStreamDestroy");
}

// The loss of an empty batch, on both backends.
TEST(CudaBackend, EmptyBatch) {
  SKIP_WITHOUT_GPU();
  for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
    Case c = base("empty", DType::bf16, 0, 512);
    c.opt.reduction = red;
    c.opt.compute_accuracy = true;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    check_case(c);
  }
}

// ------------------------------------------------------------------ out-of-place backward

// The gradient of a deferred forward written by backward(group, logits, grad, ...) into a buffer
// of row stride cols + out_extra starting out_shift elements into its allocation (a sentinel in
// every element it must not write). `logits` comes back as the logits buffer after the call.
struct OopResult {
  std::vector<uint8_t> logits, grad;
};

OopResult run_out_of_place(Backend backend, const Case& c, const Inputs& in, int64_t out_extra,
                           int64_t out_shift) {
  const size_t es = esize(c.dtype);
  const int64_t os = c.cols + out_extra;
  const size_t rows = static_cast<size_t>(c.rows);
  xent::Options opt = c.opt;
  opt.vocab_start = c.vocab_start;
  opt.vocab_size = c.vocab_size;
  opt.grad_mode = GradMode::deferred;
  OopResult r;
  r.logits = in.logits;
  r.grad.resize(static_cast<size_t>(out_shift + c.rows * os) * es);
  for (size_t i = 0; i < r.grad.size() / es; ++i)
    xtest::store_elem(c.dtype, &r.grad[i * es], 77.0f);
  std::vector<float> loss(opt.reduction == Reduction::none ? std::max<size_t>(1, rows) : 1);
  std::vector<float> lse(std::max<size_t>(1, rows));

  xent::LogitsView lv, gv;
  lv.dtype = gv.dtype = c.dtype;
  lv.rows = gv.rows = c.rows;
  lv.cols = gv.cols = c.cols;
  lv.row_stride = c.stride();
  gv.row_stride = os;
  xent::TargetsView tv;
  tv.type = c.itype;
  tv.rows = c.rows;
  xent::Outputs out;
  if (backend == Backend::cpu) {
    xent::Group g = xent::Group::local(Backend::cpu);
    lv.data = r.logits.data();
    gv.data = r.grad.data() + out_shift * es;
    tv.data = in.targets.data();
    out.loss = loss.data();
    out.lse = lse.data();
    const float* go = in.grad_output.empty() ? nullptr : in.grad_output.data();
    xent::forward(g, lv, tv, opt, out);
    xent::backward(g, lv, gv, tv, out.lse, go, opt);
    return r;
  }
  xent::Group g = xent::Group::local(Backend::cuda, 0);
  DevBuf d_logits(r.logits.size()), d_grad(r.grad.size()), d_targets(in.targets.size()),
      d_loss(loss.size() * 4), d_lse(lse.size() * 4), d_go(in.grad_output.size() * 4);
  d_logits.up(r.logits.data());
  d_grad.up(r.grad.data());
  d_targets.up(in.targets.data());
  d_go.up(in.grad_output.data());
  lv.data = d_logits.p;
  gv.data = static_cast<uint8_t*>(d_grad.p) + out_shift * es;
  tv.data = d_targets.p;
  out.loss = static_cast<float*>(d_loss.p);
  out.lse = static_cast<float*>(d_lse.p);
  xent::forward(g, lv, tv, opt, out);
  xent::backward(g, lv, gv, tv, out.lse, static_cast<const float*>(d_go.p), opt);
  g.check_errors(nullptr);
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  d_logits.down(r.logits.data());
  d_grad.down(r.grad.data());
  return r;
}

// CUDA out of place against the CPU (out of place), for row strides +0 and +3 on either side and
// an output that starts off a 16-byte boundary (the kernel's element-load path); the logits and
// every element of the output outside the gradient are bitwise unchanged; and the CUDA gradient
// is bitwise the in-place CUDA gradient (the same arithmetic, whatever the load path).
TEST(CudaBackend, OutOfPlaceBackwardMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {300, 1000}, {64, 4099}, {3, 32064}, {1, 7}, {0, 100}};
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (auto [n, v] : shapes)
      for (int64_t in_extra : {0, 3})
        for (int64_t out_extra : {0, 3})
          for (int64_t out_shift : {0, 1}) {
            Case c = base("out-of-place", d, n, v);
            c.stride_extra = in_extra;
            c.opt.grad_mode = GradMode::deferred;
            c.opt.label_smoothing = 0.05f;
            c.opt.z_loss = 1e-4f;
            c.vocab_size = v > 10 ? v - 5 : -1;
            c.go_kind = 2;
            if (v == 4099) {
              c.opt.reduction = Reduction::none;
              c.opt.softcap = 15.0f;
            }
            SCOPED_TRACE(describe(c) + " out stride +" + std::to_string(out_extra) + " shift " +
                         std::to_string(out_shift));
            const Inputs in = make_inputs(c);
            const OopResult cpu = run_out_of_place(Backend::cpu, c, in, out_extra, out_shift);
            const OopResult gpu = run_out_of_place(Backend::cuda, c, in, out_extra, out_shift);
            EXPECT_TRUE(gpu.logits == in.logits) << "the logits were written";
            const size_t es = esize(d);
            const int64_t os = v + out_extra;
            int bad = 0;
            std::ostringstream err;
            auto note = [&](const std::string& what) {
              if (bad++ < 8) err << "\n  " << what;
            };
            for (size_t i = 0; i < static_cast<size_t>(out_shift) * es; ++i)
              if (gpu.grad[i] != cpu.grad[i]) note("the element before the output was written");
            for (int64_t r = 0; r < n; ++r) {
              double rowmax = 0.0;
              const size_t row0 = static_cast<size_t>(out_shift + r * os) * es;
              for (int64_t j = 0; j < v; ++j)
                rowmax =
                    std::max(rowmax, std::fabs((double)load_as_float(d, &cpu.grad[row0 + j * es])));
              for (int64_t j = 0; j < os; ++j) {
                const size_t off = row0 + static_cast<size_t>(j) * es;
                if (j >= v) {
                  if (std::memcmp(&gpu.grad[off], &cpu.grad[off], es) != 0)
                    note("row " + std::to_string(r) + " col " + std::to_string(j) +
                         ": the output's row-stride gap was written");
                  continue;
                }
                const double a = load_as_float(d, &gpu.grad[off]);
                const double b = load_as_float(d, &cpu.grad[off]);
                const double lim = c.tol_grad_row() * rowmax + c.tol_grad_rel() * std::fabs(b) +
                                   1.01 * ulp(d, std::max(std::fabs(a), std::fabs(b)));
                if (!close(a, b, lim)) {
                  std::ostringstream s;
                  s << "grad[" << r << "][" << j << "] gpu " << a << " cpu " << b << " (lim " << lim
                    << ")";
                  note(s.str());
                }
              }
            }
            EXPECT_EQ(bad, 0) << err.str();

            // The in-place CUDA backward on the same inputs: the same bits.
            Case ci = c;
            const Result inplace = run(Backend::cuda, ci, in);
            int differ = 0;
            for (int64_t r = 0; r < n; ++r)
              for (int64_t j = 0; j < v; ++j)
                differ += std::memcmp(&inplace.logits[static_cast<size_t>(r * c.stride() + j) * es],
                                      &gpu.grad[static_cast<size_t>(out_shift + r * os + j) * es],
                                      es) != 0;
            EXPECT_EQ(differ, 0) << "CUDA out-of-place and in-place gradients differ in bits";
          }
}

// A target outside [0, vocab_size) that is not ignore_index: check_errors throws and names the
// smallest such row; the row's loss is NaN, its gradient 0; no crash, later calls work.
TEST(CudaBackend, BadTargetIsReported) {
  SKIP_WITHOUT_GPU();
  for (IndexType it : {IndexType::i64, IndexType::i32}) {
    Case c = base("bad-target", DType::bf16, 4096, 1000);
    c.itype = it;
    c.opt.reduction = Reduction::none;
    Inputs in = make_inputs(c);
    // Many bad rows racing in one launch; the smallest is 37.
    for (int64_t r = 37; r < c.rows; r += 5) in.t64[r] = (r % 2) ? 1000 + r : -7 - r;
    for (int64_t r = 0; r < c.rows; ++r) {
      if (it == IndexType::i32) {
        const int32_t v = static_cast<int32_t>(in.t64[r]);
        std::memcpy(&in.targets[r * 4], &v, 4);
      } else {
        std::memcpy(&in.targets[r * 8], &in.t64[r], 8);
      }
    }
    std::string msg;
    try {
      run(Backend::cuda, c, in);
    } catch (const xent::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("targets[37] = 1037"), std::string::npos) << "message: " << msg;

    // The outputs of such a run, without the throwing check.
    xent::Group g = xent::Group::local(Backend::cuda, 0);
    DevBuf d_logits(in.logits.size()), d_t(in.targets.size()), d_loss(c.rows * 4),
        d_lse(c.rows * 4);
    d_logits.up(in.logits.data());
    d_t.up(in.targets.data());
    xent::LogitsView lv{d_logits.p, c.dtype, c.rows, c.cols, c.cols};
    xent::TargetsView tv{d_t.p, c.itype, c.rows};
    xent::Outputs out;
    out.loss = static_cast<float*>(d_loss.p);
    out.lse = static_cast<float*>(d_lse.p);
    xent::forward(g, lv, tv, c.opt, out);
    ck(cudaDeviceSynchronize(), "sync");
    std::vector<float> loss(c.rows);
    d_loss.down(loss.data());
    std::vector<uint8_t> grad(in.logits.size());
    d_logits.down(grad.data());
    for (int64_t r = 0; r < c.rows; ++r) {
      const bool badrow = r >= 37 && (r - 37) % 5 == 0;
      const bool ignored = in.t64[r] == c.opt.ignore_index;
      if (badrow) {
        EXPECT_TRUE(std::isnan(loss[r])) << "row " << r;
      } else {
        EXPECT_TRUE(std::isfinite(loss[r])) << "row " << r;
      }
      if (badrow || ignored) {
        bool zero = true;
        for (int64_t j = 0; j < c.cols; ++j)
          zero = zero && load_as_float(c.dtype, &grad[(r * c.cols + j) * 2]) == 0.0f;
        EXPECT_TRUE(zero) << "row " << r << " has a nonzero gradient";
      }
    }
    EXPECT_THROW(g.check_errors(nullptr), xent::Error);
    EXPECT_NO_THROW(g.check_errors(nullptr));  // reported once, then re-armed
    // A clean call on the same group afterwards.
    Case ok = base("after-bad", DType::bf16, 64, 1000);
    const Inputs good = make_inputs(ok);
    EXPECT_NO_THROW(run(Backend::cuda, ok, good));
  }
}

// forward + backward captured in a CUDA graph and replayed give the eager run's bits.
TEST(CudaBackend, GraphCaptureMatchesEager) {
  SKIP_WITHOUT_GPU();
  for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
    Case c = base("graph", DType::bf16, 512, 5000);
    c.stride_extra = 3;
    c.opt.grad_mode = mode;
    c.opt.label_smoothing = 0.1f;
    c.opt.compute_accuracy = true;
    c.go_kind = 2;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c);
    cudaStream_t s;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    const Result eager = run(Backend::cuda, c, in, s);

    xent::Group g = xent::Group::local(Backend::cuda, 0);
    g.reserve(c.rows, c.opt);  // no allocation inside the capture
    DevBuf d_x(in.logits.size()), d_t(in.targets.size()), d_loss(4), d_lse(c.rows * 4),
        d_zl(c.rows * 4), d_am(c.rows * 8), d_acc(4), d_go(in.grad_output.size() * 4);
    d_t.up(in.targets.data());
    d_go.up(in.grad_output.data());
    xent::LogitsView lv{d_x.p, c.dtype, c.rows, c.cols, c.stride()};
    xent::TargetsView tv{d_t.p, c.itype, c.rows};
    xent::Outputs out;
    out.loss = static_cast<float*>(d_loss.p);
    out.lse = static_cast<float*>(d_lse.p);
    out.z_loss = static_cast<float*>(d_zl.p);
    out.argmax = static_cast<int64_t*>(d_am.p);
    out.accuracy = static_cast<float*>(d_acc.p);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    xent::forward(g, lv, tv, c.opt, out, s);
    xent::backward(g, lv, tv, out.lse, static_cast<const float*>(d_go.p), c.opt, s);
    ck(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
    ck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int rep = 0; rep < 2; ++rep) {
      d_x.up(in.logits.data());
      for (DevBuf* b : {&d_loss, &d_lse, &d_zl, &d_am, &d_acc}) b->poison();
      ck(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
      ck(cudaStreamSynchronize(s), "sync");
      Result r;
      r.loss.resize(1);
      r.lse.resize(c.rows);
      r.zl.resize(c.rows);
      r.argmax.resize(c.rows);
      r.logits.resize(in.logits.size());
      d_x.down(r.logits.data());
      d_loss.down(r.loss.data());
      d_lse.down(r.lse.data());
      d_zl.down(r.zl.data());
      d_am.down(r.argmax.data());
      d_acc.down(&r.accuracy);
      EXPECT_TRUE(bitwise_equal(r, eager)) << "graph replay " << rep << " differs from eager";
    }
    g.check_errors(s);
    ck(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    ck(cudaGraphDestroy(graph), "cudaGraphDestroy");
    ck(cudaStreamDestroy(s), "cudaStreamDestroy");
  }
}

// ---------------------------------------------------------------- two ranks in one process

// Ranks as threads of one process: records staged through host memory (device buffers are
// copied after a stream sync). Enough to drive the multi-rank merge of finalize.
class ThreadComm : public xent::Communicator {
 public:
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    int arrived = 0;
    long generation = 0;
    std::vector<std::vector<uint8_t>> slots;
    explicit Shared(int n) : slots(n) {}
  };
  ThreadComm(std::shared_ptr<Shared> s, int rank, int size, Backend b, int device)
      : s_(std::move(s)), rank_(rank), size_(size), backend_(b), device_(device) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return backend_; }
  int device() const override { return device_; }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    std::vector<uint8_t>& mine = s_->slots[rank_];
    mine.resize(bytes);
    if (backend_ == Backend::cuda) {
      ck(cudaStreamSynchronize(stream), "sync");
      if (bytes) ck(cudaMemcpy(mine.data(), send, bytes, cudaMemcpyDeviceToHost), "D2H");
    } else if (bytes) {
      std::memcpy(mine.data(), send, bytes);
    }
    barrier();
    for (int r = 0; r < size_; ++r) {
      uint8_t* dst = static_cast<uint8_t*>(recv) + r * bytes;
      if (!bytes) continue;
      if (backend_ == Backend::cuda)
        ck(cudaMemcpy(dst, s_->slots[r].data(), bytes, cudaMemcpyHostToDevice), "H2D");
      else
        std::memcpy(dst, s_->slots[r].data(), bytes);
    }
    barrier();
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(s_->m);
    const long gen = s_->generation;
    if (++s_->arrived == size_) {
      s_->arrived = 0;
      ++s_->generation;
      s_->cv.notify_all();
    } else {
      s_->cv.wait(lock, [&] { return s_->generation != gen; });
    }
  }
  std::shared_ptr<Shared> s_;
  int rank_, size_;
  Backend backend_;
  int device_;
};

TEST(CudaBackend, TwoRanksMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
    const int ranks = 2;
    const int64_t N = 500, W = 3000, V = 2 * W - 10, S = W + 3;
    const DType dt = DType::bf16;
    Case c = base("two-ranks", dt, N, 2 * W);
    const Inputs full = make_inputs(c);  // targets in [0, 2W): clamp into [0, V)
    std::vector<int64_t> t = full.t64;
    for (auto& y : t)
      if (y != c.opt.ignore_index) y %= V;
    xent::Options opt;
    opt.label_smoothing = 0.1f;
    opt.z_loss = 1e-3f;
    opt.compute_accuracy = true;
    opt.vocab_size = V;
    opt.grad_mode = mode;
    struct RankOut {
      float loss = 0, acc = 0;
      std::vector<float> lse;
      std::vector<int64_t> argmax;
      std::vector<uint8_t> grad;
    };
    auto run_ranks = [&](Backend b) {
      auto shared = std::make_shared<ThreadComm::Shared>(ranks);
      std::vector<RankOut> res(ranks);
      std::vector<std::exception_ptr> errs(ranks);
      std::vector<std::thread> th;
      for (int k = 0; k < ranks; ++k)
        th.emplace_back([&, k] {
          try {
            if (b == Backend::cuda) ck(cudaSetDevice(0), "cudaSetDevice");
            xent::Group g = xent::Group::custom(
                std::make_shared<ThreadComm>(shared, k, ranks, b, b == Backend::cuda ? 0 : -1));
            xent::Options o = opt;
            o.vocab_start = k * W;
            std::vector<uint8_t> shard(N * S * 2);
            for (int64_t i = 0; i < N; ++i)
              for (int64_t j = 0; j < S; ++j) {
                const float v =
                    j < W ? load_as_float(dt, &full.logits[(i * c.stride() + k * W + j) * 2])
                          : 99.0f;
                xtest::store_elem(dt, &shard[(i * S + j) * 2], v);
              }
            RankOut& r = res[k];
            r.lse.assign(N, 0);
            r.argmax.assign(N, 0);
            const float go = 0.5f;
            if (b == Backend::cpu) {
              xent::LogitsView lv{shard.data(), dt, N, W, S};
              xent::TargetsView tv{t.data(), IndexType::i64, N};
              xent::Outputs out;
              out.loss = &r.loss;
              out.lse = r.lse.data();
              out.argmax = r.argmax.data();
              out.accuracy = &r.acc;
              xent::forward(g, lv, tv, o, out);
              xent::backward(g, lv, tv, out.lse, &go, o);
              r.grad = shard;
            } else {
              DevBuf d_x(shard.size()), d_t(N * 8), d_loss(4), d_lse(N * 4), d_am(N * 8), d_acc(4),
                  d_go(4);
              d_x.up(shard.data());
              d_t.up(t.data());
              d_go.up(&go);
              xent::LogitsView lv{d_x.p, dt, N, W, S};
              xent::TargetsView tv{d_t.p, IndexType::i64, N};
              xent::Outputs out;
              out.loss = static_cast<float*>(d_loss.p);
              out.lse = static_cast<float*>(d_lse.p);
              out.argmax = static_cast<int64_t*>(d_am.p);
              out.accuracy = static_cast<float*>(d_acc.p);
              xent::forward(g, lv, tv, o, out);
              xent::backward(g, lv, tv, out.lse, static_cast<const float*>(d_go.p), o);
              g.check_errors(nullptr);
              r.grad.resize(shard.size());
              d_x.down(r.grad.data());
              d_loss.down(&r.loss);
              d_acc.down(&r.acc);
              d_lse.down(r.lse.data());
              d_am.down(r.argmax.data());
            }
          } catch (...) {
            errs[k] = std::current_exception();
          }
        });
      for (auto& x : th) x.join();
      for (auto& e : errs)
        if (e) std::rethrow_exception(e);
      return res;
    };
    const auto cpu = run_ranks(Backend::cpu);
    const auto gpu = run_ranks(Backend::cuda);
    for (int k = 0; k < ranks; ++k) {
      SCOPED_TRACE("rank " + std::to_string(k) +
                   (mode == GradMode::fused ? " fused" : " deferred"));
      EXPECT_EQ(std::memcmp(&gpu[k].loss, &gpu[0].loss, 4), 0) << "ranks disagree on the loss";
      EXPECT_NEAR(gpu[k].loss, cpu[k].loss, 2e-5 * std::max(1.0f, std::fabs(cpu[k].loss)));
      EXPECT_NEAR(gpu[k].acc, cpu[k].acc, 1e-6);
      int bad = 0;
      for (int64_t i = 0; i < N; ++i) {
        if (std::fabs(gpu[k].lse[i] - cpu[k].lse[i]) >
            2e-5 * std::max(1.0f, std::fabs(cpu[k].lse[i])))
          ++bad;
        if (gpu[k].argmax[i] != cpu[k].argmax[i]) ++bad;
        double rowmax = 0;
        for (int64_t j = 0; j < W; ++j)
          rowmax =
              std::max(rowmax, std::fabs((double)load_as_float(dt, &cpu[k].grad[(i * S + j) * 2])));
        for (int64_t j = 0; j < S; ++j) {
          const double a = load_as_float(dt, &gpu[k].grad[(i * S + j) * 2]);
          const double b = load_as_float(dt, &cpu[k].grad[(i * S + j) * 2]);
          if (!close(a, b,
                     1e-5 * rowmax + 2e-5 * std::fabs(b) +
                         1.01 * ulp(dt, std::max(std::fabs(a), std::fabs(b)))))
            ++bad;
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

}  // namespace
