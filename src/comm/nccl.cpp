#include <nccl.h>

#include <string>

#include "comm/comm.h"
#include "error.h"

namespace xent::comm {

namespace {

// The CUDA backend's exchange: device buffers, one ncclAllGather on the caller's stream.
class Nccl final : public Communicator {
 public:
  Nccl(ncclComm_t comm, int device, bool owned) : comm_(comm), device_(device), owned_(owned) {
    check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
    check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
    if (device_ < 0) check_nccl(ncclCommCuDevice(comm_, &device_), "ncclCommCuDevice");
  }
  ~Nccl() override {
    if (owned_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::cuda; }
  int device() const override { return device_; }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    check_nccl(ncclAllGather(send, recv, bytes, ncclChar, comm_, stream), "ncclAllGather");
  }

 private:
  ncclComm_t comm_;
  int device_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl(ncclComm_t comm, int device, bool owned) {
  if (comm == nullptr)
    fail(std::string("Group::") + (owned ? "own" : "adopt") +
         "(comm = null): needs an initialised ncclComm_t");
  return std::make_shared<Nccl>(comm, device, owned);
}

}  // namespace xent::comm
