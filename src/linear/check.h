// The fused lm head's checks, for every backend: one call's arguments on the host (shapes,
// dtypes, outputs, options), then what the ranks must agree on, exchanged and compared on every
// rank alike before any work.
#pragma once

#include "core/problem.h"
#include "linear/plan.h"
#include "xent/linear.h"

namespace xent::linear {

enum class Pass { forward, backward };

// One call, validated.
struct Call {
  // rows: this rank's rows of hidden; cols: the shard's columns (weight.rows); row_stride is the
  // chunk's logits', set per chunk.
  core::Problem p;
  MatrixView hidden, weight;
  TargetsView targets;
  LinearOutputs out;
  bool sequence_parallel = false;
  bool accumulate_d_weight = false;
  bool gradients = false;          // this pass computes d_hidden and d_weight (those that are set)
  bool single_pass = false;        // Options::single_pass: one rank's forward reads each logit once
  Allocator* allocator = nullptr;  // LinearOptions', else Options' (null: the default)
};

// Throws xent::Error naming the argument, its value and the rule. `lse`: backward's input.
Call check_call(Pass pass, MatrixView hidden, MatrixView weight, TargetsView targets,
                const Options& opt, const LinearOptions& lopt, const LinearOutputs& out,
                const float* lse);

struct Agreed {
  // Non-ignored rows of the whole problem (every rank's, with SP); the CPU backend's alone (the
  // CUDA backend counts them on the device).
  int64_t valid_rows = 0;
  Plan plan;
};

// Collective, on host values: exchanges a header of the call and throws on every rank alike where
// the ranks disagree (rows, hidden's width and dtype, options, chunks, the layout of the shards;
// on the CPU backend also the targets without sequence parallelism, and a target out of range);
// then plans the call (plan.h) from what they agree on. One rank exchanges nothing; several on
// CUDA synchronise the device, except while `stream` is being captured into a CUDA graph: then
// the ranks' shards come from the group's last exchange (check.cpp: exchange).
Agreed agree(const Group& group, const Call& call, const Options& opt, const LinearOptions& lopt,
             cudaStream_t stream);

}  // namespace xent::linear
