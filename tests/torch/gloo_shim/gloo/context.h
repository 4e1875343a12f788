// Test-only stand-in for Gloo's header (see README.md): the declaration that
// ProcessGroupGloo::setTimeout's inline body names (it is compiled in libtorch_cpu, not here).
#pragma once

#include <chrono>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
