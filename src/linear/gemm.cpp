#include "linear/gemm.h"

#include <algorithm>
#include <optional>
#include <string>

#include "error.h"
#include "linear/plan.h"

namespace xent::linear::device {

namespace {

constexpr size_t kWorkspaceBytes = kGemmWorkspaceBytes;

void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail(std::string("cuBLASLt ") + what + " failed: cublasStatus_t " +
         std::to_string(static_cast<int>(s)));
}

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// The largest power of two (at most 256) that divides the address: what the algorithm may assume.
int alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int bytes = 256;
  while (bytes > 1 && a % bytes != 0) bytes /= 2;
  return bytes;
}

// Owns the descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The timing's event calls are refused in CUDA's default capture mode while another stream is being
// captured (by this thread, or in global mode by any), and would spoil that capture: they run in
// the relaxed mode, which is sound here since none of them touches a captured stream.
struct RelaxedCapture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;
};

// Two timing events, released unless handed over (a GEMM that throws between them).
struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

}  // namespace

Gemm::Gemm() {
  check_lt(cublasLtCreate(&handle_), "cublasLtCreate");
}

Gemm::~Gemm() {
  for (auto& [key, choice] : algos_)
    for (const Choice::Timing& t : choice.pending) {
      cudaEventDestroy(t.start);
      cudaEventDestroy(t.stop);
    }
  if (handle_) cublasLtDestroy(handle_);
}

void Gemm::collect(Choice& c) {
  const RelaxedCapture relaxed;
  cudaError_t failed = cudaSuccess;
  std::vector<Choice::Timing> running;
  for (const Choice::Timing& t : c.pending) {
    cudaError_t e = cudaEventQuery(t.stop);
    float ms = 0.0f;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, t.start, t.stop);
    if (e == cudaErrorNotReady) {
      running.push_back(t);
      continue;
    }
    if (e == cudaSuccess) {
      c.fastest_ms[t.algo] = std::min(c.fastest_ms[t.algo], ms);
      ++c.timed[t.algo];
    } else if (failed == cudaSuccess) {
      failed = e;
    }
    cudaEventDestroy(t.start);
    cudaEventDestroy(t.stop);
  }
  c.pending = std::move(running);
  // A query's "not yet" may stay behind as the thread's last error (PyTorch's allocator clears it
  // too): cleared, so that the next launch's check does not report it.
  if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
  if (failed != cudaSuccess) {
    cudaGetLastError();  // reported here, not by whichever check comes next
    check_cuda(failed, "reading a GEMM's timing events");
  }
  if (*std::min_element(c.timed.begin(), c.timed.end()) >= kSamples)
    c.chosen = static_cast<int>(std::min_element(c.fastest_ms.begin(), c.fastest_ms.end()) -
                                c.fastest_ms.begin());
}

int Gemm::pick(Choice& c, bool may_time, bool* timed) {
  *timed = false;
  if (c.chosen >= 0 || !may_time) return c.chosen >= 0 ? c.chosen : 0;
  collect(c);
  if (c.chosen >= 0) return c.chosen;
  const auto fewest = std::min_element(c.issued.begin(), c.issued.end());
  if (*fewest >= kSamples) return 0;  // the last timings still running: the first meanwhile
  *timed = true;
  return static_cast<int>(fewest - c.issued.begin());
}

