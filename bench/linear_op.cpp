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

#include "linear_reference.h"
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
  const LinearRef ref = linear_reference(dev_, gemm_->handle, p, z.in);

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
  const Tolerance tol = linear_tolerance(p.dtype, dev_.gpu());
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
