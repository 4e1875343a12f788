#include "op.h"

#include <mpi.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <vector>

#include "reference.h"

namespace xb {

int64_t widest_shard(int64_t padded, int ranks) {
  return padded / ranks + (padded % ranks ? 1 : 0);
}

double shard_bytes(double tokens, double width, int dtype) {
  return tokens * width * static_cast<double>(dtype_bytes(dtype));
}

double bytes_moved(int64_t tokens, int64_t width, int dtype) {
  return 3.0 * shard_bytes(static_cast<double>(tokens), static_cast<double>(width), dtype);
}

double bytes_needed(const Settings& s, double tokens, double width, int ranks) {
  xent::Options opt;
  opt.label_smoothing = static_cast<float>(s.label_smoothing);
  const double record = static_cast<double>(xent::record_bytes(opt));
  const double per_row = 8.0 + 4.0                             // targets (int64), lse
                         + (s.reduction == kNone ? 8.0 : 0.0)  // loss and grad_output per row
                         + 2.0 * record * (1 + ranks)  // the all-gather's buffers; the workspace's
                         + 4.0                         // the workspace's lse
                         + (s.check ? sizeof(RefRow) + 8.0 : 0.0);  // reference; loss, lse copies
  // The logits: forward and backward write the gradient in place.
  return shard_bytes(tokens, width, s.dtype) + tokens * per_row;
}

double bytes_gone_over(const Settings& s, int64_t tokens, int64_t width, int calls) {
  const double shard =
      shard_bytes(static_cast<double>(tokens), static_cast<double>(width), s.dtype);
  const double check_passes =
      s.check ? 3.0 * (2.0 * static_cast<double>(s.vocab) / static_cast<double>(width) + 1.0) : 0.0;
  return shard * (1.0 + check_passes) + calls * bytes_moved(tokens, width, s.dtype);
}

xent::DType to_xent_dtype(int d) {
  return d == kF32 ? xent::DType::f32 : d == kBF16 ? xent::DType::bf16 : xent::DType::f16;
}

uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

namespace {

xent::Reduction to_xent_reduction(int r) {
  return r == kNone  ? xent::Reduction::none
         : r == kSum ? xent::Reduction::sum
                     : xent::Reduction::mean;
}

std::string describe(const Mismatch& m) {
  char buf[320];
  switch (m.kind) {
    case 1:
      std::snprintf(buf, sizeof buf,
                    "gradient [row %" PRId64 ", global column %" PRId64
                    "] = %.9g, expected %.9g (tolerance %.3g)",
                    m.row, m.col, m.got, m.want, m.tol);
      break;
    case 2:
      if (m.row >= 0)
        std::snprintf(buf, sizeof buf,
                      "loss [row %" PRId64 "] = %.9g, expected %.9g (tolerance %.3g)", m.row, m.got,
                      m.want, m.tol);
      else
        std::snprintf(buf, sizeof buf, "loss = %.9g, expected %.9g (tolerance %.3g)", m.got, m.want,
                      m.tol);
      break;
    case 3:
      std::snprintf(buf, sizeof buf, "lse [row %" PRId64 "] = %.9g, expected %.9g (tolerance %.3g)",
                    m.row, m.got, m.want, m.tol);
      break;
    case 4:
      std::snprintf(buf, sizeof buf, "loss or lse is not bitwise the same on every rank");
      break;
    case 5:
      std::snprintf(
          buf, sizeof buf,
          "bench self-check: the GPU reference disagrees with the host reference at row %" PRId64
          " (%.17g vs %.17g)",
          m.row, m.got, m.want);
      break;
    default: std::snprintf(buf, sizeof buf, "unknown mismatch");
  }
  return buf;
}

// The GPU's reference and comparison, then the first rows (all of them when small) redone on the
// host: that checks the bench's own GPU code against plain host code.
int64_t check_on_gpu(Device& dev, const Problem& p, const void* grad, std::vector<RefRow>& ref,
                     Mismatch& first) {
  Buffer rows(dev, static_cast<size_t>(p.rows) * sizeof(RefRow));
  cuda_ref_rows(p, rows.as<RefRow>(), dev.stream());
  ref.resize(static_cast<size_t>(p.rows));
  dev.download(ref.data(), rows.get(), ref.size() * sizeof(RefRow));
  const double inv = inv_valid_rows(ref);
  int64_t wrong = cuda_check_grad(p, grad, rows.as<RefRow>(), inv, &first, dev.stream());
  Problem head = p;
  head.rows = std::min<int64_t>(p.rows, std::max<int64_t>(4, (int64_t(1) << 22) / p.vocab));
  const std::vector<RefRow> host = host_ref_rows(head);
  for (size_t r = 0; r < host.size(); ++r) {
    const double a = ref[r].loss, b = host[r].loss, c = ref[r].lse, d = host[r].lse;
    if (ref[r].ignored != host[r].ignored || !(std::fabs(a - b) <= 1e-9 * (1 + std::fabs(b))) ||
        !(std::fabs(c - d) <= 1e-9 * (1 + std::fabs(d)))) {
      if (first.kind == 0) first = Mismatch{5, 0, static_cast<int64_t>(r), -1, a, b, 0.0};
      ++wrong;
    }
  }
  const int64_t gpu_head =
      cuda_check_grad(head, grad, rows.as<RefRow>(), inv, nullptr, dev.stream());
  std::vector<unsigned char> g(static_cast<size_t>(head.rows * head.width) * dtype_bytes(p.dtype));
  dev.download(g.data(), grad, g.size());
  const int64_t host_head = host_check_grad(head, g.data(), host, inv, nullptr);
  if (host_head != gpu_head) {
    std::fprintf(stderr,
                 "xent_dist_bench: bench self-check: over the first %" PRId64
                 " rows the GPU check counted %" PRId64
                 " wrong gradient values, the host check %" PRId64 "\n",
                 head.rows, gpu_head, host_head);
    wrong += std::max<int64_t>(0, host_head - gpu_head) + 1;
  }
  return wrong;
}

// Compares forward's loss and lse and the gradient now in `grad` with the fp64 reference.
int64_t check(Device& dev, const Problem& p, const void* grad, const float* loss_buf,
              const float* lse_buf, Mismatch& first) {
  const int64_t n_loss = p.reduction == kNone ? p.rows : 1;
  std::vector<float> loss(static_cast<size_t>(n_loss)), lse(static_cast<size_t>(p.rows));
  dev.download(loss.data(), loss_buf, loss.size() * sizeof(float));
  dev.download(lse.data(), lse_buf, lse.size() * sizeof(float));

  std::vector<RefRow> ref;
  int64_t wrong = 0;
  if (dev.gpu()) {
    wrong += check_on_gpu(dev, p, grad, ref, first);
  } else {
    ref = host_ref_rows(p);
    wrong += host_check_grad(p, grad, ref, inv_valid_rows(ref), &first);
  }
  wrong += check_outputs(p, ref, loss.data(), lse.data(), &first);

  // Every rank must hold bitwise the same loss and lse (lse only where the row counts).
  uint64_t h = fnv1a(0xcbf29ce484222325ull, loss.data(), loss.size() * sizeof(float));
  for (size_t r = 0; r < lse.size(); ++r)
    if (!ref[r].ignored) h = fnv1a(h, &lse[r], sizeof(float));
  uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (lo != hi) {
    if (first.kind == 0) first = Mismatch{4, 0, -1, -1, 0.0, 0.0, 0.0};
    ++wrong;
  }
  return wrong;
}

}  // namespace

// One size's problem, buffers and views.
struct Operation::Size {
  Size(Device& dev, const Problem& prob)
      : p(prob),
        n_loss(p.reduction == kNone ? p.rows : 1),
        logits(dev, static_cast<size_t>(p.rows * p.width) * dtype_bytes(p.dtype)),
        targets(dev, static_cast<size_t>(p.rows) * sizeof(int64_t)),
        loss(dev, static_cast<size_t>(n_loss) * sizeof(float)),
        lse(dev, static_cast<size_t>(p.rows) * sizeof(float)),
        gout(dev, static_cast<size_t>(n_loss) * sizeof(float)) {
    const std::vector<int64_t> t = host_targets(p);
    dev.upload(targets.get(), t.data(), t.size() * sizeof(int64_t));
    const std::vector<float> g(static_cast<size_t>(n_loss), static_cast<float>(p.grad_output));
    dev.upload(gout.get(), g.data(), g.size() * sizeof(float));
    lv.data = logits.get();
    lv.dtype = to_xent_dtype(p.dtype);
    lv.rows = p.rows;
    lv.cols = p.width;
    lv.row_stride = p.width;
    tv.data = targets.get();
    tv.type = xent::IndexType::i64;
    tv.rows = p.rows;
    out.loss = loss.as<float>();
    out.lse = lse.as<float>();
  }
  const Problem p;
  const int64_t n_loss;
  Buffer logits, targets, loss, lse, gout;
  xent::LogitsView lv;
  xent::TargetsView tv;
  xent::Outputs out;
};

xent::Options plan_options(const Settings& s, xent::Group& group, xent::Shard& shard) {
  const int64_t base = s.padded / group.size(), extra = s.padded % group.size();
  shard = xent::plan_shard(group, base + (group.rank() < extra ? 1 : 0), s.vocab);
  xent::Options opt;
  xent::apply(shard, opt);
  opt.label_smoothing = static_cast<float>(s.label_smoothing);
  opt.z_loss = static_cast<float>(s.z_loss);
  opt.softcap = static_cast<float>(s.softcap);
  opt.reduction = to_xent_reduction(s.reduction);
  return opt;
}

Problem make_problem(const Settings& s, const xent::Shard& shard, const xent::Options& opt,
                     int64_t tokens) {
  Problem p;
  p.rows = tokens;
  p.vocab = s.vocab;
  p.padded = s.padded;
  p.start = shard.start;
  p.width = shard.width;
  p.dtype = s.dtype;
  p.reduction = s.reduction;
  p.smoothing = opt.label_smoothing;
  p.z_loss = opt.z_loss;
  p.softcap = opt.softcap;
  p.grad_output = static_cast<float>(s.grad_output);
  p.seed = s.seed;
  p.ignore_index = opt.ignore_index;
  p.ignore_threshold =
      static_cast<uint32_t>(std::min(4294967295.0, std::floor(s.ignore_fraction * 4294967296.0)));
  p.step = static_cast<float>(s.logit_range / 256.0);
  return p;
}

int64_t extra_after(Device& dev, const xent::Group& group, int64_t extra,
                    const std::function<void()>& calls) {
  const int64_t before = dev.memory_in_use();
  calls();
  dev.sync();
  return std::max<int64_t>(extra + dev.memory_in_use() - before,
                           static_cast<int64_t>(group.workspace_bytes()));
}

Operation::Operation(const Settings& s, xent::Group& group, Device& dev)
    : s_(s), group_(group), dev_(dev) {
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  opt_ = plan_options(s, group_, shard_);
  opt_.single_pass = !s.two_pass;
  opt_.device_exchange = s.device_exchange;
}

Operation::~Operation() = default;

void Operation::resize(int64_t tokens) {
  const Problem p = make_problem(s_, shard_, opt_, tokens);
  size_.reset();
  size_ = std::make_unique<Size>(dev_, p);
}

std::function<void()> Operation::all_gather() {
  struct Buffers {
    Buffers(Device& dev, size_t bytes, int ranks)
        : send(dev, bytes), recv(dev, bytes * static_cast<size_t>(ranks)) {}
    Buffer send, recv;
  };
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const size_t bytes = xent::record_bytes(opt_) * static_cast<size_t>(size_->p.rows);
  auto b = std::make_shared<Buffers>(dev_, bytes, ranks);
  dev_.zero(b->send.get(), bytes);
  return [this, b, bytes] {
    group_.comm().all_gather(b->send.get(), b->recv.get(), bytes, dev_.stream());
  };
}

void Operation::first_call(const std::string& mode) {
  mode_ = mode;
  opt_.grad_mode = mode == "fused" ? xent::GradMode::fused : xent::GradMode::deferred;
  opt_.grad_scale = mode == "fused" ? static_cast<float>(s_.grad_scale) : 1.0f;
  dev_.fill_logits(size_->p, size_->logits.get());
  dev_.zero(size_->loss.get(), size_->loss.bytes());
  dev_.zero(size_->lse.get(), size_->lse.bytes());
  dev_.sync();

  extra_bytes_ = extra_after(dev_, group_, extra_bytes_, [&] {
    group_.reserve(size_->p.rows, opt_);
    forward();
    backward();
  });
  check_errors();
}

std::string Operation::path() const {
  return xent::forward_path(group_, size_->lv, opt_);
}

int64_t Operation::verify() {
  Mismatch first;
  const int64_t wrong = check(dev_, size_->p, size_->logits.get(), size_->loss.as<float>(),
                              size_->lse.as<float>(), first);
  if (wrong > 0)
    std::fprintf(stderr,
                 "xent_dist_bench: rank %d: %" PRId64 " tokens, %s: %" PRId64 " wrong; first: %s\n",
                 rank_, size_->p.rows, mode_.c_str(), wrong, describe(first).c_str());
  return wrong;
}

void Operation::forward() {
  xent::forward(group_, size_->lv, size_->tv, opt_, size_->out, dev_.stream());
}

void Operation::backward() {
  xent::backward(group_, size_->lv, size_->tv, size_->lse.as<float>(), size_->gout.as<float>(),
                 opt_, dev_.stream());
}

void Operation::check_errors() {
  group_.check_errors(dev_.stream());
}

}  // namespace xb
