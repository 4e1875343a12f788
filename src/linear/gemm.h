// The CUDA backend's GEMMs of the fused lm head, through cuBLASLt: row-major operands as the CPU
// backend's host::sgemm takes them, 16-bit or fp32 inputs, fp32 accumulation (never TF32), the
// output in fp32 or the inputs' dtype. One object per group (its handle, its workspace and the
// algorithms chosen for each shape, kept between calls).
//
// Which algorithm: cuBLASLt's heuristic ranks up to eight for a shape, and on the lean sweep's
// chunk GEMMs its first took up to 1.25x the time of the best of them (one H200, docs/linear.md,
// "GEMM engines"). For GEMMs whose size makes that matter (kTunedFlops), each candidate runs some
// of the caller's own calls of that shape between two events, read back later without waiting
// (cudaEventQuery: no synchronisation); once each has kSamples timings, the fastest runs from then
// on. The candidates are those that do not split K, where the heuristic's first does not: each
// sums over K in its own tiles' order, and on the shapes measured they wrote the same bits, so the
// choice changes the speed alone (CudaGemm.TuningKeepsBits checks it). Calls captured into a CUDA
// graph take the choice made so far, else the heuristic's first.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

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

  // Timings each candidate takes before the fastest is chosen, of at most kCandidates. Tuned:
  // GEMMs of 2 m n k flops in [kTunedFlops, kTunedFlopsMax]. Smaller ones take microseconds; in the
  // larger ones measured (the bench's whole-shard GEMMs, over a millisecond) the heuristic's first
  // was within 1.5 % of the best, and timing the slower candidates would cost whole calls (one
  // H200, docs/linear.md).
  static constexpr int kSamples = 2, kCandidates = 8;
  static constexpr double kTunedFlops = 1e9, kTunedFlopsMax = 1e12;
  // The last call's shape: how many candidates it has, and the one chosen (-1: not yet).
  int last_candidates() const { return last_ ? static_cast<int>(last_->algos.size()) : 0; }
  int last_chosen() const { return last_ ? last_->chosen : -1; }

 private:
  // What the algorithm depends on: the column-major problem, types, beta 0 or not, alignments,
  // the pointer mode of alpha and beta.
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int,
                         bool, int, int, int, bool>;
  // One shape's candidates (the heuristic's first at 0), their timings and the choice.
  struct Choice {
    struct Timing {
      int algo;
      cudaEvent_t start, stop;
    };
    std::vector<cublasLtMatmulAlgo_t> algos;
    std::vector<float> fastest_ms;  // per candidate, its fastest timing so far
    std::vector<int> issued, timed;
    std::vector<Timing> pending;  // recorded, not yet read
    int chosen = -1;              // once decided
  };
  // Reads the timings that have completed, without waiting; decides once every candidate has
  // kSamples of them.
  static void collect(Choice& c);
  // The candidate this call runs, and whether it is timed.
  static int pick(Choice& c, bool may_time, bool* timed);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, Choice> algos_;
  const Choice* last_ = nullptr;
};

}  // namespace xent::linear::device
