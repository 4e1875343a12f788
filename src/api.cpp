// The public API: validates on the host, then drives a backend's steps (backend.h) around one
// all-gather of the stats records.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend.h"
#include "core/dtype.h"
#include "device_scope.h"
#include "error.h"
#include "layout.h"

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

// ------------------------------------------------------------------------- forward, backward

namespace {

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

// The paths of forward on CUDA: statistics, exchange, gradient; each row read once on one rank
// (Options::single_pass); with Options::device_exchange (where the communicator has peer
// memory) the records exchanged device-side, in the single pass or after the statistics.
enum class Path { two_pass, single_pass, single_pass_exchange, two_pass_exchange };

Path path_of(const Group& group, const core::Problem& p, DType dtype, const Options& opt) {
  if (group.backend() != Backend::cuda) return Path::two_pass;
  const bool single =
      opt.single_pass && opt.grad_mode == GradMode::fused && cuda::single_pass_fits(p, dtype);
  // Whether a rank exchanges device-side depends on nothing of its own shard: ranks whose rows
  // do not fit the single pass publish theirs after the statistics, and still meet the others.
  if (exchanges_device_side(group, opt))
    return single ? Path::single_pass_exchange : Path::two_pass_exchange;
  return single && group.size() == 1 ? Path::single_pass : Path::two_pass;
}

}  // namespace

const char* forward_path(const Group& group, LogitsView logits, const Options& opt) {
  // The problem's checks need no data: a view with rows 0 plans the same columns.
  LogitsView shape = logits;
  shape.rows = 0;
  const core::Problem p = core::make_problem(shape, TargetsView{nullptr, IndexType::i64, 0}, opt);
  const DeviceScope on_device(group);  // the choice reads the device's compute capability
  switch (path_of(group, p, logits.dtype, opt)) {
    case Path::single_pass: return "single-pass";
    case Path::single_pass_exchange: return "single-pass, device exchange";
    case Path::two_pass_exchange: return "two-pass, device exchange";
    default: return "two-pass";
  }
}

