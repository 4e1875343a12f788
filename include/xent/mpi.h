// Groups over MPI (target xent::mpi, which links MPI): what xent_dist_bench and the dist tests
// use. The core (xent/xent.h, target xent::xent) and the LibTorch adapter need no MPI.
#pragma once

#include <mpi.h>

#include "xent/xent.h"

namespace xent::mpi {

// CPU backend over MPI: records gathered with MPI_Allgather. Needs MPI_Init first.
Group host_group(MPI_Comm comm);

// CUDA backend: an NCCL communicator bootstrapped over MPI (rank 0's ncclUniqueId broadcast),
// owned by the group. device -1: the local rank (MPI_COMM_TYPE_SHARED) modulo the visible GPU
// count. Makes that device current (one GPU per process). Collective. Needs MPI_Init first.
Group nccl_group(MPI_Comm comm, int device = -1);

// CUDA backend without NCCL: device buffers, the records staged through host memory for
// MPI_Allgather (it synchronises the stream), and peer memory for Options::device_exchange
// through CUDA IPC (ranks of one host). Several ranks may share a GPU: their processes take turns
// on it. device -1 as for nccl_group; made current. Collective. Needs MPI_Init first.
Group cuda_group(MPI_Comm comm, int device = -1);

}  // namespace xent::mpi
