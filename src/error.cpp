#include "error.h"

#include "xent/xent.h"

namespace xent {

void fail(const std::string& message) {
  throw Error("xent: " + message);
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(std::string(what) + " failed: " + cudaGetErrorString(status));
}

void check_nccl(ncclResult_t status, const char* what) {
  if (status != ncclSuccess) fail(std::string(what) + " failed: " + ncclGetErrorString(status));
}

}  // namespace xent
