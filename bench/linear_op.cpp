#include "linear_op.h"

#include <cublas_v2.h>
#include <mpi.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "op.h"
#include "reference.h"
#include "xent/linear.h"

#if XENT_BENCH_CBLAS
#include <cblas.h>
#endif

namespace xb {

double linear_bytes_needed(const Settings& s, double tokens, double width, int ranks) {
  const double b = static_cast<double>(dtype_bytes(s.dtype)), H = static_cast<double>(s.hidden);
  const double vocab = static_cast<double>(s.vocab), logits = tokens * width;
  const double io = 2.0 * (tokens + width) * H * b  // hidden, weight, gradients
                    + tokens * (8.0 + 8.0 + (s.reduction == kNone ? 8.0 : 0.0));  // targets...
  const double gemm3 = logits * b + (s.device == "cuda" ? 0.0 : (2 * (tokens + width) * H) * 4.0);
  const double library = std::min(logits * 8.0, 256.0 * (1 << 20)) + width * H * 4.0 +
                         static_cast<double>(ranks) * tokens * H * 4.0;
  // The fp64 reference: hidden, d_hidden, d_weight with their magnitudes, a chunk of logits.
  const double check =
      s.check
          ? 8.0 * (3 * tokens * H + 2 * width * H + std::min(3.0 * tokens * vocab, 3.0 * (1 << 25)))
          : 0.0;
  return io + std::max(gemm3, library) + check;
}

double linear_bytes_gone_over(const Settings& s, int64_t tokens, int64_t width, int calls) {
  // Multiply-adds: a CBLAS does about 100 per byte of bytes_gone_over's rate, the fp64 reference's
  // plain loops about 5.
  const double t = static_cast<double>(tokens), H = static_cast<double>(s.hidden);
  const double gemms = calls * 4.0 * t * static_cast<double>(width) * H;
  const double check = s.check ? (4.0 * static_cast<double>(s.vocab) + 2.0 * width) * t * H : 0.0;
  return gemms / 100.0 + check / 5.0;
}

namespace {

void cublas_ok(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(st));
}

// The inputs: k / 128 with k uniform integers in [-128, 128), the weight times a power of two
// near logit_range / sqrt(H) (logits of a few units): exact in every dtype, so the reference
// regenerates them. The weight's padding rows are large: a library that read them would be off.
double unit_value(uint64_t seed, uint64_t salt, int64_t row, int64_t col) {
  const uint64_t h = mix64(mix64(seed ^ salt) + static_cast<uint64_t>(row) * 0x9e3779b97f4a7c15ull +
                           static_cast<uint64_t>(col));
  return static_cast<double>(static_cast<int>(h >> 56) - 128) / 128.0;
}
struct Inputs {
  uint64_t seed;
  int64_t vocab, H;
  double wscale;
  double hidden(int64_t i, int64_t h) const { return unit_value(seed, 0x68696464ull, i, h); }
  double weight(int64_t j, int64_t h) const {
    return j >= vocab ? 16.0 * wscale : wscale * unit_value(seed, 0x77656967ull, j, h);
  }
};

// Rows [r0, r0 + rows) of `f` ([rows, H] row-major) in `dtype` on the device.
template <typename F>
void upload_matrix(Device& dev, void* dst, int dtype, int64_t rows, int64_t H, F f) {
  std::vector<unsigned char> host(static_cast<size_t>(rows * H) * dtype_bytes(dtype));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t h = 0; h < H; ++h) store_elem(dtype, host.data(), i * H + h, float(f(i, h)));
  dev.upload(dst, host.data(), host.size());
}

