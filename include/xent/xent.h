// xent: vocab-parallel cross-entropy for tensor-parallel LLMs.
//
// Every rank holds the logits of its slice of the vocabulary. forward() computes per-row softmax
// statistics on this rank, all-gathers those few numbers per row over the Group, and writes the
// exact global loss (and, in fused mode, the gradient in place of the logits). Like NCCL, every
// call takes its group and stream explicitly and never synchronises the host behind the caller.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

typedef struct ncclComm* ncclComm_t;  // as nccl.h declares it; the header stays NCCL-free

namespace xent {

// Host-side misuse: the message names the argument, the value and the rule.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Backend { cpu, cuda };
enum class DType { f32, bf16, f16 };
enum class IndexType { i32, i64 };
enum class Reduction { none, mean, sum };
// fused: forward writes the gradient (for grad_output = 1, or Options::grad_scale) over the
//        logits or into Outputs::grad, and backward only revisits rows where grad_output differs
//        from it: rescaled in place, or recomputed from the intact logits (out of place).
// deferred: forward leaves the logits untouched; backward reads them once and writes the
//        gradient once (over the logits, or into a separate buffer), grad_output applied before
//        the single rounding to the logits' dtype.
// none: forward only, no gradient.
enum class GradMode { fused, deferred, none };

const char* to_string(Backend);
const char* to_string(DType);
const char* to_string(Reduction);
const char* to_string(GradMode);
size_t dtype_size(DType);

// This rank's logits shard: rows x cols elements, row r starting at data + r * row_stride.
// Host memory for the CPU backend, device memory for CUDA. Not owned.
struct LogitsView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // in elements, >= cols
};

// One target class id per row (global vocabulary index), contiguous. Same on every rank.
struct TargetsView {
  const void* data = nullptr;
  IndexType type = IndexType::i64;
  int64_t rows = 0;
};

// Where a call takes the scratch that grows with its problem: every byte it allocates beyond
// its inputs and outputs comes from here, once per call, and is handed back before the call
// returns (stream-ordered on CUDA: the memory may still be in use by the call's queued work, as
// with cudaFreeAsync). Host memory for the CPU backend, device memory of the group's device for
// CUDA. The logits path (Options::allocator) takes its per-row records, their exchange and the
// lse here; the fused lm head all of its scratch (LinearOptions::allocator, else
// Options::allocator: one allocator set in Options serves both). Null: for the logits path the
// group's workspace; for the lm head malloc/free on the CPU backend, cudaMallocAsync/
// cudaFreeAsync on the call's stream on CUDA (the device's default memory pool: inside CUDA graph
// capture that makes graph memory nodes). The LibTorch adapter passes PyTorch's caching
// allocator for CUDA tensors.
class Allocator {
 public:
  virtual ~Allocator() = default;
  // At least `bytes` bytes, aligned to 256; throws xent::Error where it cannot.
  virtual void* allocate(size_t bytes, cudaStream_t stream) = 0;
  virtual void release(void* p, size_t bytes, cudaStream_t stream) = 0;
};

