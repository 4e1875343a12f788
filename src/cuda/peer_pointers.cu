// What the host needs to read of peer memory on the device: the addresses of every rank's part of
// an NCCL symmetric window, as this process maps them (NCCL 2.28's device API computes them on the
// device only), and the words that prove every rank's part can be read. One small kernel each,
// when peer memory is made, so that the exchange's kernels take plain pointers (PeerMemory) and
// need no NCCL header.
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "comm/comm.h"
#include "cuda/exchange.cuh"
#include "error.h"

#if defined(XENT_NCCL_WINDOWS)
#include <nccl_device.h>
#endif

namespace xent::comm {
namespace {

constexpr uint32_t kSignature = 0x7e400000u;
constexpr int kSignatureWord = cuda::detail::PeerExchange::kSignatureWord;

// n values of type T that `kernel` (one block of 32 threads, given a device array of n) writes,
// copied back into out; `what` names it in errors.
template <typename T, typename Kernel, typename... Args>
void read_back(T* out, int n, const char* what, Kernel kernel, Args... args) {
  T* dev = nullptr;
  const size_t bytes = sizeof(T) * static_cast<size_t>(n);
  check_cuda(cudaMalloc(&dev, bytes), (std::string("cudaMalloc (") + what + ")").c_str());
  kernel<<<1, 32>>>(args..., dev);
  const cudaError_t e = cudaMemcpy(out, dev, bytes, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  check_cuda(e, (std::string("the kernel reading the ") + what).c_str());
}

// The 32-bit word at each of `at` (one per rank, device addresses).
struct PeerWords {
  const void* at[PeerMemory::kMaxRanks];
};

__global__ void read_words_kernel(PeerWords w, int ranks, uint32_t* out) {
  const int k = static_cast<int>(threadIdx.x);
  if (k < ranks) out[k] = *static_cast<const volatile uint32_t*>(w.at[k]);
}

#if defined(XENT_NCCL_WINDOWS)
__global__ void lsa_pointers_kernel(ncclWindow_t win, int ranks, void** out) {
  const int k = static_cast<int>(threadIdx.x);
  if (k < ranks) out[k] = ncclGetLsaPointer(win, 0, k);
}
#endif

}  // namespace

void write_signature(void* buffer, int rank) {
  const uint32_t mine = kSignature + static_cast<uint32_t>(rank);
  check_cuda(cudaMemcpy(static_cast<uint32_t*>(buffer) + kSignatureWord, &mine, sizeof mine,
                        cudaMemcpyHostToDevice),
             "cudaMemcpy (peer memory signature)");
}

bool signatures_read_back(const PeerMemory& m, int ranks) {
  PeerWords w{};
  for (int k = 0; k < ranks; ++k)
    w.at[k] = static_cast<const uint32_t*>(m.peers[k]) + kSignatureWord;
  uint32_t seen[PeerMemory::kMaxRanks] = {};
  read_back(seen, ranks, "peer words", read_words_kernel, w, ranks);
  bool ok = true;
  for (int k = 0; k < ranks; ++k) ok &= seen[k] == kSignature + static_cast<uint32_t>(k);
  return ok;
}

#if defined(XENT_NCCL_WINDOWS)
void lsa_pointers(ncclWindow_t win, int ranks, void** out) {
  read_back(out, ranks, "window addresses", lsa_pointers_kernel, win, ranks);
}

int lsa_size(ncclComm_t comm) {
  return ncclTeamLsa(comm).nRanks;
}

bool has_symmetric_memory(ncclComm_t comm) {
  ncclDevCommRequirements reqs{};  // nothing asked: only whether the communicator can
  ncclDevComm dev{};
  if (ncclDevCommCreate(comm, &reqs, &dev) != ncclSuccess) return false;
  ncclDevCommDestroy(comm, &dev);
  return true;
}
#endif

}  // namespace xent::comm