// Row-major C[m, n] += op(A) op(B) in fp64, op(A) [m, k]: cublasDgemm on the GPU (through
// device copies), else plain loops. The reference's GEMMs.
void gemm64(Device& dev, cublasHandle_t handle, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
            const double* A, int64_t lda, const double* B, int64_t ldb, double* C, int64_t ldc) {
  if (m == 0 || n == 0 || k == 0) return;
  if (!dev.gpu()) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t p = 0; p < k; ++p) {
        const double a = ta ? A[p * lda + i] : A[i * lda + p];
        if (a == 0.0) continue;
        for (int64_t j = 0; j < n; ++j)
          C[i * ldc + j] += a * (tb ? B[j * ldb + p] : B[p * ldb + j]);
      }
    return;
  }
  auto staged = [&](const double* host, int64_t rows, int64_t cols, int64_t ld) {
    const size_t bytes = static_cast<size_t>((rows - 1) * ld + cols) * sizeof(double);
    auto buf = std::make_unique<Buffer>(dev, bytes);
    dev.upload(buf->get(), host, bytes);
    return buf;
  };
  const auto a = staged(A, ta ? k : m, ta ? m : k, lda), b = staged(B, tb ? n : k, tb ? k : n, ldb);
  const auto c = staged(C, m, n, ldc);
  const double one = 1.0;
  cublas_ok(cublasDgemm(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                        int(n), int(m), int(k), &one, b->as<double>(), int(ldb), a->as<double>(),
                        int(lda), &one, c->as<double>(), int(ldc)),
            "cublasDgemm");
  dev.download(C, c->get(), c->bytes());
}

// The fp64 reference of one rank: per-row statistics (RefRow, gen.h) over the global vocabulary,
// d_hidden [T, H] and this rank's d_weight [width, H], each with the sum of its terms' magnitudes
// (mag), the sum of the other factor's magnitudes (abs, for the 16-bit gradient's atol) and the
// fp32 error of the logits' gradient carried through the products (fp32: fp32_grad_err).
struct LinearRef {
  std::vector<RefRow> rows;
  std::vector<double> dh, dh_mag, dh_abs, dh_fp32, dw, dw_mag, dw_abs, dw_fp32;
};

// The fp32 error of one element of the logits' gradient, as a bound: the library computes
// exp(z - lse) in fp32, lse carrying about |lse| 2^-24 and the argument about |z - lse| 2^-24 (and
// a softcapped z about 2 c 2^-24), so the softmax term moves by that much relative (2^-23: twice
// it): a few 1e-7 for logits of a few units, 1.5e-5 at |z - lse| of 256, past the fixed 5e-6 of
// the magnitude (Tolerance) that covers the GEMMs. A softcap's slope, 4 r (1 - r) from
// r = 1 / (1 + e^(2x/c)) of about 4 ulps, is off by up to 16 x 2^-24 absolute where it saturates
// (a tiny slope: not a relative error). The fp32 logits themselves are exact here (Inputs:
// integers over 128 times a power of two, whose sums over H keep within 24 bits while they stay
// below 2^10 times the weight's scale, as random signs keep them).
double fp32_grad_err(const Problem& p, double soft, double g, double z, double lse, double scale,
                     double slope) {
  const double arg = std::fabs(z - lse) + std::fabs(lse) + 2.0 * p.softcap;
  return std::fabs(soft * scale * slope) * std::ldexp(arg, -23) +
         (p.softcap > 0.0 ? std::fabs(g * scale) * std::ldexp(1.0, -20) : 0.0);
}

