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

Workspace::~Workspace() {
  if (base == nullptr) return;
  if (backend == Backend::cpu)
    std::free(base);
  else
    cudaFree(base);
}

void Workspace::prepare(int64_t rows, int fields, int ranks, cudaStream_t stream) {
  const size_t need = bytes_needed(rows, fields, ranks);
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
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
      if (capture != cudaStreamCaptureStatusNone)
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
      const Layout l = layout(rows, fields, ranks);
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
  const Layout l = layout(rows, fields, ranks);
  error = reinterpret_cast<int64_t*>(p + l.error);
  scalars = reinterpret_cast<float*>(p + l.scalars);
  partials = reinterpret_cast<unsigned long long*>(p + l.partials);
  send = reinterpret_cast<float*>(p + l.send);
  recv = reinterpret_cast<float*>(p + l.recv);
  lse = reinterpret_cast<float*>(p + l.lse);
}

}  // namespace xent
