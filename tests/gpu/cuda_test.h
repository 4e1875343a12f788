// What the CUDA test files share: the visible device count, a skip where there is no GPU (CI),
// a CUDA status check, the single pass's choice for capped rows, and a device buffer that frees
// itself.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
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

// Whether forward_path takes the single pass for capped rows (a softcap) of `real_cols` columns
// of `elem_bytes`-byte logits on the current device, where the rows fit it: not for 2-byte rows
// wider than 16384 columns (the smallest shape) where the memory's peak bandwidth exceeds 16
// bytes per multiprocessor clock (H200; not H100), as xent measured them slower there. An
// attribute the driver does not report counts as 0, as in the library: the single pass stays.
inline bool capped_rows_take_single_pass(int elem_bytes, int64_t real_cols) {
  int dev = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  const auto attribute = [dev](cudaDeviceAttr a) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, a, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0.0;
    }
    return static_cast<double>(v);
  };
  const double mem_khz = attribute(cudaDevAttrMemoryClockRate);
  const double bus_bits = attribute(cudaDevAttrGlobalMemoryBusWidth);
  const double sm_khz = attribute(cudaDevAttrClockRate);
  const double sms = attribute(cudaDevAttrMultiProcessorCount);
  const double bytes_per_clock =
      sm_khz * sms > 0.0 ? 2.0 * mem_khz * bus_bits / 8.0 / (sm_khz * sms) : 0.0;
  return !(elem_bytes == 2 && bytes_per_clock > 16.0 && real_cols / 8 > 2048);
}

// The architecture the test binary's kernels run as on the current device (kernel_arch.cu).
int kernel_arch();

// Whether the library may launch thread-block clusters on the current device: the device and
// the code that runs on it are both of 9.0 or newer (a build for sm_80 on an H100 has none).
inline bool clusters_available() {
  int dev = 0, major = 0;
  ck(cudaGetDevice(&dev), "cudaGetDevice");
  ck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "compute capability");
  return major >= 9 && kernel_arch() >= 90;
}

// Whether the single pass holds rows of `real_cols` columns of `elem_bytes`-byte logits: 4096
// 16-byte packs in one block's registers, 32768 in a cluster of 4 blocks' registers and shared
// memory.
inline bool single_pass_holds(int elem_bytes, int64_t real_cols) {
  const int64_t packs = (real_cols * elem_bytes + 15) / 16;
  return packs <= (clusters_available() ? 32768 : 4096);
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
