// Shared by the one-process adapter tests of xent_torch_tests (test_torch_results.cpp,
// test_torch_autograd.cpp, test_torch_operator.cpp, whose suites live in xtt): the operator's C++
// entry, no process group (one rank), and whether a GPU is there for the CUDA cases.
#pragma once

#include <c10/cuda/CUDAFunctions.h>

#include "torch_test_util.h"

namespace xtt {

using xent::torch::vocab_parallel_cross_entropy;

inline const c10::intrusive_ptr<c10d::ProcessGroup> kNoGroup;

inline bool have_gpu() {
  return c10::cuda::device_count() > 0;
}

}  // namespace xtt
