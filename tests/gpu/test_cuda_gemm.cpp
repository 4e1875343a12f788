// The fused lm head's cuBLASLt GEMMs (src/linear/gemm.h) round a 16-bit output once: each element
// of C within half a unit in the last place of the float64 sum, plus the fp32 accumulation's
// error, which the same GEMM into an fp32 C measures (its largest error, four times: another
// algorithm may sum in another order). Shapes with few output tiles and a long K (d_weight's of
// one chunk at TP 4: 3002 x 256 x 1024) invite cuBLASLt to split K; where it adds the slices in
// C's dtype, elements are rounded once per slice and come out up to a whole unit off
// (docs/linear.md, "Accuracy").
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// Half a unit in the last place of x in a format with `bits` of significand (bf16 8, f16 11).
double half_ulp(double x, int bits, int min_exp) {
  int e = 0;
  std::frexp(x, &e);  // x = f 2^e, f in [0.5, 1)
  return std::ldexp(1.0, std::max(e, min_exp) - bits) / 2.0;
}

template <DType T>
void expect_rounded_once(GemmShape s) {
  using E = xent::core::Elem<T>;
  using V = typename E::type;
  SCOPED_TRACE(std::to_string(s.m) + " x " + std::to_string(s.n) + " x " + std::to_string(s.k) +
               (T == DType::bf16 ? " bf16" : " f16"));
  // d_weight's GEMM: C [m, n] = A^T B with A [k, m] (the gradient) and B [k, n] (hidden).
  std::mt19937 gen(static_cast<unsigned>(s.m * 7 + s.k));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<V> a(s.k * s.m), b(s.k * s.n);
  for (V& x : a) x = E::store(normal(gen));
  for (V& x : b) x = E::store(normal(gen));
  DevBuf da(a.size() * sizeof(V)), db(b.size() * sizeof(V));
  DevBuf dc(s.m * s.n * sizeof(V)), dc32(s.m * s.n * sizeof(float));
  DevBuf work(xent::linear::kGemmWorkspaceBytes);
  ck(cudaMemcpy(da.p, a.data(), da.bytes, cudaMemcpyHostToDevice), "copy A");
  ck(cudaMemcpy(db.p, b.data(), db.bytes, cudaMemcpyHostToDevice), "copy B");
  xent::linear::device::Gemm gemm;
  gemm.set_workspace(work.p);
  for (const auto& [out, dtype] : {std::pair{dc.p, T}, std::pair{dc32.p, DType::f32}})
    gemm.run(true, false, s.m, s.n, s.k, {da.p, T, s.m}, {db.p, T, s.n}, 0.0f, out, dtype, s.n,
             nullptr);
  ck(cudaDeviceSynchronize(), "GEMMs");
  std::vector<V> c(s.m * s.n);
  std::vector<float> c32(s.m * s.n);
  ck(cudaMemcpy(c.data(), dc.p, dc.bytes, cudaMemcpyDeviceToHost), "copy C");
  ck(cudaMemcpy(c32.data(), dc32.p, dc32.bytes, cudaMemcpyDeviceToHost), "copy fp32 C");

  // float64 sums of the exact products, row by row of C.
  std::vector<double> sum(s.m * s.n, 0.0);
  for (int64_t i = 0; i < s.m; ++i)
    for (int64_t r = 0; r < s.k; ++r) {
      const double x = E::load(a[r * s.m + i]);
      double* out = &sum[i * s.n];
      for (int64_t j = 0; j < s.n; ++j) out[j] += x * static_cast<double>(E::load(b[r * s.n + j]));
    }
  double fp32 = 0.0;
  for (int64_t e = 0; e < s.m * s.n; ++e) fp32 = std::max(fp32, std::fabs(c32[e] - sum[e]));
  fp32 *= 4.0;
  const int bits = T == DType::bf16 ? 8 : 11, min_exp = T == DType::bf16 ? -125 : -13;
  int64_t bad = 0;
  std::string first;
  for (int64_t e = 0; e < s.m * s.n; ++e) {
    const double got = E::load(c[e]);
    const double allowed = half_ulp(std::fabs(sum[e]) + fp32, bits, min_exp) + fp32;
    if (!(std::fabs(got - sum[e]) <= allowed) && bad++ == 0)
      first = "C[" + std::to_string(e / s.n) + ", " + std::to_string(e % s.n) +
              "] = " + std::to_string(got) + ", float64 " + std::to_string(sum[e]) + ", allowed " +
              std::to_string(allowed);
  }
  EXPECT_EQ(bad, 0) << "elements rounded more than once (first: " << first << ")";
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

}  // namespace
