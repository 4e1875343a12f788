// Whether the epilogue engine (sm90/epilogue_gemm.h) runs a call's GEMMs here, and, in a build
// without its kernel (no CUTLASS headers, or no sm_90 among the architectures: CMake says which),
// its refusal, which the plan never takes there.
#include <cstdint>
#include <string>

#include "error.h"
#include "linear/sm90/epilogue_gemm.h"

namespace xent::linear::sm90 {

namespace {

bool aligned(const void* p, int64_t ld) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 8 == 0;  // 16 bytes of bf16
}

}  // namespace

std::string why_not(DType inputs, const void* a, int64_t lda, const void* b, int64_t ldb,
                    int64_t k) {
#if !defined(XENT_HAVE_SM90_GEMMS)
  (void)inputs, (void)a, (void)lda, (void)b, (void)ldb, (void)k;
  return "this build has no sm_90a kernels (built without CUTLASS's headers, or without sm_90 "
         "among its CUDA architectures)";
#else
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return "no CUDA device could be queried";
  }
  if (major != 9 || minor != 0)
    return "the device is of compute capability " + std::to_string(major) + "." +
           std::to_string(minor) + ", and the kernels are sm_90a's (H100, H200)";
  if (inputs != DType::bf16)
    return std::string("hidden.dtype = ") + to_string(inputs) + ": the kernels take bf16";
  if (!aligned(a, lda) || !aligned(b, ldb))
    return "hidden's or weight's data or row_stride is not 16-byte aligned (TMA's rule)";
  if (k % 8 != 0)
    return "hidden.cols = " + std::to_string(k) + " is not a multiple of 8 (16 bytes of bf16)";
  return "";
#endif
}

#if !defined(XENT_HAVE_SM90_GEMMS)
void gradient_gemm(const Operands&, const core::Problem&, TargetsView, const float*, const float*,
                   const float*, void*, int64_t, cudaStream_t) {
  fail("the gradient GEMM (sm90): " + why_not(DType::bf16, nullptr, 0, nullptr, 0, 0));
}
void stats_gemm(const Operands&, const core::Problem&, TargetsView, float*, cudaStream_t) {
  fail("the statistics GEMM (sm90): " + why_not(DType::bf16, nullptr, 0, nullptr, 0, 0));
}
void merge_stats(const core::Problem&, TargetsView, const float*, float*, int64_t*, cudaStream_t) {
  fail("the statistics merge (sm90): " + why_not(DType::bf16, nullptr, 0, nullptr, 0, 0));
}
#endif

}  // namespace xent::linear::sm90
