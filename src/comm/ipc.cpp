// Peer memory through CUDA IPC (comm/comm.h): for communicators without NCCL's symmetric windows
// (NCCL before 2.28, or a build of it without symmetric memory support) and for ranks that share
// a GPU (processes of one host: the GPU time-slices their kernels, so that every rank's kernel
// runs in its turn).
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/comm.h"
#include "error.h"

namespace xent::comm {

int min_over_ranks(const HostAllGather& gather, int size, int v) {
  std::vector<int> all(static_cast<size_t>(size));
  gather(&v, all.data(), sizeof v);
  return *std::min_element(all.begin(), all.end());
}

namespace {

// What each rank tells the others: where it runs, and its buffer's handle.
struct Offer {
  char host[64];  // gethostname: a handle opens only on its own host
  cudaIpcMemHandle_t handle;
  int ok;  // this rank allocated its buffer and made its handle
};

}  // namespace

const PeerMemory* IpcPeerMemory::grow(size_t bytes, int rank, int size,
                                      const HostAllGather& gather) {
  if (size > PeerMemory::kMaxRanks || rank < 0 || rank >= size)
    fail("CUDA IPC peer memory: rank " + std::to_string(rank) + " of " + std::to_string(size) +
         " ranks (1 to " + std::to_string(PeerMemory::kMaxRanks) + " ranks)");
  if (bytes <= peers_.bytes) return &peers_;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (peer memory)");
  release(&gather, size);
  rank_ = rank;

  // A failed CUDA call here is not an error: the ranks go without peer memory, together. Each
  // failure is cleared (cudaGetLastError) so that it is not reported by a later call.
  const auto ok_call = [](cudaError_t e) {
    if (e != cudaSuccess) cudaGetLastError();
    return e == cudaSuccess;
  };
  Offer mine{};
  std::vector<Offer> offers(static_cast<size_t>(size));
  gethostname(mine.host, sizeof mine.host - 1);
  void* own = nullptr;
  mine.ok = ok_call(cudaMalloc(&own, bytes)) && ok_call(cudaMemset(own, 0, bytes)) &&
            ok_call(cudaIpcGetMemHandle(&mine.handle, own));
  peers_.peers[rank] = mine.ok ? own : nullptr;
  if (!mine.ok && own != nullptr) cudaFree(own);
  if (mine.ok) {
    write_signature(own, rank);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (peer memory)");
  }
  gather(&mine, offers.data(), sizeof mine);

  int ok = 1;
  for (const Offer& o : offers)
    ok &= o.ok && std::strncmp(o.host, mine.host, sizeof mine.host) == 0 ? 1 : 0;
  for (int k = 0; k < size && ok; ++k) {
    if (k == rank) continue;
    void* p = nullptr;
    ok = ok_call(cudaIpcOpenMemHandle(&p, offers[static_cast<size_t>(k)].handle,
                                      cudaIpcMemLazyEnablePeerAccess));
    peers_.peers[k] = ok ? p : nullptr;
  }
  // Every rank opened every other's buffer: each reads every rank's signature through the
  // addresses it will use.
  if (min_over_ranks(gather, size, ok) == 1) ok = signatures_read_back(peers_, size) ? 1 : 0;
  if (min_over_ranks(gather, size, ok) == 0) {
    release(&gather, size);
    return nullptr;
  }
  peers_.bytes = bytes;
  return &peers_;
}

void IpcPeerMemory::release(const HostAllGather* gather, int size) {
  for (int k = 0; k < PeerMemory::kMaxRanks; ++k)
    if (k != rank_ && peers_.peers[k] != nullptr) cudaIpcCloseMemHandle(peers_.peers[k]);
  // Every rank closes its mappings of a buffer before the rank that owns it frees it.
  if (gather != nullptr) min_over_ranks(*gather, size, 1);
  if (peers_.peers[rank_] != nullptr) cudaFree(peers_.peers[rank_]);
  peers_ = PeerMemory{};
}

}  // namespace xent::comm