struct Options {
  int64_t ignore_index = -100;            // rows with this target: loss 0, gradient 0
  float label_smoothing = 0.0f;           // in [0, 1), uniform over the real vocab_size classes
  float z_loss = 0.0f;                    // weight w >= 0 of w * lse^2
  float softcap = 0.0f;                   // > 0: logits become c * tanh(x / c); 0: off
  Reduction reduction = Reduction::mean;  // mean: over rows whose target is not ignore_index
  GradMode grad_mode = GradMode::fused;
  // Shard layout: this rank owns global columns [vocab_start, vocab_start + cols); columns at or
  // past vocab_size are padding (treated as -inf, gradient 0). Use plan_shard() to fill them.
  int64_t vocab_start = 0;
  int64_t vocab_size = -1;        // -1: vocab_start + cols (a single rank with no padding)
  bool compute_accuracy = false;  // fills Outputs::argmax / Outputs::accuracy
  // CUDA backend: ask the driver where each pointer lives and refuse host memory with a clear
  // error naming the argument (a few driver calls per call; the fused lm head's too). An adapter
  // whose buffers are known to be on the group's device (the LibTorch adapter's tensors) turns it
  // off.
  bool check_pointers = true;
  // CUDA backend, compute capability 9.0 and newer: programmatic dependent launch, each kernel
  // scheduled while the previous one in the stream drains (about 1 % of a step at small
  // shards); false launches them one after another.
  bool programmatic_launch = true;
  // CUDA backend, one rank, grad_mode fused: read each row once where it fits on chip (a block's
  // registers and shared memory, or a cluster of 2 to 4 blocks: rows of 4097 to 262144 real
  // columns of 2-byte logits, 2049 to 131072 of float32, before compute capability 9.0 up to
  // 32768 and 16384; and up to 4096 padding columns): statistics and gradient in one kernel.
  // Capped rows (softcap) of 2-byte logits wider than 16384 columns take two passes where the
  // memory is fast for the SMs (more than 16 bytes per SM clock at peak: H200, not H100), where
  // two passes measured faster. false takes the two-pass path (statistics, then gradient), as
  // every other case does. forward_path() says which one a call takes. The fused lm head
  // (linear.h) takes it too on one rank, over each sub-chunk of its fp32 logits.
  bool single_pass = true;
  // grad_mode fused: forward writes the gradient for grad_output = grad_scale (e.g. 1 / the
  // gradient-accumulation steps, or a loss scale) rather than 1, and backward revisits only rows
  // whose grad_output / grad_scale is not 1 (see backward). A backward whose grad_output equals
  // grad_scale (the loss divided by the same number) then reads and writes nothing. In place it
  // is also what keeps the gradient rounded once: there a rescaled row is rounded twice. Finite
  // and > 0; must be 1 with the other grad modes, whose backward applies grad_output in its one
  // pass anyway.
  float grad_scale = 1.0f;
  // CUDA backend, several ranks: the rows' records exchanged device-side (each rank stores its
  // record of a row into every rank's peer memory: Communicator::peer_memory, an NCCL 2.28
  // symmetric window over NVLink, else CUDA IPC between the ranks of one host) rather than by an
  // all-gather. With the single pass (fused, rows that fit on chip) each row is read once on every
  // rank, its record exchanged while the row is on chip; a rank whose rows do not fit takes the
  // two passes and publishes its records after the first, so that ranks of uneven shards still
  // meet ("two-pass, device exchange"). Every rank must make the same calls with this option, and
  // each rank's kernel must be able to start: a kernel of another stream that waits for another
  // GPU (a data-parallel all-reduce) must not hold all of a GPU's multiprocessors meanwhile (the
  // kernels take rows by ticket, so they need no more than some of them). A rank that waits
  // longer than PeerMemory::wait_timeout_s (60 s) for another's record stops its kernel with a
  // message. Off by default: checked against the fp64 reference with 2 to 4 ranks
  // (processes sharing one GPU: the dist tests), not yet timed across GPUs. A communicator
  // without peer memory takes the all-gather; on one rank the exchange is with itself, through
  // its own peer memory (tests).
  bool device_exchange = false;
  // The call's per-row scratch (this rank's records, every rank's, the lse where Outputs::lse is
  // null: (ranks + 1) x record + 4 bytes a row) from here, handed back when the call returns;
  // null: the group's workspace, grown to the most rows seen and kept with the group (what
  // Group::reserve grows ahead of CUDA graph capture). The small fixed part (error slot, scalars,
  // cross-block partials) stays in the group's workspace either way.
  Allocator* allocator = nullptr;
};

// Where forward() writes. Host pointers for the CPU backend, device pointers for CUDA.
struct Outputs {
  float* loss = nullptr;      // required: [1] for mean/sum, [rows] for none
  float* lse = nullptr;       // [rows] global log-sum-exp; required for GradMode::deferred
  float* z_loss = nullptr;    // [rows] optional: the z-loss term w * lse^2 of each row
  int64_t* argmax = nullptr;  // [rows] optional: global argmax column (compute_accuracy)
  float* accuracy = nullptr;  // [1] optional: share of non-ignored rows with argmax == target
  // GradMode::fused only, optional: where forward writes the gradient (same dtype and shape as
  // the logits, its own row stride, not overlapping them); data = null: over the logits. The
  // out-of-place backward(logits, grad, ...) then applies any grad_output with one rounding.
  LogitsView grad{};
};

