// Shared by the adapter's sources: the core's errors as LibTorch errors.
#pragma once

#include <c10/util/Exception.h>

#include <utility>

#include "xent/xent.h"

namespace xent::torch::detail {

// Runs a call into the core; its xent::Error (std::runtime_error) becomes a c10::Error, as the
// adapter's own checks are, so that C++ callers catch one type and Python sees a RuntimeError.
template <typename F>
decltype(auto) core_call(F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const xent::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace xent::torch::detail
