// Communicator implementations. They move bytes; they know nothing of the loss.
#pragma once

#include <memory>

#include "xent/xent.h"

namespace xent::comm {

std::shared_ptr<Communicator> make_local(Backend backend, int device);
std::shared_ptr<Communicator> make_mpi(MPI_Comm comm);
std::shared_ptr<Communicator> make_nccl_from_mpi(MPI_Comm comm, int device);
std::shared_ptr<Communicator> make_nccl_adopted(ncclComm_t comm, int device);

// Throws xent::Error naming the CUDA call that failed.
void check_cuda(cudaError_t status, const char* what);

}  // namespace xent::comm
