#include "linear/scratch.h"

#include <cstdlib>
#include <memory>
#include <string>

#include "error.h"

namespace xent::linear {

namespace {

class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, cudaStream_t) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr)
      fail("the fused lm head's scratch: malloc of " + std::to_string(bytes) + " bytes failed");
    return p;
  }
  void release(void* p, size_t, cudaStream_t) override { std::free(p); }
};

class DeviceAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, cudaStream_t stream) override {
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, bytes, stream);
    if (e != cudaSuccess)
      fail("the fused lm head's scratch: cudaMallocAsync of " + std::to_string(bytes) +
           " bytes failed: " + cudaGetErrorString(e));
    return p;
  }
  void release(void* p, size_t, cudaStream_t stream) override { cudaFreeAsync(p, stream); }
};

}  // namespace

std::unique_ptr<Allocator> host_allocator() {
  return std::make_unique<HostAllocator>();
}
std::unique_ptr<Allocator> device_allocator() {
  return std::make_unique<DeviceAllocator>();
}

Scratch::Scratch(Backend backend, Allocator* allocator, const Plan& plan, cudaStream_t stream)
    : allocator_(allocator), plan_(plan), stream_(stream) {
  if (allocator_ == nullptr) {
    default_ = backend == Backend::cpu ? host_allocator() : device_allocator();
    allocator_ = default_.get();
  }
  if (plan_.total > 0) base_ = static_cast<char*>(allocator_->allocate(plan_.total, stream_));
}

Scratch::~Scratch() {
  if (base_ != nullptr) allocator_->release(base_, plan_.total, stream_);
}

}  // namespace xent::linear
