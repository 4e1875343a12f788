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

DeviceInfo device_info() {
  static PerDevice cache;  // sms * 2 + pdl
  const int dev = current_device();
  const int v = cache.get(dev, [dev] {
    int sms = 0, major = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)");
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
               "cudaDeviceGetAttribute(cudaDevAttrComputeCapabilityMajor)");
    return sms * 2 + (major >= 9 ? 1 : 0);
  });
  return DeviceInfo{v / 2, (v & 1) != 0};
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