LinearRef reference(Device& dev, cublasHandle_t handle, const Problem& p, const Inputs& in) {
  const int64_t T = p.rows, H = in.H, V = p.vocab;
  LinearRef ref;
  ref.rows.resize(static_cast<size_t>(T));
  std::vector<double> X(static_cast<size_t>(T * H)), Xabs(X.size()), xsum(H, 0.0), wsum(H, 0.0);
  for (int64_t i = 0; i < T; ++i) {
    RefRow& r = ref.rows[static_cast<size_t>(i)];
    r.target = gen_target(p, i);
    r.ignored = r.target == p.ignore_index;
    for (int64_t h = 0; h < H; ++h) {
      X[i * H + h] = in.hidden(i, h);
      Xabs[i * H + h] = std::fabs(X[i * H + h]);
      if (!r.ignored) xsum[h] += Xabs[i * H + h];
    }
  }
  // Logits a chunk of global columns at a time, twice: the statistics, then the gradient.
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(V, (int64_t(1) << 22) / std::max<int64_t>(1, T)));
  std::vector<double> W, Wabs, Z;
  auto logits = [&](int64_t c0, int64_t n) {
    W.assign(static_cast<size_t>(n * H), 0.0);
    Wabs.resize(W.size());
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < H; ++h) {
        W[j * H + h] = in.weight(c0 + j, h);
        Wabs[j * H + h] = std::fabs(W[j * H + h]);
      }
    Z.assign(static_cast<size_t>(T * n), 0.0);
    gemm64(dev, handle, false, true, T, n, H, X.data(), H, W.data(), H, Z.data(), n);
  };
  std::vector<double> m(T, -INFINITY), e(T, 0.0);  // running max and sum of exp(z - max)
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t n = std::min(chunk, V - c0);
    logits(c0, n);
    for (int64_t i = 0; i < T; ++i) {
      RefRow& r = ref.rows[static_cast<size_t>(i)];
      for (int64_t j = 0; j < n; ++j) {
        const double z = ref_z(p, Z[i * n + j]);
        if (z > m[i]) {
          e[i] = e[i] * std::exp(m[i] - z) + 1.0;
          m[i] = z;
        } else {
          e[i] += std::exp(z - m[i]);
        }
        r.sum_z += z;
        if (c0 + j == r.target) r.target_z = z;
      }
    }
  }
  for (int64_t i = 0; i < T; ++i) {
    RefRow& r = ref.rows[static_cast<size_t>(i)];
    r.lse = m[i] + std::log(e[i]);
    ref_finish_row(p, r);
  }
  const double scale = ref_row_scale(p, inv_valid_rows(ref.rows)), Vd = static_cast<double>(V);
  const int64_t width = p.width;
  for (auto* v : {&ref.dh, &ref.dh_mag, &ref.dh_abs, &ref.dh_fp32})
    v->assign(static_cast<size_t>(T * H), 0.0);
  for (auto* v : {&ref.dw, &ref.dw_mag, &ref.dw_abs, &ref.dw_fp32})
    v->assign(static_cast<size_t>(width * H), 0.0);
  std::vector<double> G, Gabs, Gfp32;
  for (int64_t c0 = 0; c0 < V; c0 += chunk) {
    const int64_t n = std::min(chunk, V - c0);
    logits(c0, n);
    G.assign(Z.size(), 0.0);
    Gabs.assign(Z.size(), 0.0);
    Gfp32.assign(Z.size(), 0.0);
    for (int64_t i = 0; i < T; ++i) {
      const RefRow& r = ref.rows[static_cast<size_t>(i)];
      if (r.ignored) continue;
      for (int64_t j = 0; j < n; ++j) {
        const double x = Z[i * n + j], z = ref_z(p, x);
        const double soft = (1.0 + 2.0 * p.z_loss * r.lse) * std::exp(z - r.lse);
        const double g = soft - p.smoothing / Vd - (c0 + j == r.target ? 1.0 - p.smoothing : 0.0);
        const double slope = ref_slope(p, x);
        G[i * n + j] = g * scale * slope;
        Gabs[i * n + j] = std::fabs(G[i * n + j]);
        Gfp32[i * n + j] = fp32_grad_err(p, soft, g, z, r.lse, scale, slope);
      }
    }
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < H; ++h) wsum[h] += Wabs[j * H + h];
    gemm64(dev, handle, false, false, T, H, n, G.data(), n, W.data(), H, ref.dh.data(), H);
    gemm64(dev, handle, false, false, T, H, n, Gabs.data(), n, Wabs.data(), H, ref.dh_mag.data(),
           H);
    gemm64(dev, handle, false, false, T, H, n, Gfp32.data(), n, Wabs.data(), H, ref.dh_fp32.data(),
           H);
    // This rank's rows of the weight in the chunk: [a, b) global.
    const int64_t a = std::max(c0, p.start), b = std::min(c0 + n, p.start + width);
    if (a >= b) continue;
    double* dw = ref.dw.data() + (a - p.start) * H;
    double* dw_mag = ref.dw_mag.data() + (a - p.start) * H;
    gemm64(dev, handle, true, false, b - a, H, T, G.data() + (a - c0), n, X.data(), H, dw, H);
    gemm64(dev, handle, true, false, b - a, H, T, Gabs.data() + (a - c0), n, Xabs.data(), H, dw_mag,
           H);
    gemm64(dev, handle, true, false, b - a, H, T, Gfp32.data() + (a - c0), n, Xabs.data(), H,
           ref.dw_fp32.data() + (a - p.start) * H, H);
    for (int64_t j = a; j < b; ++j)
      std::copy(xsum.begin(), xsum.end(), ref.dw_abs.begin() + (j - p.start) * H);
  }
  for (int64_t i = 0; i < T; ++i)
    if (!ref.rows[static_cast<size_t>(i)].ignored)
      std::copy(wsum.begin(), wsum.end(), ref.dh_abs.begin() + i * H);
  return ref;
}

