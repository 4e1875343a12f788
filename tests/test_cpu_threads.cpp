// The CPU backend over threads (XENT_CPU_THREADS): rows are split over the threads, each row's
// math stays the same and the cross-row sums stay serial, so every thread count must give the
// same bits — loss, lse, z-loss, argmax, accuracy and the gradient of every grad mode — for
// every dtype, with ignored rows, label smoothing, z-loss, padding columns and a row stride.
// The backend reads XENT_CPU_THREADS (and XENT_CPU_ISA) on every call, so one process can try
// them all.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"

namespace {

using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;
using xtest::Matrix;

// Sets an environment variable for a scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = std::string(old);
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Big enough that the backend really splits it over 3 threads (it gives a thread at least 64k
// elements): 96 rows x 4100 columns. 4000 real columns (not a multiple of the 512-column chunks
// nor of the 8 vector lanes), 100 of padding, and a stride gap of 13.
constexpr int64_t kRows = 96, kVocab = 4000, kCols = 4100, kStride = kCols + 13;

struct Case {
  DType dtype;
  float softcap;
};

std::string case_name(const Case& c) {
  return std::string(xtest::dtype_name(c.dtype)) + (c.softcap > 0 ? " softcap" : "");
}

Matrix make_logits(const Case& c) {
  Matrix x = xtest::random_logits(kRows, kCols, 11, c.dtype, 3.0);
  for (int64_t j = 0; j < kVocab; j += 3) x.at(5, j) = -xtest::kInf;  // some -inf in a row
  return x;
}

std::vector<int64_t> make_targets() {
  auto t = xtest::random_targets(kRows, kVocab, 11, /*p_ignore=*/0.2);
  t[0] = -100;
  t[1] = kVocab - 1;  // the last real column (in the tail of the last chunk)
  t[2] = 0;
  return t;
}

xent::Options make_options(const Case& c) {
  xent::Options opt;
  opt.vocab_size = kVocab;
  opt.label_smoothing = 0.1f;
  opt.z_loss = 1e-3f;
  opt.softcap = c.softcap;
  opt.compute_accuracy = true;
  return opt;
}

template <typename T>
std::vector<unsigned char> bytes_of(const std::vector<T>& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Every output of every mode, as raw bytes (NaN-safe bitwise comparison).
struct Bits {
  std::vector<std::vector<unsigned char>> parts;
  std::vector<std::string> names;
  void add(const std::string& name, std::vector<unsigned char> b) {
    names.push_back(name);
    parts.push_back(std::move(b));
  }
};

Bits run_everything(const Case& c) {
  const Matrix x = make_logits(c);
  const std::vector<int64_t> t = make_targets();
  const xtest::HostTargets tg(t, IndexType::i64);
  xent::Group g = xent::Group::local(xent::Backend::cpu);
  Bits bits;

  // fused, mean: forward writes the gradient in place; backward rescales it by grad_output.
  {
    xent::Options opt = make_options(c);
    xtest::HostLogits buf = xtest::make_shard(x, 0, kCols, c.dtype, kStride);
    std::vector<float> loss(1), lse(kRows), zl(kRows), acc(1);
    std::vector<int64_t> am(kRows);
    xent::Outputs out;
    out.loss = loss.data();
    out.lse = lse.data();
    out.z_loss = zl.data();
    out.argmax = am.data();
    out.accuracy = acc.data();
    xent::forward(g, buf.view(), tg.view(), opt, out);
    bits.add("fused loss", bytes_of(loss));
    bits.add("fused lse", bytes_of(lse));
    bits.add("fused z_loss", bytes_of(zl));
    bits.add("fused argmax", bytes_of(am));
    bits.add("fused accuracy", bytes_of(acc));
    bits.add("fused forward gradient", buf.bytes);
    const float go = 0.37f;
    xent::backward(g, buf.view(), tg.view(), lse.data(), &go, opt);
    bits.add("fused backward gradient (grad_output 0.37)", buf.bytes);
  }
  // deferred, none: per-row loss; the gradient out of place, per-row grad_output.
  {
    xent::Options opt = make_options(c);
    opt.grad_mode = GradMode::deferred;
    opt.reduction = Reduction::none;
    xtest::HostLogits buf = xtest::make_shard(x, 0, kCols, c.dtype, kStride);
    xtest::HostLogits grad = xtest::make_shard(Matrix(kRows, kCols, 0.0), 0, kCols, c.dtype);
    std::vector<float> loss(kRows), lse(kRows);
    xent::Outputs out;
    out.loss = loss.data();
    out.lse = lse.data();
    xent::forward(g, buf.view(), tg.view(), opt, out);
    std::vector<float> go(kRows);
    for (int64_t i = 0; i < kRows; ++i) go[i] = 0.5f + 0.01f * static_cast<float>(i);
    xent::backward(g, buf.view(), grad.view(), tg.view(), lse.data(), go.data(), opt);
    bits.add("deferred per-row loss", bytes_of(loss));
    bits.add("deferred lse", bytes_of(lse));
    bits.add("deferred gradient", grad.bytes);
    bits.add("deferred logits after backward", buf.bytes);
  }
  // fused, none: backward's scale_rows with a per-row grad_output (1 on every third row: kept).
  {
    xent::Options opt = make_options(c);
    opt.reduction = Reduction::none;
    xtest::HostLogits buf = xtest::make_shard(x, 0, kCols, c.dtype, kStride);
    std::vector<float> loss(kRows), lse(kRows);
    xent::Outputs out;
    out.loss = loss.data();
    out.lse = lse.data();
    xent::forward(g, buf.view(), tg.view(), opt, out);
    std::vector<float> go(kRows);
    for (int64_t i = 0; i < kRows; ++i) go[i] = (i % 3 == 0) ? 1.0f : -0.3f * static_cast<float>(i);
    xent::backward(g, buf.view(), tg.view(), lse.data(), go.data(), opt);
    bits.add("fused none gradient (per-row grad_output)", buf.bytes);
  }
  return bits;
}

void expect_same(const Bits& want, const Bits& got, const std::string& what) {
  ASSERT_EQ(want.parts.size(), got.parts.size());
  for (size_t i = 0; i < want.parts.size(); ++i)
    EXPECT_TRUE(want.parts[i] == got.parts[i]) << want.names[i] << " differs: " << what;
}

const Case kCases[] = {{DType::f32, 0.0f},  {DType::bf16, 0.0f},  {DType::f16, 0.0f},
                       {DType::f32, 30.0f}, {DType::bf16, 30.0f}, {DType::f16, 30.0f}};

TEST(CpuThreads, BitwiseIdenticalForOneTwoThreeThreads) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(case_name(c));
    Bits one;
    {
      ScopedEnv env("XENT_CPU_THREADS", "1");
      one = run_everything(c);
    }
    for (const char* n : {"2", "3"}) {
      ScopedEnv env("XENT_CPU_THREADS", n);
      expect_same(one, run_everything(c), std::string("XENT_CPU_THREADS=") + n + " against 1");
    }
  }
}

// The baseline code (XENT_CPU_ISA=generic) and the AVX2 one (where the CPU has it) compute the
// same lanes with the same operations: the same bits. (Without AVX2 both runs are the baseline.)
TEST(CpuThreads, BitwiseIdenticalForEveryInstructionSet) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(case_name(c));
    ScopedEnv threads("XENT_CPU_THREADS", "2");
    const Bits best = run_everything(c);
    ScopedEnv isa("XENT_CPU_ISA", "generic");
    expect_same(best, run_everything(c), "XENT_CPU_ISA=generic against the default");
  }
}

// And the threaded results are right: against the double-precision reference, 3 threads.
TEST(CpuThreads, ThreeThreadsMatchTheReference) {
  ScopedEnv env("XENT_CPU_THREADS", "3");
  for (const Case& c : kCases) {
    SCOPED_TRACE(case_name(c));
    for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
      xent::Options opt = make_options(c);
      opt.grad_mode = mode;
      xtest::LocalRun run;
      run.dtype = c.dtype;
      run.stride_extra = kStride - kCols;
      run.grad_output = {0.37};
      xtest::run_local(make_logits(c), make_targets(), opt, run);
    }
  }
}

// An XENT_CPU_THREADS that is not a positive integer is ignored (the default), never an error.
TEST(CpuThreads, MalformedThreadCountIsIgnored) {
  const Case c{DType::bf16, 0.0f};
  Bits one;
  {
    ScopedEnv env("XENT_CPU_THREADS", "1");
    one = run_everything(c);
  }
  for (const char* v : {"0", "-2", "two", ""}) {
    ScopedEnv env("XENT_CPU_THREADS", v);
    expect_same(one, run_everything(c), std::string("XENT_CPU_THREADS='") + v + "'");
  }
}

}  // namespace
