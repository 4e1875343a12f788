// Host-side validation of one call and the constants every backend derives from it.
#pragma once

#include <string>

#include "core/record.h"
#include "xent/xent.h"

namespace xent::core {

// What a forward/backward needs besides the pointers, validated once on the host.
struct Problem {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
  int64_t vocab_start = 0;
  int64_t vocab_size = 0;
  int64_t real_cols = 0;  // columns of this shard below vocab_size (the rest is padding)
  float inv_vocab = 0.0f;
  float smoothing = 0.0f;
  float z_loss = 0.0f;
  float softcap = 0.0f;
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
  float grad_scale = 1.0f;  // Options::grad_scale (1 unless fused)
  RecordLayout layout;
  bool programmatic_launch = true;  // Options::programmatic_launch
};

// Throws xent::Error naming the argument, the value and the rule.
Problem make_problem(LogitsView logits, TargetsView targets, const Options& opt);
void check_outputs(const Problem& p, const Options& opt, const Outputs& out);
// The out-of-place backward's `grad` against the logits of `p`: same dtype, rows and cols, its
// own row_stride >= cols, and either exactly the logits (same data and row_stride) or no
// intersection of the two address ranges.
void check_grad(const Problem& p, LogitsView logits, LogitsView grad);

// A fingerprint of everything all ranks must agree on (rows, layout, options, the logits' dtype,
// the targets), exchanged by the layout checks (docs/design of the contracts: README, "The API").
struct LayoutHeader {
  int64_t rows = 0, vocab_start = 0, width = 0, vocab_size = 0;
  int64_t options_hash = 0;
  int64_t dtype = 0;         // the logits' DType: one model, one dtype on every rank
  int64_t targets_hash = 0;  // of every target value (0 where not hashed: plan_shard, layouts)
  int64_t bad_row = -1, bad_target = -1;  // first target out of range on this rank, or -1
};
LayoutHeader make_header(const Problem& p, const Options& opt, DType dtype);
// A hash of the target values (host memory), equal on two ranks iff (barring collisions) they
// hold the same targets, whatever their index type.
int64_t hash_targets(const Problem& p, TargetsView targets);
// Checks the gathered headers of all ranks; every rank reaches the same verdict.
void check_headers(const LayoutHeader* all, int ranks, bool check_tiling);

}  // namespace xent::core
