// xent's fused lm head: the output projection and the vocab-parallel loss in one operation, so
// that the logits never exist in full (docs/linear.md). Hidden states [N, H] and this rank's
// weight shard [V_local, H] go in; the loss, lse, d_hidden and d_weight come out. The logits are
// made in chunks of rows whose memory LinearOptions bounds, and each chunk goes through the same
// statistics record, exchange and finalize as forward() on a logits shard.
//
// CPU backend: fp32 GEMMs (a CBLAS where the build found one). CUDA backend: cuBLASLt GEMMs with
// fp32 accumulation (never TF32) and fp32 logits; for 16-bit inputs the gradient of the logits is
// rounded to their dtype before the two GEMMs that consume it, as the unfused path's is
// (docs/linear.md, "Accuracy").
#pragma once

#include "xent/xent.h"

namespace xent {

// A row-major matrix: rows x cols elements, row r starting at data + r * row_stride (elements,
// >= cols). Host memory for the CPU backend, device memory for CUDA. Not owned.
struct MatrixView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;
};

struct LinearOptions {
  // false: every rank holds the same hidden [N, H] and targets [N]. true (sequence parallelism):
  // rank k holds its own N_k rows of hidden and their targets, N_k the same on every rank, and
  // the problem is over the ranks' rows in rank order, gathered chunk by chunk.
  bool sequence_parallel = false;
  // Rows of this rank's hidden per chunk; with sequence_parallel every rank gives that many, so
  // a chunk's logits have ranks * chunk_rows rows. 0: the most that max_chunk_bytes allows.
  int64_t chunk_rows = 0;
  // With chunk_rows = 0: a chunk's buffers take at most this many bytes, counted for the widest
  // rank's shard (it must hold one row of each rank). CPU: its logits and their gradient in fp32,
  // 8 bytes per row and column. CUDA: its gradient in the inputs' dtype (2 or 4 bytes per row and
  // column) and, for 16-bit inputs, the fp32 logits of a sub-chunk of at most 512 rows. The
  // CUDA backend's other buffers: the fp32 d_weight accumulator where d_weight is not f32 and
  // there is more than one chunk ([V_local, H]), cuBLASLt's 32 MiB workspace. Where that
  // accumulator would be no smaller than the whole 16-bit gradient of every row (rows <= 2 H),
  // the chunk is every row instead (the gradient takes [rows, V_local] 16-bit beside this bound,
  // and the sub-chunk all of it): docs/linear.md, "The CUDA backend". 1 GiB: chunks of about
  // 3000 rows at V_local 128256, enough for d_weight's fp32 accumulation to hide under its GEMM
  // (256 MiB took 1.90x the three GEMMs' time at hidden 2048 on H100, 1 GiB 1.34x).
  size_t max_chunk_bytes = size_t(1) << 30;
  // d_weight += the gradient rather than = it (Megatron's main_grad); d_weight must be f32, and
  // its padding rows (past vocab_size) are left as they are.
  bool accumulate_d_weight = false;
};

// Where linear_forward writes (and linear_backward: d_hidden and d_weight only). "This rank's
// rows": all N without sequence parallelism (the same values on every rank), else its own N_k.
struct LinearOutputs {
  float* loss = nullptr;      // required: [1] for mean/sum (over every rank's rows), else [rows]
  float* lse = nullptr;       // [rows] global log-sum-exp; required for GradMode::deferred
  float* z_loss = nullptr;    // [rows] optional: each row's z-loss term w * lse^2
  int64_t* argmax = nullptr;  // [rows] optional: global argmax column (compute_accuracy)
  float* accuracy = nullptr;  // [1] optional: over every rank's valid rows (compute_accuracy)
  // [rows, H], hidden's dtype or f32: the gradient with respect to hidden, summed over the ranks'
  // shards. data null: not computed (every rank alike).
  MatrixView d_hidden{};
  // [V_local, H], weight's dtype or f32: the gradient with respect to this rank's weight shard,
  // over every rank's rows; padding rows 0. data null: not computed.
  MatrixView d_weight{};
};

// Forward of loss(hidden @ weight^T) on this rank's shard of the vocabulary. The weight's rows
// are the shard's columns: opt.vocab_start and opt.vocab_size as for forward() (plan_shard and
// apply), uneven shards and padding rows past vocab_size included (never read: their logits act
// as -inf). Every option of forward() holds.
// GradMode::fused: out.d_hidden and out.d_weight (at least one) are computed here, for
//   grad_output = opt.grad_scale, with no recompute; linear_backward is not called.
// GradMode::deferred: loss and lse only (d_hidden and d_weight null); linear_backward recomputes
//   each chunk's logits from the lse.
// GradMode::none: the loss only.
// Collective: every rank calls it with the same options, rows and hidden width (the CPU backend
// checks that across ranks on every call, and throws on every rank alike).
void linear_forward(const Group& group, MatrixView hidden, MatrixView weight, TargetsView targets,
                    const Options& opt, const LinearOptions& lopt, const LinearOutputs& out,
                    cudaStream_t stream = nullptr);

// Backward of GradMode::deferred: out.d_hidden and out.d_weight (at least one; the other fields
// of out are not read) from forward's lse (this rank's rows) and grad_output ([1], or [rows] for
// Reduction::none; null: 1), applied before the one rounding to their dtypes.
void linear_backward(const Group& group, MatrixView hidden, MatrixView weight, TargetsView targets,
                     const float* lse, const float* grad_output, const Options& opt,
                     const LinearOptions& lopt, const LinearOutputs& out,
                     cudaStream_t stream = nullptr);

}  // namespace xent