// Tolerances (tests/linear_harness.h): an element of d_hidden or d_weight within its dtype's one
// ulp of its value (out_rtol: 0 for f32) plus half an ulp of its smallest spacing, plus 5e-6 of its
// terms' magnitudes; the gradient of the logits is fp32, 0 where it is below fp32's normal range
// at worst (an exp that flushes), which adds 2^-126 times `abs`; on CUDA for 16-bit inputs it is
// 16-bit, which adds 2^-8 (bf16) or 2^-11 (f16) of the magnitude and half its subnormal spacing
// times `abs`. On top: the fp32 error of the logits' gradient through the products (LinearRef's
// fp32, fp32_grad_err).
struct Tolerance {
  double out_rtol, out_atol, mag_rtol, abs_atol;
};
Tolerance tolerance(int dtype, bool gpu) {
  constexpr double kLinearRtol = 5e-6;
  const bool bf16 = dtype == kBF16, rounded = gpu && dtype != kF32;
  Tolerance t{0.0, std::ldexp(1.0, -150), kLinearRtol, std::ldexp(1.0, -126)};
  if (dtype == kF32) return t;
  t.out_rtol = bf16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
  t.out_atol = bf16 ? std::ldexp(1.0, -134) : std::ldexp(1.0, -25);
  if (rounded) {
    t.mag_rtol += bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    t.abs_atol = bf16 ? std::ldexp(1.0, -134) : std::ldexp(1.0, -25);
  }
  return t;
}

// The loss and lse: within 1e-5 of the larger of the value and the magnitude of its terms
// (RefRow::loss_mag: a loss near 0 can be the difference of a large lse and target logit), plus
// 1e-6.
bool loss_ok(double got, double want, double magnitude) {
  return std::fabs(got - want) <= 1e-5 * std::max(std::fabs(want), magnitude) + 1e-6;  // NaN: false
}
double loss_magnitude(const RefRow& r) {
  return r.ignored ? 0.0 : r.loss_mag;
}

}  // namespace

// One size's problem, buffers and views.
struct LinearOperation::Size {
  Size(Device& dev, const Problem& prob, const Inputs& inputs)
      : p(prob),
        in(inputs),
        n_loss(p.reduction == kNone ? p.rows : 1),
        hidden(dev, static_cast<size_t>(p.rows * in.H) * dtype_bytes(p.dtype)),
        weight(dev, static_cast<size_t>(p.width * in.H) * dtype_bytes(p.dtype)),
        targets(dev, static_cast<size_t>(p.rows) * sizeof(int64_t)),
        loss(dev, static_cast<size_t>(n_loss) * sizeof(float)),
        lse(dev, static_cast<size_t>(p.rows) * sizeof(float)),
        gout(dev, static_cast<size_t>(n_loss) * sizeof(float)),
        d_hidden(dev, hidden.bytes()),
        d_weight(dev, weight.bytes()) {
    const std::vector<int64_t> t = host_targets(p);
    dev.upload(targets.get(), t.data(), t.size() * sizeof(int64_t));
    const std::vector<float> g(static_cast<size_t>(n_loss), static_cast<float>(p.grad_output));
    dev.upload(gout.get(), g.data(), g.size() * sizeof(float));
    upload_matrix(dev, hidden.get(), p.dtype, p.rows, in.H,
                  [this](int64_t i, int64_t h) { return in.hidden(i, h); });
    upload_matrix(dev, weight.get(), p.dtype, p.width, in.H,
                  [this](int64_t j, int64_t h) { return in.weight(p.start + j, h); });
    const xent::DType d = to_xent_dtype(p.dtype);
    hv = {hidden.get(), d, p.rows, in.H, in.H};
    wv = {weight.get(), d, p.width, in.H, in.H};
    tv.data = targets.get();
    tv.type = xent::IndexType::i64;
    tv.rows = p.rows;
    grads.d_hidden = {d_hidden.get(), d, p.rows, in.H, in.H};
    grads.d_weight = {d_weight.get(), d, p.width, in.H, in.H};
  }
  Problem p;  // p.grad_output: the gradients' (fused: grad_scale), set by first_call
  const Inputs in;
  const int64_t n_loss;
  Buffer hidden, weight, targets, loss, lse, gout, d_hidden, d_weight;
  xent::MatrixView hv, wv;
  xent::TargetsView tv;
  xent::LinearOutputs grads;  // d_hidden and d_weight only (linear_backward's)
};

