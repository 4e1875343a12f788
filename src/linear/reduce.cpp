#include "linear/reduce.h"

namespace xent::linear {

namespace {

// Every rank's `count` floats gathered; out[i] = sum over ranks q, in order, of q's
// partial[offset + i], for i < n.
const float* gather_and_sum(Communicator& comm, const float* partial, int64_t count, int64_t offset,
                            int64_t n, float* gathered, float* out) {
  const int ranks = comm.size();
  if (ranks == 1) return partial + offset;
  comm.all_gather(partial, gathered, sizeof(float) * static_cast<size_t>(count), nullptr);
  for (int64_t i = 0; i < n; ++i) {
    float s = gathered[offset + i];
    for (int q = 1; q < ranks; ++q) s += gathered[q * count + offset + i];
    out[i] = s;
  }
  return out;
}

}  // namespace

const float* all_reduce_sum(Communicator& comm, const float* partial, int64_t count,
                            float* gathered, float* out) {
  return gather_and_sum(comm, partial, count, 0, count, gathered, out);
}

const float* reduce_scatter_sum(Communicator& comm, const float* partial, int64_t block,
                                float* gathered, float* out) {
  return gather_and_sum(comm, partial, block * comm.size(), block * comm.rank(), block, gathered,
                        out);
}

const float* sum_over_ranks(Communicator& comm, bool sequence_parallel, const float* partial,
                            int64_t own, float* gathered, float* out) {
  return sequence_parallel ? reduce_scatter_sum(comm, partial, own, gathered, out)
                           : all_reduce_sum(comm, partial, own, gathered, out);
}

}  // namespace xent::linear
