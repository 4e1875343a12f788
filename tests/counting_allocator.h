// An xent::Allocator of host memory that counts its calls and checks that each block comes back
// whole, last taken first (a call's scratch is one block at a time): for the tests of
// Options::allocator and LinearOptions::allocator on the CPU backend.
#pragma once

#include <gtest/gtest.h>
#include <xent/xent.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace xtest {

class CountingAllocator final : public xent::Allocator {
 public:
  void* allocate(size_t bytes, cudaStream_t) override {
    ++allocations;
    largest = std::max(largest, bytes);
    held.emplace_back(bytes + 256);
    char* p = held.back().data();
    return p + (256 - reinterpret_cast<uintptr_t>(p) % 256) % 256;  // aligned to 256, as promised
  }
  void release(void* p, size_t bytes, cudaStream_t) override {
    ++releases;
    EXPECT_TRUE(!held.empty() && held.back().size() == bytes + 256 &&
                static_cast<char*>(p) >= held.back().data() &&
                static_cast<char*>(p) < held.back().data() + 256)
        << "a block handed back that is not the last one taken, or not whole";
    if (!held.empty()) held.pop_back();
  }
  int allocations = 0, releases = 0;
  size_t largest = 0;
  std::vector<std::vector<char>> held;  // the blocks not yet handed back
};

}  // namespace xtest
