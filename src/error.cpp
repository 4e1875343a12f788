#include "error.h"

#include "xent/xent.h"

namespace xent {

void fail(const std::string& message) {
  throw Error("xent: " + message);
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(std::string(what) + " failed: " + cudaGetErrorString(status));
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  return capture != cudaStreamCaptureStatusNone;
}

void check_nccl(ncclResult_t status, const char* what) {
  if (status != ncclSuccess) fail(std::string(what) + " failed: " + ncclGetErrorString(status));
}

void check_placement(const Group& group, const Options& opt, const void* ptr, const char* name) {
  if (ptr == nullptr || group.backend() == Backend::cpu || !opt.check_pointers) return;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();
    fail(std::string(name) + " is not a CUDA pointer, but the group's backend is cuda");
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    fail(std::string(name) + " is host memory, but the group's backend is cuda: pass " +
         "device memory (or use a CPU group)");
}

}  // namespace xent
