// One call's scratch: a single allocation of the plan's size from the caller's Allocator (or the
// default: malloc on the CPU backend, cudaMallocAsync on the call's stream on CUDA), carved as
// the plan lays it out (plan.h), and handed back when the call ends: nothing stays allocated
// between calls (on CUDA stream-ordered: the call's queued work may still use it, as
// cudaFreeAsync allows).
#pragma once

#include <memory>

#include "linear/plan.h"

namespace xent::linear {

class Scratch {
 public:
  Scratch(Backend backend, Allocator* allocator, const Plan& plan, cudaStream_t stream);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // Buffer b, or null where the plan gives it no bytes.
  template <typename T>
  T* get(Buf b) const {
    return plan_.bytes[b] == 0 ? nullptr : reinterpret_cast<T*>(base_ + plan_.offset[b]);
  }
  size_t bytes(Buf b) const { return plan_.bytes[b]; }

 private:
  Allocator* allocator_;
  const Plan& plan_;
  cudaStream_t stream_;
  char* base_ = nullptr;
  std::unique_ptr<Allocator> default_;
};

// The default allocators: malloc/free (host memory), cudaMallocAsync/cudaFreeAsync (the current
// device's default pool, on the stream).
std::unique_ptr<Allocator> host_allocator();
std::unique_ptr<Allocator> device_allocator();

}  // namespace xent::linear
