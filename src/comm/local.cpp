#include <cstring>

#include "comm/comm.h"
#include "error.h"

namespace xent::comm {
namespace {

// One rank: the gather is a copy (callers skip even that when they can); peer memory is plain
// device memory (the device exchange with itself: Options::device_exchange on one rank).
class Local final : public Communicator {
 public:
  Local(Backend backend, int device) : backend_(backend), device_(device) {}
  ~Local() override {
    if (peers_.peers[0] != nullptr) cudaFree(peers_.peers[0]);
  }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Backend backend() const override { return backend_; }
  int device() const override { return device_; }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    if (bytes == 0 || send == recv) return;
    if (backend_ == Backend::cpu)
      std::memcpy(recv, send, bytes);
    else
      check_cuda(cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (local all_gather)");
  }
  bool has_peer_memory() const override { return backend_ == Backend::cuda; }
  const PeerMemory* peer_memory(size_t bytes) override {
    if (backend_ != Backend::cuda) return nullptr;
    if (bytes <= peers_.bytes) return &peers_;
    // Growth: the old buffer may still be in use by queued kernels.
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (peer memory)");
    if (peers_.peers[0] != nullptr) check_cuda(cudaFree(peers_.peers[0]), "cudaFree (peer memory)");
    peers_ = PeerMemory{};
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), "cudaMalloc (peer memory)");
    check_cuda(cudaMemset(p, 0, bytes), "cudaMemset (peer memory)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (peer memory)");
    peers_.peers[0] = p;
    peers_.bytes = bytes;
    return &peers_;
  }

 private:
  Backend backend_;
  int device_;
  PeerMemory peers_;
};

}  // namespace

std::shared_ptr<Communicator> make_local(Backend backend, int device) {
  return std::make_shared<Local>(backend, device);
}

}  // namespace xent::comm
