// xent/mpi.h: the CPU backend's exchange over MPI, and NCCL bootstrapped over MPI. Built into
// libxent_mpi (xent::mpi) so that the core needs no MPI.
#include <climits>
#include <memory>
#include <string>

#include "error.h"
#include "xent/mpi.h"

namespace xent::mpi {
namespace {

void require_init(const char* who) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) fail(std::string(who) + " needs MPI_Init to be called first");
}

// The CPU backend's exchange: host buffers, MPI_Allgather (blocking; the stream is unused).
class Mpi final : public Communicator {
 public:
  explicit Mpi(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::cpu; }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t) override {
    if (bytes > static_cast<size_t>(INT_MAX))
      fail("all_gather of " + std::to_string(bytes) +
           " bytes per rank: MPI counts must stay below 2^31 bytes");
    const int n = static_cast<int>(bytes);
    const int rc = MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_);
    if (rc != MPI_SUCCESS) fail("MPI_Allgather failed with code " + std::to_string(rc));
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

Group host_group(MPI_Comm comm) {
  require_init("xent::mpi::host_group");
  return Group::custom(std::make_shared<Mpi>(comm));
}

Group nccl_group(MPI_Comm comm, int device) {
  require_init("xent::mpi::nccl_group");
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
    check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount (xent::mpi::nccl_group)");
    device = local_rank % count;
  }
  check_cuda(cudaSetDevice(device), "cudaSetDevice (xent::mpi::nccl_group)");

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
  return Group::own(nccl, device);
}

}  // namespace xent::mpi
