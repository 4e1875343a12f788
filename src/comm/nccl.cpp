#include <nccl.h>

#include <cstdint>
#include <string>

#include "comm/comm.h"
#include "error.h"

namespace xent::comm {

namespace {

// The CUDA backend's exchange: device buffers, one ncclAllGather on the caller's stream; and peer
// memory as an NCCL symmetric window (NCCL 2.28 on: XENT_NCCL_WINDOWS) where every rank is in
// this rank's NVLink domain.
class Nccl final : public Communicator {
 public:
  Nccl(ncclComm_t comm, int device, bool owned) : comm_(comm), device_(device), owned_(owned) {
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
    if (device_ < 0) check_nccl(ncclCommCuDevice(comm_, &device_), "ncclCommCuDevice");
#if defined(XENT_NCCL_WINDOWS)
    windows_ = size_ <= PeerMemory::kMaxRanks && lsa_size(comm_) == size_;
#endif
  }
  ~Nccl() override {
    release();
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
  bool has_peer_memory() const override {
    return windows_;
  }

  // Collective. Growth: a new window, zeroed; every rank checks that it could make it and that
  // it reads every other's part, and all agree (a minimum over the ranks) before any uses it:
  // null on every rank alike where one cannot (from then on has_peer_memory is false).
  const PeerMemory* peer_memory(size_t bytes) override {
    if (!windows_) return nullptr;
    if (bytes <= peers_.bytes) return &peers_;
#if defined(XENT_NCCL_WINDOWS)
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (peer memory)");
    release();
    // NCCL may refuse a window (a communicator without symmetric memory support): the ranks then
    // agree to go without, rather than one of them throw. Each collective step is taken by all
    // ranks or none.
    int ok = min_over_ranks(has_symmetric_memory(comm_) ? 1 : 0);
    if (ok && ncclMemAlloc(&buf_, bytes) != ncclSuccess) {
      buf_ = nullptr;
      ok = 0;
    }
    ok = ok ? min_over_ranks(buf_ != nullptr ? 1 : 0) : 0;
    ncclWindow_t win = nullptr;
    ok = ok &&
         ncclCommWindowRegister(comm_, buf_, bytes, &win, NCCL_WIN_COLL_SYMMETRIC) == ncclSuccess;
    win_ = ok ? win : nullptr;
    PeerMemory m;
    if (ok) {
      check_cuda(cudaMemset(buf_, 0, bytes), "cudaMemset (peer memory)");
      lsa_pointers(win_, size_, m.peers);
      // Word 1 of each part (the exchange leaves it alone) holds its rank's signature.
      const uint32_t mine = kSignature + static_cast<uint32_t>(rank_);
      check_cuda(
          cudaMemcpy(static_cast<uint32_t*>(buf_) + 1, &mine, sizeof mine, cudaMemcpyHostToDevice),
          "cudaMemcpy (peer memory)");
    }
    if (min_over_ranks(ok) == 1) {  // every window made, every signature written
      PeerWords w{};
      for (int k = 0; k < size_; ++k) w.at[k] = static_cast<const uint32_t*>(m.peers[k]) + 1;
      uint32_t seen[PeerMemory::kMaxRanks] = {};
      read_words(w, size_, seen);
      for (int k = 0; k < size_; ++k) ok &= seen[k] == kSignature + static_cast<uint32_t>(k);
    }
    if (min_over_ranks(ok) == 0) {
      windows_ = false;
      release();
      return nullptr;
    }
    m.bytes = bytes;
    peers_ = m;
    return &peers_;
#else
    (void)bytes;
    return nullptr;
#endif
  }

 private:
  static constexpr uint32_t kSignature = 0x7e400000u;

  // The minimum of v over the ranks (also a barrier). Synchronises the device.
  int min_over_ranks(int v) {
    int* d = nullptr;
    check_cuda(cudaMalloc(&d, sizeof v), "cudaMalloc (peer memory)");
    check_cuda(cudaMemcpy(d, &v, sizeof v, cudaMemcpyHostToDevice), "cudaMemcpy (peer memory)");
    const ncclResult_t r = ncclAllReduce(d, d, 1, ncclInt, ncclMin, comm_, nullptr);
    const cudaError_t e =
        r == ncclSuccess ? cudaMemcpy(&v, d, sizeof v, cudaMemcpyDeviceToHost) : cudaSuccess;
    cudaFree(d);
    check_nccl(r, "ncclAllReduce (peer memory)");
    check_cuda(e, "cudaMemcpy (peer memory)");
    return v;
  }

  void release() {
#if defined(XENT_NCCL_WINDOWS)
    if (win_ != nullptr) ncclCommWindowDeregister(comm_, win_);
    if (buf_ != nullptr) ncclMemFree(buf_);
    win_ = nullptr;
#endif
    buf_ = nullptr;
    peers_ = PeerMemory{};
  }

  ncclComm_t comm_;
  int device_;
  bool owned_;
  int rank_ = 0, size_ = 1;
  bool windows_ = false;
  void* buf_ = nullptr;
#if defined(XENT_NCCL_WINDOWS)
  ncclWindow_t win_ = nullptr;
#endif
  PeerMemory peers_;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl(ncclComm_t comm, int device, bool owned) {
  if (comm == nullptr)
    fail(std::string("Group::") + (owned ? "own" : "adopt") +
         "(comm = null): needs an initialised ncclComm_t");
  return std::make_shared<Nccl>(comm, device, owned);
}

}  // namespace xent::comm
