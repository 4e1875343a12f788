// The fused lm head's two rank-to-rank sums of fp32 partials (d_hidden), in one place so that a
// CUDA backend can replace them with NCCL collectives. Here they go through the communicator's
// all-gather of host memory: every rank gathers every rank's partial and sums them in rank order,
// so that every rank gets the same bits.
#pragma once

#include <cstdint>

#include "xent/xent.h"

namespace xent::linear {

// The sum over ranks of each rank's `count` floats at `partial`, into `out` [count]; `gathered`
// holds ranks * count floats. Returns the sum: `partial` itself on one rank, else `out`.
const float* all_reduce_sum(Communicator& comm, const float* partial, int64_t count,
                            float* gathered, float* out);

// `partial` holds one block of `block` floats per rank, in rank order; rank r gets the sum over
// ranks of their block r, into `out` [block]; `gathered` holds ranks * ranks * block floats.
// Returns the sum: `partial` itself on one rank, else `out`.
const float* reduce_scatter_sum(Communicator& comm, const float* partial, int64_t block,
                                float* gathered, float* out);

// d_hidden's partial summed over the ranks: with sequence parallelism this rank's block of
// `own` floats (reduce_scatter_sum), else all `own` floats (all_reduce_sum, every rank the same
// rows). `gathered` as those need; returns the sum as they do.
const float* sum_over_ranks(Communicator& comm, bool sequence_parallel, const float* partial,
                            int64_t own, float* gathered, float* out);

}  // namespace xent::linear