// Device memory that every rank of a group loads and stores directly (GPUs of one NVLink domain),
// for Options::device_exchange.
struct PeerMemory {
  static constexpr int kMaxRanks = 8;
  void* peers[kMaxRanks] = {};  // rank k's buffer, as this process addresses it
  size_t bytes = 0;             // each buffer's size
  // The share of the device's resident blocks one rank's kernel takes: 1 for a GPU of its own,
  // 1 / ranks where the ranks share one GPU (tests), so that their grids fit side by side.
  float device_share = 1.0f;
  // A kernel that waits longer than this for another rank's record stops with a message naming
  // the rank and the row (a launch failure) rather than hang: the ranks did not make the same
  // calls, or a rank's kernel could not start (kernels of other streams held its GPU).
  double wait_timeout_s = 60.0;
};

// How stats records travel between ranks. Implementations: NCCL (device memory, stream-ordered),
// MPI (host memory; xent/mpi.h), or an adapter's own (e.g. a c10d ProcessGroup).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;  // where the buffers of all_gather live
  virtual int device() const { return -1; }
  // recv[r * bytes, (r + 1) * bytes) = rank r's send; on `stream` for device buffers.
  virtual void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) = 0;
  // fp32 sums over the ranks (the fused lm head's d_hidden), on `stream` for device buffers:
  // all_reduce_sum: recv[i] = the sum over ranks of their send[i], i < count; reduce_scatter_sum:
  // send holds one block of `count` floats per rank in rank order, and rank r's recv[i] = the sum
  // over ranks of their block r's element i. Every rank gets the same bits; recv may be send (in
  // place; for reduce_scatter_sum, send + rank * count). Where has_sums() is false the caller
  // gathers every rank's send and sums them in rank order itself (the CPU backend, MPI staging).
  virtual bool has_sums() const { return false; }
  virtual void all_reduce_sum(const float* send, float* recv, size_t count, cudaStream_t stream);
  virtual void reduce_scatter_sum(const float* send, float* recv, size_t count,
                                  cudaStream_t stream);
  // Whether peer_memory can give memory at all (no collective call, no allocation).
  virtual bool has_peer_memory() const { return false; }
  // Collective (every rank, the same `bytes`): every rank's buffer of at least `bytes`, zeroed
  // and visible to all ranks when it returns (it synchronises the device when it allocates), and
  // kept until a call asks for more or the communicator goes. nullptr: none.
  virtual const PeerMemory* peer_memory(size_t bytes) {
    (void)bytes;
    return nullptr;
  }
};

struct Workspace;  // scratch owned by a Group: stats records and small reductions

// A rank-aware handle: its communicator and its scratch. Cheap to copy (shared). Calls on one
// Group must be ordered (one stream at a time), as with an NCCL communicator.
class Group {
 public:
  // One rank, no communication at all; no MPI needed. CUDA: device -1 is the current one.
  // Every call on a CUDA group makes the group's device current for its duration and restores
  // the caller's after it, as NCCL does.
  static Group local(Backend backend = Backend::cpu, int device = -1);
  // Groups over MPI (CPU backend over MPI_Allgather; NCCL bootstrapped over MPI) live in
  // xent/mpi.h, target xent::mpi: this header and xent::xent need no MPI.
  // Drives a communicator the caller already owns (not destroyed by xent).
  static Group adopt(ncclComm_t comm, int device = -1);
  // Takes a communicator made for xent: destroyed (ncclCommDestroy) with the group's last copy.
  static Group own(ncclComm_t comm, int device = -1);
  static Group custom(std::shared_ptr<Communicator> comm);

  int rank() const;
  int size() const;
  Backend backend() const;
  int device() const;
  Communicator& comm() const;
  Workspace& workspace() const;
  // Allocates the scratch for up to `rows` rows now, so that later calls (and CUDA graph
  // capture) allocate nothing. Synchronises the device when it grows. A call that would grow
  // it otherwise waits for its own stream only, and is refused inside CUDA graph capture.
  // With Options::device_exchange it also makes the peer memory for `rows`: collective then,
  // every rank calls it alike.
  void reserve(int64_t rows, const Options& opt) const;
  // Bytes of scratch the group holds now (host or device, as its backend): the only memory
  // xent allocates beyond the caller's inputs and outputs.
  size_t workspace_bytes() const;
  // CUDA backend: waits for `stream`, then throws xent::Error if a kernel since the last check
  // saw a target outside [0, vocab_size) that is not ignore_index (those rows' loss is NaN).
  // The CPU backend throws at once, so this is a no-op there.
  void check_errors(cudaStream_t stream) const;

