// What the CUDA test files share: the visible device count, a skip where there is no GPU (CI),
// a CUDA status check, and a device buffer that frees itself.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace xtest::gpu {

// Devices visible, 0 where there is no usable driver (never throws).
inline int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(n) {
    if (n > 0) ck(cudaMalloc(&p, n), "cudaMalloc");
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  // up() and poison() wait until the device holds the data: they run on the legacy default
  // stream (a pageable cudaMemcpy may return before its DMA lands, and cudaMemset is
  // asynchronous), which a non-blocking stream's later work does not wait for.
  void up(const void* h) {
    if (bytes) ck(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  void down(void* h) const {
    if (bytes) ck(cudaMemcpy(h, p, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  void poison() {
    if (bytes) ck(cudaMemset(p, 0x7f, bytes), "cudaMemset");
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
};

}  // namespace xtest::gpu

#define SKIP_WITHOUT_GPU() \
  if (xtest::gpu::device_count() == 0) GTEST_SKIP() << "no CUDA device visible"
