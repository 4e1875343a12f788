// The CUDA backend's GEMMs of the fused lm head, through cuBLASLt: row-major operands as the CPU
// backend's host::sgemm takes them, 16-bit or fp32 inputs, fp32 accumulation (never TF32), the
// output in fp32 or the inputs' dtype. One object per group (its handle, its workspace and the
// algorithms chosen for each shape, kept between calls).
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "xent/xent.h"

namespace xent::linear::device {

// A row-major matrix in device memory: row r at data + r * ld elements.
struct Operand {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int64_t ld = 0;
};

class Gemm {
 public:
  Gemm();
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // C = alpha op(A) op(B) + beta C on `stream`: op(A) is [m, k] (A stored [k, m] when trans_a),
  // op(B) is [k, n] (B stored [n, k] when trans_b), C [m, n] of c_dtype (f32, or A's dtype) with
  // leading dimension ldc. A and B have one dtype. beta 0: C is not read. alpha: 1 where
  // device_alpha is null, else device_alpha[0], read on the device when the GEMM runs (a scale
  // that an earlier kernel on the stream computes); device_alpha[1] and [2] must then hold 0 and
  // 1, from which beta (0 or 1 only) is read (Workspace::kGemmScale's layout).
  void run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, Operand a, Operand b,
           float beta, void* c, DType c_dtype, int64_t ldc, cudaStream_t stream,
           const float* device_alpha = nullptr);
  // The workspace of the calls that follow (linear::kGemmWorkspaceBytes of the call's scratch).
  void set_workspace(void* workspace) { workspace_ = workspace; }

 private:
  // What the algorithm depends on: the column-major problem, types, beta 0 or not, alignments,
  // the pointer mode of alpha and beta.
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                         bool, int, int, int, bool>;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, cublasLtMatmulAlgo_t> algos_;
};

}  // namespace xent::linear::device
