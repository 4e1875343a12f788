// From a c10d ProcessGroup to an xent::Group, cached per (process group, device) so that the
// Group's workspace and the planned shard layout persist across calls.
//   CUDA tensors: the group's ProcessGroupNCCL communicator for that device, adopted (xent drives
//                 PyTorch's own ncclComm_t on the caller's stream; nothing is created twice).
//   CPU tensors:  the CPU backend, whose records travel by the group's own all-gather (Gloo...).
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/env.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <utility>
#include <vector>

#include "internal.h"
#include "xent/torch.h"

namespace xent::torch {
namespace {

// The CPU backend's exchange over a c10d group: host buffers wrapped as uint8 tensors, one
// ProcessGroup::allgather, waited for (the CPU backend is synchronous).
class C10dHost final : public Communicator {
 public:
  explicit C10dHost(c10d::ProcessGroup* pg) : pg_(pg), rank_(pg->getRank()), size_(pg->getSize()) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::cpu; }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t) override {
    const auto u8 = at::TensorOptions().dtype(at::kByte).device(at::kCPU);
    const int64_t n = static_cast<int64_t>(bytes);
    std::vector<at::Tensor> in{at::from_blob(const_cast<void*>(send), {n}, u8)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < size_; ++r)
      out[0].push_back(at::from_blob(static_cast<char*>(recv) + r * bytes, {n}, u8));
    pg_->allgather(out, in)->wait();
  }

 private:
  c10d::ProcessGroup* pg_;  // alive while the cache entry is (the entry watches it)
  int rank_, size_;
};

struct Entry {
  const c10d::ProcessGroup* key = nullptr;  // null: one rank, no process group
  c10::weak_intrusive_ptr<c10d::ProcessGroup> pg{c10::intrusive_ptr<c10d::ProcessGroup>()};
  c10::Device device{c10::kCPU};
  Group group;
  std::map<std::pair<int64_t, int64_t>, Shard> shards;  // (width, vocab_size argument) -> shard
  Entry(Group g) : group(std::move(g)) {}
};

std::mutex& cache_mutex() {
  static std::mutex* m = new std::mutex;  // never destroyed: no exit-order surprises
  return *m;
}
std::vector<std::unique_ptr<Entry>>& cache() {
  static auto* v = new std::vector<std::unique_ptr<Entry>>;
  return *v;
}

std::string describe(const c10d::ProcessGroup& pg) {
  std::string name;
  try {
    name = pg.getGroupName();
  } catch (const c10::Error&) {  // a group without backends has no name
  }
  return "process group '" + (name.empty() ? std::string("?") : name) + "' (" +
         pg.getBackendName() + ", rank " + std::to_string(pg.getRank()) + " of " +
         std::to_string(pg.getSize()) + ")";
}

bool has_backend_for(const c10d::ProcessGroup& pg, c10::DeviceType type) {
  for (const c10::Device& d : pg.getDeviceTypes())
    if (d.type() == type) return true;
  return false;
}

