// Communicator implementations. They move bytes; they know nothing of the loss.
#pragma once

#include <nccl.h>

#include <memory>

#include "xent/xent.h"

namespace xent::comm {

std::shared_ptr<Communicator> make_local(Backend backend, int device);
// owned: ncclCommDestroy when the communicator goes.
std::shared_ptr<Communicator> make_nccl(ncclComm_t comm, int device, bool owned);

}  // namespace xent::comm
