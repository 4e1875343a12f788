// The device-side exchange of the records on several ranks (Options::device_exchange): each rank
// stores its record of a row straight into every rank's peer memory (PeerMemory) and waits in its
// own for the other ranks' records of that row: in the single-pass kernel while the row is still
// on chip, or after the statistics kernel (exchange_records, the two-pass path).
//
// Each rank's peer memory starts with a header of 32-bit words (PeerExchange::k*Word): its epoch,
// the number of its calls (count_valid adds one before each, on the device, so that a CUDA graph's
// replays count too; never 0, and after 2^32 - 1 comes 2, so that the parity alternates), the
// setup's signature (comm.h; the exchange leaves it alone), and its row tickets (count_valid
// zeroes them). Then the slots. A slot holds a record's
// fields (core::RecordLayout, 5 at most), each in a 64-bit word of its own together with the
// call's epoch: an aligned 64-bit store is single-copy atomic, so a reader that sees this call's
// epoch in a word sees the field stored with it, and neither side needs a fence (NCCL's LL
// protocol does the same). A release at system scope cost the single pass about a microsecond a
// row (it waits for the thread's earlier gradient stores). Slots [parity][row][from rank], parity
// the epoch's: a rank can reach call e + 2's store into a slot only after every rank has passed
// call e + 1's kernel for that row, which starts after their call e (its kernel and finalize,
// stream-ordered) read the slot.
//
// The kernels take their rows by ticket (take_ticket): a cluster or block holds a row only once
// it runs, publishes its record before it waits for any, and a rank's rows are taken in
// increasing order. So no wait depends on a block that has not started: the smallest row that
// any block waits for belongs to a rank that has not taken it, whose running blocks hold smaller
// rows and so are not waiting; they finish and that rank takes the row. No grid needs to be
// resident (a kernel of another stream may hold some of the multiprocessors), and a block that
// runs faster takes more rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/record.h"
#include "xent/xent.h"

