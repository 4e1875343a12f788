// Group: a communicator and its workspace; the factories, reserve and check_errors.
#include <memory>
#include <string>
#include <utility>

#include "backend.h"
#include "comm/comm.h"
#include "device_scope.h"
#include "error.h"

namespace xent {

struct Group::Impl {
  std::shared_ptr<Communicator> comm;
  Workspace ws;
};

Group::Group(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {
Group make_group(std::shared_ptr<Communicator> comm) {
  // A device that the kernels cannot run on is refused here, before any call.
  if (comm->backend() == Backend::cuda && comm->device() >= 0) cuda::check_device(comm->device());
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
    if (count == 0) fail("Group::local(cuda): no CUDA device is visible");
    if (device < 0) check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    if (device >= count)
      fail("Group::local(cuda, device = " + std::to_string(device) + "): only " +
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
  if (!comm) fail("Group::custom(comm = null): needs a communicator");
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

bool exchanges_device_side(const Group& group, const Options& opt) {
  return opt.device_exchange && group.backend() == Backend::cuda &&
         group.size() <= PeerMemory::kMaxRanks && group.comm().has_peer_memory();
}

void Group::reserve(int64_t rows, const Options& opt) const {
  if (rows < 0) fail("reserve(rows = " + std::to_string(rows) + "): must be >= 0");
  const DeviceScope on_device(*this);
  const int fields = static_cast<int>(record_bytes(opt) / sizeof(float));
  // Collective where it allocates: every rank reserves alike.
  if (exchanges_device_side(*this, opt)) comm().peer_memory(cuda::exchange_bytes(rows, size()));
  if (backend() == Backend::cuda &&
      Workspace::bytes_needed(rows, fields, size()) > impl_->ws.capacity) {
    // Setup time, no stream given: the old buffer may be in use on any stream.
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (Group::reserve)");
    impl_->ws.prepare(rows, fields, size(), nullptr);
    check_cuda(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize (Group::reserve)");
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
  check_cuda(cudaMemcpyAsync(bad, ws.error, sizeof bad, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync (check_errors)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (check_errors)");
  if (bad[0] < 0) return;
  // On the stream, so that the next call's kernels see the slot reset.
  check_cuda(cudaMemsetAsync(ws.error, 0xff, sizeof bad, stream), "cudaMemsetAsync (check_errors)");
  fail("targets[" + std::to_string(bad[0]) + "] = " + std::to_string(bad[1]) +
       ": must be in [0, vocab_size) or equal ignore_index (that row's loss is NaN)");
}

}  // namespace xent
