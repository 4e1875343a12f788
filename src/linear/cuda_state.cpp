// What a CUDA group keeps between the fused lm head's calls (cuda.h: CudaState), made on a
// group's first call and destroyed with its workspace; both schedules' steps use it.
#include <memory>

#include "backend.h"
#include "error.h"
#include "linear/cuda.h"

namespace xent::linear {

CudaState::CudaState() {
  check_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int i = 0; i < 2; ++i) {
    check_cuda(cudaEventCreateWithFlags(&ready[i], cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming), "cudaEventCreate");
  }
}

CudaState::~CudaState() {
  for (int i = 0; i < 2; ++i) {
    if (ready[i]) cudaEventDestroy(ready[i]);
    if (done[i]) cudaEventDestroy(done[i]);
  }
  if (side) cudaStreamDestroy(side);
}

CudaState& cuda_state(const Group& group) {
  Workspace& ws = group.workspace();
  if (!ws.linear) ws.linear = std::make_shared<CudaState>();
  return *static_cast<CudaState*>(ws.linear.get());
}

}  // namespace xent::linear
