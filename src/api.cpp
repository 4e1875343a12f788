// The public API: validates on the host, then drives a backend's steps (backend.h) around one
// all-gather of the stats records.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend.h"
#include "comm/comm.h"
#include "core/dtype.h"

namespace xent {

const char* to_string(Backend b) {
  return b == Backend::cpu ? "cpu" : "cuda";
}
const char* to_string(DType d) {
  switch (d) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    default: return "f32";
  }
}
const char* to_string(Reduction r) {
  switch (r) {
    case Reduction::none: return "none";
    case Reduction::sum: return "sum";
    default: return "mean";
  }
}
const char* to_string(GradMode m) {
  switch (m) {
    case GradMode::deferred: return "deferred";
    case GradMode::none: return "none";
    default: return "fused";
  }
}
size_t dtype_size(DType d) {
  return d == DType::f32 ? 4 : 2;
}

size_t record_bytes(const Options& opt) {
  return core::RecordLayout::make(opt.label_smoothing > 0.0f, opt.compute_accuracy).bytes_per_row();
}

// ---------------------------------------------------------------------------------- Workspace

namespace {
constexpr size_t kAlign = 256;
constexpr size_t aligned(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}
// Where Workspace::partials (its counter first) starts: after the error slot and the scalars.
constexpr size_t kCounterOffset =
    aligned(2 * sizeof(int64_t)) + aligned(sizeof(float) * Workspace::kScalars);
}  // namespace

size_t Workspace::bytes_needed(int64_t rows, int fields, int ranks) {
  const size_t r = static_cast<size_t>(rows);
  const size_t record = aligned(sizeof(float) * fields * r);
  return aligned(2 * sizeof(int64_t)) + aligned(sizeof(float) * kScalars) +
         aligned(sizeof(unsigned long long) * (1 + 3 * kPartials)) +
         record * (ranks > 1 ? 1 + ranks : 1) + aligned(sizeof(float) * r);
}

Workspace::~Workspace() {
  if (base == nullptr) return;
  if (backend == Backend::cpu)
    std::free(base);
  else
    cudaFree(base);
}

void Workspace::prepare(int64_t rows, int fields, int ranks, cudaStream_t stream) {
  const size_t need = bytes_needed(rows, fields, ranks);
  if (need > capacity) {
    // Growth happens outside the hot path (Group::reserve sizes it up front).
    if (backend == Backend::cpu) {
      std::free(base);
      base = std::aligned_alloc(kAlign, aligned(need));
      if (base == nullptr)
        core::fail("cannot allocate " + std::to_string(need) + " bytes of workspace");
      std::memset(base, 0xff, 2 * sizeof(int64_t));  // error slot: -1, no bad target seen
    } else {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      comm::check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
      if (capture != cudaStreamCaptureStatusNone)
        core::fail("the group's workspace must grow from " + std::to_string(capacity) + " to " +
                   std::to_string(need) + " bytes (" + std::to_string(rows) +
                   " rows) while the stream is being captured into a CUDA graph, where memory "
                   "cannot be allocated: call Group::reserve(rows, options) with the largest rows "
                   "before capturing");
      if (base != nullptr) {  // kernels queued on the stream may still use it
        comm::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (workspace growth)");
        comm::check_cuda(cudaFree(base), "cudaFree (workspace)");
        base = nullptr;
        capacity = 0;
      }
      comm::check_cuda(cudaMalloc(&base, need), "cudaMalloc (workspace)");
      // On the stream: ordered before the kernels that read them, whatever the stream's kind.
      comm::check_cuda(cudaMemsetAsync(base, 0xff, 2 * sizeof(int64_t), stream),
                       "cudaMemsetAsync (error slot)");
      comm::check_cuda(cudaMemsetAsync(static_cast<char*>(base) + kCounterOffset, 0,
                                       sizeof(unsigned long long), stream),
                       "cudaMemsetAsync (finalize block counter)");
    }
    capacity = need;
  }
  // The error slot, the scalars and the finalize counter come first so that they stay put when
  // rows change.
  char* p = static_cast<char*>(base);
  error = reinterpret_cast<int64_t*>(p);
  p += aligned(2 * sizeof(int64_t));
  scalars = reinterpret_cast<float*>(p);
  p += aligned(sizeof(float) * kScalars);
  partials = reinterpret_cast<unsigned long long*>(p);
  p += aligned(sizeof(unsigned long long) * (1 + 3 * kPartials));
  const size_t record = aligned(sizeof(float) * fields * static_cast<size_t>(rows));
  send = reinterpret_cast<float*>(p);
  p += record;
  recv = ranks > 1 ? reinterpret_cast<float*>(p) : send;  // one rank gathers nothing
  if (ranks > 1) p += record * ranks;
  lse = reinterpret_cast<float*>(p);
}

