// xent_dist_bench's operation, as a collective's file is to nccl-tests' common harness: xent's
// forward + backward on this rank's vocabulary shard, its buffers, its check against the
// independent fp64 reference, and its byte and memory models. The harness (harness.cpp) decides
// what to run when and times it; nothing here takes a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "device.h"
#include "options.h"
#include "xent/xent.h"

namespace xb {

// Columns of the widest shard: the padded vocabulary split as evenly as it goes, in rank order.
int64_t widest_shard(int64_t padded, int ranks);

// One pass over a shard of `tokens` rows of `width` columns.
double shard_bytes(double tokens, double width, int dtype);

// The byte model: the 3-pass roofline reads the logits shard twice
// (forward's stats, the gradient pass) and writes the gradient once. GB/s, %roof and the CPU
// backend's time estimate all come from it.
double bytes_moved(int64_t tokens, int64_t width, int dtype);

// What one rank holds at once at `tokens` rows of `width` columns, in bytes (a size's buffers are
// freed before the next, and the library's workspace grows to the largest). A double, not an
// int64: tokens x width x 4 bytes can pass 2^63 with two flags each below 2^31, and must be
// refused, not wrapped round to a size that fits.
double bytes_needed(const Settings& s, double tokens, double width, int ranks);

// The bytes one size and mode goes over on the CPU backend: generating the logits, `calls`
// forward + backward and, with --check, the fp64 reference (the global row twice and the shard
// once, each about 3 passes' worth: a hash and an exp per element).
double bytes_gone_over(const Settings& s, int64_t tokens, int64_t width, int calls);

// The library's dtype of a DTypeCode.
xent::DType to_xent_dtype(int dtype);
// FNV-1a over bytes, from `h` (0xcbf29ce484222325 to start): the ranks compare their outputs' bits.
uint64_t fnv1a(uint64_t h, const void* data, size_t bytes);

// Shared with the fused lm head (linear_op.cpp): this rank's shard of the padded vocabulary, split
// as evenly as it goes in rank order (plan_shard: a collective), and the options the settings give
// every operation.
xent::Options plan_options(const Settings& s, xent::Group& group, xent::Shard& shard);
// One size's problem on this rank (the reference sees exactly the fp32 values the library is
// given).
Problem make_problem(const Settings& s, const xent::Shard& shard, const xent::Options& opt,
                     int64_t tokens);
// Runs an operation's first calls of a size and returns the memory xent took beyond its inputs
// and outputs over the sweep so far: `extra` plus what the memory in use grew by, at least the
// workspace itself (the allocator rounds small allocations up to its pages).
int64_t extra_after(Device& dev, const xent::Group& group, int64_t extra,
                    const std::function<void()>& calls);

class Operation {
 public:
  // Plans this rank's shard: a collective.
  Operation(const Settings& s, xent::Group& group, Device& dev);
  ~Operation();

  // The buffers of one size; the previous size's are freed first.
  void resize(int64_t tokens);
  // The all-gather of the stats records alone, as forward issues it: the communication inside
  // forward. Its buffers live as long as the returned step.
  std::function<void()> all_gather();
  // Pristine logits, then reserve and the first forward + backward in `mode` ("fused" or
  // "deferred"), whose outputs verify() checks; updates extra_bytes().
  void first_call(const std::string& mode);
  // The values of this rank out of tolerance after first_call(); the first one goes to stderr.
  int64_t verify();
  // What the harness times. Later calls run on the gradient of the one before: the same work on
  // finite values.
  void forward();
  void backward();
  // The path forward takes in the mode of the last first_call (xent::forward_path).
  std::string path() const;
  // After the device is synchronised: throws if a target was out of range.
  void check_errors();
  // Memory xent took beyond its inputs and outputs over the sweep so far (the workspace only
  // grows), at least the workspace itself: the allocator rounds small allocations up to its pages.
  int64_t extra_bytes() const { return extra_bytes_; }

 private:
  struct Size;
  const Settings& s_;
  xent::Group& group_;
  Device& dev_;
  int rank_ = 0;
  xent::Shard shard_;
  xent::Options opt_;
  std::string mode_;
  std::unique_ptr<Size> size_;
  int64_t extra_bytes_ = 0;
};

}  // namespace xb
