// The device exchange's host side (the protocol: cuda/exchange.cuh), and its two-pass form: the
// records of the statistics kernel published to every rank's peer memory and gathered back, in
// place of the all-gather, on a rank whose rows the single pass does not take (so that it meets
// ranks that take the single pass with the exchange: uneven shards, padding).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backend.h"
#include "cuda/exchange.cuh"
#include "cuda/launch.cuh"
#include "cuda/row_walk.cuh"
#include "error.h"

namespace xent::cuda {
namespace detail {

PeerExchange make_peer_exchange(const PeerMemory& peers, int rank, int ranks, int64_t rows) {
  if (ranks < 1 || ranks > PeerMemory::kMaxRanks || rank < 0 || rank >= ranks)
    fail("the device exchange takes 1 to " + std::to_string(PeerMemory::kMaxRanks) +
         " ranks, got rank " + std::to_string(rank) + " of " + std::to_string(ranks));
  if (peers.bytes < exchange_bytes(rows, ranks))
    fail("the device exchange's peer memory holds " + std::to_string(peers.bytes) + " bytes, " +
         std::to_string(exchange_bytes(rows, ranks)) + " needed");
  if (!(peers.wait_timeout_s > 0.0 && peers.wait_timeout_s <= 1e9))
    fail("PeerMemory::wait_timeout_s = " + std::to_string(peers.wait_timeout_s) +
         ": must be > 0 seconds (and at most 1e9)");
  PeerExchange xc;
  for (int k = 0; k < ranks; ++k) xc.peers[k] = static_cast<float*>(peers.peers[k]);
  xc.rank = rank;
  xc.ranks = ranks;
  xc.rows = rows;
  xc.timeout_ns = static_cast<uint64_t>(std::ceil(peers.wait_timeout_s * 1e9));
  return xc;
}

namespace {

constexpr int kExchangeThreads = 256;

// A thread a row, the block's rows kExchangeThreads at a time by ticket (exchange.cuh): each
// thread publishes its row's record, then gathers every rank's.
__global__ void __launch_bounds__(kExchangeThreads)
    exchange_records_kernel(const PeerExchange xc, const core::RecordLayout layout,
                            const float* record, float* gathered) {
  __shared__ int64_t group;
  pdl_trigger();
  pdl_wait();
  const uint32_t epoch = exchange_epoch(xc);
  for (;;) {
    if (threadIdx.x == 0) group = take_ticket(xc);
    __syncthreads();
    const int64_t first = group * kExchangeThreads;
    __syncthreads();  // every thread has read group before thread 0 takes the next
    if (first >= xc.rows) return;
    const int64_t row = first + threadIdx.x;
    if (row < xc.rows) {
      float rec[core::RecordLayout::kMaxFields];
      for (int f = 0; f < layout.fields; ++f) rec[f] = record[f * xc.rows + row];
      publish_record(xc, layout, rec, row, epoch);
      gather_record(xc, layout, row, gathered, epoch);
    }
  }
}

}  // namespace
}  // namespace detail

size_t exchange_bytes(int64_t rows, int ranks) {
  using detail::PeerExchange;
  return sizeof(float) * PeerExchange::kHeaderFloats +
         sizeof(uint64_t) * 2 * static_cast<size_t>(rows) * static_cast<size_t>(ranks) *
             PeerExchange::kSlotWords;
}

void exchange_records(const core::Problem& p, const float* record, const PeerMemory& peers,
                      int rank, int ranks, float* gathered, cudaStream_t stream) {
  using namespace detail;
  if (p.rows == 0) return;
  const PeerExchange xc = make_peer_exchange(peers, rank, ranks, p.rows);
  const auto kernel = exchange_records_kernel;
  static PerDevice resident_blocks;  // more would start only to find the tickets taken
  const int n = resident_blocks.get(
      current_device(), [&] { return resident_clusters(kernel, kExchangeThreads, 1, 0); });
  const auto resident = static_cast<int64_t>(static_cast<double>(n) * peers.device_share);
  const int64_t blocks = std::clamp<int64_t>((p.rows + kExchangeThreads - 1) / kExchangeThreads, 1,
                                             std::max<int64_t>(1, resident));
  launch("xent exchange records kernel", kernel, static_cast<unsigned>(blocks), kExchangeThreads,
         p.programmatic_launch, stream, xc, p.layout, record, gathered);
}

}  // namespace xent::cuda
