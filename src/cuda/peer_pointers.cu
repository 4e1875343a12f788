// The addresses of every rank's part of an NCCL symmetric window, as this process maps them
// (NCCL 2.28's device API computes them on the device only): one small kernel when a window is
// made, so that the kernels take plain pointers (PeerMemory) and need no NCCL header.
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "comm/comm.h"
#include "error.h"

#if defined(XENT_NCCL_WINDOWS)
#include <nccl_device.h>
#endif

namespace xent::comm {

#if defined(XENT_NCCL_WINDOWS)
namespace {
__global__ void lsa_pointers_kernel(ncclWindow_t win, int ranks, void** out) {
  const int k = static_cast<int>(threadIdx.x);
  if (k < ranks) out[k] = ncclGetLsaPointer(win, 0, k);
}
}  // namespace

void lsa_pointers(ncclWindow_t win, int ranks, void** out) {
  void** dev = nullptr;
  const size_t bytes = sizeof(void*) * static_cast<size_t>(ranks);
  check_cuda(cudaMalloc(&dev, bytes), "cudaMalloc (window addresses)");
  lsa_pointers_kernel<<<1, 32>>>(win, ranks, dev);
  const cudaError_t e = cudaMemcpy(out, dev, bytes, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  check_cuda(e, "the window addresses' kernel");
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

namespace {
__global__ void read_words_kernel(PeerWords w, int ranks, uint32_t* out) {
  const int k = static_cast<int>(threadIdx.x);
  if (k < ranks) out[k] = *static_cast<const volatile uint32_t*>(w.at[k]);
}
}  // namespace

void read_words(const PeerWords& w, int ranks, uint32_t* out) {
  uint32_t* dev = nullptr;
  const size_t bytes = sizeof(uint32_t) * static_cast<size_t>(ranks);
  check_cuda(cudaMalloc(&dev, bytes), "cudaMalloc (peer words)");
  read_words_kernel<<<1, 32>>>(w, ranks, dev);
  const cudaError_t e = cudaMemcpy(out, dev, bytes, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  check_cuda(e, "the peer words' kernel");
}
#endif

}  // namespace xent::comm
