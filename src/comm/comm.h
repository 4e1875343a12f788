// Communicator implementations. They move bytes; they know nothing of the loss.
#pragma once

#include <nccl.h>

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
// The 32-bit word at each of `at` (one per rank, device addresses), read on the device.
struct PeerWords {
  const void* at[PeerMemory::kMaxRanks];
};
void read_words(const PeerWords& w, int ranks, uint32_t* out);
#endif

}  // namespace xent::comm
