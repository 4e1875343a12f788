#include "linear/check.h"

#include <algorithm>
#include <string>
#include <vector>

#include "backend.h"
#include "core/dtype.h"
#include "core/math.h"
#include "error.h"
#include "layout.h"
#include "linear/sm90/epilogue_gemm.h"

namespace xent::linear {

namespace {

using std::to_string;

// A view's own rules: rows >= 0, cols >= 1, row_stride >= cols, data where there are rows.
void check_view(const std::string& name, MatrixView v) {
  if (v.rows < 0) fail(name + ".rows = " + to_string(v.rows) + ": must be >= 0");
  if (v.cols < 1) fail(name + ".cols = " + to_string(v.cols) + ": must be >= 1");
  if (v.row_stride < v.cols)
    fail(name + ".row_stride = " + to_string(v.row_stride) + ": must be >= " + name +
         ".cols = " + to_string(v.cols));
  if (v.rows > 0 && v.data == nullptr)
    fail(name + ".data is null with " + name + ".rows = " + to_string(v.rows));
}

// A gradient output: `of`'s shape, and `of`'s dtype or f32.
void check_gradient(const std::string& name, MatrixView g, const std::string& of_name,
                    MatrixView of) {
  check_view(name, g);
  if (g.rows != of.rows)
    fail(name + ".rows = " + to_string(g.rows) + ": must equal " + of_name +
         ".rows = " + to_string(of.rows));
  if (g.cols != of.cols)
    fail(name + ".cols = " + to_string(g.cols) + ": must equal " + of_name +
         ".cols = " + to_string(of.cols));
  if (g.dtype != of.dtype && g.dtype != DType::f32)
    fail(name + ".dtype = " + to_string(g.dtype) + ": must be " + of_name + "'s (" +
         to_string(of.dtype) + ") or f32");
}

void check_outputs(Pass pass, const Call& c, const Options& opt, const LinearOptions& lopt,
                   const float* lse) {
  const LinearOutputs& out = c.out;
  const bool dh = out.d_hidden.data != nullptr, dw = out.d_weight.data != nullptr;
  const char* mode = to_string(opt.grad_mode);
  if (pass == Pass::forward) {
    Outputs o;  // the logits path's rules of the loss, lse and accuracy outputs
    o.loss = out.loss;
    o.lse = out.lse;
    o.argmax = out.argmax;
    o.accuracy = out.accuracy;
    core::check_outputs(c.p, opt, o);
    if (opt.grad_mode != GradMode::fused && (dh || dw))
      fail(
          std::string("out.") + (dh ? "d_hidden" : "d_weight") + " is set with grad_mode = " +
          mode + ": linear_forward computes the gradients only with grad_mode = fused" +
          (opt.grad_mode == GradMode::deferred ? " (deferred: pass them to linear_backward)" : ""));
  } else {
    if (opt.grad_mode == GradMode::fused)
      fail(
          "linear_backward with grad_mode = fused: linear_forward computed d_hidden and d_weight "
          "already (for grad_output = grad_scale); linear_backward is for grad_mode = deferred");
    if (opt.grad_mode == GradMode::none)
      fail("linear_backward with grad_mode = none: forward computed no gradient");
    if (lse == nullptr && c.p.rows > 0) fail("linear_backward(lse = null): pass forward's lse");
  }
  if (c.gradients && !dh && !dw)
    fail(std::string(pass == Pass::forward ? "linear_forward with grad_mode = fused"
                                           : "linear_backward") +
         ": out.d_hidden and out.d_weight are both null; set one" +
         (pass == Pass::forward ? " (or use grad_mode = none)" : ""));
  if (dh) check_gradient("out.d_hidden", out.d_hidden, "hidden", c.hidden);
  if (dw) check_gradient("out.d_weight", out.d_weight, "weight", c.weight);
  if (dw && lopt.accumulate_d_weight && out.d_weight.dtype != DType::f32)
    fail("out.d_weight.dtype = " + std::string(to_string(out.d_weight.dtype)) +
         " with accumulate_d_weight: the accumulation buffer must be f32");
}

}  // namespace

Call check_call(Pass pass, MatrixView hidden, MatrixView weight, TargetsView targets,
                const Options& opt, const LinearOptions& lopt, const LinearOutputs& out,
                const float* lse) {
  check_view("hidden", hidden);
  check_view("weight", weight);
  if (weight.rows < 1)
    fail("weight.rows = " + to_string(weight.rows) +
         ": must be >= 1 (this rank's columns of the vocabulary)");
  if (weight.cols != hidden.cols)
    fail("weight.cols = " + to_string(weight.cols) +
         ": must equal hidden.cols = " + to_string(hidden.cols) + " (the hidden size)");
  if (targets.rows != hidden.rows)
    fail("targets.rows = " + to_string(targets.rows) +
         ": must equal hidden.rows = " + to_string(hidden.rows));
  if (targets.rows > 0 && targets.data == nullptr)
    fail("targets.data is null with targets.rows = " + to_string(targets.rows));
  check_options(lopt);
  Call c;
  // The options' rules and constants, as for a logits shard of the weight's rows (a view of no
  // rows: the checks need no data).
  const LogitsView shape{nullptr, DType::f32, 0, weight.rows, weight.rows};
  c.p = core::make_problem(shape, TargetsView{nullptr, targets.type, 0}, opt);
  c.p.rows = hidden.rows;
  c.hidden = hidden;
  c.weight = weight;
  c.targets = targets;
  c.out = out;
  c.sequence_parallel = lopt.sequence_parallel;
  c.accumulate_d_weight = lopt.accumulate_d_weight;
  c.gradients = pass == Pass::backward || opt.grad_mode == GradMode::fused;
  c.single_pass = opt.single_pass;
  c.allocator = lopt.allocator != nullptr ? lopt.allocator : opt.allocator;
  check_outputs(pass, c, opt, lopt, lse);
  return c;
}

namespace {

// What every rank sends: the logits path's header (layout, rows, options, targets) and the
// lm head's own fields.
struct Header {
  core::LayoutHeader layout;
  int64_t rows = 0;  // layout.rows, compared first with the lm head's own message
  int64_t sequence_parallel = 0;
  int64_t hidden_cols = 0;
  int64_t hidden_dtype = 0;
  int64_t chunk_rows = 0;
  int64_t chunk_cols = 0;
  int64_t schedule = 0;
  int64_t gemm = 0;
  int64_t budget = 0;    // max_scratch_bytes, else max_chunk_bytes
  int64_t d_hidden = 0;  // computed here: it is summed over the ranks
  int64_t valid_rows = 0;
  // What the plan reads of each rank beyond the above (plan.h: Shape), combined over the ranks.
  int64_t d_hidden_f32 = 0, d_weight = 0, d_weight_f32 = 0, sums = 0, epilogue = 0;
};

// Fails on every rank alike where a field differs from rank 0's.
void expect_same(const std::vector<Header>& all, int64_t Header::*field, const std::string& name,
                 const std::string& rule, std::string (*show)(int64_t)) {
  for (size_t k = 1; k < all.size(); ++k)
    if (all[k].*field != all[0].*field)
      fail(name + " = " + show(all[k].*field) + " on rank " + to_string(k) + " but " +
           show(all[0].*field) + " on rank 0: " + rule);
}

std::string show_int(int64_t v) {
  return to_string(v);
}
std::string show_bool(int64_t v) {
  return v ? "true" : "false";
}
std::string show_dtype(int64_t v) {
  return to_string(static_cast<DType>(v));
}

// Every rank's header. One rank exchanges nothing. Several on CUDA stage it through the device, a
// synchronisation that a stream being captured into a CUDA graph refuses; so each exchange is
// kept in the group's workspace, and a captured call takes every rank's header to be its own
// (every rank captures the same step) but for what differs between the ranks: their shards of
// the vocabulary and their engines, from the last exchange. Its own must match there: the step
// ran once before capture (as capture needs anyway).
std::vector<Header> exchange(const Group& group, const Header& mine, cudaStream_t stream) {
  const int ranks = group.size();
  std::vector<Header> all(ranks);
  if (ranks == 1) {
    all[0] = mine;
    return all;
  }
  const bool cuda = group.backend() == Backend::cuda;
  std::vector<unsigned char>& last = group.workspace().linear_headers;
  if (cuda && capturing(stream)) {
    const Header* before = reinterpret_cast<const Header*>(last.data());
    const core::LayoutHeader* me =
        last.size() == all.size() * sizeof(Header) ? &before[group.rank()].layout : nullptr;
    if (me == nullptr || me->vocab_start != mine.layout.vocab_start ||
        me->width != mine.layout.width || me->vocab_size != mine.layout.vocab_size)
      fail("linear_cross_entropy over " + to_string(ranks) +
           " CUDA ranks, captured into a CUDA graph before any uncaptured call with this shard "
           "of the vocabulary (vocab_start " +
           to_string(mine.layout.vocab_start) + ", width " + to_string(mine.layout.width) +
           ", vocab_size " + to_string(mine.layout.vocab_size) +
           ") on this group: its ranks agree on the shards on the host, which capture refuses; "
           "run the step once before capturing it");
    for (int k = 0; k < ranks; ++k) {
      all[k] = mine;
      all[k].layout.vocab_start = before[k].layout.vocab_start;
      all[k].layout.width = before[k].layout.width;
      all[k].epilogue = before[k].epilogue;
      all[k].sums = before[k].sums;
    }
    return all;
  }
  gather_on_host(group, &mine, all.data(), sizeof mine);
  if (cuda) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(all.data());
    last.assign(bytes, bytes + all.size() * sizeof(Header));
  }
  return all;
}

}  // namespace

