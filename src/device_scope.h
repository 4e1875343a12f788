// DeviceScope: the group's (or a device's) device, current for one call (src/group.cpp, api.cpp,
// layout.cpp, cuda::check_device).
#pragma once

#include "error.h"
#include "xent/xent.h"

namespace xent {

// Makes the group's device current for one call and restores the caller's after it, as NCCL's
// enqueue does: a call on another device's group neither launches nor allocates on the wrong one.
class DeviceScope {
 public:
  explicit DeviceScope(const Group& group) : DeviceScope(group.backend(), group.device()) {}
  DeviceScope(Backend backend, int device) {
    if (backend != Backend::cuda || device < 0) return;
    check_cuda(cudaGetDevice(&saved_), "cudaGetDevice");
    if (saved_ == device) return;
    check_cuda(cudaSetDevice(device), "cudaSetDevice (the group's device)");
    switched_ = true;
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(saved_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int saved_ = -1;
  bool switched_ = false;
};

}  // namespace xent