Group make_nccl(c10d::ProcessGroup& pg, c10::Device device) {
  XENT_CHECK(has_backend_for(pg, c10::DeviceType::CUDA), "logits are on ", device, " but ",
             describe(pg),
             " has no backend for CUDA tensors: CUDA logits need an NCCL group "
             "(backend \"nccl\" or \"cpu:gloo,cuda:nccl\")");
  c10::intrusive_ptr<c10d::Backend> backend = pg.getBackend(c10::DeviceType::CUDA);
  auto* nccl = dynamic_cast<c10d::ProcessGroupNCCL*>(backend.get());
  XENT_CHECK(nccl != nullptr || backend->getBackendName() != "nccl", "the CUDA backend of ",
             describe(pg),
             " is an NCCL backend wrapped in another class (TORCH_DISTRIBUTED_DEBUG=DETAIL?), "
             "whose communicator xent cannot reach: unset TORCH_DISTRIBUTED_DEBUG or set it to "
             "INFO");
  XENT_CHECK(nccl != nullptr, "logits are on ", device, " but the CUDA backend of ", describe(pg),
             " is ", backend->getBackendName(),
             ", not nccl: CUDA logits need an NCCL group (CPU logits work with any group)");
  // A non-blocking communicator returns ncclInProgress from collectives, which xent's NCCL
  // communicator treats as an error: refuse it here, clearly.
  const std::optional<bool> nonblocking_env =
      c10::utils::check_env("TORCH_NCCL_USE_COMM_NONBLOCKING");
  const int blocking = nccl->getOptions()->config.blocking;
  XENT_CHECK(
      blocking != 0 && !(blocking == NCCL_CONFIG_UNDEF_INT && nonblocking_env.value_or(false)),
      describe(pg),
      " uses a non-blocking NCCL communicator (TORCH_NCCL_USE_COMM_NONBLOCKING=1 or "
      "config.blocking = 0), which xent does not support");
  const std::optional<at::Device> bound = pg.getBoundDeviceId();
  XENT_CHECK(!bound || bound->index() == device.index(), "logits are on ", device, " but ",
             describe(pg), " is bound to ", *bound, ": put the logits on the group's device");
  const c10::cuda::CUDAGuard guard(device);
  // getCommPtr looks up the communicator of the current device; ProcessGroupNCCL creates it on
  // its first collective there, so make it now if needed (collective: every rank gets here).
  int64_t comm = nccl->getCommPtr();
  if (comm == 0) {
    nccl->eagerConnectSingleDevice(device);
    comm = nccl->getCommPtr();
  }
  XENT_CHECK(comm != 0, describe(pg), " has no NCCL communicator for ", device,
             " even after connecting it");
  Group g = detail::core_call(
      [&] { return Group::adopt(reinterpret_cast<ncclComm_t>(comm), device.index()); });
  XENT_CHECK(g.size() == pg.getSize() && g.rank() == pg.getRank(), "the NCCL communicator of ",
             describe(pg), " has rank ", g.rank(), " of ", g.size());
  return g;
}

Group make_host(c10d::ProcessGroup& pg) {
  XENT_CHECK(has_backend_for(pg, c10::DeviceType::CPU), "logits are on cpu but ", describe(pg),
             " has no backend for CPU tensors: CPU logits need a group with one, e.g. gloo "
             "(\"gloo\" or \"cpu:gloo,cuda:nccl\")");
  return Group::custom(std::make_shared<C10dHost>(&pg));
}

// The cache entry for (pg, device), created on first use. Caller holds the mutex.
Entry& entry_for(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, c10::Device device) {
  XENT_CHECK(device.is_cpu() || device.is_cuda(), "logits must be on a CPU or CUDA device, got ",
             device);
  if (device.is_cuda() && !device.has_index())
    device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  if (device.is_cpu()) device = c10::Device(c10::kCPU);
  auto& entries = cache();
  // Forget the groups of process groups that are gone (their communicators may be too).
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [](const std::unique_ptr<Entry>& e) {
                                 return e->key != nullptr && e->pg.expired();
                               }),
                entries.end());
  for (auto& e : entries)
    if (e->key == pg.get() && e->device == device) return *e;

  std::unique_ptr<Entry> e;
  if (!pg) {
    e = std::make_unique<Entry>(detail::core_call([&] {
      return device.is_cuda() ? Group::local(Backend::cuda, device.index())
                              : Group::local(Backend::cpu);
    }));
  } else {
    e = std::make_unique<Entry>(device.is_cuda() ? make_nccl(*pg, device) : make_host(*pg));
    e->pg = c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg);
  }
  e->key = pg.get();
  e->device = device;
  entries.push_back(std::move(e));
  return *entries.back();
}

}  // namespace

Group group_for(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device) {
  std::lock_guard<std::mutex> lock(cache_mutex());
  return entry_for(group, device).group;
}

Options core_options(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device,
                     int64_t cols, const CrossEntropyOptions& o) {
  return detail::setup(group, device, cols, o).opt;
}

namespace detail {

namespace {

// Scratch from PyTorch's CUDA caching allocator, on the call's stream: torch.cuda.
// max_memory_allocated counts it, CUDA graph capture takes it from the graph's pool, and it goes
// back to the cache when the call ends.
class CachingAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, cudaStream_t stream) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
  }
  void release(void* p, size_t, cudaStream_t) override {
    c10::cuda::CUDACachingAllocator::raw_delete(p);
  }
};

}  // namespace

Allocator* caching_allocator() {
  static CachingAllocator caching;
  return &caching;
}

