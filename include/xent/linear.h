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

// How the fused lm head orders its work (docs/linear.md, "Schedules"):
//   fast: chunks of rows; each chunk's logits made once, and its gradient consumed by the
//         d_hidden and d_weight GEMMs at once (three GEMMs). A 16-bit d_weight over several
//         chunks is accumulated in fp32 scratch ([V_local, H] floats) and rounded once at the end.
//   lean: forward keeps only each row's statistics (chunks of the vocabulary); the gradient
//         sweeps the vocabulary in chunks, making each chunk's logits again, writing that chunk's
//         d_weight rows complete (rounded once, no [V_local, H] accumulator) and adding its part
//         of d_hidden to an fp32 [rows, H] accumulator (four GEMMs).
//   automatic: fast where d_weight accumulates in fp32 anyway (f32 d_weight, accumulate_d_weight,
//         or no d_weight), or where the budget holds fast's chunks of at least kFastRows rows;
//         else lean. Both are exact: the same loss (to fp32 rounding) and gradients rounded once.
enum class LinearSchedule { automatic, fast, lean };
const char* to_string(LinearSchedule s);

// Which GEMMs make the logits (docs/linear.md, "GEMM engines"):
//   cublaslt: cuBLASLt writes fp32 logits, and the logits path's kernels read them back (every
//         CUDA build and device; the CPU backend's BLAS is named so too);
//   epilogue: lean's logits GEMMs are xent's own for sm_90a (CUTLASS), whose epilogues work on
//         the fp32 accumulators: the forward's writes their statistics, the sweep's the chunk's
//         16-bit gradient, and neither writes fp32 logits. The lean schedule with gradients,
//         bf16 inputs, a build with the kernels (CUTLASS's headers found, sm_90 among its
//         architectures), an H100 or H200, rows of hidden and weight 16-byte aligned;
//   automatic: epilogue where every rank can run it and the plan takes lean, else cublaslt.
// The d_weight and d_hidden GEMMs are cuBLASLt's on either, and so are fast's.
enum class LinearGemm { automatic, cublaslt, epilogue };
const char* to_string(LinearGemm g);

struct LinearOptions {
  // false: every rank holds the same hidden [N, H] and targets [N]. true (sequence parallelism):
  // rank k holds its own N_k rows of hidden and their targets, N_k the same on every rank, and
  // the problem is over the ranks' rows in rank order.
  bool sequence_parallel = false;
  LinearSchedule schedule = LinearSchedule::automatic;
  // The bound on every byte of scratch a call takes (chunks of logits and of their gradient,
  // accumulators, exchange buffers, cuBLASLt's workspace), counted for the widest rank's shard.
  // 0: the default, the larger of an eighth of the 16-bit logits [rows, V_local] that the call
  // replaces and what the lean schedule needs, of which lean spends no more than chunks of 4096
  // columns take (docs/linear.md, "Schedules and the budget"). A schedule that cannot fit in it
  // is refused, naming what it needs.
  size_t max_scratch_bytes = 0;
  // The former name of max_scratch_bytes, still honoured where max_scratch_bytes is 0 (its
  // former default of 1 GiB is no longer applied: leave both 0 for the default).
  size_t max_chunk_bytes = 0;
  // fast: rows of this rank's hidden per chunk (with sequence_parallel every rank gives that
  // many, so a chunk's logits have ranks * chunk_rows rows); lean: rows of each block of fp32
  // logits. 0: the most that the budget allows.
  int64_t chunk_rows = 0;
  // lean: columns of each chunk of the vocabulary (of this rank's shard). 0: from the budget.
  int64_t chunk_cols = 0;
  // The engine of the logits GEMMs (LinearGemm). epilogue where a rank cannot run it is refused,
  // saying why; so is epilogue with schedule fast.
  LinearGemm gemm = LinearGemm::automatic;
  // d_weight += the gradient rather than = it (Megatron's main_grad); d_weight must be f32, and
  // its padding rows (past vocab_size) are left as they are.
  bool accumulate_d_weight = false;
  // Scratch comes from here (see Allocator); null: from Options::allocator where that is set,
  // else the default.
  Allocator* allocator = nullptr;
};

// The plan a call takes (LinearOutputs::plan, linear_plan): the same on every rank.
struct LinearPlan {
  LinearSchedule schedule = LinearSchedule::fast;  // never automatic
  size_t budget = 0;         // the bound in force (LinearOptions, or the default)
  size_t scratch_bytes = 0;  // what the call allocates, within budget
  int64_t chunk_rows = 0;    // fast: this rank's rows per chunk; lean: rows per block of logits
  int64_t chunk_cols = 0;    // lean: vocabulary columns per chunk; fast: the shard's
  int64_t chunks = 0;        // fast: chunks of rows; lean: chunks of the vocabulary
  LinearGemm gemm = LinearGemm::cublaslt;  // the logits GEMMs' engine, never automatic
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
  // shards. data null: not computed (every rank alike, as its dtype).
  MatrixView d_hidden{};
  // [V_local, H], weight's dtype or f32: the gradient with respect to this rank's weight shard,
  // over every rank's rows; padding rows 0. data null: not computed.
  MatrixView d_weight{};
  // Optional: the plan the call took (host memory).
  LinearPlan* plan = nullptr;
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

// The plan linear_forward (or linear_backward, with `gradients` true) would take for these
// arguments: collective as they are (the ranks agree on it), computing nothing. For logs and
// benchmarks; the outputs' pointers need not be set, only their dtypes (d_hidden, d_weight: data
// non-null where they would be computed).
LinearPlan linear_plan(const Group& group, MatrixView hidden, MatrixView weight,
                       TargetsView targets, const Options& opt, const LinearOptions& lopt,
                       const LinearOutputs& out);

}  // namespace xent
