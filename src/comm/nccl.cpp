#include <nccl.h>

#include <cstdint>
#include <string>

#include "comm/comm.h"
#include "error.h"

namespace xent::comm {

namespace {

// The CUDA backend's exchange: device buffers, one ncclAllGather on the caller's stream; and peer
// memory for the device exchange where every rank is in this rank's NVLink domain: an NCCL
// symmetric window (NCCL 2.28 on, with symmetric memory: XENT_NCCL_WINDOWS), else CUDA IPC
// (ranks of one host).
class Nccl final : public Communicator {
 public:
  Nccl(ncclComm_t comm, int device, bool owned) : comm_(comm), device_(device), owned_(owned) {
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
    if (device_ < 0) check_nccl(ncclCommCuDevice(comm_, &device_), "ncclCommCuDevice");
    peer_memory_ = size_ <= PeerMemory::kMaxRanks;
#if defined(XENT_NCCL_WINDOWS)
    windows_ = peer_memory_ && lsa_size(comm_) == size_;
#endif
  }
  ~Nccl() override {
    release_window();
    ipc_.release(nullptr, 0);
    if (owned_) ncclCommDestroy(comm_);
  }
  int rank() const override {
    return rank_;
  }
  int size() const override {
    return size_;
  }
  Backend backend() const override {
    return Backend::cuda;
  }
  int device() const override {
    return device_;
  }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    check_nccl(ncclAllGather(send, recv, bytes, ncclChar, comm_, stream), "ncclAllGather");
  }
  // NCCL's sums reduce each element in one place and broadcast it (ring or tree alike), so every
  // rank gets the same bits, and a given communicator and size always sum in the same order.
  bool has_sums() const override {
    return true;
  }
  void all_reduce_sum(const float* send, float* recv, size_t count, cudaStream_t stream) override {
    check_nccl(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, comm_, stream),
               "ncclAllReduce");
  }
  void reduce_scatter_sum(const float* send, float* recv, size_t count,
                          cudaStream_t stream) override {
    check_nccl(ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, comm_, stream),
               "ncclReduceScatter");
  }
  bool has_peer_memory() const override {
    return peer_memory_;
  }

  // Collective. Growth: a new window, zeroed, where NCCL makes one; else CUDA IPC. Every rank
  // checks that it could make it and that it reads every other's part, and all agree (a minimum
  // over the ranks) before any uses it: null on every rank alike where none can be made (from
  // then on has_peer_memory is false).
  const PeerMemory* peer_memory(size_t bytes) override {
    if (!peer_memory_) return nullptr;
    if (current_ != nullptr && bytes <= current_->bytes) return current_;
    const HostAllGather gather = [this](const void* send, void* recv, size_t n) {
      host_all_gather(send, recv, n);
    };
    const PeerMemory* m = nullptr;
#if defined(XENT_NCCL_WINDOWS)
    if (windows_) m = grow_window(bytes, gather);
    windows_ = m != nullptr;
#endif
    if (m == nullptr) m = ipc_.grow(bytes, rank_, size_, gather);
    peer_memory_ = m != nullptr;
    current_ = m;
    return m;
  }

 private:
#if defined(XENT_NCCL_WINDOWS)
  const PeerMemory* grow_window(size_t bytes, const HostAllGather& gather) {
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (peer memory)");
    release_window();
    // NCCL may refuse a window (a communicator without symmetric memory support): the ranks then
    // agree to go without, rather than one of them throw. Each collective step is taken by all
    // ranks or none.
    int ok = min_over_ranks(gather, size_, has_symmetric_memory(comm_) ? 1 : 0);
    if (ok && ncclMemAlloc(&buf_, bytes) != ncclSuccess) {
      buf_ = nullptr;
      ok = 0;
    }
    ok = ok ? min_over_ranks(gather, size_, buf_ != nullptr ? 1 : 0) : 0;
    ncclWindow_t win = nullptr;
    ok = ok &&
         ncclCommWindowRegister(comm_, buf_, bytes, &win, NCCL_WIN_COLL_SYMMETRIC) == ncclSuccess;
    win_ = ok ? win : nullptr;
    PeerMemory m;
    if (ok) {
      check_cuda(cudaMemset(buf_, 0, bytes), "cudaMemset (peer memory)");
      lsa_pointers(win_, size_, m.peers);
      write_signature(buf_, rank_);
    }
    if (min_over_ranks(gather, size_, ok) == 1) ok = signatures_read_back(m, size_) ? 1 : 0;
    if (min_over_ranks(gather, size_, ok) == 0) {
      release_window();
      return nullptr;
    }
    m.bytes = bytes;
    window_ = m;
    return &window_;
  }
#endif

  // Host bytes through a device buffer and ncclAllGather. Synchronises the device.
  void host_all_gather(const void* send, void* recv, size_t bytes) {
    char* d = nullptr;
    const size_t total = bytes * static_cast<size_t>(size_);
    check_cuda(cudaMalloc(&d, total), "cudaMalloc (peer memory)");
    cudaError_t e =
        cudaMemcpy(d + bytes * static_cast<size_t>(rank_), send, bytes, cudaMemcpyHostToDevice);
    const ncclResult_t r = e == cudaSuccess ? ncclAllGather(d + bytes * static_cast<size_t>(rank_),
                                                            d, bytes, ncclChar, comm_, nullptr)
                                            : ncclSuccess;
    if (e == cudaSuccess && r == ncclSuccess)
      e = cudaMemcpy(recv, d, total, cudaMemcpyDeviceToHost);
    cudaFree(d);
    check_nccl(r, "ncclAllGather (peer memory)");
    check_cuda(e, "cudaMemcpy (peer memory)");
  }

  void release_window() {
#if defined(XENT_NCCL_WINDOWS)
    if (win_ != nullptr) ncclCommWindowDeregister(comm_, win_);
    if (buf_ != nullptr) ncclMemFree(buf_);
    win_ = nullptr;
#endif
    buf_ = nullptr;
    window_ = PeerMemory{};
  }

  ncclComm_t comm_;
  int device_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  bool peer_memory_ = false;  // false once neither a window nor CUDA IPC could be made
  bool windows_ = false;
  void* buf_ = nullptr;
#if defined(XENT_NCCL_WINDOWS)
  ncclWindow_t win_ = nullptr;
#endif
  PeerMemory window_;
  IpcPeerMemory ipc_;
  const PeerMemory* current_ = nullptr;  // window_ or ipc_'s
};

}  // namespace

std::shared_ptr<Communicator> make_nccl(ncclComm_t comm, int device, bool owned) {
  if (comm == nullptr)
    fail(std::string("Group::") + (owned ? "own" : "adopt") +
         "(comm = null): needs an initialised ncclComm_t");
  return std::make_shared<Nccl>(comm, device, owned);
}

}  // namespace xent::comm
