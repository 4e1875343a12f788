// xent_dist_bench --hidden H: the fused lm head (xent::linear_forward / linear_backward) on this
// rank's vocabulary shard of the weight, as op.h's Operation is for the logits. Its buffers, the
// three GEMMs alone that it is measured against (gemm3), its check against an independent fp64
// reference, and its memory model. The harness picks it when --hidden is set and times it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "device.h"
#include "options.h"
#include "xent/linear.h"
#include "xent/xent.h"

namespace xb {

// What one rank holds at once at `tokens` rows of `width` columns and hidden width s.hidden, in
// bytes, as bytes_needed (op.h) is for the logits.
double linear_bytes_needed(const Settings& s, double tokens, double width, int ranks);

// The bytes one size and mode goes over on the CPU backend, in the units of bytes_gone_over (op.h):
// its multiply-adds (the GEMMs, and the fp64 reference with --check) counted as bytes.
double linear_bytes_gone_over(const Settings& s, int64_t tokens, int64_t width, int calls);

// The harness calls it as it calls Operation (op.h): resize, first_call, verify, then forward and
// backward timed; gemm3 stands where Operation's all_gather does.
class LinearOperation {
 public:
  LinearOperation(const Settings& s, xent::Group& group, Device& dev);  // a collective
  ~LinearOperation();

  void resize(int64_t tokens);
  // The three GEMMs alone (logits = hidden W^T, d_hidden = G W, d_weight = G^T hidden; G the
  // logits' gradient [tokens, V_local] in the inputs' dtype): cuBLAS, or the CBLAS on the CPU.
  // On GPUs at TP > 1 then d_hidden's sum over the ranks (an all-reduce of its bytes).
  // Empty where there is none (a CPU build without a CBLAS). Its buffers live as long as the step.
  std::function<void()> gemm3();
  void first_call(const std::string& mode);
  // Loss, lse, d_hidden and this rank's d_weight against the fp64 reference: the wrong values.
  int64_t verify();
  void forward();
  void backward();  // fused: nothing (linear_forward made the gradients)
  void check_errors();
  int64_t extra_bytes() const { return extra_bytes_; }
  std::string path() const { return path_; }  // the schedule the plan took

 private:
  struct Size;
  struct Gemm;
  const Settings& s_;
  xent::Group& group_;
  Device& dev_;
  int rank_ = 0;
  xent::Shard shard_;
  xent::Options opt_;
  std::string mode_;
  std::unique_ptr<Size> size_;
  std::shared_ptr<Gemm> gemm_;
  int64_t extra_bytes_ = 0;
  std::string path_;
  // The scratch of the calls, counted: the most held at once is the extra column.
  struct Counting;
  std::shared_ptr<Counting> alloc_;
  xent::LinearOptions lopt_;
};

}  // namespace xb
