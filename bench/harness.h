// xent_dist_bench's harness, as nccl-tests' common code is to its collectives: the environment,
// the sweep, the timing (back to back, from an idle device, or replayed from CUDA graphs), the
// slowest-rank reduction, the table and the JSON. What it times is the Operation (op.h), or with
// --hidden the LinearOperation (linear_op.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device.h"
#include "options.h"
#include "xent/xent.h"

namespace xb {

struct Env {
  int rank = 0, ranks = 1;
  std::string hostname, mpi, cuda_runtime, cuda_driver, nccl, copy_how, started;
  double copy_bw = 0.0;  // bytes/s, slowest rank
  std::vector<std::string> rank_lines;
};

// One row of the table: after the slowest-rank reduction, the slowest rank's times and memory
// and the wrong values of all ranks.
struct Result {
  int64_t tokens = 0, width = 0;
  std::string mode;
  std::string path;  // xent::forward_path: "single-pass" or "two-pass" (", device exchange")
  double bytes = 0;  // bytes_moved (op.h): what GB/s and %roof are of
  double fwd_ms = 0, bwd_ms = 0, total_ms = 0, gather_ms = 0, extra_bytes = 0;
  // --hidden: the three GEMMs alone (linear_op.h), the slowest rank's; < 0 where not timed (n/a).
  double gemm3_ms = -1;
  int64_t wrong = 0;
};

// Versions, a line per rank (to rank 0) and the copy bandwidth measured on every rank at once.
// Collective. env.cpp.
Env gather_env(Device& dev, const xent::Group& group);

// Rank 0's output. report.cpp.
void print_header(const Settings& s, const Env& env, int64_t width);
void print_row(const Settings& s, const Env& env, const Result& r);
// The footer, and the JSON file when asked for; returns the exit status the JSON leaves (1 when it
// could not be written).
int print_summary(const Settings& s, const Env& env, const std::vector<Result>& results,
                  int64_t wrong);

// The whole run on every rank; returns the exit status. harness.cpp.
int run(const Settings& s);

}  // namespace xb