  struct Impl;
  explicit Group(std::shared_ptr<Impl> impl);

 private:
  std::shared_ptr<Impl> impl_;
};

struct Shard {
  int64_t start = 0;       // this rank's first global column
  int64_t width = 0;       // this rank's columns, padding included
  int64_t vocab_size = 0;  // real classes; columns at or past it are padding
};

// Collective: every rank passes its own width; returns this rank's start (the prefix sum of the
// widths in rank order). vocab_size -1: the sum of all widths. Throws on every rank alike if the
// widths cannot cover vocab_size. Synchronises (setup only).
Shard plan_shard(const Group& group, int64_t width, int64_t vocab_size = -1);
// Collective: checks that the ranks' shards tile [0, total width) in rank order, agree on
// vocab_size, and that they agree on `rows`. Throws on every rank alike. Synchronises.
void check_layout(const Group& group, const Shard& mine, int64_t rows);
// Copies the shard into options.
void apply(const Shard& shard, Options& opt);

// Forward: loss (and lse, z-loss, accuracy as asked); in fused mode also the gradient of
// sum-or-mean loss (grad_output = 1) in place of the logits. Stream-ordered, no host sync on CUDA.
// The CPU backend checks the layout across ranks on every call (one small all-gather).
void forward(const Group& group, LogitsView logits, TargetsView targets, const Options& opt,
             const Outputs& out, cudaStream_t stream = nullptr);
// The same, for an adapter that allocates the outputs per call (the LibTorch one): make_outputs
// is called once, after the statistics and their exchange are queued on CUDA (first thing on
// CPU), so that its host work overlaps the GPU's first pass. Its outputs are checked as above;
// a mistake then throws on this rank alone, after its part of the exchange (no rank waits).
void forward(const Group& group, LogitsView logits, TargetsView targets, const Options& opt,
             const std::function<Outputs()>& make_outputs, cudaStream_t stream = nullptr);

// The path that forward takes for these arguments on this group: "single-pass" (each row read
// once: Options::single_pass) or "two-pass" (statistics, exchange, then gradient). For
// benchmarks and logs; no check of the arguments beyond what the choice needs.
const char* forward_path(const Group& group, LogitsView logits, const Options& opt);

// Backward. grad_output: [1] for mean/sum, [rows] for none (host or device, as the logits).
// fused: `logits` holds forward's gradient (written over the logits); rows are rescaled by
//        grad_output / grad_scale where that is not 1 (decided on the device; grad_output null
//        counts as 1). The logits are gone, so such a row is rounded twice (forward's rounding,
//        then the rescale's): pass the grad_output as Options::grad_scale, or use deferred, or
//        forward's Outputs::grad and the overload below, for a gradient rounded once. deferred:
//        `logits` holds the logits; `lse` is forward's Outputs::lse; the gradient overwrites the
//        logits (the overload below with grad = logits). none: throws.
void backward(const Group& group, LogitsView logits, TargetsView targets, const float* lse,
              const float* grad_output, const Options& opt, cudaStream_t stream = nullptr);

// Out-of-place backward: `logits` holds the logits, left untouched; `lse` is forward's
// Outputs::lse (required). grad_output is applied before the single rounding to the logits' dtype.
// deferred: reads `logits` once and writes the gradient once into `grad`. It may alias the logits
//        exactly (same data and row_stride: the in-place backward above).
// fused: `grad` is forward's Outputs::grad (its gradient for grad_output = grad_scale), not the
//        logits (an error). Only the rows whose factor grad_output / grad_scale is not exactly 1
//        are recomputed from the logits into `grad`; the others (and ignored rows) are left as
//        forward wrote them, so a backward whose grad_output is grad_scale reads grad_output
//        alone (grad_output null counts as 1), and every row is rounded once whatever it is.
// none: throws. `grad` has the logits' dtype, rows and cols, its own row_stride (>= cols; the
// columns between cols and row_stride are not written), and lives where the logits do; unless it
// aliases them exactly, the address ranges of the two (first to last element) must not intersect.
void backward(const Group& group, LogitsView logits, LogitsView grad, TargetsView targets,
              const float* lse, const float* grad_output, const Options& opt,
              cudaStream_t stream = nullptr);

// Bytes of the per-row stats record exchanged for these options (the all-gather moves
// rows * record_bytes * ranks).
size_t record_bytes(const Options& opt);

}  // namespace xent
