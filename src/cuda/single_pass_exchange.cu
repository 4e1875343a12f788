// The single-pass path on several ranks, the records exchanged device-side
// (Options::device_exchange; the kernel: cuda/single_pass.cuh, the exchange: cuda/exchange.cuh).
// A file of its own: its kernels compile beside the one-rank ones.
#include "cuda/single_pass.cuh"

namespace xent::cuda {

using namespace single_pass_detail;

void single_pass_exchange(const core::Problem& p, LogitsView in, LogitsView out,
                          TargetsView targets, const PeerMemory& peers, int rank, int ranks,
                          float* gathered, int64_t* error, const float* scalars,
                          cudaStream_t stream) {
  if (p.rows == 0) return;
  check_single_pass(p, in, out, /*mixed=*/false);
  const PeerExchange xc = make_peer_exchange(peers, rank, ranks, p.rows);
  launch_single_pass<true>(p, in, out, targets, SinglePassPointers{gathered, error, scalars}, xc,
                           peers.device_share, stream);
}

}  // namespace xent::cuda