// The cuBLAS handle (CUDA): gemm3 and the reference's fp64 GEMMs.
struct LinearOperation::Gemm {
  explicit Gemm(Device& dev) {
    if (!dev.gpu()) return;
    cublas_ok(cublasCreate(&handle), "cublasCreate");
    cublas_ok(cublasSetStream(handle, dev.stream()), "cublasSetStream");
  }
  ~Gemm() {
    if (handle) cublasDestroy(handle);
  }
  cublasHandle_t handle = nullptr;
};

// The fused lm head's scratch through xent::Allocator, as a caller's allocator would give it
// (cudaMallocAsync on the call's stream; malloc on the CPU), counted: `peak` is the most held
// at once.
struct LinearOperation::Counting final : xent::Allocator {
  bool gpu = false;
  int64_t now = 0, peak = 0;
  void* allocate(size_t bytes, cudaStream_t stream) override {
    void* p = nullptr;
    if (gpu) {
      if (cudaMallocAsync(&p, bytes, stream) != cudaSuccess)
        throw std::runtime_error("cudaMallocAsync of " + std::to_string(bytes) + " bytes failed");
    } else {
      p = std::malloc(bytes);
      if (p == nullptr) throw std::runtime_error("malloc failed");
    }
    now += static_cast<int64_t>(bytes);
    peak = std::max(peak, now);
    return p;
  }
  void release(void* p, size_t bytes, cudaStream_t stream) override {
    if (gpu)
      cudaFreeAsync(p, stream);
    else
      std::free(p);
    now -= static_cast<int64_t>(bytes);
  }
};

LinearOperation::LinearOperation(const Settings& s, xent::Group& group, Device& dev)
    : s_(s), group_(group), dev_(dev), gemm_(std::make_shared<Gemm>(dev)) {
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  opt_ = plan_options(s, group, shard_);
  alloc_ = std::make_shared<Counting>();
  alloc_->gpu = dev.gpu();
  lopt_.allocator = alloc_.get();
  lopt_.max_scratch_bytes = static_cast<size_t>(s.scratch_mib) << 20;
  lopt_.chunk_rows = s.chunk_rows;
  lopt_.chunk_cols = s.chunk_cols;
  lopt_.schedule = s.schedule == "fast"   ? xent::LinearSchedule::fast
                   : s.schedule == "lean" ? xent::LinearSchedule::lean
                                          : xent::LinearSchedule::automatic;
  lopt_.gemm = s.gemm == "cublaslt"   ? xent::LinearGemm::cublaslt
               : s.gemm == "epilogue" ? xent::LinearGemm::epilogue
                                      : xent::LinearGemm::automatic;
}

LinearOperation::~LinearOperation() = default;

void LinearOperation::resize(int64_t tokens) {
  const double H = static_cast<double>(s_.hidden);
  const Inputs in{s_.seed, s_.vocab, s_.hidden,
                  std::exp2(std::round(std::log2(s_.logit_range / std::sqrt(H))))};
  size_.reset();
  size_ = std::make_unique<Size>(dev_, make_problem(s_, shard_, opt_, tokens), in);
}