Agreed agree(const Group& group, const Call& call, const Options& opt, const LinearOptions& lopt,
             cudaStream_t stream) {
  const core::Problem& p = call.p;
  Header mine;
  mine.layout = core::make_header(p, opt, call.hidden.dtype);
  // The targets are read on the host by the CPU backend alone: with sequence parallelism each
  // rank holds its own, and only their range is compared. The CUDA backend's live on the device:
  // it counts the valid rows there, and a target out of range gets a NaN loss (check_errors).
  const bool host_targets = group.backend() == Backend::cpu;
  if (!call.sequence_parallel && host_targets)
    mine.layout.targets_hash = core::hash_targets(p, call.targets);
  for (int64_t r = 0; host_targets && r < p.rows; ++r) {
    const int64_t y = core::load_target(call.targets.data, call.targets.type, r);
    if (y == p.ignore_index) continue;
    ++mine.valid_rows;
    if (mine.layout.bad_row < 0 && !core::target_in_range(y, p.vocab_size)) {
      mine.layout.bad_row = r;
      mine.layout.bad_target = y;
    }
  }
  mine.rows = p.rows;
  mine.sequence_parallel = call.sequence_parallel ? 1 : 0;
  mine.hidden_cols = call.hidden.cols;
  mine.hidden_dtype = static_cast<int64_t>(call.hidden.dtype);
  mine.chunk_rows = lopt.chunk_rows;
  mine.chunk_cols = lopt.chunk_cols;
  mine.schedule = static_cast<int64_t>(lopt.schedule);
  mine.gemm = static_cast<int64_t>(lopt.gemm);
  mine.budget = static_cast<int64_t>(lopt.max_scratch_bytes != 0 ? lopt.max_scratch_bytes
                                                                 : lopt.max_chunk_bytes);
  mine.d_hidden = call.gradients && call.out.d_hidden.data != nullptr ? 1 : 0;
  mine.d_hidden_f32 = call.out.d_hidden.dtype == DType::f32 ? 1 : 0;
  const MatrixView& dw = call.out.d_weight;
  mine.d_weight = call.gradients && dw.data != nullptr ? 1 : 0;
  mine.d_weight_f32 = dw.dtype == DType::f32 ? 1 : 0;
  mine.sums = group.comm().has_sums() ? 1 : 0;
  // The epilogue engine reads hidden (or its gathered copy, rows of H) and the weight by TMA.
  const std::string no_epilogue =
      group.backend() != Backend::cuda
          ? std::string("the group's backend is cpu")
          : sm90::why_not(call.hidden.dtype, call.hidden.data,
                          call.sequence_parallel ? call.hidden.cols : call.hidden.row_stride,
                          call.weight.data, call.weight.row_stride, call.hidden.cols);
  mine.epilogue = no_epilogue.empty() ? 1 : 0;

  const int ranks = group.size();
  const std::vector<Header> all = exchange(group, mine, stream);

  expect_same(all, &Header::sequence_parallel, "LinearOptions::sequence_parallel",
              "every rank must pass the same", show_bool);
  expect_same(all, &Header::rows, "hidden.rows",
              call.sequence_parallel
                  ? "with sequence_parallel every rank must hold the same number of rows"
                  : "without sequence_parallel every rank holds the same hidden states",
              show_int);
  expect_same(all, &Header::hidden_cols, "hidden.cols",
              "every rank must pass hidden states of the same width", show_int);
  expect_same(all, &Header::hidden_dtype, "hidden.dtype",
              "every rank must pass hidden states of the same dtype", show_dtype);
  expect_same(all, &Header::chunk_rows, "LinearOptions::chunk_rows",
              "every rank must make the same chunks", show_int);
  expect_same(all, &Header::chunk_cols, "LinearOptions::chunk_cols",
              "every rank must make the same chunks", show_int);
  expect_same(all, &Header::schedule, "LinearOptions::schedule",
              "every rank must take the same schedule", show_int);
  expect_same(all, &Header::gemm, "LinearOptions::gemm", "every rank must take the same engine",
              show_int);
  expect_same(all, &Header::budget, "LinearOptions::max_scratch_bytes",
              "every rank must make the same chunks", show_int);
  expect_same(all, &Header::d_hidden, "out.d_hidden set",
              "d_hidden is summed over the ranks: every rank computes it, or none does", show_bool);
  if (all[0].d_hidden != 0)  // device::sum_over_ranks's collectives depend on it
    expect_same(all, &Header::d_hidden_f32, "out.d_hidden.dtype f32",
                "d_hidden is summed over the ranks: every rank gives it the same dtype", show_bool);
  std::vector<core::LayoutHeader> layouts(ranks);
  for (int k = 0; k < ranks; ++k) layouts[k] = all[k].layout;
  core::check_headers(layouts.data(), ranks, /*check_tiling=*/true);

  Agreed a;
  Shape shape;
  shape.backend = group.backend();
  shape.ranks = ranks;
  shape.sequence_parallel = call.sequence_parallel;
  shape.rows = p.rows;
  shape.hidden = call.hidden.cols;
  shape.inputs = call.hidden.dtype;
  shape.gradients = call.gradients;
  shape.d_hidden = mine.d_hidden != 0;
  shape.d_hidden_f32 = shape.d_weight_f32 = shape.sums = shape.epilogue = true;
  shape.accuracy = p.layout.max_field >= 0;
  shape.fields = p.layout.fields;
  for (const Header& h : all) {
    shape.widest = std::max(shape.widest, h.layout.width);
    shape.d_hidden_f32 = shape.d_hidden_f32 && h.d_hidden_f32 != 0;
    shape.d_weight = shape.d_weight || h.d_weight != 0;
    shape.d_weight_f32 = shape.d_weight_f32 && h.d_weight_f32 != 0;
    shape.sums = shape.sums && h.sums != 0;
    shape.epilogue = shape.epilogue && h.epilogue != 0;
    if (call.sequence_parallel) a.valid_rows += h.valid_rows;
  }
  if (!call.sequence_parallel) a.valid_rows = mine.valid_rows;  // the same targets everywhere
  if (lopt.gemm == LinearGemm::epilogue && !shape.epilogue) {
    const std::string why = mine.epilogue ? "another rank cannot run it" : no_epilogue;
    fail("LinearOptions::gemm = epilogue: " + why +
         "; leave gemm automatic (it takes cublaslt there) or choose cublaslt");
  }
  a.plan = make_plan(shape, lopt);
  return a;
}

}  // namespace xent::linear