void Gemm::run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, Operand a, Operand b,
               float beta, void* c, DType c_dtype, int64_t ldc, cudaStream_t stream,
               const float* device_alpha) {
  last_ = nullptr;
  if (m == 0 || n == 0) return;
  if (device_alpha != nullptr && beta != 0.0f && beta != 1.0f)
    fail("Gemm::run: beta " + std::to_string(beta) + " with a device alpha: it must be 0 or 1");
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's A is our B.
  const cublasOperation_t ta = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t M = n, N = m, K = k;
  const cudaDataType_t in_type = cuda_type(a.dtype), out_type = cuda_type(c_dtype);
  Descriptors d;
  check_lt(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  check_lt(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta),
           "set TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb),
           "set TRANSB");
  if (device_alpha != nullptr) {
    const cublasLtPointerMode_t mode = CUBLASLT_POINTER_MODE_DEVICE;
    check_lt(
        cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof mode),
        "set POINTER_MODE");
  }
  // Stored shapes (column-major): cuBLASLt's A is [M, K] (N) or [K, M] (T); its B [K, N] or [N, K].
  const bool na = ta == CUBLAS_OP_N, nb = tb == CUBLAS_OP_N;
  check_lt(cublasLtMatrixLayoutCreate(&d.a, in_type, na ? M : K, na ? K : M, b.ld), "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&d.b, in_type, nb ? K : N, nb ? N : K, a.ld), "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&d.c, out_type, M, N, ldc), "layout C");
  // K = 0: C = beta C (cuBLASLt may refuse an empty reduction): a GEMM over nothing is 0.
  if (K == 0) {
    if (beta != 0.0f) return;
    check_cuda(
        cudaMemset2DAsync(c, ldc * dtype_size(c_dtype), 0, M * dtype_size(c_dtype), N, stream),
        "cudaMemset2DAsync (empty GEMM)");
    return;
  }
  const Key key{ta,
                tb,
                M,
                N,
                K,
                b.ld,
                a.ld,
                ldc,
                in_type,
                out_type,
                beta == 0.0f,
                alignment(b.data),
                alignment(a.data),
                alignment(c),
                device_alpha != nullptr};
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    check_lt(cublasLtMatmulPreferenceCreate(&d.pref), "PreferenceCreate");
    const auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
      check_lt(cublasLtMatmulPreferenceSetAttribute(d.pref, attr, &value, sizeof value),
               "MatmulPreferenceSetAttribute");
    };
    prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{kWorkspaceBytes});
    // What the pointers are aligned to: cuBLASLt's A is our b, its B our a.
    const uint32_t al_a = std::get<11>(key), al_b = std::get<12>(key), al_c = std::get<13>(key);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_c);
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_c);
    // Split-K into a 16-bit C: the INPLACE and OUTPUT_TYPE schemes add the K-slices' partial sums
    // in C's dtype, rounding each element once per slice, where the contract is one rounding of
    // the fp32 sum (docs/linear.md, "Accuracy"). Only no split, or partials kept in fp32.
    if (out_type != CUDA_R_32F)
      prefer(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
             uint32_t{CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE});
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int found = 0;
    const double flops = 2.0 * static_cast<double>(M) * N * K;
    const bool tuned = flops >= kTunedFlops && flops <= kTunedFlopsMax;
    check_lt(cublasLtMatmulAlgoGetHeuristic(handle_, d.op, d.a, d.b, d.c, d.c, d.pref,
                                            tuned ? kCandidates : 1, results, &found),
             "MatmulAlgoGetHeuristic");
    if (found == 0)
      fail("cuBLASLt has no algorithm for a " + std::to_string(m) + " x " + std::to_string(n) +
           " x " + std::to_string(k) + " GEMM of " + to_string(a.dtype) + " into " +
           to_string(c_dtype));
    const auto splits = [](const cublasLtMatmulAlgo_t& algo) {  // 0: not known
      uint32_t s = 0;
      size_t written = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoConfigGetAttribute(
          &algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &s, sizeof s, &written);
      return st == CUBLAS_STATUS_SUCCESS ? s : 0;
    };
    Choice choice;
    const bool first_whole_k = splits(results[0].algo) == 1;
    for (int i = 0; i < found; ++i)  // the first, and where it does not split K, others that do not
      if (i == 0 || (first_whole_k && splits(results[i].algo) == 1))
        choice.algos.push_back(results[i].algo);
    const size_t count = choice.algos.size();
    choice.fastest_ms.assign(count, 1e30f);
    choice.issued.assign(count, 0);
    choice.timed.assign(count, 0);
    if (count == 1) choice.chosen = 0;
    it = algos_.emplace(key, std::move(choice)).first;
  }
  Choice& choice = it->second;
  last_ = &choice;
  bool timed = false;
  // Nothing of the timing on a captured stream: its events would time nothing.
  const int at = pick(choice, choice.chosen < 0 && !capturing(stream), &timed);
  std::optional<RelaxedCapture> relaxed;
  Events events;
  if (timed) {
    relaxed.emplace();
    check_cuda(cudaEventCreate(&events.start), "cudaEventCreate (GEMM timing)");
    check_cuda(cudaEventCreate(&events.stop), "cudaEventCreate (GEMM timing)");
    check_cuda(cudaEventRecord(events.start, stream), "cudaEventRecord (GEMM timing)");
  }
  const float one = 1.0f;
  const float* alpha = device_alpha != nullptr ? device_alpha : &one;
  const float* beta_at = device_alpha == nullptr ? &beta : device_alpha + (beta == 0.0f ? 1 : 2);
  const auto matmul = [&](int i) {
    return cublasLtMatmul(handle_, d.op, alpha, b.data, d.a, a.data, d.b, beta_at, c, d.c, c, d.c,
                          &choice.algos[i], workspace_, kWorkspaceBytes, stream);
  };
  const cublasStatus_t status = matmul(at);
  // A candidate that cannot run is out from here on, and the heuristic's first runs this call.
  if (status != CUBLAS_STATUS_SUCCESS && at != 0) {
    cudaGetLastError();
    choice.fastest_ms[at] = 1e30f;
    choice.issued[at] = choice.timed[at] = kSamples;
    if (choice.chosen == at) choice.chosen = 0;
    check_lt(matmul(0), "Matmul");
    return;
  }
  check_lt(status, "Matmul");
  if (!timed) return;
  check_cuda(cudaEventRecord(events.stop, stream), "cudaEventRecord (GEMM timing)");
  choice.pending.push_back({at, events.start, events.stop});
  ++choice.issued[at];
  events.start = events.stop = nullptr;  // the pending timing owns them now
}

}  // namespace xent::linear::device
