// The fused lm head's cuBLASLt GEMMs (src/linear/gemm.h) round a 16-bit output once. The inputs
// are small integers, so every product and every fp32 partial sum is exact in any order: C must be
// the float64 sum rounded once to its dtype, bit for bit, and the same GEMM into an fp32 C must be
// that sum exactly. Shapes with few output tiles and a long K (d_weight's of one chunk at TP 4:
// 3002 x 256 x 1024) invite cuBLASLt to split K; where it adds the slices in C's dtype, elements
// are rounded once per slice (docs/linear.md, "Accuracy"). Both alpha modes, as the library calls
// them with a device scale. Each GEMM is called until its shape's algorithm is chosen, so that
// every candidate the tuning tries is checked (gemm.h); TuningKeepsBits checks on random inputs
// that the candidates compute the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "gpu/cuda_test.h"
#include "linear/gemm.h"
#include "linear/plan.h"

namespace {

using xent::DType;
using xtest::gpu::ck;
using xtest::gpu::DevBuf;

struct GemmShape {
  int64_t m, n, k;
};

// Calls of one shape, synchronised, after which its algorithm is chosen: each candidate timed
// kSamples times, and one more call to read the last timings.
constexpr int kCallsToChoose =
    xent::linear::device::Gemm::kCandidates * xent::linear::device::Gemm::kSamples + 1;

template <DType T>
void expect_rounded_once(GemmShape s) {
  using E = xent::core::Elem<T>;
  using V = typename E::type;
  SCOPED_TRACE(std::to_string(s.m) + " x " + std::to_string(s.n) + " x " + std::to_string(s.k) +
               (T == DType::bf16 ? " bf16" : " f16"));
  // d_weight's GEMM: C [m, n] = A^T B with A [k, m] (the gradient) and B [k, n] (hidden); entries
  // in [-7, 7]: |partial sums| <= 49 k < 2^24 for k <= 2^18.
  std::mt19937 gen(static_cast<unsigned>(s.m * 7 + s.k));
  std::uniform_int_distribution<int> small(-7, 7);
  std::vector<float> af(s.k * s.m), bf(s.k * s.n);
  for (float& x : af) x = static_cast<float>(small(gen));
  for (float& x : bf) x = static_cast<float>(small(gen));
  std::vector<V> a(af.size()), b(bf.size());
  for (size_t e = 0; e < a.size(); ++e) a[e] = E::store(af[e]);
  for (size_t e = 0; e < b.size(); ++e) b[e] = E::store(bf[e]);
  std::vector<double> sum(s.m * s.n, 0.0);  // exact: integers below 2^53
  for (int64_t r = 0; r < s.k; ++r)
    for (int64_t i = 0; i < s.m; ++i) {
      const double x = af[r * s.m + i];
      const float* brow = &bf[r * s.n];
      double* out = &sum[i * s.n];
      for (int64_t j = 0; j < s.n; ++j) out[j] += x * brow[j];
    }

  DevBuf da(a.size() * sizeof(V)), db(b.size() * sizeof(V));
  DevBuf dc(s.m * s.n * sizeof(V)), dc32(s.m * s.n * sizeof(float));
  DevBuf work(xent::linear::kGemmWorkspaceBytes), scale(3 * sizeof(float));
  const float one_zero_one[3] = {1.0f, 0.0f, 1.0f};  // Workspace::kGemmScale's layout
  ck(cudaMemcpy(da.p, a.data(), da.bytes, cudaMemcpyHostToDevice), "copy A");
  ck(cudaMemcpy(db.p, b.data(), db.bytes, cudaMemcpyHostToDevice), "copy B");
  ck(cudaMemcpy(scale.p, one_zero_one, scale.bytes, cudaMemcpyHostToDevice), "copy scale");
  xent::linear::device::Gemm gemm;
  gemm.set_workspace(work.p);
  for (int call = 0; call < kCallsToChoose; ++call)
    for (const float* alpha :
         {static_cast<const float*>(nullptr), static_cast<const float*>(scale.p)}) {
      SCOPED_TRACE((alpha == nullptr ? "host alpha, call " : "device alpha, call ") +
                   std::to_string(call));
      for (const auto& [out, dtype] : {std::pair{dc.p, T}, std::pair{dc32.p, DType::f32}})
        gemm.run(true, false, s.m, s.n, s.k, {da.p, T, s.m}, {db.p, T, s.n}, 0.0f, out, dtype, s.n,
                 /*stream=*/nullptr, alpha);
      ck(cudaDeviceSynchronize(), "GEMMs");
      std::vector<V> c(s.m * s.n);
      std::vector<float> c32(s.m * s.n);
      ck(cudaMemcpy(c.data(), dc.p, dc.bytes, cudaMemcpyDeviceToHost), "copy C");
      ck(cudaMemcpy(c32.data(), dc32.p, dc32.bytes, cudaMemcpyDeviceToHost), "copy fp32 C");
      int64_t bad = 0, bad32 = 0;
      std::string first;
      for (int64_t e = 0; e < s.m * s.n; ++e) {
        bad32 += static_cast<double>(c32[e]) != sum[e];
        const float want = E::load(E::store(static_cast<float>(sum[e])));  // one rounding
        if (E::load(c[e]) != want && bad++ == 0)
          first = "C[" + std::to_string(e / s.n) + ", " + std::to_string(e % s.n) +
                  "] = " + std::to_string(E::load(c[e])) + ", float64 " + std::to_string(sum[e]) +
                  ", rounded once " + std::to_string(want);
      }
      EXPECT_EQ(bad32, 0) << "the fp32 C is not the exact sum";
      EXPECT_EQ(bad, 0) << "elements not rounded once (first: " << first << ")";
    }
  EXPECT_GE(gemm.last_chosen(), 0) << "no algorithm chosen after " << kCallsToChoose << " calls";
}

class CudaGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (xtest::gpu::device_count() == 0) GTEST_SKIP() << "no GPU";
  }
};

