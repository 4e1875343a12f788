// The plan of the fused lm head, one for every backend (docs/linear.md, "Schedules" and "The
// budget"): which schedule a call takes, the sizes of its chunks, and every buffer it allocates,
// so that the call's scratch is one allocation of a known size, carved as laid out here. Every
// rank must make the same chunks (each is a collective), so the plan reads only what the ranks
// agree on (Shape).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "xent/linear.h"

namespace xent::linear {

// What the plan depends on; the same on every rank (check.cpp: agree).
struct Shape {
  Backend backend = Backend::cpu;
  int ranks = 1;  // the group's size
  bool sequence_parallel = false;
  int64_t rows = 0;           // this rank's rows of hidden
  int64_t widest = 0;         // the most columns of any rank's shard (padding included)
  int64_t hidden = 0;         // H
  DType inputs = DType::f32;  // hidden's (and weight's) dtype
  bool gradients = false;     // this pass computes d_hidden and/or d_weight
  bool d_hidden = false;      // computed (every rank alike)
  bool d_hidden_f32 = false;  // every rank's d_hidden is f32
  bool d_weight = false;      // computed on some rank
  bool d_weight_f32 = false;  // every rank's d_weight is f32 (or accumulated into: f32 too)
  bool accuracy = false;      // argmax and accuracy asked for
  int fields = 2;             // floats of a row's statistics record
  bool sums = false;          // the communicator sums (Communicator::has_sums) on every rank
  bool epilogue = false;      // every rank can run the epilogue engine (LinearGemm::epilogue)
  int64_t rows_all() const { return rows * (sequence_parallel ? ranks : 1); }
};

// The buffers of a call, each carved from the one allocation at an offset aligned to 256 bytes.
// kLogits, kGrad and kDHidden come one after another: lean's forward makes its fp32 logits in all
// three at once (their sweep has not begun).
enum Buf : int {
  kGemmWorkspace,  // cuBLASLt's workspace (CUDA)
  kLogits,         // fp32 logits of a chunk or block (then, where fp32, their gradient in place);
                   // the epilogue engine: forward's alone, with kGrad and kDHidden after it
  kGrad,           // the gradient of a chunk in 16 bits (CUDA, 16-bit inputs)
  kDHidden,        // fp32 d_hidden: lean's accumulator [rows, H]; fast's sum of a chunk (CPU)
  kHidden,         // every rank's rows of hidden (sequence parallelism; CPU: all rows in fp32)
  kMine,           // this rank's rows of hidden, contiguous (and fp32 on the CPU), to send
  kWeight,         // the weight's rows of a chunk in fp32 (CPU, 16-bit weight)
  kPartial,        // fp32 d_hidden of a chunk before the sum over the ranks (two on CUDA: overlap)
  kGathered,       // every rank's partial, for a rank-order sum (communicators without sums)
  kDWeight,        // fp32 d_weight: fast's accumulator [V, H], or lean's chunk (CPU) [cols, H]
  kPad,            // the CPU logits GEMM's padded last block (sgemm_nt_row_invariant)
  kRows,           // per-row floats: lse, loss, z-loss, grad_output (all rows or a chunk's)
  kTargets,        // every rank's targets as int64, twice (gathered, then in chunk order)
  kArgmax,         // per-row argmax (int64)
  kSend,           // this rank's statistics records
  kRecv,           // every rank's records (several ranks)
  kBlockRecord,    // the records of one block of rows (lean on CUDA), before they are placed
  kBufCount
};

struct Plan {
  LinearPlan info;                         // schedule, budget, chunks
  int64_t sub_rows = 0;                    // fast, 16-bit on CUDA: fp32 logits per sub-chunk
  std::array<size_t, kBufCount> bytes{};   // each buffer's size
  std::array<size_t, kBufCount> offset{};  // and offset in the allocation
  size_t total = 0;                        // the allocation: the scratch of the call

