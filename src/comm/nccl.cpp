#include <nccl.h>

#include <string>

#include "comm/comm.h"

namespace xent::comm {
namespace {

void check_nccl(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess)
    throw Error(std::string("xent: ") + what + " failed: " + ncclGetErrorString(rc));
}

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

std::shared_ptr<Communicator> make_nccl_from_mpi(MPI_Comm comm, int device) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw Error("xent: Group::from_mpi needs MPI_Init to have been called first");
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (device < 0) {
    MPI_Comm node;
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    int local_rank = 0;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    int count = 0;
    check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount (Group::from_mpi)");
    device = local_rank % count;
  }
  check_cuda(cudaSetDevice(device), "cudaSetDevice (Group::from_mpi)");

  // Rank 0 makes the id and broadcasts it with its status, so that a failure there reaches
  // every rank instead of leaving them waiting in ncclCommInitRank.
  struct {
    int status;
    ncclUniqueId id;
  } boot{};
  if (rank == 0) boot.status = ncclGetUniqueId(&boot.id);
  MPI_Bcast(&boot, sizeof boot, MPI_BYTE, 0, comm);
  check_nccl(static_cast<ncclResult_t>(boot.status), "ncclGetUniqueId (on rank 0)");
  ncclComm_t nccl = nullptr;
  check_nccl(ncclCommInitRank(&nccl, size, boot.id, rank), "ncclCommInitRank");
  return std::make_shared<Nccl>(nccl, device, /*owned=*/true);
}

std::shared_ptr<Communicator> make_nccl_adopted(ncclComm_t comm, int device) {
  if (comm == nullptr)
    throw Error("xent: Group::adopt(comm = null): needs an initialised ncclComm_t");
  return std::make_shared<Nccl>(comm, device, /*owned=*/false);
}

}  // namespace xent::comm