std::function<void()> LinearOperation::gemm3() {
  const Size& z = *size_;
  const int64_t T = z.p.rows, V = z.p.width, H = z.in.H;
  if (dev_.gpu()) {
    const cudaDataType_t t = z.p.dtype == kF32    ? CUDA_R_32F
                             : z.p.dtype == kBF16 ? CUDA_R_16BF
                                                  : CUDA_R_16F;
    auto g = std::make_shared<Buffer>(dev_, static_cast<size_t>(T * V) * dtype_bytes(z.p.dtype));
    const auto gemm = gemm_;
    // At TP > 1 an unfused step sums d_hidden over the ranks in its own dtype (Megatron's
    // all-reduce of the input's gradient): timed as an fp32 all-reduce of the same bytes, the
    // group's communicator's sum, on its own buffer (the bits are not numbers).
    xent::Communicator& comm = group_.comm();
    const size_t sum_floats =
        comm.size() > 1 && comm.has_sums()
            ? static_cast<size_t>(T * H) * dtype_bytes(z.p.dtype) / sizeof(float)
            : 0;
    auto dh = std::make_shared<Buffer>(dev_, sum_floats * sizeof(float));
    cudaStream_t stream = dev_.stream();
    return [&z, g, gemm, t, T, V, H, &comm, dh, sum_floats, stream] {
      const float one = 1.0f, zero = 0.0f;
      auto ex = [&](cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
                    const void* A, int64_t lda, const void* B, int64_t ldb, void* C, int64_t ldc) {
        cublas_ok(
            cublasGemmEx(gemm->handle, ta, tb, int(m), int(n), int(k), &one, A, t, int(lda), B, t,
                         int(ldb), &zero, C, t, int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
      };
      // Column-major views of the row-major matrices: logits^T = W hidden^T, d_hidden^T =
      // W^T G^T, d_weight^T = hidden^T G.
      ex(CUBLAS_OP_T, CUBLAS_OP_N, V, T, H, z.weight.get(), H, z.hidden.get(), H, g->get(), V);
      ex(CUBLAS_OP_N, CUBLAS_OP_N, H, T, V, z.weight.get(), H, g->get(), V, z.d_hidden.get(), H);
      ex(CUBLAS_OP_N, CUBLAS_OP_T, H, V, T, z.hidden.get(), H, g->get(), V, z.d_weight.get(), H);
      if (sum_floats > 0) {
        auto* sum = static_cast<float*>(dh->get());
        comm.all_reduce_sum(sum, sum, sum_floats, stream);
      }
    };
  }
#if XENT_BENCH_CBLAS
  // fp32 copies, as the CPU backend widens its inputs.
  struct Host {
    std::vector<float> x, w, g, dh, dw;
  };
  auto b = std::make_shared<Host>();
  for (int64_t i = 0; i < T * H; ++i)
    b->x.push_back(float(load_elem(z.p.dtype, z.hidden.get(), i)));
  for (int64_t i = 0; i < V * H; ++i)
    b->w.push_back(float(load_elem(z.p.dtype, z.weight.get(), i)));
  b->g.resize(static_cast<size_t>(T * V));
  b->dh.resize(b->x.size());
  b->dw.resize(b->w.size());
  return [b, T, V, H] {
    const int t = int(T), v = int(V), h = int(H);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, t, v, h, 1.0f, b->x.data(), h, b->w.data(),
                h, 0.0f, b->g.data(), v);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, t, h, v, 1.0f, b->g.data(), v,
                b->w.data(), h, 0.0f, b->dh.data(), h);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, t, 1.0f, b->g.data(), v, b->x.data(),
                h, 0.0f, b->dw.data(), h);
  };
#else
  return {};
#endif
}

void LinearOperation::first_call(const std::string& mode) {
  mode_ = mode;
  const bool fused = mode == "fused";
  opt_.grad_mode = fused ? xent::GradMode::fused : xent::GradMode::deferred;
  opt_.grad_scale = fused ? static_cast<float>(s_.grad_scale) : 1.0f;
  size_->p.grad_output = fused ? opt_.grad_scale : static_cast<float>(s_.grad_output);
  for (const Buffer* b : {&size_->loss, &size_->lse, &size_->d_hidden, &size_->d_weight})
    dev_.zero(b->get(), b->bytes());
  dev_.sync();

  alloc_->peak = 0;
  extra_bytes_ = extra_after(dev_, group_, extra_bytes_, [this] {
    forward();
    backward();
    dev_.sync();
    check_errors();
  });
  // The scratch is the call's (it goes back when the call ends): its most at once.
  extra_bytes_ = std::max(extra_bytes_, alloc_->peak);
}

void LinearOperation::forward() {
  xent::LinearOutputs out;
  out.loss = size_->loss.as<float>();
  out.lse = size_->lse.as<float>();
  if (opt_.grad_mode == xent::GradMode::fused) {
    out.d_hidden = size_->grads.d_hidden;
    out.d_weight = size_->grads.d_weight;
  }
  xent::LinearPlan plan;
  out.plan = &plan;
  xent::linear_forward(group_, size_->hv, size_->wv, size_->tv, opt_, lopt_, out, dev_.stream());
  path_ = std::string(xent::to_string(plan.schedule)) + " " + xent::to_string(plan.gemm);
}

void LinearOperation::backward() {
  if (opt_.grad_mode != xent::GradMode::deferred) return;
  xent::linear_backward(group_, size_->hv, size_->wv, size_->tv, size_->lse.as<float>(),
                        size_->gout.as<float>(), opt_, lopt_, size_->grads, dev_.stream());
}