// d_weight of one chunk at TP 4 (test_linear_accuracy's small problem), at TP 2, and shapes of
// fewer tiles and longer K still.
const GemmShape kShapes[] = {
    {3002, 256, 1024}, {6004, 256, 1024}, {1000, 128, 8192}, {256, 256, 16384}, {128, 512, 16384}};

TEST_F(CudaGemm, Bf16OutputIsRoundedOnce) {
  for (const GemmShape& s : kShapes) expect_rounded_once<DType::bf16>(s);
}

TEST_F(CudaGemm, F16OutputIsRoundedOnce) {
  for (const GemmShape& s : kShapes) expect_rounded_once<DType::f16>(s);
}

// The lean sweep's three chunk GEMMs, smaller, on random bf16 inputs (fp32 sums that round): every
// call, whichever candidate runs it, writes the first call's bits; and the shape's algorithm is
// chosen once the calls have timed every candidate.
TEST_F(CudaGemm, TuningKeepsBits) {
  using Gemm = xent::linear::device::Gemm;
  using BF16 = xent::core::Elem<DType::bf16>;
  const int64_t rows = 2048, hidden = 1024, cols = 4096;
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  const auto random_bf16 = [&](int64_t n) {
    std::vector<__nv_bfloat16> v(n);
    for (auto& x : v) x = BF16::store(normal(gen));
    return v;
  };
  const auto h = random_bf16(rows * hidden), w = random_bf16(cols * hidden),
             g = random_bf16(rows * cols);
  std::vector<float> acc0(rows * hidden);
  for (float& x : acc0) x = normal(gen);
  DevBuf dh(h.size() * 2), dw(w.size() * 2), dg(g.size() * 2),
      work(xent::linear::kGemmWorkspaceBytes);
  DevBuf logits(rows * cols * 4), d_weight(cols * hidden * 2), acc(rows * hidden * 4);
  ck(cudaMemcpy(dh.p, h.data(), dh.bytes, cudaMemcpyHostToDevice), "copy h");
  ck(cudaMemcpy(dw.p, w.data(), dw.bytes, cudaMemcpyHostToDevice), "copy w");
  ck(cudaMemcpy(dg.p, g.data(), dg.bytes, cudaMemcpyHostToDevice), "copy g");
  Gemm gemm;
  gemm.set_workspace(work.p);
  struct Case {
    const char* what;
    const DevBuf& out;
    std::function<void()> call;
  };
  const Case cases[] = {
      {"logits = h w^T, fp32", logits,
       [&] {
         gemm.run(false, true, rows, cols, hidden, {dh.p, DType::bf16, hidden},
                  {dw.p, DType::bf16, hidden}, 0.0f, logits.p, DType::f32, cols, nullptr);
       }},
      {"d_weight = g^T h, bf16", d_weight,
       [&] {
         gemm.run(true, false, cols, hidden, rows, {dg.p, DType::bf16, cols},
                  {dh.p, DType::bf16, hidden}, 0.0f, d_weight.p, DType::bf16, hidden, nullptr);
       }},
      {"d_hidden += g w, fp32", acc, [&] {
         ck(cudaMemcpy(acc.p, acc0.data(), acc.bytes, cudaMemcpyHostToDevice), "copy acc");
         gemm.run(false, false, rows, hidden, cols, {dg.p, DType::bf16, cols},
                  {dw.p, DType::bf16, hidden}, 1.0f, acc.p, DType::f32, hidden, nullptr);
       }}};
  int most_candidates = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<unsigned char> first(c.out.bytes), now(c.out.bytes);
    for (int call = 0; call < kCallsToChoose; ++call) {
      c.call();
      ck(cudaDeviceSynchronize(), "GEMM");
      ck(cudaMemcpy((call == 0 ? first : now).data(), c.out.p, c.out.bytes, cudaMemcpyDeviceToHost),
         "copy out");
      if (call > 0) ASSERT_TRUE(now == first) << "call " << call << " changed the bits";
    }
    std::printf("%s: %d candidates, chosen %d\n", c.what, gemm.last_candidates(),
                gemm.last_chosen());
    most_candidates = std::max(most_candidates, gemm.last_candidates());
    EXPECT_GE(gemm.last_chosen(), 0) << "not chosen after " << kCallsToChoose << " calls";
  }
  // cuBLASLt 13 offers eight for each on an H100 or H200; one everywhere would test nothing here.
  EXPECT_GT(most_candidates, 1) << "cuBLASLt offered one algorithm for every shape: no tuning ran";
}

}  // namespace
