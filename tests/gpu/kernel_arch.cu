// The architecture that the tests' own kernel code runs as on the current device (__CUDA_ARCH__
// / 10, read on the device): the test binary is built with the library's architectures, so the
// runtime picks the same kind of image for both, and what the library may use (clusters, PDL:
// 90 and newer) can be checked against it without asking the library.
#include <cuda_runtime.h>

#include "cuda_test.h"

namespace xtest::gpu {
namespace {
__global__ void arch_kernel(int* out) {
#if defined(__CUDA_ARCH__)
  *out = __CUDA_ARCH__ / 10;
#endif
}
}  // namespace

int kernel_arch() {
  DevBuf d(sizeof(int));
  arch_kernel<<<1, 1>>>(static_cast<int*>(d.p));
  ck(cudaGetLastError(), "arch_kernel launch");
  ck(cudaDeviceSynchronize(), "arch_kernel");
  int arch = 0;
  d.down(&arch);
  return arch;
}

}  // namespace xtest::gpu