namespace {

// What forward checks of its outputs (host only).
void check_forward_outputs(const core::Problem& p, const Options& opt, LogitsView logits,
                           const Outputs& out) {
  core::check_outputs(p, opt, out);
  if (out.grad.data != nullptr) {
    if (opt.grad_mode != GradMode::fused)
      fail(std::string("outputs.grad is set with grad_mode = ") + to_string(opt.grad_mode) +
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
  const CallRows call_rows(ws, opt.allocator, p.rows, p.layout.fields, ranks, stream);
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
    const size_t tbytes = static_cast<size_t>(p.rows) * core::target_size(targets.type);
    std::vector<char> host(tbytes);
    if (tbytes > 0)
      check_cuda(cudaMemcpy(host.data(), targets.data, tbytes, cudaMemcpyDeviceToHost),
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
      check_cuda(cudaMemsetAsync(out.loss, 0, sizeof(float), stream), "cudaMemsetAsync");
    if (out.accuracy)
      check_cuda(cudaMemsetAsync(out.accuracy, 0, sizeof(float), stream), "cudaMemsetAsync");
    return;
  }
  check_placement(group, opt, logits.data, "logits.data");
  check_placement(group, opt, targets.data, "targets.data");
  // Single pass: the reduction's scale first, and the outputs (the gradient's buffer among them)
  // before the one pass that writes them. Two passes: the statistics and their exchange first.
  Path path = path_of(group, p, logits.dtype, opt);
  const PeerMemory* peers = nullptr;
  if (path == Path::single_pass_exchange || path == Path::two_pass_exchange) {
    // Collective; null on every rank alike where the communicator could not make it.
    peers = group.comm().peer_memory(cuda::exchange_bytes(p.rows, ranks));
    if (peers == nullptr)
      path = path == Path::single_pass_exchange && ranks == 1 ? Path::single_pass : Path::two_pass;
    else if (peers->bytes < cuda::exchange_bytes(p.rows, ranks))
      fail("Options::device_exchange: the communicator gave " + std::to_string(peers->bytes) +
           " bytes of peer memory, " + std::to_string(cuda::exchange_bytes(p.rows, ranks)) +
           " needed");
  }
  const bool single = path == Path::single_pass || path == Path::single_pass_exchange;
  if (peers != nullptr) {
    cuda::count_valid(p, targets, ws.scalars, stream,
                      static_cast<uint32_t*>(peers->peers[group.rank()]));
  } else if (single) {
    cuda::count_valid(p, targets, ws.scalars, stream);
  }
  if (!single) {
    cuda::stats(p, logits, targets, ws.send, ws.error, stream);
    if (peers != nullptr)
      cuda::exchange_records(p, ws.send, *peers, group.rank(), ranks, ws.recv, stream);
    else if (ranks > 1)
      group.comm().all_gather(ws.send, ws.recv, bytes, stream);
  }
  const Outputs out = take_outputs();
  check_placement(group, opt, out.loss, "outputs.loss");
  check_placement(group, opt, out.lse, "outputs.lse");
  check_placement(group, opt, out.grad.data, "outputs.grad.data");
  const LogitsView grad = out.grad.data != nullptr ? out.grad : logits;
  float* lse = out.lse ? out.lse : ws.lse;
  if (path == Path::single_pass)
    cuda::single_pass(p, logits, grad, targets, ws.send, ws.error, ws.scalars, stream);
  else if (path == Path::single_pass_exchange)
    cuda::single_pass_exchange(p, logits, grad, targets, *peers, group.rank(), ranks, ws.recv,
                               ws.error, ws.scalars, stream);
  cuda::finalize(p, targets, ws.recv, ranks, out, lse, ws.scalars, ws.partials, stream);
  if (!single && opt.grad_mode == GradMode::fused)
    cuda::gradient(p, logits, grad, targets, lse, ws.scalars, nullptr, stream);
}

void backward(const Group& group, LogitsView logits, TargetsView targets, const float* lse,
              const float* grad_output, const Options& opt, cudaStream_t stream) {
  if (opt.grad_mode != GradMode::fused) {  // deferred in place; none throws there
    backward(group, logits, logits, targets, lse, grad_output, opt, stream);
    return;
  }
  const core::Problem p = core::make_problem(logits, targets, opt);
  // The gradient is already final: for grad_output = 1 (null) where grad_scale is 1.
  if (p.rows == 0 || (grad_output == nullptr && p.grad_scale == 1.0f)) return;
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
    fail("backward with grad_mode = none: forward computed no gradient");
  // Fused: `grad` holds forward's gradient (Outputs::grad, for grad_output = grad_scale) and the
  // logits are intact, so the rows that grad_output rescales are recomputed from them, rounded
  // once, rather than rescaled (which would round them twice).
  const bool fused = opt.grad_mode == GradMode::fused;
  if (fused && grad.data != nullptr && grad.data == logits.data)
    fail(
        "backward(logits, grad, ...) with grad_mode = fused and grad = logits: the fused "
        "out-of-place backward recomputes rows of forward's Outputs::grad from the intact "
        "logits; for a gradient that forward wrote over the logits use backward(logits, ...)");
  core::check_grad(p, logits, grad);
  if (lse == nullptr && p.rows > 0)
    fail(std::string("backward(lse = null) with grad_mode = ") + to_string(opt.grad_mode) +
         ": pass forward's Outputs::lse");
  // Forward's gradient is already final: for grad_output = 1 (null) where grad_scale is 1.
  if (fused && grad_output == nullptr && p.grad_scale == 1.0f) return;
  const GradRows rows = fused ? GradRows::rescaled : GradRows::all;
  const DeviceScope on_device(group);
  Workspace& ws = group.workspace();
  ws.prepare(0, p.layout.fields, group.size(), stream);  // the scalars alone
  if (group.backend() == Backend::cpu) {
    cpu::count_valid(p, targets, ws.scalars);
    cpu::gradient(p, logits, grad, targets, lse, ws.scalars, grad_output, rows);
  } else {
    if (p.rows > 0 && grad.data != logits.data) check_placement(group, opt, grad.data, "grad.data");
    cuda::count_valid(p, targets, ws.scalars, stream);
    cuda::gradient(p, logits, grad, targets, lse, ws.scalars, grad_output, stream, rows);
  }
}

}  // namespace xent
