// The CUDA backend's launch helpers (launch.cuh) and device_count().
#include <climits>
#include <cstdint>
#include <string>

#include "backend.h"
#include "cuda/launch.cuh"
#include "error.h"

namespace xent::cuda {
namespace detail {

int current_device() {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  return dev;
}

namespace {
int attribute(cudaDeviceAttr a, int dev, const char* name) {
  int v = 0;
  check_cuda(cudaDeviceGetAttribute(&v, a, dev),
             (std::string("cudaDeviceGetAttribute(") + name + ")").c_str());
  return v;
}
// 0 where the driver does not report it (the choice it feeds then keeps its default).
int optional_attribute(cudaDeviceAttr a, int dev) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, a, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return v;
}
}  // namespace

DeviceInfo device_info() {
  static PerDevice cache;  // sms * 4 + fast_memory * 2 + pdl
  const int dev = current_device();
  const int v = cache.get(dev, [dev] {
    const int sms = attribute(cudaDevAttrMultiProcessorCount, dev, "MultiProcessorCount");
    const int major = attribute(cudaDevAttrComputeCapabilityMajor, dev, "ComputeCapabilityMajor");
    // Peak figures, in kHz and bits (double data rate): H100 SXM 12.8 bytes per clock, H200 18.8.
    const double mem_khz = optional_attribute(cudaDevAttrMemoryClockRate, dev);
    const double bus_bits = optional_attribute(cudaDevAttrGlobalMemoryBusWidth, dev);
    const double sm_khz = optional_attribute(cudaDevAttrClockRate, dev);
    const double per_clock =
        sm_khz > 0.0 && sms > 0 ? mem_khz * bus_bits * 2.0 / 8.0 / (sm_khz * sms) : 0.0;
    return sms * 4 + (per_clock > 16.0 ? 2 : 0) + (major >= 9 ? 1 : 0);
  });
  return DeviceInfo{v / 4, (v & 1) != 0, (v & 2) != 0};
}

void launch_failed(const char* name, cudaError_t e) {
  cudaGetLastError();
  fail(std::string("launch of ") + name + " failed: " + cudaGetErrorString(e));
}

void check_shape(const core::Problem& p, LogitsView logits, const char* name) {
  if (p.cols > INT_MAX - 64)
    fail(std::string(name) + ".cols = " + std::to_string(p.cols) +
         ": the CUDA backend takes at most 2^31 - 65 columns per shard");
  if (reinterpret_cast<uintptr_t>(logits.data) % dtype_size(logits.dtype) != 0)
    fail(std::string(name) + ".data is not aligned to its element size (" +
         to_string(logits.dtype) + ")");
}

}  // namespace detail

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace xent::cuda
