// The steps every backend implements; api.cpp drives them in this order:
//   forward:  stats -> Communicator::all_gather(records) -> finalize [-> gradient (fused)]
//   backward: gradient (deferred; in place or into a separate buffer) | scale_rows (fused, in
//             place) | gradient(GradRows::rescaled) (fused, forward's gradient in its own buffer)
// All pointers live where the backend computes (host for cpu, device for cuda).
#pragma once

#include <memory>
#include <vector>

#include "core/problem.h"
#include "xent/xent.h"

namespace xent {

// Scratch owned by a Group, grown on demand (Group::reserve grows it up front). One layout for
// both backends; the CUDA backend's lives in device memory.
struct Workspace {
  Backend backend = Backend::cpu;
  int device = -1;
  void* base = nullptr;
  size_t capacity = 0;

  // Carved out of base for one call.
  float* send = nullptr;     // [fields * rows]: this rank's records
  float* recv = nullptr;     // [ranks * fields * rows]: everyone's, rank order
  float* lse = nullptr;      // [rows]: global lse when the caller did not ask for it
  float* scalars = nullptr;  // [kScalars]: see below
  int64_t* error = nullptr;  // [2]: first bad row (-1 if none) and its target; CUDA only
  // [1 + 3 * kPartials]: the CUDA finalize's cross-block reduction: [0] counts the blocks that
  // are done (0 between launches: the last block resets it), then per block its partial totals
  // (loss as the bits of a double, valid rows, correct rows). CUDA only.
  unsigned long long* partials = nullptr;

  static constexpr int kScale = 0;  // the gradient's: 1 / valid rows or 1, times grad_scale
  static constexpr int kValid = 1;  // number of non-ignored rows
  // The fused lm head's GEMMs' {alpha, 0, 1} in device memory (cuBLASLt's device pointer mode
  // reads beta there too): the gradient's scale, applied by the GEMMs that consume its 16-bit
  // gradient rather than folded into it before the rounding (linear::device::take_gemm_scale).
  static constexpr int kGemmScale = 2;
  // A set of the above: the fused lm head keeps a second one, the whole problem's, at kSet.
  static constexpr int kSet = 8;
  static constexpr int kScalars = 2 * kSet;
  static constexpr int kPartials = 256;  // at most this many finalize blocks

  // The fused lm head's scratch (src/linear/: its chunk buffers, each backend's own type), grown
  // by it and freed with the group.
  std::shared_ptr<void> linear;
  // Every rank's header of the fused lm head's last exchange on a CUDA group of several ranks
  // (src/linear/check.cpp: exchange), for the calls captured into a CUDA graph.
  std::vector<unsigned char> linear_headers;

  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace();

  static size_t bytes_needed(int64_t rows, int fields, int ranks);
  // The per-row part of bytes_needed: send, recv and lse.
  static size_t row_bytes(int64_t rows, int fields, int ranks);
  // Grows if needed (allocation happens only here) and carves the pointers. CUDA: growth waits
  // for `stream` (calls on one group are ordered on one stream), sets up the new buffer on it,
  // and is refused while `stream` is being captured into a CUDA graph (Group::reserve first).
  // `rows_block` (row_bytes of the caller's memory, held for the call): only the fixed part
  // grows here, and send, recv and lse are carved from it.
  void prepare(int64_t rows, int fields, int ranks, cudaStream_t stream,
               void* rows_block = nullptr);
};

// One call's per-row part of the workspace: from `allocator` where given (handed back when this
// goes, stream-ordered), else the workspace's own; the workspace prepared either way.
class CallRows {
 public:
  CallRows(Workspace& ws, Allocator* allocator, int64_t rows, int fields, int ranks,
           cudaStream_t stream);
  ~CallRows();
  CallRows(const CallRows&) = delete;
  CallRows& operator=(const CallRows&) = delete;

