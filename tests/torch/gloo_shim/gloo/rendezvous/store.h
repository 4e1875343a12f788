// Test-only stand-in for Gloo's header (see README.md). ProcessGroupGloo::GlooStore derives from
// it; the tests never make one (libtorch_cpu does, with the real class).
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace gloo::rendezvous {
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys,
                    const std::chrono::milliseconds& timeout) = 0;
};
}  // namespace gloo::rendezvous
