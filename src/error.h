// xent's one error module. Every error the library raises is an xent::Error (xent/xent.h) whose
// message starts with "xent: " and names the argument and its value, or the CUDA / NCCL call, and
// the rule it broke. The LibTorch adapter raises its own checks through XENT_CHECK
// (torch/internal.h), which writes the same prefix.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "xent/xent.h"

namespace xent {

// Throws xent::Error("xent: " + message).
[[noreturn]] void fail(const std::string& message);
// Throw xent::Error naming the call `what` and the CUDA / NCCL error string when status is one.
void check_cuda(cudaError_t status, const char* what);
void check_nccl(ncclResult_t status, const char* what);
// Whether `stream` is being captured into a CUDA graph (nothing may then synchronise).
bool capturing(cudaStream_t stream);
// On a group of the CUDA backend with Options::check_pointers, throws where `ptr` (not null) is
// not device (or managed) memory, naming the argument `name`: a kernel would fault on it.
void check_placement(const Group& group, const Options& opt, const void* ptr, const char* name);

}  // namespace xent