 private:
  Workspace& ws_;
  Allocator* allocator_;
  void* block_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_;
};

// Whether calls with `opt` on `group` exchange the records device-side (Options::device_exchange
// on a CUDA group whose communicator may give peer memory); the same on every rank, whatever its
// shard. Group::reserve and forward both ask (src/group.cpp).
bool exchanges_device_side(const Group& group, const Options& opt);

// Which rows the gradient step writes (see cpu::gradient).
enum class GradRows { all, rescaled };

namespace cpu {
void stats(const core::Problem& p, LogitsView logits, TargetsView targets, float* record);
// Global lse, losses, reduction, accuracy; writes ws.lse-or-out.lse and ws.scalars.
void finalize(const core::Problem& p, TargetsView targets, const float* gathered, int ranks,
              const Outputs& out, float* lse, float* scalars);
// What finalize sums over the rows before the reduction: the loss of the valid rows in row
// order, in double, and the counts.
struct Totals {
  double loss = 0.0;
  int64_t valid = 0, correct = 0;
};
// finalize's per-row part for rows [r0, r1) (lse and the per-row outputs), added to `totals` row
// by row in order; the fused lm head finalizes its chunks so and reduces once at the end.
void finalize_rows(const core::Problem& p, TargetsView targets, const float* gathered, int ranks,
                   int64_t r0, int64_t r1, const Outputs& out, float* lse, Totals& totals);
// out = row_scale * d loss / d x, x read from `in`; row_scale = scalars[kScale] times
// grad_output (scalar, or per row for Reduction::none; nullptr means 1). `in` and `out` have
// p's rows and cols, each its own row_stride; out may be in (same data and stride: in place),
// else they do not overlap. GradRows::rescaled (the fused backward out of place): `out` holds
// forward's gradient (for grad_output = grad_scale) and only the rows whose
// core::fused_backward_factor is not 1 are written, recomputed from `in` with row_scale =
// scalars[kScale] times that factor (one rounding, as the deferred backward); the other rows,
// and ignored ones, are left as they are.
void gradient(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
              const float* lse, const float* scalars, const float* grad_output,
              GradRows rows = GradRows::all);
// Fused backward: multiplies each row of the gradient by grad_output / grad_scale where that is
// not 1 (core::fused_backward_factor; grad_output null means 1).
void scale_rows(const core::Problem& p, LogitsView grad, const float* grad_output);
// Counts non-ignored rows into scalars[kValid] and sets scalars[kScale] (deferred backward).
void count_valid(const core::Problem& p, TargetsView targets, float* scalars);
}  // namespace cpu

namespace cuda {
// The same steps as cpu::, stream-ordered, no host synchronisation, no allocation. `error`
// (device, [2]) receives the first row whose target is out of range, and that row's loss is NaN.
void stats(const core::Problem& p, LogitsView logits, TargetsView targets, float* record,
           int64_t* error, cudaStream_t stream);
// `partials`: Workspace::partials (its counter 0 on entry, and again on exit).
void finalize(const core::Problem& p, TargetsView targets, const float* gathered, int ranks,
              const Outputs& out, float* lse, float* scalars, unsigned long long* partials,
              cudaStream_t stream);
// As cpu::gradient; out may also be bf16 or f16 where in is f32 (the fused lm head's chunks).
void gradient(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
              const float* lse, const float* scalars, const float* grad_output, cudaStream_t stream,
              GradRows rows = GradRows::all);
void scale_rows(const core::Problem& p, LogitsView grad, const float* grad_output,
                cudaStream_t stream);
// The fused lm head's reduction of rows that finalize (Reduction::none) wrote chunk by chunk:
// out.loss[0] (p.reduction mean or sum) and out.accuracy from every row's loss, target and
// argmax (null without accuracy), and scalars as finalize writes them. One block, a fixed order.
void reduce_rows(const core::Problem& p, TargetsView targets, const float* row_loss,
                 const int64_t* argmax, const Outputs& out, float* scalars, cudaStream_t stream);
// exchange_header: the device exchange's header in this rank's peer memory (cuda/exchange.cuh):
// its call counter is advanced and its row tickets zeroed here before the exchange's kernels;
// null elsewhere.
void count_valid(const core::Problem& p, TargetsView targets, float* scalars, cudaStream_t stream,
                 uint32_t* exchange_header = nullptr);
// One rank, fused: whether single_pass takes rows of p's shape (no padding columns, rows that a
// block's registers hold and that the two-pass path would give a block).
bool single_pass_fits(const core::Problem& p, DType dtype);
// stats, the gradient (scale from scalars, after count_valid) and the records in one pass over
// each row; finalize(records, 1 rank) follows. out may be in (in place); its dtype is in's, or
// 16 bits for f32 logits (the fused lm head's sub-chunks).
void single_pass(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
                 float* record, int64_t* error, const float* scalars, cudaStream_t stream);
// Several ranks (Options::device_exchange): the single pass with each row's record exchanged
// device-side through `peers` (at least exchange_bytes(rows, ranks) on every rank, zeroed before
// the first call) while the row is on chip; every rank's records land in `gathered` (the
// all-gather's layout), for finalize(gathered, ranks). count_valid(..., peers) comes first.
size_t exchange_bytes(int64_t rows, int ranks);
void single_pass_exchange(const core::Problem& p, LogitsView in, LogitsView out,
                          TargetsView targets, const PeerMemory& peers, int rank, int ranks,
                          float* gathered, int64_t* error, const float* scalars,
                          cudaStream_t stream);
// Several ranks (Options::device_exchange), on the two-pass path: this rank's records (stats'
// `record`) published through `peers` and every rank's gathered into `gathered`, as the
// all-gather would; it meets single_pass_exchange on the other ranks. count_valid(..., peers)
// comes first.
void exchange_records(const core::Problem& p, const float* record, const PeerMemory& peers,
                      int rank, int ranks, float* gathered, cudaStream_t stream);
// Throws xent::Error where `device` is older than compute capability 8.0 or no kernel image of
// this build runs on it (cuda/launch.cuh: device_info); the current device is left as it was.
void check_device(int device);
// Device count, 0 when there is no usable driver/GPU (never throws).
int device_count();
}  // namespace cuda

}  // namespace xent
