#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>

#include "harness.h"

namespace xb {
namespace {

std::string first_line(const std::string& s) {
  const size_t nl = s.find('\n');
  std::string out = nl == std::string::npos ? s : s.substr(0, nl);
  while (!out.empty() && (out.back() == ' ' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string version(int v, int major, int minor) {
  return std::to_string(v / major) + "." + std::to_string((v % major) / minor);
}

}  // namespace

Env gather_env(Device& dev, const xent::Group& group) {
  Env env;
  MPI_Comm_rank(MPI_COMM_WORLD, &env.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &env.ranks);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  env.hostname = host;
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  MPI_Get_library_version(mpi, &len);
  env.mpi = first_line(mpi);
  int rt = 0, drv = 0, nv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  cudaGetLastError();
  env.cuda_runtime = rt > 0 ? version(rt, 1000, 10) : "none";
  env.cuda_driver = drv > 0 ? version(drv, 1000, 10) : "none";
  if (ncclGetVersion(&nv) == ncclSuccess && nv > 0)
    env.nccl = version(nv, 10000, 100) + "." + std::to_string(nv % 100);
  else
    env.nccl = "unknown";
  std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S%z", std::localtime(&now));
  env.started = when;

  char line[512];
  if (dev.gpu()) {
    cudaDeviceProp prop;
    cuda_ok(cudaGetDeviceProperties(&prop, group.device()), "cudaGetDeviceProperties");
    char bus[32] = {0};
    cudaDeviceGetPCIBusId(bus, sizeof bus, group.device());
    std::snprintf(line, sizeof line, "#  Rank %3d Pid %7d on %12s device %2d [%s] %s, %.0f GiB",
                  env.rank, static_cast<int>(getpid()), host, group.device(), bus, prop.name,
                  static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  } else {
    std::snprintf(line, sizeof line,
                  "#  Rank %3d Pid %7d on %12s CPU backend (host memory, MPI all-gather)", env.rank,
                  static_cast<int>(getpid()), host);
  }
  std::vector<char> all(env.rank == 0 ? sizeof line * static_cast<size_t>(env.ranks) : 1);
  MPI_Gather(line, sizeof line, MPI_CHAR, all.data(), sizeof line, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (env.rank == 0)
    for (int r = 0; r < env.ranks; ++r)
      env.rank_lines.emplace_back(all.data() + sizeof line * static_cast<size_t>(r));

  MPI_Barrier(MPI_COMM_WORLD);  // every rank copies at once, as they will run
  double bw = dev.copy_bandwidth(&env.copy_how);
  MPI_Allreduce(&bw, &env.copy_bw, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return env;
}

}  // namespace xb