  // lean's forward (statistics only): blocks of stats_rows rows of stats_cols columns, in
  // stats_chunks chunks of the vocabulary; on CUDA as wide as kLogits, kGrad and kDHidden hold
  // together for every row (fp32 logits; on the epilogue engine the statistics GEMM's partials),
  // else the sweep's chunks.
  int64_t stats_rows = 0, stats_cols = 0, stats_chunks = 0;
  int64_t ranks_in_chunk = 1;  // ranks whose rows a chunk holds (SP: all, else 1)
  // fast: this rank's first row of `chunk` and how many it holds of `total` rows.
  int64_t first(int64_t chunk) const { return chunk * info.chunk_rows; }
  int64_t count(int64_t chunk, int64_t total_rows) const {
    const int64_t left = total_rows - first(chunk);
    return left < info.chunk_rows ? left : info.chunk_rows;
  }
  int64_t logits_rows() const { return info.chunk_rows * ranks_in_chunk; }
};

// cuBLASLt's workspace (its heuristic offers only algorithms that fit). Its recommendation for
// Hopper is 32 MiB; 8 MiB timed the same (one H200: lean at 32064 and 128256 columns a rank, fast
// at 128256; docs/linear.md), and the 24 MiB it leaves in the default budget buy wider chunks.
constexpr size_t kGemmWorkspaceBytes = size_t(8) << 20;
// fast, 16-bit on CUDA: fp32 logits made a sub-chunk of at most this many rows at a time (its
// logits GEMM reads the weight once per that many rows: 128 rows took 2x the GEMM's time on H100).
constexpr int64_t kSubRows = 512;
// automatic: fast only where its chunks hold at least this many rows (or every row): fewer make
// its logits GEMM reread the weight too often.
constexpr int64_t kFastRows = 1024;
// lean on CUDA, 16-bit: rows of a block of fp32 logits (its GEMM's M).
constexpr int64_t kLeanRows = 2048;
// lean: the least columns of a chunk of the vocabulary that its need (the default budget's floor)
// counts: each chunk adds its d_hidden part to the fp32 accumulator, rows x H x 8 bytes of
// traffic, so chunks much narrower than H spend more on that than on the GEMM.
constexpr int64_t kLeanCols = 3072;
// lean under the default budget: chunks of at most this many columns. The accumulator's traffic
// per GEMM work falls as 1 / width: at 8192 rows, hidden 4096 and 128256 columns, chunks of 6144
// took 52.4-53.2 ms a step against 54.3-55.1 at 4096 (one H200). Wider gained nothing more, and
// the default keeps the rest of its budget unspent (where the budget would buy fast, fast takes
// it). At hidden 2048 (Llama 3.2 1B in a Transformers step) an eighth of the logits bought about
// 6500 columns, and that scratch set the step's peak, 26 MiB over Liger-Kernel's, where 170 and
// 224 MiB (about 3000 and 5000 columns) met Liger's peak at the same step time; 6144 columns take
// 170 MiB there.
constexpr int64_t kWideCols = 6144;
// lean on the epilogue engine: chunks of a multiple of this many columns (where wider), two of the
// gradient GEMM's 256-column tiles. A chunk that ends inside a tile pays for the whole tile on
// every row: at 32064 columns a rank, chunks of 4480 columns took 14.1-14.6 ms a step, of 4096
// and 4608 columns 12.5-12.7 (one H200, docs/linear.md).
constexpr int64_t kEpilogueCols = 512;

// The default budget's floor: below it the schedules' difference in memory is too small to
// matter, and fast's fewer GEMMs win.
constexpr size_t kMinBudget = size_t(64) << 20;

// Throws xent::Error naming the argument, its value and the rule (before any collective).
void check_options(const LinearOptions& lopt);

// The plan for `s` under `lopt` (schedule, budget, chunk sizes): throws where the budget holds no
// chunk of the schedule asked for (automatic: of either), naming what one needs.
Plan make_plan(const Shape& s, const LinearOptions& lopt);

// The default budget for `s`: the largest of an eighth of the 16-bit logits [rows, widest], what
// lean needs (its fixed buffers and chunks of kLeanCols columns) and kMinBudget. (Within it, lean
// takes chunks of at most kWideCols columns.)
size_t default_budget(const Shape& s);

}  // namespace xent::linear
