// Communicator implementations. They move bytes; they know nothing of the loss.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "xent/xent.h"

namespace xent::comm {

std::shared_ptr<Communicator> make_local(Backend backend, int device);
// owned: ncclCommDestroy when the communicator goes.
std::shared_ptr<Communicator> make_nccl(ncclComm_t comm, int device, bool owned);

// NCCL symmetric windows (NCCL 2.28 and newer: XENT_NCCL_WINDOWS; cuda/peer_pointers.cu): every
// rank's part of one (`ranks` of one NVLink domain), as this process addresses
// it. Synchronises the device.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define XENT_NCCL_WINDOWS 1
void lsa_pointers(ncclWindow_t win, int ranks, void** out);
int lsa_size(ncclComm_t comm);  // ranks of this rank's NVLink domain (NCCL's LSA team)
// Collective: whether the communicator supports symmetric memory (a device communicator can be
// made). Where it does not, NCCL 2.28.3 still registers a window, whose device-side addresses
// then fault.
bool has_symmetric_memory(ncclComm_t comm);
#endif

// Each rank's peer memory carries its rank's signature in a word of its header
// (PeerExchange::kSignatureWord, cuda/exchange.cuh; the exchange leaves it alone): written into
// this rank's buffer, then checked on the device through every rank's address before any rank
// uses the memory.
void write_signature(void* buffer, int rank);
bool signatures_read_back(const PeerMemory& m, int ranks);

// `send` of every rank, in rank order, into `recv` (host memory, `bytes` per rank): what the
// collective steps of making peer memory need of a communicator.
using HostAllGather = std::function<void(const void* send, void* recv, size_t bytes)>;
// The minimum of v over the ranks, through `gather` (a barrier too).
int min_over_ranks(const HostAllGather& gather, int size, int v);

// Peer memory through CUDA IPC: every rank's cudaMalloc'd buffer, its handle all-gathered and
// opened by the others (ranks of one host whose devices can map one another's memory; several
// ranks may share a GPU). grow() is collective; it agrees across the ranks (a minimum) at each
// step, so that it returns null on every rank alike where any rank cannot take part: another
// host, a device that cannot be mapped, an allocation that failed.
class IpcPeerMemory {
 public:
  IpcPeerMemory() = default;
  IpcPeerMemory(const IpcPeerMemory&) = delete;
  IpcPeerMemory& operator=(const IpcPeerMemory&) = delete;
  ~IpcPeerMemory() { release(nullptr, 0); }
  // Synchronises the device first: the old buffer may still be in use by queued kernels.
  const PeerMemory* grow(size_t bytes, int rank, int size, const HostAllGather& gather);
  // Collective where `gather` is given (a barrier between closing the others' buffers and
  // freeing this rank's); the destructor's is not (the ranks are going).
  void release(const HostAllGather* gather, int size);

 private:
  int rank_ = 0;
  PeerMemory peers_;  // peers_.peers[rank_] is this rank's allocation, the others opened handles
};

}  // namespace xent::comm