namespace xent::cuda::detail {

struct PeerExchange {
  // The header's words; the rest of its 256 bytes is unused.
  static constexpr int kEpochWord = 0;
  static constexpr int kSignatureWord = 1;
  static constexpr int kTicketWord = 2;
  static constexpr int kHeaderFloats = 64;
  static constexpr int kSlotWords = 8;  // 64-bit words: a field and the epoch each
  float* peers[PeerMemory::kMaxRanks];  // every rank's peer memory, as this process addresses it
  int rank = 0, ranks = 1;
  int64_t rows = 0;         // slots per parity and rank: the call's rows
  uint64_t timeout_ns = 0;  // a wait longer than this stops the kernel with a message
};
static_assert(core::RecordLayout::kMaxFields <= PeerExchange::kSlotWords, "fields fit a slot");
static_assert(PeerExchange::kEpochWord != PeerExchange::kTicketWord &&
                  PeerExchange::kSignatureWord != PeerExchange::kEpochWord &&
                  PeerExchange::kSignatureWord != PeerExchange::kTicketWord &&
                  PeerExchange::kTicketWord < PeerExchange::kHeaderFloats,
              "the header's words are distinct and within it");

// x.peers[k], read with constant indices: indexing the kernel parameter by a runtime value makes
// the compiler copy the array to local memory, and the single pass's exchange waited for three
// loads from it a row (one H200, one rank, 8192 rows of bf16: 64128 columns 0.636 against 0.645
// ms, 128256 1.313 against 1.334, 16032 0.188 against 0.192).
__device__ __forceinline__ float* peer(const PeerExchange& x, int k) {
  float* p = x.peers[0];
#pragma unroll
  for (int i = 1; i < PeerMemory::kMaxRanks; ++i)
    if (k == i) p = x.peers[i];
  return p;
}

// The slot of rank `from`'s record of `row` in the peer memory at `buffer` (a rank's, peer()).
__device__ __forceinline__ uint64_t* exchange_slot(const PeerExchange& x, float* buffer,
                                                   uint32_t epoch, int64_t row, int from) {
  const int64_t parity = epoch & 1u;
  return reinterpret_cast<uint64_t*>(buffer + PeerExchange::kHeaderFloats) +
         ((parity * x.rows + row) * x.ranks + from) * PeerExchange::kSlotWords;
}

__device__ __forceinline__ void store_word_sys(uint64_t* p, float value, uint32_t epoch) {
  const uint64_t w = (static_cast<uint64_t>(epoch) << 32) | __float_as_uint(value);
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ uint64_t load_word_sys(const uint64_t* p) {
  uint64_t w;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The exchange of `rows` rows on rank `rank` of `ranks` through `peers` (checked:
// cuda/exchange.cu).
PeerExchange make_peer_exchange(const PeerMemory& peers, int rank, int ranks, int64_t rows);

// This call's epoch, from count_valid (a kernel before this one): read once per kernel.
__device__ __forceinline__ uint32_t exchange_epoch(const PeerExchange& x) {
  return reinterpret_cast<const uint32_t*>(peer(x, x.rank))[PeerExchange::kEpochWord];
}

// By one thread: the next of this call's tickets on this rank (0, 1, 2, ...): a row, or for
// exchange_records a group of rows.
__device__ __forceinline__ int64_t take_ticket(const PeerExchange& x) {
  return atomicAdd(reinterpret_cast<unsigned int*>(peer(x, x.rank)) + PeerExchange::kTicketWord,
                   1u);
}

// By one thread: this rank's record of `row` (rec, in the one-row layout of core::write_record)
// into every rank's slot for it.
__device__ __forceinline__ void publish_record(const PeerExchange& x, const core::RecordLayout& L,
                                               const float* rec, int64_t row, uint32_t epoch) {
#pragma unroll
  for (int k = 0; k < PeerMemory::kMaxRanks; ++k) {
    if (k == x.ranks) break;
    uint64_t* s = exchange_slot(x, x.peers[k], epoch, row, x.rank);
    for (int f = 0; f < L.fields; ++f) store_word_sys(s + f, rec[f], epoch);
  }
}

// By one thread: every rank's record of `row`, in rank order, into `gathered` (the layout that
// finalize and core::merge_records read, rows `rows`), each field waited for in this rank's
// memory. A rank's fields are loaded together first (one round trip to memory for a record that
// has arrived), then any not yet stored waited for. This rank's own record is read back too:
// taking it from the caller's registers instead made the single-pass kernel, which holds its row
// in registers, spill more of them (8192 x 16032 bf16, one rank, H100: 0.300 ms against 0.243;
// 0.202 without the exchange); the exchange as a function of its own, not inlined, made ptxas
// report more spill stores still (not timed). A wait past the timeout means the ranks do not
// run the same calls, or a rank's kernel could not start (kernels of other streams held its
// GPU): the kernel stops (a launch failure) rather than hang.
__device__ __forceinline__ void gather_record(const PeerExchange& x, const core::RecordLayout& L,
                                              int64_t row, float* gathered, uint32_t epoch) {
  constexpr int kMax = core::RecordLayout::kMaxFields;
  const uint64_t start = global_ns();
  float* own = peer(x, x.rank);
  for (int k = 0; k < x.ranks; ++k) {
    const uint64_t* s = exchange_slot(x, own, epoch, row, k);
    uint64_t w[kMax];
#pragma unroll
    for (int f = 0; f < kMax; ++f)
      if (f < L.fields) w[f] = load_word_sys(s + f);
#pragma unroll
    for (int f = 0; f < kMax; ++f) {
      if (f >= L.fields) continue;
      while (static_cast<uint32_t>(w[f] >> 32) != epoch) {
        if (global_ns() - start > x.timeout_ns) {
          printf(
              "xent: device exchange: rank %d waited %.0f s for rank %d's record of row %lld "
              "(call %u; the slot holds call %u's): the ranks must make the same calls in the "
              "same order, and each rank's kernel must be able to start\n",
              x.rank, 1e-9 * static_cast<double>(x.timeout_ns), k, static_cast<long long>(row),
              epoch, static_cast<uint32_t>(w[f] >> 32));
          __trap();
        }
        __nanosleep(64);
        w[f] = load_word_sys(s + f);
      }
      gathered[(static_cast<int64_t>(k) * L.fields + f) * x.rows + row] =
          __uint_as_float(static_cast<uint32_t>(w[f]));
    }
  }
}

}  // namespace xent::cuda::detail
