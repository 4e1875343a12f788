// The single-pass path on several ranks, the records exchanged device-side
// (Options::device_exchange; the kernel: cuda/single_pass.cuh, the exchange: cuda/exchange.cuh).
// A file of its own: its kernels compile beside the one-rank ones.
#include "cuda/single_pass.cuh"

namespace xent::cuda {

using namespace single_pass_detail;

size_t exchange_bytes(int64_t rows, int ranks) {
  return sizeof(float) *
         (PeerExchange::kHeaderFloats +
          2 * static_cast<size_t>(rows) * static_cast<size_t>(ranks) * PeerExchange::kSlotFloats);
}

void single_pass_exchange(const core::Problem& p, LogitsView in, LogitsView out,
                          TargetsView targets, const PeerMemory& peers, int rank, int ranks,
                          float* gathered, int64_t* error, const float* scalars,
                          cudaStream_t stream) {
  if (p.rows == 0) return;
  check_single_pass(p, in, out);
  if (ranks < 1 || ranks > PeerMemory::kMaxRanks || rank < 0 || rank >= ranks)
    fail("the device exchange takes 1 to " + std::to_string(PeerMemory::kMaxRanks) +
         " ranks, got rank " + std::to_string(rank) + " of " + std::to_string(ranks));
  if (peers.bytes < exchange_bytes(p.rows, ranks))
    fail("the device exchange's peer memory holds " + std::to_string(peers.bytes) + " bytes, " +
         std::to_string(exchange_bytes(p.rows, ranks)) + " needed");
  PeerExchange xc;
  for (int k = 0; k < ranks; ++k) xc.peers[k] = static_cast<float*>(peers.peers[k]);
  xc.rank = rank;
  xc.ranks = ranks;
  xc.rows = p.rows;
  xc.timeout_ns = 60ull * 1000 * 1000 * 1000;
  launch_single_pass<true>(p, in, out, targets, SinglePassPointers{gathered, error, scalars}, xc,
                           peers.device_share, stream);
}

}  // namespace xent::cuda
