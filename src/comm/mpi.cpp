#include <climits>
#include <string>

#include "comm/comm.h"

namespace xent::comm {
namespace {

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
      throw Error("xent: all_gather of " + std::to_string(bytes) +
                  " bytes per rank: MPI counts must stay below 2^31 bytes");
    const int n = static_cast<int>(bytes);
    const int rc = MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_);
    if (rc != MPI_SUCCESS)
      throw Error("xent: MPI_Allgather failed with code " + std::to_string(rc));
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi(MPI_Comm comm) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw Error("xent: Group::host needs MPI_Init to have been called first");
  return std::make_shared<Mpi>(comm);
}

}  // namespace xent::comm
