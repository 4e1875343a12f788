// xent_dist_bench: where the buffers live and how time is taken. The CUDA side times with events on
// one stream; the host side (CPU backend) with MPI_Wtime.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gen.h"

namespace xb {

class Device {
 public:
  virtual ~Device() = default;
  virtual bool gpu() const = 0;
  cudaStream_t stream() const { return stream_; }

  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;    // host -> buffer
  virtual void download(void* dst, const void* src, size_t bytes) = 0;  // buffer -> host (waits)
  virtual void zero(void* p, size_t bytes) = 0;
  virtual void fill_logits(const Problem& p, void* data) = 0;
  virtual void sync() = 0;
  // Memory in use now: device memory (cudaMemGetInfo) or the heap (mallinfo2), in bytes.
  virtual int64_t memory_in_use() = 0;
  // Memory a run may still take, in bytes: the GPU's free memory (cudaMemGetInfo), or the host's
  // available memory (MemAvailable in /proc/meminfo, else free pages); `how` says which, as in
  // "N bytes of <how>".
  virtual int64_t memory_available(std::string* how) = 0;
  // Copy bandwidth in bytes/s (read + written), best of several; `how` says what was measured.
  virtual double copy_bandwidth(std::string* how) = 0;

  // Timestamps: marks(n) readies n of them, mark(i) records one in stream order, ms(a, b) is the
  // time between two (after sync()).
  virtual void marks(int n) = 0;
  virtual void mark(int i) = 0;
  virtual double ms(int a, int b) = 0;

 protected:
  cudaStream_t stream_ = nullptr;
};

std::unique_ptr<Device> make_host_device();
std::unique_ptr<Device> make_cuda_device(int device);

// A buffer freed with its device.
class Buffer {
 public:
  Buffer(Device& d, size_t bytes) : d_(d), p_(d.alloc(bytes > 0 ? bytes : 1)), bytes_(bytes) {}
  ~Buffer() { d_.release(p_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  Device& d_;
  void* p_;
  size_t bytes_;
};

void cuda_ok(cudaError_t e, const char* what);

}  // namespace xb