Setup setup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device, int64_t cols,
            const CrossEntropyOptions& o) {
  Options opt;
  // CUDA tensors: the per-row scratch from PyTorch's allocator, as the fused lm head's
  if (device.is_cuda()) opt.allocator = caching_allocator();
  opt.ignore_index = o.ignore_index;
  opt.label_smoothing = static_cast<float>(o.label_smoothing);
  opt.z_loss = static_cast<float>(o.z_loss);
  opt.softcap = static_cast<float>(o.softcap);
  opt.reduction = o.reduction;
  opt.grad_mode = o.grad_mode;
  // Only a gradient computed ahead of grad_output takes it (the callers refuse it otherwise);
  // a forward without a gradient has nothing to scale.
  opt.grad_scale = o.grad_mode == GradMode::fused ? static_cast<float>(o.grad_scale) : 1.0f;
  opt.compute_accuracy = o.compute_accuracy;
  XENT_CHECK(o.vocab_start >= -1, "vocab_start = ", o.vocab_start,
             ": must be >= 0, or -1 to plan the layout from all ranks' widths");
  XENT_CHECK(o.vocab_size >= -1 && o.vocab_size != 0, "vocab_size = ", o.vocab_size,
             ": must be >= 1, or -1 for the sum of all ranks' widths");

  std::lock_guard<std::mutex> lock(cache_mutex());
  Entry& e = entry_for(group, device);
  if (o.vocab_start >= 0) {
    XENT_CHECK(o.vocab_size > 0 || e.group.size() == 1,
               "vocab_size = -1 with vocab_start = ", o.vocab_start, " on a group of ",
               e.group.size(),
               " ranks: pass the real vocabulary size too, or vocab_start = -1 to plan the "
               "layout from all ranks' widths");
    opt.vocab_start = o.vocab_start;
    opt.vocab_size = o.vocab_size;
    return {e.group, opt};
  }
  if (e.group.size() == 1) {  // nothing to plan: the only rank owns every column
    XENT_CHECK(o.vocab_size <= cols, "vocab_size = ", o.vocab_size, ": must be in [1, ", cols,
               "], the columns of the only rank (columns past it are padding)");
    opt.vocab_start = 0;
    opt.vocab_size = o.vocab_size;
    return {e.group, opt};
  }
  // Planned once per (width, vocab_size) and cached on each rank, so that later calls need no
  // collective. Hence the contract: every rank switches layouts together (a model's vocabulary
  // split is fixed; pass vocab_start and vocab_size for anything else).
  const auto key = std::make_pair(cols, o.vocab_size);
  auto it = e.shards.find(key);
  if (it == e.shards.end()) {
    // Collective (every rank calls with its own width), once per (group, width, vocab_size).
    const Shard s = detail::core_call([&] { return plan_shard(e.group, cols, o.vocab_size); });
    it = e.shards.emplace(key, s).first;
  }
  apply(it->second, opt);
  return {e.group, opt};
}

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name) {
  if (name.empty()) return {};
  return c10d::resolve_process_group(name);
}

std::string name_of(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group) return "";
  const auto resolves_to_it = [&](const std::string& name) {
    try {
      return c10d::resolve_process_group(name).get() == group.get();
    } catch (const c10::Error&) {  // not registered, or its group is gone
      return false;
    }
  };
  std::string name;
  try {
    name = group->getGroupName();
  } catch (const c10::Error&) {  // a group without backends has no name
  }
  if (!name.empty() && resolves_to_it(name)) return name;
  // A group made in C++ and never registered: register it under a name of xent's own (the
  // registry holds it weakly), so that the operators can find it.
  char own[64];
  std::snprintf(own, sizeof own, "xent_unregistered_%p", static_cast<void*>(group.get()));
  if (resolves_to_it(own)) return own;
  try {
    c10d::unregister_process_group(own);  // a dead group that lived at the same address
  } catch (const c10::Error&) {
  }
  c10d::register_process_group(own, group);
  return own;
}

}  // namespace detail

Reduction parse_reduction(const std::string& name) {
  if (name == "mean") return Reduction::mean;
  if (name == "sum") return Reduction::sum;
  if (name == "none") return Reduction::none;
  XENT_CHECK(false, "reduction = \"", name, "\": must be \"mean\", \"sum\" or \"none\"");
}

GradMode parse_grad_mode(const std::string& name) {
  if (name == "fused") return GradMode::fused;
  if (name == "deferred") return GradMode::deferred;
  if (name == "none") return GradMode::none;
  XENT_CHECK(false, "grad_mode = \"", name, "\": must be \"fused\", \"deferred\" or \"none\"");
}

}  // namespace xent::torch
