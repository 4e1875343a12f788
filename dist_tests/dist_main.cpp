// main() of xent_dist_tests, the multi-rank tests (test_dist.cpp, test_dist_errors.cpp), run
// under mpirun with 2, 3 and 4 ranks: it sets up the environment (dist_harness.h) that they share.
//
// XENT_TEST_BACKEND=cpu (default): xent::mpi::host_group(MPI_COMM_WORLD), host buffers.
// XENT_TEST_BACKEND=cuda: xent::mpi::nccl_group(MPI_COMM_WORLD) (NCCL), device buffers; every test
//   skips (GTEST_SKIP) where there are fewer visible GPUs than ranks on a node.
// XENT_TEST_BACKEND=cuda-mpi: xent::mpi::cuda_group(MPI_COMM_WORLD) (MPI through host memory, CUDA
//   IPC peer memory), device buffers; ranks may share a GPU; every test skips without one.
// XENT_TEST_DEVICE_EXCHANGE=1 (CUDA backends): every call with Options::device_exchange, and each
//   forward must have taken it (the group's communicator made peer memory). With cuda-mpi on one
//   GPU the ranks' processes take turns on it, so that every rank's kernel runs: the device
//   exchange of several ranks, tested on one GPU.
//
// Only rank 0 prints gtest's usual output; other ranks print their failures, prefixed with the
// rank. The exit status is non-zero on every rank if any rank failed.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <xent/mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "dist_harness.h"

using xdist::cuda_ok;
using xdist::env;
using xdist::Env;

namespace {

// Non-zero ranks: print only failures, prefixed with the rank.
class RankPrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankPrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (t.result()->Failed())
      std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, t.test_suite_name(), t.name());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  Env& e = env();
  MPI_Comm_rank(MPI_COMM_WORLD, &e.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &e.size);
  if (e.size < 2) {  // the tests' shard layouts assume a second rank (test_dist.cpp)
    std::fprintf(stderr,
                 "xent_dist_tests: %d rank; it needs 2 or more (mpirun -np 2 ...). On one GPU, "
                 "XENT_TEST_BACKEND=cuda-mpi lets the ranks share it\n",
                 e.size);
    MPI_Finalize();
    return 2;
  }
  const std::string be =
      std::getenv("XENT_TEST_BACKEND") ? std::getenv("XENT_TEST_BACKEND") : "cpu";
  const bool nccl = be == "cuda", shared = be == "cuda-mpi";
  const char* ex = std::getenv("XENT_TEST_DEVICE_EXCHANGE");
  e.cuda = nccl || shared;
  e.exchange = ex != nullptr && ex[0] == '1';
  if ((!e.cuda && be != "cpu") || (e.exchange && !e.cuda)) {
    if (e.rank == 0)
      std::fprintf(stderr,
                   "XENT_TEST_BACKEND=%s: expected cpu, cuda or cuda-mpi (and one of the last two "
                   "for XENT_TEST_DEVICE_EXCHANGE=1)\n",
                   be.c_str());
    MPI_Finalize();
    return 2;
  }

  if (e.cuda) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      cudaGetLastError();
      devices = 0;
    }
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, e.rank, MPI_INFO_NULL, &node);
    int local_ranks = 1;
    MPI_Comm_size(node, &local_ranks);
    MPI_Comm_free(&node);
    const int ok = devices >= (shared ? 1 : local_ranks) ? 1 : 0;
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok)
      e.skip = shared ? "XENT_TEST_BACKEND=cuda-mpi needs a GPU (none visible)"
                      : "XENT_TEST_BACKEND=cuda needs a GPU per rank on each node (" +
                            std::to_string(devices) + " visible, " + std::to_string(local_ranks) +
                            " ranks on this node)";
  }
  if (e.skip.empty()) {
    if (e.cuda) {
      e.group =
          nccl ? xent::mpi::nccl_group(MPI_COMM_WORLD) : xent::mpi::cuda_group(MPI_COMM_WORLD);
      cuda_ok(cudaSetDevice(e.group->device()), "cudaSetDevice");
      cuda_ok(cudaStreamCreateWithFlags(&e.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    } else {
      e.group = xent::mpi::host_group(MPI_COMM_WORLD);
    }
  }

  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (e.rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankPrinter(e.rank));
  }
  const int mine = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (e.rank == 0 && worst != 0 && mine == 0)
    std::fprintf(stderr, "rank 0 passed, but another rank failed (see [rank k] lines)\n");
  if (e.stream) cudaStreamDestroy(e.stream);
  e.group.reset();  // before MPI_Finalize (an NCCL group owns its communicator)
  MPI_Finalize();
  return worst != 0 ? 1 : 0;
}
