// Shard planning and the layout checks across ranks: small collectives on host values, at setup
// (and on every call of the CPU backend, which exchanges a header per call).
#include "layout.h"

#include <string>
#include <vector>

#include "device_scope.h"
#include "error.h"

namespace xent {

// Setup and CPU calls (and the fused lm head's header on CUDA with several ranks): it
// synchronises the device for CUDA groups.
void gather_on_host(const Group& group, const void* mine, void* all, size_t bytes) {
  Communicator& c = group.comm();
  if (c.backend() == Backend::cpu) {
    c.all_gather(mine, all, bytes, nullptr);
    return;
  }
  const DeviceScope on_device(group);
  void* dev = nullptr;
  const size_t total = bytes * c.size();
  check_cuda(cudaMalloc(&dev, bytes + total), "cudaMalloc (layout check)");
  char* d = static_cast<char*>(dev);
  try {
    check_cuda(cudaMemcpy(d, mine, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    c.all_gather(d, d + bytes, bytes, nullptr);
    check_cuda(cudaMemcpy(all, d + bytes, total, cudaMemcpyDeviceToHost), "cudaMemcpy");
  } catch (...) {
    cudaFree(dev);
    throw;
  }
  cudaFree(dev);
}

void exchange_and_check(const Group& group, const core::LayoutHeader& mine, bool tiling) {
  std::vector<core::LayoutHeader> all(group.size());
  gather_on_host(group, &mine, all.data(), sizeof mine);
  core::check_headers(all.data(), group.size(), tiling);
}

Shard plan_shard(const Group& group, int64_t width, int64_t vocab_size) {
  if (width < 1) fail("plan_shard(width = " + std::to_string(width) + "): must be >= 1");
  std::vector<int64_t> widths(group.size());
  gather_on_host(group, &width, widths.data(), sizeof width);
  Shard s;
  int64_t total = 0;
  for (int k = 0; k < group.size(); ++k) {
    if (k == group.rank()) s.start = total;
    total += widths[k];
  }
  s.width = width;
  s.vocab_size = vocab_size < 0 ? total : vocab_size;
  if (s.vocab_size < 1 || s.vocab_size > total)
    fail("plan_shard(vocab_size = " + std::to_string(vocab_size) + "): must be in [1, " +
         std::to_string(total) + "], the sum of the ranks' widths (columns past it are padding)");
  return s;
}

void apply(const Shard& shard, Options& opt) {
  opt.vocab_start = shard.start;
  opt.vocab_size = shard.vocab_size;
}

void check_layout(const Group& group, const Shard& mine, int64_t rows) {
  core::LayoutHeader h;
  h.rows = rows;
  h.vocab_start = mine.start;
  h.width = mine.width;
  h.vocab_size = mine.vocab_size;
  exchange_and_check(group, h, /*tiling=*/true);
}

}  // namespace xent
