// Workspace: the scratch a Group owns, and its one layout.
#include <cstdlib>
#include <cstring>
#include <string>

#include "backend.h"
#include "error.h"

namespace xent {

namespace {

constexpr size_t kAlign = 256;
constexpr size_t aligned(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

// The layout, written once: where each part starts (bytes from the base) and where it ends, for
// sizing and for carving alike. The error slot, the scalars and the finalize counter come first,
// so that they stay put when rows change (a grown buffer re-initialises them).
struct Layout {
  size_t error, scalars, partials, send, recv, lse, end;
};

Layout layout(int64_t rows, int fields, int ranks) {
  const size_t r = static_cast<size_t>(rows);
  const size_t record = aligned(sizeof(float) * static_cast<size_t>(fields) * r);
  Layout l{};
  size_t at = 0;
  l.error = at;
  at += aligned(2 * sizeof(int64_t));
  l.scalars = at;
  at += aligned(sizeof(float) * Workspace::kScalars);
  l.partials = at;
  at += aligned(sizeof(unsigned long long) * (1 + 3 * Workspace::kPartials));
  l.send = at;
  at += record;
  l.recv = ranks > 1 ? at : l.send;  // one rank gathers nothing
  if (ranks > 1) at += record * static_cast<size_t>(ranks);
  l.lse = at;
  at += aligned(sizeof(float) * r);
  l.end = at;
  return l;
}

}  // namespace

size_t Workspace::bytes_needed(int64_t rows, int fields, int ranks) {
  return layout(rows, fields, ranks).end;
}

size_t Workspace::row_bytes(int64_t rows, int fields, int ranks) {
  const Layout l = layout(rows, fields, ranks);
  return l.end - l.send;
}

Workspace::~Workspace() {
  if (base == nullptr) return;
  if (backend == Backend::cpu)
    std::free(base);
  else
    cudaFree(base);
}

void Workspace::prepare(int64_t rows, int fields, int ranks, cudaStream_t stream,
                        void* rows_block) {
  const Layout l = layout(rows, fields, ranks);
  const size_t need = rows_block != nullptr ? l.send : l.end;
  if (need > capacity) {
    // Growth happens outside the hot path (Group::reserve sizes it up front).
    if (backend == Backend::cpu) {
      std::free(base);
      base = std::aligned_alloc(kAlign, aligned(need));
      if (base == nullptr) fail("cannot allocate " + std::to_string(need) + " bytes of workspace");
      // error slot: -1, no bad target seen
      std::memset(static_cast<char*>(base) + layout(rows, fields, ranks).error, 0xff,
                  2 * sizeof(int64_t));
    } else {
      if (capturing(stream))
        fail("the group's workspace must grow from " + std::to_string(capacity) + " to " +
             std::to_string(need) + " bytes (" + std::to_string(rows) +
             " rows) while the stream is being captured into a CUDA graph, where memory "
             "cannot be allocated: call Group::reserve(rows, options) with the largest rows "
             "before capturing");
      if (base != nullptr) {  // kernels queued on the stream may still use it
        check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (workspace growth)");
        check_cuda(cudaFree(base), "cudaFree (workspace)");
        base = nullptr;
        capacity = 0;
      }
      check_cuda(cudaMalloc(&base, need), "cudaMalloc (workspace)");
      // On the stream: ordered before the kernels that read them, whatever the stream's kind.
      check_cuda(
          cudaMemsetAsync(static_cast<char*>(base) + l.error, 0xff, 2 * sizeof(int64_t), stream),
          "cudaMemsetAsync (error slot)");
      check_cuda(cudaMemsetAsync(static_cast<char*>(base) + l.partials, 0,
                                 sizeof(unsigned long long), stream),
                 "cudaMemsetAsync (finalize block counter)");
    }
    capacity = need;
  }
  char* p = static_cast<char*>(base);
  error = reinterpret_cast<int64_t*>(p + l.error);
  scalars = reinterpret_cast<float*>(p + l.scalars);
  partials = reinterpret_cast<unsigned long long*>(p + l.partials);
  // The per-row part at its offsets from l.send, in the workspace or in the caller's block.
  char* r = rows_block != nullptr ? static_cast<char*>(rows_block) : p + l.send;
  send = reinterpret_cast<float*>(r);
  recv = reinterpret_cast<float*>(r + (l.recv - l.send));
  lse = reinterpret_cast<float*>(r + (l.lse - l.send));
}

CallRows::CallRows(Workspace& ws, Allocator* allocator, int64_t rows, int fields, int ranks,
                   cudaStream_t stream)
    : ws_(ws), allocator_(allocator), stream_(stream) {
  if (allocator_ != nullptr) {
    bytes_ = Workspace::row_bytes(rows, fields, ranks);
    block_ = allocator_->allocate(bytes_, stream_);
  }
  try {
    ws_.prepare(rows, fields, ranks, stream_, block_);
  } catch (...) {
    if (block_ != nullptr) allocator_->release(block_, bytes_, stream_);
    throw;
  }
}

CallRows::~CallRows() {
  if (block_ == nullptr) return;
  allocator_->release(block_, bytes_, stream_);
  ws_.send = ws_.recv = ws_.lse = nullptr;  // nothing may read the caller's block after the call
}

}  // namespace xent
