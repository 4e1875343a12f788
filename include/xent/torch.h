// xent for LibTorch: vocab-parallel cross-entropy as an autograd-aware function of torch tensors,
// over a c10d ProcessGroup. Built only with -DXENT_WITH_TORCH=ON (library xent_torch, which also
// registers the operator torch.ops.xent.vocab_parallel_cross_entropy; see docs/torch.md).
//
//   auto r = xent::torch::vocab_parallel_cross_entropy(logits_shard, target, tp_group, opt);
//   r.loss.backward();   // d loss / d logits_shard, this rank's columns only
//
// CUDA tensors go through the group's NCCL communicator (ProcessGroupNCCL, adopted: no second
// communicator is created) on the current CUDA stream; CPU tensors through the CPU backend, whose
// few bytes per row travel by the group's own all-gather (Gloo, for instance).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "xent/linear.h"
#include "xent/xent.h"

namespace xent::torch {

struct CrossEntropyOptions {
  int64_t ignore_index = -100;   // rows with this target: loss 0, gradient 0, not in the mean
  double label_smoothing = 0.0;  // in [0, 1), as torch.nn.functional.cross_entropy defines it
  double z_loss = 0.0;           // weight w >= 0 of w * lse^2, added to each row's loss
  double softcap = 0.0;          // > 0: logits become c * tanh(x / c) first; 0: off
  Reduction reduction = Reduction::mean;
  // fused: forward also computes the gradient (for grad_output = grad_scale); backward revisits
  // only rows whose grad_output differs from it (see grad_scale).
  // deferred: forward only reads the logits; backward computes the gradient from the saved lse.
  // none: no gradient at all (the loss does not require grad).
  // Without autograd (the logits do not require grad, or grad mode is off) it is always none.
  GradMode grad_mode = GradMode::fused;
  // true: the gradient is written over the logits' own storage (no N x V copy): fused mode in
  // forward, deferred mode in backward. The logits' version counter is bumped when that happens,
  // so autograd refuses any later backward that needs their old values; the logits must not be a
  // leaf (or a view of one). false: the logits are never written; the gradient goes into a new
  // tensor (fused: by forward; deferred: by backward, which reads the logits once). With
  // reduction none (a per-row grad_output), fused in place takes the deferred path, which applies
  // grad_output before its one rounding.
  bool inplace_grad = false;
  // fused: the gradient that forward computes is for grad_output = grad_scale rather than 1, so
  // that a backward whose grad_output is grad_scale (loss / accumulation steps, a loss scale)
  // has nothing left to do. Any other grad_output is still applied: without inplace_grad the
  // rows are recomputed from the logits (kept until backward) and rounded once; with it the
  // logits are gone and, for mean or sum, the gradient is rescaled, rounded twice (more than
  // half an ulp of the logits' dtype: a mean loss times 2.5 measured 1.12 ulps in bfloat16, 1.75
  // in float16): pass the grad_output you will use here, or use deferred, for a gradient rounded
  // once. Finite and > 0; must stay 1 with deferred.
  double grad_scale = 1.0;
  // This rank's first global column. -1: computed once from all ranks' widths (the logits'
  // columns, rank order) and cached per (group, width, vocab_size): a collective on first use.
  int64_t vocab_start = -1;
  // Real classes; columns at or past it are padding (gradient 0). -1: the sum of all ranks'
  // widths (or, with an explicit vocab_start on one rank, vocab_start + columns).
  int64_t vocab_size = -1;
  bool return_lse = false;        // CrossEntropyResult::lse
  bool return_z_loss = false;     // CrossEntropyResult::z_loss
  bool compute_accuracy = false;  // CrossEntropyResult::argmax and ::accuracy
};

struct CrossEntropyResult {
  at::Tensor loss;    // float32; [] for mean and sum, [rows] for none. The only differentiable one
  at::Tensor lse;     // float32 [rows]: the global log-sum-exp of each row (return_lse)
  at::Tensor z_loss;  // float32 [rows]: w * lse^2, 0 on ignored rows (return_z_loss)
  at::Tensor argmax;  // int64 [rows]: the global argmax column (compute_accuracy)
  at::Tensor accuracy;  // float32 []: share of non-ignored rows whose argmax is the target
};

// logits: [rows, this rank's columns], float32/bfloat16/float16, CPU or CUDA, contiguous in the
// last dimension (any row stride). target: [rows] int64 or int32 global class ids, same device,
// same on every rank. group: the tensor-parallel group (null: one rank, no communication).
// Errors are c10::Error (RuntimeError in Python) naming the argument and the value.
CrossEntropyResult vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                                const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                const CrossEntropyOptions& options = {});

// The loss only (CrossEntropyResult::loss).
at::Tensor vocab_parallel_cross_entropy_loss(const at::Tensor& logits, const at::Tensor& target,
                                             const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                             const CrossEntropyOptions& options = {});

// The fused lm head: the loss of hidden @ weight^T, this rank's shard of the vocabulary, without
// the logits ever existing in full (xent/linear.h; docs/torch.md). CPU and CUDA tensors.
struct LinearCrossEntropyOptions {
  // The loss's options: every field of CrossEntropyOptions but inplace_grad, return_lse,
  // return_z_loss and compute_accuracy (which must stay false). grad_mode fused (the default):
  // forward computes the gradients for grad_output = grad_scale, and backward recomputes them
  // (rounded once) only where grad_output is something else; deferred: backward recomputes.
  CrossEntropyOptions loss;
  // true: hidden and target are this rank's own rows (the same count on every rank), the problem
  // is over every rank's rows in rank order, and d_hidden is this rank's rows. false: every rank
  // holds the same hidden and target, and d_hidden is summed over the ranks.
  bool sequence_parallel = false;
  int64_t chunk_rows = 0;  // rows of hidden per chunk (LinearOptions::chunk_rows); 0: the budget's
  // The bound on the call's scratch (LinearOptions::max_scratch_bytes; 0: the default budget),
  // taken from PyTorch's caching allocator for CUDA tensors. max_chunk_bytes: its former name,
  // honoured where max_scratch_bytes is 0.
  int64_t max_scratch_bytes = 0;
  int64_t max_chunk_bytes = 0;
  LinearSchedule schedule = LinearSchedule::automatic;  // LinearOptions::schedule
};

// hidden: [..., H] float32/bfloat16/float16 on the CPU; weight: [V_local, H], hidden's dtype
// (its rows are this rank's columns of the vocabulary); target: hidden's shape without the last
// dimension, int64 or int32. Returns the float32 loss, [] or target's shape for reduction none;
// differentiable for hidden and weight.
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& target,
                                const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                const LinearCrossEntropyOptions& options = {});

// The xent::Group used for `group` on `device` (created on first use and cached while the
// process group lives, so that its workspace persists). For CUDA: the group's NCCL communicator
// for that device, created (collectively) if the process group has not made it yet. Use it to
// call Group::reserve before CUDA graph capture, or Group::check_errors.
Group group_for(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device);

// The core options equivalent to `options` for logits of `cols` columns on `group` (plans the
// shard when vocab_start is -1, as the call itself would), e.g. for group_for(...).reserve().
Options core_options(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::Device device,
                     int64_t cols, const CrossEntropyOptions& options);

// "mean" / "sum" / "none" and "fused" / "deferred" / "none"; anything else is an error.
Reduction parse_reduction(const std::string& name);
GradMode parse_grad_mode(const std::string& name);

}  // namespace xent::torch