void LinearOperation::check_errors() {
  group_.check_errors(dev_.stream());
}

int64_t LinearOperation::verify() {
  const Size& z = *size_;
  const Problem& p = z.p;
  const int64_t T = p.rows, H = z.in.H;
  std::vector<float> loss(static_cast<size_t>(z.n_loss)), lse(static_cast<size_t>(T));
  dev_.download(loss.data(), z.loss.get(), z.loss.bytes());
  dev_.download(lse.data(), z.lse.get(), z.lse.bytes());
  std::vector<unsigned char> dh(z.d_hidden.bytes()), dw(z.d_weight.bytes());
  dev_.download(dh.data(), z.d_hidden.get(), dh.size());
  dev_.download(dw.data(), z.d_weight.get(), dw.size());
  const LinearRef ref = reference(dev_, gemm_->handle, p, z.in);

  int64_t wrong = 0;
  std::string first;
  auto bad = [&](const char* what, int64_t i, int64_t j, double got, double want, double tol) {
    if (wrong++ > 0) return;
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s [%" PRId64 "%s%s] = %.9g, expected %.9g (tolerance %.3g)",
                  what, i, j >= 0 ? ", " : "", j >= 0 ? std::to_string(j).c_str() : "", got, want,
                  tol);
    first = buf;
  };
  if (p.reduction == kNone) {
    for (int64_t i = 0; i < T; ++i)
      if (!loss_ok(loss[i], ref.rows[i].loss, loss_magnitude(ref.rows[i])))
        bad("loss", i, -1, loss[i], ref.rows[i].loss, 0);
  } else {
    double sum = 0.0, mag = 0.0;
    for (const RefRow& r : ref.rows) {
      sum += r.loss;
      mag += loss_magnitude(r);
    }
    const double f = p.reduction == kMean ? inv_valid_rows(ref.rows) : 1.0;
    if (!loss_ok(loss[0], sum * f, mag * f)) bad("loss", 0, -1, loss[0], sum * f, 0);
  }
  for (int64_t i = 0; i < T; ++i)
    if (!ref.rows[i].ignored && !loss_ok(lse[i], ref.rows[i].lse, std::fabs(ref.rows[i].lse)))
      bad("lse", i, -1, lse[i], ref.rows[i].lse, 0);
  const Tolerance tol = tolerance(p.dtype, dev_.gpu());
  auto compare = [&](const char* what, const std::vector<unsigned char>& got,
                     const std::vector<double>& want, const std::vector<double>& mag,
                     const std::vector<double>& abs, const std::vector<double>& fp32,
                     int64_t row0) {
    for (size_t e = 0; e < want.size(); ++e) {
      const double have = load_elem(p.dtype, got.data(), static_cast<int64_t>(e)), w = want[e];
      const double lim = tol.out_rtol * std::fabs(w) + (mag[e] > 0 ? tol.out_atol : 0.0) +
                         tol.mag_rtol * mag[e] + tol.abs_atol * abs[e] + fp32[e];
      if (!(std::fabs(have - w) <= lim))
        bad(what, row0 + static_cast<int64_t>(e) / H, static_cast<int64_t>(e) % H, have, w, lim);
    }
  };
  compare("d_hidden", dh, ref.dh, ref.dh_mag, ref.dh_abs, ref.dh_fp32, 0);
  compare("d_weight (global row, column)", dw, ref.dw, ref.dw_mag, ref.dw_abs, ref.dw_fp32,
          p.start);

  // The loss, lse and d_hidden are the same bits on every rank.
  uint64_t h = fnv1a(0xcbf29ce484222325ull, loss.data(), loss.size() * sizeof(float));
  for (int64_t i = 0; i < T; ++i)
    if (!ref.rows[i].ignored) h = fnv1a(h, &lse[i], sizeof(float));
  h = fnv1a(h, dh.data(), dh.size());
  uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (lo != hi) {
    if (wrong == 0) first = "loss, lse or d_hidden is not bitwise the same on every rank";
    ++wrong;
  }
  if (wrong > 0)
    std::fprintf(stderr,
                 "xent_dist_bench: rank %d: %" PRId64 " tokens, hidden %" PRId64 ", %s: %" PRId64
                 " wrong; first: %s\n",
                 rank_, T, H, mode_.c_str(), wrong, first.c_str());
  return wrong;
}

}  // namespace xb
