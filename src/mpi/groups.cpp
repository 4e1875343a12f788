// xent/mpi.h: the CPU backend's exchange over MPI, NCCL bootstrapped over MPI, and the CUDA
// backend over MPI without NCCL. Built into libxent_mpi (xent::mpi) so that the core needs no MPI.
#include <cuda_runtime.h>

#include <climits>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "error.h"
#include "xent/mpi.h"

namespace xent::mpi {
namespace {

void require_init(const char* who) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) fail(std::string(who) + " needs MPI_Init to be called first");
}

void all_gather_bytes(MPI_Comm comm, const void* send, void* recv, size_t bytes) {
  if (bytes > static_cast<size_t>(INT_MAX))
    fail("all_gather of " + std::to_string(bytes) +
         " bytes per rank: MPI counts must stay below 2^31 bytes");
  const int n = static_cast<int>(bytes);
  const int rc = MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm);
  if (rc != MPI_SUCCESS) fail("MPI_Allgather failed with code " + std::to_string(rc));
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
    all_gather_bytes(comm_, send, recv, bytes);
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

// The CUDA backend without NCCL: device buffers staged through host memory for MPI_Allgather
// (the stream synchronised), and peer memory through CUDA IPC.
class MpiCuda final : public Communicator {
 public:
  MpiCuda(MPI_Comm comm, int device) : comm_(comm), device_(device) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    peer_memory_ = size_ <= PeerMemory::kMaxRanks;
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::cuda; }
  int device() const override { return device_; }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    send_.resize(bytes);
    recv_.resize(bytes * static_cast<size_t>(size_));
    check_cuda(cudaMemcpyAsync(send_.data(), send, bytes, cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync (MPI all_gather)");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (MPI all_gather)");
    all_gather_bytes(comm_, send_.data(), recv_.data(), bytes);
    check_cuda(cudaMemcpyAsync(recv, recv_.data(), recv_.size(), cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync (MPI all_gather)");
    // The host staging buffer is reused by the next call: the copy out of it must be done.
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (MPI all_gather)");
  }
  bool has_peer_memory() const override { return peer_memory_; }
  const PeerMemory* peer_memory(size_t bytes) override {
    if (!peer_memory_) return nullptr;
    const PeerMemory* m = ipc_.grow(bytes, rank_, size_, [this](const void* s, void* r, size_t n) {
      all_gather_bytes(comm_, s, r, n);
    });
    peer_memory_ = m != nullptr;
    return m;
  }

 private:
  MPI_Comm comm_;
  int device_;
  int rank_ = 0, size_ = 1;
  std::vector<char> send_, recv_;
  bool peer_memory_ = false;  // false once CUDA IPC could not be made
  comm::IpcPeerMemory ipc_;
};

// device -1: the local rank (MPI_COMM_TYPE_SHARED) modulo the visible GPU count. Made current.
int pick_device(MPI_Comm comm, int device, const char* who) {
  if (device < 0) {
    int rank = 0;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm node;
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    int local_rank = 0;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    int count = 0;
    check_cuda(cudaGetDeviceCount(&count),
               (std::string("cudaGetDeviceCount (") + who + ")").c_str());
    device = local_rank % count;
  }
  check_cuda(cudaSetDevice(device), (std::string("cudaSetDevice (") + who + ")").c_str());
  return device;
}

// NCCL needs one GPU per rank: ranks of one host that would share a device are refused on every
// rank before ncclCommInitRank, which fails with a bare "invalid usage" on some of them and can
// leave the others waiting. Collective over `comm`.
void check_one_gpu_per_rank(MPI_Comm comm, int device) {
  constexpr int kBusId = 32;
  char bus[kBusId] = {};
  check_cuda(cudaDeviceGetPCIBusId(bus, kBusId, device),
             "cudaDeviceGetPCIBusId (xent::mpi::nccl_group)");
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int local = 0, locals = 1;
  MPI_Comm_rank(node, &local);
  MPI_Comm_size(node, &locals);
  std::vector<char> all(static_cast<size_t>(kBusId) * locals);
  MPI_Allgather(bus, kBusId, MPI_BYTE, all.data(), kBusId, MPI_BYTE, node);
  MPI_Comm_free(&node);
  int other = -1;
  for (int k = 0; k < locals && other < 0; ++k)
    if (k != local && std::strncmp(all.data() + static_cast<size_t>(k) * kBusId, bus, kBusId) == 0)
      other = k;
  int mine = other >= 0 ? 1 : 0, any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm);
  const std::string rule =
      ": NCCL needs one GPU per rank (run at most as many ranks per host as it has GPUs, or give "
      "each rank its own device); for ranks that share a GPU use xent::mpi::cuda_group";
  if (mine)
    fail("xent::mpi::nccl_group: local ranks " + std::to_string(local) + " and " +
         std::to_string(other) + " of this host both use GPU " + bus + " (device " +
         std::to_string(device) + ")" + rule);
  if (any) fail("xent::mpi::nccl_group: ranks of another host share a GPU" + rule);
}

// nccl_group on `device`, already current.
Group nccl_group_on(MPI_Comm comm, int device, int rank, int size) {
  check_one_gpu_per_rank(comm, device);

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
  // A refused call leaves the caller's device current (the caller's buffers live there).
  // (Without a GPU there is none to restore: pick_device reports that.)
  int caller = 0;
  const bool restore = cudaGetDevice(&caller) == cudaSuccess;
  if (!restore) cudaGetLastError();
  try {
    return nccl_group_on(comm, pick_device(comm, device, "xent::mpi::nccl_group"), rank, size);
  } catch (...) {
    if (restore) cudaSetDevice(caller);
    throw;
  }
}

Group cuda_group(MPI_Comm comm, int device) {
  require_init("xent::mpi::cuda_group");
  device = pick_device(comm, device, "xent::mpi::cuda_group");
  return Group::custom(std::make_shared<MpiCuda>(comm, device));
}

}  // namespace xent::mpi
