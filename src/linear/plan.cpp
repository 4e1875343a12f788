#include "linear/plan.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "error.h"
#include "linear/sm90/partials.h"

namespace xent {

const char* to_string(LinearSchedule s) {
  switch (s) {
    case LinearSchedule::fast: return "fast";
    case LinearSchedule::lean: return "lean";
    default: return "automatic";
  }
}

const char* to_string(LinearGemm g) {
  switch (g) {
    case LinearGemm::cublaslt: return "cublaslt";
    case LinearGemm::epilogue: return "epilogue";
    default: return "automatic";
  }
}

}  // namespace xent

namespace xent::linear {

namespace {

using std::to_string;

size_t u(int64_t v) {
  return static_cast<size_t>(std::max<int64_t>(v, 0));
}

// n rounded down to a multiple of `tile` where it is larger than one.
int64_t whole(int64_t n, int64_t tile) {
  return n > tile ? n - n % tile : n;
}

// Offsets of the buffers, each aligned to 256 bytes, and the total.
void place(Plan& p) {
  size_t at = 0;
  for (int b = 0; b < kBufCount; ++b) {
    p.offset[b] = at;
    at += (p.bytes[b] + 255) / 256 * 256;
  }
  p.total = at;
}

// fast: chunks of c rows of this rank's hidden; sub: rows of fp32 logits at a time (16-bit on
// CUDA; 0 elsewhere).
Plan fast_layout(const Shape& s, int64_t c, int64_t sub) {
  Plan p;
  p.info.schedule = LinearSchedule::fast;
  p.ranks_in_chunk = s.sequence_parallel ? s.ranks : 1;
  p.info.chunk_rows = c;
  p.info.chunk_cols = s.widest;
  p.info.chunks = c > 0 ? (s.rows + c - 1) / c : 0;
  const int64_t m = c * p.ranks_in_chunk, M = s.rows_all(), V = s.widest, H = s.hidden;
  const size_t es = dtype_size(s.inputs), G = u(s.ranks);
  const bool f32 = s.inputs == DType::f32, dh = s.gradients && s.d_hidden;
  const bool acc = s.gradients && s.d_weight && !s.d_weight_f32 && p.info.chunks > 1;
  auto& b = p.bytes;
  b[kSend] = u(s.fields) * u(m) * 4;
  b[kRecv] = s.ranks > 1 ? G * b[kSend] : 0;
  b[kArgmax] = s.accuracy ? u(M) * 8 : 0;
  if (s.backend == Backend::cuda) {
    p.sub_rows = f32 ? 0 : std::max<int64_t>(1, std::min(sub, m));
    b[kGemmWorkspace] = kGemmWorkspaceBytes;
    b[kLogits] = u(f32 ? m : p.sub_rows) * u(V) * 4;
    b[kGrad] = s.gradients && !f32 ? u(m) * u(V) * es : 0;
    b[kHidden] = s.sequence_parallel ? u(m) * u(H) * es : 0;
    b[kMine] = s.sequence_parallel ? u(c) * u(H) * es : 0;
    b[kPartial] = dh && s.ranks > 1 ? (s.sums ? 2 : 1) * u(m) * u(H) * 4 : 0;
    b[kGathered] = dh && s.ranks > 1 && !s.sums ? G * u(m) * u(H) * 4 : 0;
    b[kDWeight] = acc ? u(V) * u(H) * 4 : 0;
    b[kRows] = (4 * u(m) + u(M)) * 4;
    b[kTargets] = s.sequence_parallel ? 2 * u(M) * 8 : 0;
  } else {
    b[kLogits] = u(m) * u(V) * 4;
    b[kPad] = 128 * (u(H) + u(V)) * 4;
    b[kWeight] = f32 ? 0 : u(V) * u(H) * 4;
    b[kMine] = s.sequence_parallel || !f32 ? u(c) * u(H) * 4 : 0;
    b[kHidden] = s.sequence_parallel ? u(m) * u(H) * 4 : 0;
    b[kPartial] = dh ? u(m) * u(H) * 4 : 0;
    b[kGathered] = dh && s.ranks > 1 ? G * u(m) * u(H) * 4 : 0;
    b[kDHidden] = dh ? u(c) * u(H) * 4 : 0;
    b[kDWeight] = s.gradients && s.d_weight && !s.d_weight_f32 ? u(V) * u(H) * 4 : 0;
    b[kRows] = 4 * u(m) * 4;
    b[kTargets] = (u(c) + u(m)) * 8;
    b[kArgmax] = s.accuracy ? u(m) * 8 : 0;
  }
  place(p);
  return p;
}

// lean: blocks of rb rows of fp32 logits, chunks of vc columns of the vocabulary; on the epilogue
// engine (epi) the sweep has no fp32 logits: each chunk's gradient is made over every row by one
// GEMM (rb = M), and kLogits serves forward's alone.
Plan lean_layout(const Shape& s, int64_t rb, int64_t vc, bool epi) {
  Plan p;
  p.info.schedule = LinearSchedule::lean;
  p.info.gemm = epi ? LinearGemm::epilogue : LinearGemm::cublaslt;
  p.ranks_in_chunk = s.sequence_parallel ? s.ranks : 1;
  const int64_t M = s.rows_all(), V = s.widest, H = s.hidden, N = s.rows;
  p.info.chunk_rows = rb;
  p.info.chunk_cols = vc;
  p.info.chunks = vc > 0 ? (V + vc - 1) / vc : 0;
  const size_t es = dtype_size(s.inputs), G = u(s.ranks);
  const bool f32 = s.inputs == DType::f32, dh = s.gradients && s.d_hidden;
  auto& b = p.bytes;
  b[kRows] = 4 * u(M) * 4;
  b[kArgmax] = s.accuracy ? u(M) * 8 : 0;
  b[kGathered] = dh && s.ranks > 1 && !s.sums ? G * u(M) * u(H) * 4 : 0;
  if (s.backend == Backend::cuda) {
    b[kGemmWorkspace] = kGemmWorkspaceBytes;
    b[kLogits] = epi ? 0 : u(f32 ? M : rb) * u(vc) * 4;  // epi: forward's, below
    b[kGrad] = s.gradients && !f32 ? u(M) * u(vc) * es : 0;
    b[kHidden] = s.sequence_parallel ? u(M) * u(H) * es : 0;
    b[kMine] = s.sequence_parallel ? u(N) * u(H) * es : 0;
    // d_hidden itself where it is f32 on one rank; else scratch (summed over the ranks in it).
    b[kDHidden] = dh && !(s.ranks == 1 && s.d_hidden_f32) ? u(M) * u(H) * 4 : 0;
    b[kTargets] = s.sequence_parallel ? u(M) * 8 : 0;
  } else {
    b[kLogits] = u(M) * u(vc) * 4;
    b[kPad] = 128 * (u(H) + u(vc)) * 4;
    b[kHidden] = u(M) * u(H) * 4;
    b[kMine] = s.sequence_parallel ? u(N) * u(H) * 4 : 0;
    b[kWeight] = f32 ? 0 : u(vc) * u(H) * 4;
    b[kDWeight] = s.gradients && s.d_weight && !s.d_weight_f32 ? u(vc) * u(H) * 4 : 0;
    b[kDHidden] = dh ? u(M) * u(H) * 4 : 0;
    b[kPartial] = dh && s.ranks > 1 ? u(M) * u(H) * 4 : 0;
    b[kGathered] = dh && s.ranks > 1 ? G * u(M) * u(H) * 4 : 0;
    b[kTargets] = u(M) * 8;
  }
  // The forward's chunks: on CUDA every row at once, as wide as the sweep's three buffers allow
  // (fewer, larger logits GEMMs, fewer records), where that is no narrower than the sweep's.
  p.stats_rows = f32 || s.backend == Backend::cpu ? M : rb;
  p.stats_cols = vc;
  const size_t region = b[kLogits] + b[kGrad] + b[kDHidden];
  if (epi) {
    // Forward's chunks over every row: the statistics GEMM writes a partial record per row and
    // 256-column tile (sm90/partials.h), no logits, into kGrad and kDHidden (idle in forward: epi
    // comes with gradients), as many tiles as they hold (the whole shard at 8192 rows: 94 MiB at
    // 128256 columns), at least one (kLogits then holds the rest).
    const size_t idle = b[kGrad] + b[kDHidden];
    const size_t tile = sm90::Partial::kFields * 4 * u(M);  // bytes of one tile's partials
    const int64_t tiles =
        std::max<int64_t>(1, static_cast<int64_t>(idle / std::max<size_t>(tile, 1)));
    p.stats_rows = M;
    p.stats_cols = std::min<int64_t>(V, tiles * sm90::kStatsTileCols);
    const size_t need = u(sm90::stats_tiles(p.stats_cols)) * tile;
    b[kLogits] = std::max<size_t>(4 * u(M), need - std::min(idle, need));
  } else if (s.backend == Backend::cuda && M > 0) {
    const int64_t wide = std::min<int64_t>(V, static_cast<int64_t>(region / (4 * u(M))));
    if (wide >= vc) {
      p.stats_rows = M;
      p.stats_cols = wide == V ? V : std::max(vc, wide - wide % 128);
    }
  }
  p.stats_chunks = p.stats_cols > 0 ? (V + p.stats_cols - 1) / p.stats_cols : 0;
  b[kSend] = u(p.stats_chunks) * u(s.fields) * u(M) * 4;
  b[kRecv] = s.ranks > 1 ? G * b[kSend] : 0;
  b[kBlockRecord] = p.stats_rows < M ? u(s.fields) * u(p.stats_rows) * 4 : 0;
  place(p);
  return p;
}

// Rows of lean's blocks of fp32 logits: every row where the gradient is made in place over them
// (fp32 on CUDA, and the CPU) or where there are none (the epilogue engine), else kLeanRows (or
// the rows asked for).
int64_t lean_block_rows(const Shape& s, const LinearOptions& lopt, bool epi) {
  const int64_t M = std::max<int64_t>(s.rows_all(), 1);
  if (s.backend == Backend::cpu || s.inputs == DType::f32 || epi) return M;
  return std::min(lopt.chunk_rows > 0 ? lopt.chunk_rows : kLeanRows, M);
}

// The largest n in [lo, hi] with fits(n), assuming fits is monotone; lo - 1 where none.
template <typename F>
int64_t largest(int64_t lo, int64_t hi, F fits) {
  if (hi < lo || !fits(lo)) return lo - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Whether the CUDA backend makes fast's fp32 logits a sub-chunk at a time (16-bit inputs).
bool has_sub_chunks(const Shape& s) {
  return s.backend == Backend::cuda && s.inputs != DType::f32;
}

// fast with chunks of c rows and the largest sub-chunk within `budget` (or of one row where none
// fits): at most kSubRows rows where there are several chunks, else up to every row (a
// sub-chunk's logits GEMM reads the whole weight: 512-row sub-chunks of one chunk of 8192 rows
// read it 16 times, 8 GB at V_local 64128, H 4096).
Plan fast_within(const Shape& s, int64_t c, size_t budget) {
  if (!has_sub_chunks(s)) return fast_layout(s, c, 0);
  const int64_t m = c * (s.sequence_parallel ? s.ranks : 1);
  const int64_t most = c >= s.rows ? m : std::min(kSubRows, m);
  const int64_t sub = largest(1, std::max<int64_t>(most, 1),
                              [&](int64_t n) { return fast_layout(s, c, n).total <= budget; });
  return fast_layout(s, c, std::max<int64_t>(whole(sub, 128), 1));  // whole tiles of the GEMM
}

// Whether fast's plan p makes its fp32 logits kSubRows rows at a time (or the whole chunk's):
// shorter sub-chunks each take a GEMM that rereads the weight, a statistics pass and an exchange
// of their own (one row each: thousands a step).
bool whole_sub_chunks(const Shape& s, const Plan& p) {
  return !has_sub_chunks(s) || p.sub_rows >= std::min(kSubRows, p.logits_rows());
}

// fast within `budget`; info.chunks == -1 where no chunk fits. The most rows a chunk whose
// sub-chunks are whole (whole_sub_chunks); where none is, the most rows a chunk at all.
Plan plan_fast(const Shape& s, const LinearOptions& lopt, size_t budget) {
  const int64_t N = std::max<int64_t>(s.rows, 1);
  if (lopt.chunk_rows > 0) return fast_within(s, std::min(lopt.chunk_rows, N), budget);
  const auto fits = [&](int64_t r) { return fast_within(s, r, budget).total <= budget; };
  const auto fits_whole = [&](int64_t r) {
    const Plan p = fast_within(s, r, budget);
    return p.total <= budget && whole_sub_chunks(s, p);
  };
  Plan one = fast_within(s, N, budget);  // one chunk: no accumulator over chunks
  if (one.total <= budget && whole_sub_chunks(s, one)) return one;
  int64_t c = largest(1, N - 1, fits_whole);
  if (c < 1 && one.total <= budget) return one;
  if (c < 1) c = largest(1, N - 1, fits);
  if (c < 1) {
    Plan none = fast_within(s, 1, budget);
    none.info.chunks = -1;
    return none;
  }
  // Whole sub-chunks (whole 128-row tiles of the GEMM): a short one rereads the whole weight.
  const int64_t R = s.sequence_parallel ? s.ranks : 1;
  const Plan fit = fast_within(s, c, budget);
  const int64_t tile = fit.sub_rows > 0 ? fit.sub_rows : 128;
  return fast_within(s, std::max<int64_t>(1, whole(c * R, tile) / R), budget);
}

// lean within `budget`, chunks of at most `most_cols` columns (more where lean's least scratch
// needs them); info.chunks == -1 where no chunk fits.
Plan plan_lean(const Shape& s, const LinearOptions& lopt, size_t budget, int64_t most_cols,
               bool epi) {
  const int64_t V = std::max<int64_t>(s.widest, 1), rb = lean_block_rows(s, lopt, epi);
  if (lopt.chunk_cols > 0) return lean_layout(s, rb, std::min(lopt.chunk_cols, V), epi);
  // The scratch grows with the columns of a chunk, save the records of the chunks, which shrink
  // with them: search above the width where the total is least (a ternary search of a function
  // that falls, then rises).
  const auto total = [&](int64_t n) { return lean_layout(s, rb, n, epi).total; };
  int64_t lo = 1, hi = V;
  while (hi - lo > 2) {
    const int64_t a = lo + (hi - lo) / 3, b = hi - (hi - lo) / 3;
    if (total(a) <= total(b))
      hi = b;
    else
      lo = a;
  }
  int64_t least = lo;
  for (int64_t n = lo + 1; n <= hi; ++n)
    if (total(n) < total(least)) least = n;
  const int64_t most = std::max(least, std::min(V, most_cols));
  const int64_t vc = largest(least, most, [&](int64_t n) { return total(n) <= budget; });
  if (vc < least) {
    Plan none = lean_layout(s, rb, least, epi);
    none.info.chunks = -1;
    return none;
  }
  return lean_layout(s, rb, vc == V ? V : whole(vc, epi ? kEpilogueCols : 128), epi);
}

[[noreturn]] void refuse(const Shape& s, const LinearOptions& lopt, size_t budget, bool given,
                         LinearSchedule asked, const Plan& fast, const Plan& lean) {
  std::string what = "LinearOptions::max_scratch_bytes = " + to_string(budget);
  if (!given)
    what = "LinearOptions::max_scratch_bytes = 0: the default budget (" + to_string(budget) +
           " bytes, an eighth of the 16-bit logits or what lean needs)";
  else if (lopt.max_scratch_bytes == 0)
    what = "LinearOptions::max_chunk_bytes = " + to_string(budget);
  std::string need;
  size_t least = SIZE_MAX;  // the least budget that admits the schedule asked for
  if (asked != LinearSchedule::lean) {
    need += "fast needs " + to_string(fast.total) + " bytes for a chunk of " +
            to_string(fast.info.chunk_rows) + " rows";
    least = std::min(least, fast.total);
  }
  if (asked != LinearSchedule::fast) {
    need += std::string(need.empty() ? "" : ", ") + "lean needs " + to_string(lean.total) +
            " bytes for a chunk of " + to_string(lean.info.chunk_cols) + " columns";
    least = std::min(least, lean.total);
  }
  const std::string which = asked == LinearSchedule::automatic
                                ? std::string("either schedule")
                                : std::string("schedule ") + to_string(asked);
  std::string advice = "raise it to at least " + to_string(least);
  if (!given)
    advice = "set max_scratch_bytes to at least " + to_string(least) + " for " + which +
             ", or leave the schedule automatic";
  else if (asked == LinearSchedule::automatic)
    advice += ", or leave it 0 for the default";
  fail(what + ": too small for " + which + " of " + to_string(s.rows_all()) + " rows, hidden " +
       to_string(s.hidden) + " and " + to_string(s.widest) + " columns on this backend (" + need +
       "): " + advice);
}

}  // namespace

void check_options(const LinearOptions& lopt) {
  if (lopt.chunk_rows < 0)
    fail("LinearOptions::chunk_rows = " + to_string(lopt.chunk_rows) +
         ": must be >= 1, or 0 (from the budget)");
  if (lopt.chunk_cols < 0)
    fail("LinearOptions::chunk_cols = " + to_string(lopt.chunk_cols) +
         ": must be >= 1, or 0 (from the budget)");
  const int s = static_cast<int>(lopt.schedule);
  if (s < 0 || s > static_cast<int>(LinearSchedule::lean))
    fail("LinearOptions::schedule = " + to_string(s) + ": must be automatic, fast or lean");
  const int g = static_cast<int>(lopt.gemm);
  if (g < 0 || g > static_cast<int>(LinearGemm::epilogue))
    fail("LinearOptions::gemm = " + to_string(g) + ": must be automatic, cublaslt or epilogue");
  if (lopt.gemm == LinearGemm::epilogue && lopt.schedule == LinearSchedule::fast)
    fail(
        "LinearOptions::gemm = epilogue with schedule = fast: the epilogue engine runs the lean "
        "schedule only; choose schedule lean or automatic, or gemm cublaslt or automatic");
}

size_t default_budget(const Shape& s) {
  const size_t logits16 = u(s.rows_all()) * u(s.widest) * 2;
  LinearOptions lopt;
  lopt.chunk_cols = std::min<int64_t>(std::max<int64_t>(s.widest, 1), kLeanCols);
  const Plan need = lean_layout(s, lean_block_rows(s, lopt, false), lopt.chunk_cols, false);
  return std::max({logits16 / 8, need.total, kMinBudget});
}

Plan make_plan(const Shape& s, const LinearOptions& lopt) {
  check_options(lopt);
  size_t budget = lopt.max_scratch_bytes != 0 ? lopt.max_scratch_bytes : lopt.max_chunk_bytes;
  const bool given = budget != 0;
  if (!given) budget = default_budget(s);
  const Plan fast = plan_fast(s, lopt, budget);
  // The epilogue engine makes the sweep's gradient: a call without gradients has none to make.
  const bool epi = s.epilogue && s.gradients && lopt.gemm != LinearGemm::cublaslt;
  const Plan lean = plan_lean(s, lopt, budget, given ? s.widest : kWideCols, epi);
  const bool fast_fits = fast.info.chunks >= 0 && fast.total <= budget;
  const bool lean_fits = lean.info.chunks >= 0 && lean.total <= budget;
  Plan p;
  switch (lopt.schedule) {
    case LinearSchedule::fast:
      if (!fast_fits) refuse(s, lopt, budget, given, lopt.schedule, fast, lean);
      p = fast;
      break;
    case LinearSchedule::lean:
      if (!lean_fits) refuse(s, lopt, budget, given, lopt.schedule, fast, lean);
      p = lean;
      break;
    default: {
      // fast where its chunks are long enough for its GEMMs (or asked for), else lean.
      const bool fast_good =
          fast_fits && lopt.gemm != LinearGemm::epilogue &&
          (lopt.chunk_rows > 0 || fast.info.chunk_rows >= std::min(s.rows, kFastRows));
      if (fast_good || (fast_fits && !lean_fits && lopt.gemm != LinearGemm::epilogue))
        p = fast;
      else if (lean_fits)
        p = lean;
      else
        refuse(s, lopt, budget, given, lopt.schedule, fast, lean);
    }
  }
  p.info.budget = budget;
  p.info.scratch_bytes = p.total;
  return p;
}

}  // namespace xent::linear
