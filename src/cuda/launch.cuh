// How the CUDA backend launches: the device's properties (read once per
// device), the launch itself (programmatic dependent launch where the problem asks for it and the
// device takes it), and the runtime-to-template dispatch that picks a kernel instantiation.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <string>
#include <type_traits>
#include <utility>

#include "core/problem.h"
#include "xent/xent.h"

namespace xent::cuda::detail {

// A value per device, read once by `read` (a nonzero int); one cache per call site (a function-
// local static). Devices past the cache are read on every call, never given another's value.
class PerDevice {
 public:
  template <typename F>
  int get(int dev, F&& read) {
    const bool cached = dev >= 0 && dev < static_cast<int>(v_.size());
    int v = cached ? v_[dev].load(std::memory_order_relaxed) : 0;
    if (v == 0) {
      v = read();
      if (cached) v_[dev].store(v, std::memory_order_relaxed);
    }
    return v;
  }

 private:
  std::array<std::atomic<int>, 1024> v_{};  // 0: not read yet
};

// The current device (cudaGetDevice, checked).
int current_device();

// What the launches need of the current device and of the kernel image loaded on it. The
// Hopper-only paths (programmatic dependent launch, thread-block clusters, distributed shared
// memory) are compiled out of code for older architectures, so they are chosen from the image:
// a build for sm_80 run on an H100 takes the sm_80 paths. Every kernel of the library is built
// with the same architectures, so one probe kernel's image (cudaFuncGetAttributes' ptxVersion:
// the __CUDA_ARCH__ its code was compiled for, also when the driver compiles PTX for a newer
// device) stands for all of them.
struct DeviceInfo {
  int sms;
  bool pdl;          // and clusters: both the device and the image are of 9.0 or newer
  bool fast_memory;  // more than 16 bytes of memory bandwidth per multiprocessor clock
};
// Throws xent::Error where the device is older than compute capability 8.0, or where the
// library holds no kernel image that runs on it (naming the device and the build's
// architectures). Read once per device.
DeviceInfo device_info();

// Throws xent::Error for a launch that failed (clearing the error, so that the caller's next
// check does not report it again).
void launch_failed(const char* name, cudaError_t e);

// kernel<<<grid, block, smem, stream>>>(args...) in clusters of `cluster` blocks (1: none), with
// programmatic stream serialization when `pdl` and the device takes it; reports the launch's own
// status only (cudaGetLastError here would also report an earlier, unrelated asynchronous error
// of the caller's as this launch's).
template <typename... Params, typename... Args>
void launch_clusters(const char* name, void (*kernel)(Params...), unsigned grid, unsigned block,
                     unsigned cluster, size_t smem, bool pdl, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  const DeviceInfo device = device_info();  // also refuses a device the image cannot run on
  if (pdl && device.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    // A cluster launch of code built without clusters would run its blocks unsynchronised.
    if (!device.pdl) launch_failed(name, cudaErrorInvalidConfiguration);
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {cluster, 1, 1};
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) launch_failed(name, e);
}

// How many clusters of `cluster` blocks (1: plain blocks) of `block` threads and `smem` bytes of
// dynamic shared memory the current device holds at once; at least 1, or it throws.
template <typename... Params>
int resident_clusters(void (*kernel)(Params...), unsigned block, unsigned cluster, size_t smem) {
  int n = 0;
  if (cluster > 1) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(cluster);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim = {cluster, 1, 1};
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
    if (e != cudaSuccess) launch_failed("cudaOccupancyMaxActiveClusters", e);
  } else {
    const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, smem);
    if (e != cudaSuccess) launch_failed("cudaOccupancyMaxActiveBlocksPerMultiprocessor", e);
    n *= device_info().sms;
  }
  if (n < 1)
    launch_failed("a resident grid (the kernel fits no multiprocessor)",
                  cudaErrorInvalidConfiguration);
  return n;
}

template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), unsigned grid, unsigned block, bool pdl,
            cudaStream_t stream, Args&&... args) {
  launch_clusters(name, kernel, grid, block, 1, 0, pdl, stream, std::forward<Args>(args)...);
}

// f(std::bool_constant<b>{}): a run-time flag as a template argument.
template <typename F>
decltype(auto) dispatch_bool(bool b, F&& f) {
  return b ? f(std::true_type{}) : f(std::false_type{});
}

// Rows and columns as the kernels index them: columns in int (checked), rows in int64; and the
// data aligned to its element size.
void check_shape(const core::Problem& p, LogitsView logits, const char* name = "logits");

}  // namespace xent::cuda::detail
