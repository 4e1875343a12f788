// xent_dist_bench: the nccl-tests-style benchmark and verifier of xent's vocab-parallel
// cross-entropy. One MPI rank per vocabulary shard; every rank regenerates its shard of the global
// logits from a hash, times forward + backward, and (--check) compares loss, lse and its gradient
// shard with an independent fp64 reference. Times are the slowest rank's, like nccl-tests.
//
// options.cpp: flags and presets; harness.cpp (env.cpp, report.cpp): the sweep, timing and
// output; op.cpp: the operation timed, its buffers, check and byte model.
#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>
#include <exception>
#include <string>

#include "harness.h"
#include "options.h"

namespace {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  cudaGetLastError();  // clear "no driver" and the like
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  // Every rank parses the same command line; they agree on the outcome before anything else.
  xb::Settings s;
  std::string message;
  int status = xb::parse_settings(argc, argv, ranks, rank, cuda_device_count(), s, message);
  int worst = 0;
  MPI_Allreduce(&status, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (worst != xb::kParseOk) {
    int me = status == worst ? rank : ranks, speaker = 0;
    MPI_Allreduce(&me, &speaker, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rank == speaker) {
      if (worst == xb::kParseHelp)
        std::printf("%s", message.c_str());
      else
        std::fprintf(stderr, "%s\n", message.c_str());
      std::fflush(nullptr);
    }
    MPI_Finalize();
    return worst == xb::kParseHelp ? 0 : 2;
  }

  int rc = 0;
  try {
    rc = xb::run(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "xent_dist_bench: rank %d: %s\n", rank, e.what());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