// -------------------------------------------------------------------------------------- Group

namespace {

// Makes the group's device current for one call and restores the caller's after it, as NCCL's
// enqueue does: a call on another device's group neither launches nor allocates on the wrong one.
class DeviceScope {
 public:
  explicit DeviceScope(const Group& group) {
    if (group.backend() != Backend::cuda || group.device() < 0) return;
    comm::check_cuda(cudaGetDevice(&saved_), "cudaGetDevice");
    if (saved_ == group.device()) return;
    comm::check_cuda(cudaSetDevice(group.device()), "cudaSetDevice (the group's device)");
    switched_ = true;
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int saved_ = -1;
  bool switched_ = false;
};

}  // namespace

struct Group::Impl {
  std::shared_ptr<Communicator> comm;
  Workspace ws;
};

Group::Group(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {
Group make_group(std::shared_ptr<Communicator> comm) {
  auto impl = std::make_shared<Group::Impl>();
  impl->ws.backend = comm->backend();
  impl->ws.device = comm->device();
  impl->comm = std::move(comm);
  return Group(impl);
}
}  // namespace

Group Group::local(Backend backend, int device) {
  if (backend == Backend::cuda) {
    const int count = cuda::device_count();
    if (count == 0) core::fail("Group::local(cuda): no CUDA device is visible");
    if (device < 0) comm::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    if (device >= count)
      core::fail("Group::local(cuda, device = " + std::to_string(device) + "): only " +
                 std::to_string(count) + " CUDA device(s) are visible");
  }
  return make_group(comm::make_local(backend, device));
}
Group Group::adopt(ncclComm_t comm, int device) {
  return make_group(comm::make_nccl(comm, device, /*owned=*/false));
}
Group Group::own(ncclComm_t comm, int device) {
  return make_group(comm::make_nccl(comm, device, /*owned=*/true));
}
Group Group::custom(std::shared_ptr<Communicator> comm) {
  if (!comm) core::fail("Group::custom(comm = null): needs a communicator");
  return make_group(std::move(comm));
}

int Group::rank() const {
  return impl_->comm->rank();
}
int Group::size() const {
  return impl_->comm->size();
}
Backend Group::backend() const {
  return impl_->comm->backend();
}
int Group::device() const {
  return impl_->comm->device();
}
Communicator& Group::comm() const {
  return *impl_->comm;
}
Workspace& Group::workspace() const {
  return impl_->ws;
}

void Group::reserve(int64_t rows, const Options& opt) const {
  if (rows < 0) core::fail("reserve(rows = " + std::to_string(rows) + "): must be >= 0");
  const DeviceScope on_device(*this);
  const int fields = static_cast<int>(record_bytes(opt) / sizeof(float));
  if (backend() == Backend::cuda &&
      Workspace::bytes_needed(rows, fields, size()) > impl_->ws.capacity) {
    // Setup time, no stream given: the old buffer may be in use on any stream.
    comm::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (Group::reserve)");
    impl_->ws.prepare(rows, fields, size(), nullptr);
    comm::check_cuda(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize (Group::reserve)");
    return;
  }
  impl_->ws.prepare(rows, fields, size(), nullptr);
}

size_t Group::workspace_bytes() const {
  return impl_->ws.capacity;
}

void Group::check_errors(cudaStream_t stream) const {
  Workspace& ws = impl_->ws;
  if (backend() == Backend::cpu || ws.error == nullptr) return;
  const DeviceScope on_device(*this);
  int64_t bad[2];
  comm::check_cuda(cudaMemcpyAsync(bad, ws.error, sizeof bad, cudaMemcpyDeviceToHost, stream),
                   "cudaMemcpyAsync (check_errors)");
  comm::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (check_errors)");
  if (bad[0] < 0) return;
  // On the stream, so that the next call's kernels see the slot reset.
  comm::check_cuda(cudaMemsetAsync(ws.error, 0xff, sizeof bad, stream),
                   "cudaMemsetAsync (check_errors)");
  core::fail("targets[" + std::to_string(bad[0]) + "] = " + std::to_string(bad[1]) +
             ": must be in [0, vocab_size) or equal ignore_index (that row's loss is NaN)");
}

// ----------------------------------------------------------------------------- Layout checks

namespace {

// A small collective on host values, whatever the backend (setup and CPU calls only: it
// synchronises the device for CUDA groups).
void gather_on_host(const Group& group, const void* mine, void* all, size_t bytes) {
  Communicator& c = group.comm();
  if (c.backend() == Backend::cpu) {
    c.all_gather(mine, all, bytes, nullptr);
    return;
  }
  const DeviceScope on_device(group);
  void* dev = nullptr;
  const size_t total = bytes * c.size();
  comm::check_cuda(cudaMalloc(&dev, bytes + total), "cudaMalloc (layout check)");
  char* d = static_cast<char*>(dev);
  try {
    comm::check_cuda(cudaMemcpy(d, mine, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    c.all_gather(d, d + bytes, bytes, nullptr);
    comm::check_cuda(cudaMemcpy(all, d + bytes, total, cudaMemcpyDeviceToHost), "cudaMemcpy");
  } catch (...) {
    cudaFree(dev);
    throw;
  }
  cudaFree(dev);
}

void exchange_and_check(const Group& group, const core::LayoutHeader& mine, bool tiling) {
  std::vector<core::LayoutHeader> all(group.size());
  gather_on_host(group, &mine, all.data(), sizeof mine);
  core::check_headers(all.data(), group.size(), tiling);
}

}  // namespace

Shard plan_shard(const Group& group, int64_t width, int64_t vocab_size) {
  if (width < 1) core::fail("plan_shard(width = " + std::to_string(width) + "): must be >= 1");
  std::vector<int64_t> widths(group.size());
  gather_on_host(group, &width, widths.data(), sizeof width);
  Shard s;
  int64_t total = 0;
  for (int k = 0; k < group.size(); ++k) {
    if (k == group.rank()) s.start = total;
    total += widths[k];
  }
  s.width = width;
  s.vocab_size = vocab_size < 0 ? total : vocab_size;
  if (s.vocab_size < 1 || s.vocab_size > total)
    core::fail("plan_shard(vocab_size = " + std::to_string(vocab_size) + "): must be in [1, " +
               std::to_string(total) +
               "], the sum of the ranks' widths (columns past it are padding)");
  return s;
}

void apply(const Shard& shard, Options& opt) {
  opt.vocab_start = shard.start;
  opt.vocab_size = shard.vocab_size;
}

void check_layout(const Group& group, const Shard& mine, int64_t rows) {
  core::LayoutHeader h;
  h.rows = rows;
  h.vocab_start = mine.start;
  h.width = mine.width;
  h.vocab_size = mine.vocab_size;
  exchange_and_check(group, h, /*tiling=*/true);
}

// ------------------------------------------------------------------------- forward, backward

namespace {

void check_placement(const Group& group, const Options& opt, const void* ptr, const char* name) {
  if (ptr == nullptr || group.backend() == Backend::cpu || !opt.check_pointers) return;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();
    core::fail(std::string(name) + " is not a CUDA pointer, but the group's backend is cuda");
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    core::fail(std::string(name) + " is host memory, but the group's backend is cuda: pass " +
               "device memory (or use a CPU group)");
}

// XENT_CHECK_RANKS=1: the CUDA backend also exchanges and compares every call's header across
// ranks (layout, rows, options, dtype, targets), as the CPU backend always does. It copies the
// targets to the host and synchronises: a debugging aid, read once per process.
bool check_ranks_on_cuda() {
  static const bool on = [] {
    const char* e = std::getenv("XENT_CHECK_RANKS");
    return e != nullptr && e[0] == '1';
  }();
  return on;
}

int64_t first_bad_target(const core::Problem& p, TargetsView t, int64_t* value) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t y = core::load_target(t.data, t.type, r);
    if (y != p.ignore_index && !core::target_in_range(y, p.vocab_size)) {
      *value = y;
      return r;
    }
  }
  return -1;
}

}  // namespace

namespace {

// What forward checks of its outputs (host only).
void check_forward_outputs(const core::Problem& p, const Options& opt, LogitsView logits,
                           const Outputs& out) {
  core::check_outputs(p, opt, out);
  if (out.grad.data != nullptr) {
    if (opt.grad_mode != GradMode::fused)
      core::fail(std::string("outputs.grad is set with grad_mode = ") + to_string(opt.grad_mode) +
                 ": forward writes a gradient only with grad_mode = fused");
    core::check_grad(p, logits, out.grad);
  }
}

}  // namespace

void forward(const Group& group, LogitsView logits, TargetsView targets, const Options& opt,
             const Outputs& out, cudaStream_t stream) {
  // Checked before any work (and again, cheaply, where the outputs are taken).
  check_forward_outputs(core::make_problem(logits, targets, opt), opt, logits, out);
  forward(
      group, logits, targets, opt, [&out] { return out; }, stream);
}

void forward(const Group& group, LogitsView logits, TargetsView targets, const Options& opt,
             const std::function<Outputs()>& make_outputs, cudaStream_t stream) {
  const core::Problem p = core::make_problem(logits, targets, opt);
  const DeviceScope on_device(group);
  Workspace& ws = group.workspace();
  const int ranks = group.size();
  const size_t bytes = p.layout.bytes_per_row() * static_cast<size_t>(p.rows);
  ws.prepare(p.rows, p.layout.fields, ranks, stream);
  const auto take_outputs = [&] {
    const Outputs out = make_outputs();
    check_forward_outputs(p, opt, logits, out);
    return out;
  };

  // Every rank learns of every other rank's mistakes before any work, so all throw together.
  // One rank (nothing to exchange) obeys the same tiling rule: its shard is the whole vocabulary.
  core::LayoutHeader h = core::make_header(p, opt, logits.dtype);
  if (group.backend() == Backend::cpu) {
    const Outputs out = take_outputs();
    const LogitsView grad = out.grad.data != nullptr ? out.grad : logits;
    float* lse = out.lse ? out.lse : ws.lse;
    h.targets_hash = core::hash_targets(p, targets);
    h.bad_row = first_bad_target(p, targets, &h.bad_target);
    exchange_and_check(group, h, /*tiling=*/true);
    cpu::stats(p, logits, targets, ws.send);
    if (ranks > 1) group.comm().all_gather(ws.send, ws.recv, bytes, stream);
    cpu::finalize(p, targets, ws.recv, ranks, out, lse, ws.scalars);
    if (opt.grad_mode == GradMode::fused)
      cpu::gradient(p, logits, grad, targets, lse, ws.scalars, nullptr);
    return;
  }

  if (check_ranks_on_cuda()) {
    const size_t tbytes = static_cast<size_t>(p.rows) * (targets.type == IndexType::i32 ? 4 : 8);
    std::vector<char> host(tbytes);
    if (tbytes > 0)
      comm::check_cuda(cudaMemcpy(host.data(), targets.data, tbytes, cudaMemcpyDeviceToHost),
                       "cudaMemcpy (XENT_CHECK_RANKS targets)");
    const TargetsView on_host{host.data(), targets.type, targets.rows};
    h.targets_hash = core::hash_targets(p, on_host);
    h.bad_row = first_bad_target(p, on_host, &h.bad_target);
    exchange_and_check(group, h, /*tiling=*/true);
  } else if (ranks == 1) {
    core::check_headers(&h, 1, /*check_tiling=*/true);  // host only: no synchronisation
  }
  if (p.rows == 0) {  // nothing to gather (every rank has no rows); the reductions are 0
    const Outputs out = take_outputs();
    if (p.reduction != Reduction::none)
      comm::check_cuda(cudaMemsetAsync(out.loss, 0, sizeof(float), stream), "cudaMemsetAsync");
    if (out.accuracy)
      comm::check_cuda(cudaMemsetAsync(out.accuracy, 0, sizeof(float), stream), "cudaMemsetAsync");
    return;
  }
  check_placement(group, opt, logits.data, "logits.data");
  check_placement(group, opt, targets.data, "targets.data");
  cuda::stats(p, logits, targets, ws.send, ws.error, stream);
  if (ranks > 1) group.comm().all_gather(ws.send, ws.recv, bytes, stream);

  const Outputs out = take_outputs();
  check_placement(group, opt, out.loss, "outputs.loss");
  check_placement(group, opt, out.lse, "outputs.lse");
  check_placement(group, opt, out.grad.data, "outputs.grad.data");
  const LogitsView grad = out.grad.data != nullptr ? out.grad : logits;
  float* lse = out.lse ? out.lse : ws.lse;
  cuda::finalize(p, targets, ws.recv, ranks, out, lse, ws.scalars, ws.partials, stream);
  if (opt.grad_mode == GradMode::fused)
    cuda::gradient(p, logits, grad, targets, lse, ws.scalars, nullptr, stream);
}

void backward(const Group& group, LogitsView logits, TargetsView targets, const float* lse,
              const float* grad_output, const Options& opt, cudaStream_t stream) {
  if (opt.grad_mode != GradMode::fused) {  // deferred in place; none throws there
    backward(group, logits, logits, targets, lse, grad_output, opt, stream);
    return;
  }
  const core::Problem p = core::make_problem(logits, targets, opt);
  if (grad_output == nullptr || p.rows == 0) return;  // the gradient is already final
  const DeviceScope on_device(group);
  if (group.backend() == Backend::cpu)
    cpu::scale_rows(p, logits, grad_output);
  else
    cuda::scale_rows(p, logits, grad_output, stream);
}

void backward(const Group& group, LogitsView logits, LogitsView grad, TargetsView targets,
              const float* lse, const float* grad_output, const Options& opt, cudaStream_t stream) {
  const core::Problem p = core::make_problem(logits, targets, opt);
  if (opt.grad_mode == GradMode::none)
    core::fail("backward with grad_mode = none: forward computed no gradient");
  if (opt.grad_mode != GradMode::deferred)
    core::fail(std::string("backward(logits, grad, ...) with grad_mode = ") +
               to_string(opt.grad_mode) +
               ": the out-of-place backward needs grad_mode = deferred (a fused forward already "
               "wrote the gradient over the logits; use backward(logits, ...) for it)");
  core::check_grad(p, logits, grad);
  if (lse == nullptr && p.rows > 0)
    core::fail("backward(lse = null) with grad_mode = deferred: pass forward's Outputs::lse");
  const DeviceScope on_device(group);
  Workspace& ws = group.workspace();
  ws.prepare(p.rows, p.layout.fields, group.size(), stream);
  if (group.backend() == Backend::cpu) {
    cpu::count_valid(p, targets, ws.scalars);
    cpu::gradient(p, logits, grad, targets, lse, ws.scalars, grad_output);
  } else {
    if (p.rows > 0 && grad.data != logits.data) check_placement(group, opt, grad.data, "grad.data");
    cuda::count_valid(p, targets, ws.scalars, stream);
    cuda::gradient(p, logits, grad, targets, lse, ws.scalars, grad_output, stream);
  }
}

}  // namespace xent
