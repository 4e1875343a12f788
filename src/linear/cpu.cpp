// The chunk loop on the CPU backend. Per chunk of rows: the hidden rows in fp32 (gathered from
// every rank with sequence parallelism), logits = hidden @ weight^T (fp32 GEMMs of a fixed number
// of rows, so that a row's logits do not depend on the chunking), then the logits
// path's own steps on them (cpu::stats, the all-gather of the records, cpu::finalize_rows), then
// the gradient over the logits (cpu::gradient, in place) and the two GEMMs that consume it:
// d_hidden's partial (summed over the ranks) and d_weight's (accumulated in fp32 over the chunks).
#include "linear/cpu.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "backend.h"
#include "core/dtype.h"
#include "core/finalize.h"
#include "linear/blas.h"
#include "linear/reduce.h"
#include "linear/scratch.h"

namespace xent::linear {

namespace {

// Rows [r0, r0 + rows) of v in fp32: v itself where it is f32, else converted into `buf`.
const float* as_f32(MatrixView v, int64_t r0, int64_t rows, float* buf, int64_t* ld) {
  if (v.dtype == DType::f32) {
    *ld = v.row_stride;
    return static_cast<const float*>(v.data) + r0 * v.row_stride;
  }
  *ld = v.cols;
  host::to_f32(v, r0, rows, buf);
  return buf;
}

class Chunks {
 public:
  Chunks(const Group& group, const Call& call, const Agreed& agreed, Pass pass)
      : comm_(group.comm()),
        call_(call),
        plan_(agreed.plan),
        pass_(pass),
        ws_(group.workspace()),
        scratch_(Backend::cpu, call.allocator, agreed.plan, nullptr),
        H_(call.hidden.cols),
        V_(call.p.cols),
        real_(call.p.real_cols) {
    // The gradient's scale of the whole problem, known before the first chunk.
    ws_.prepare(1, call.p.layout.fields, comm_.size(), nullptr);
    ws_.scalars[Workspace::kScale] =
        core::gradient_scale(call.p.reduction == Reduction::mean,
                             static_cast<float>(agreed.valid_rows), call.p.grad_scale);
    w_ = as_f32(call.weight, 0, real_, scratch_.get<float>(kWeight), &ldw_);  // once per call
    totals_.resize(static_cast<size_t>(plan_.ranks_in_chunk));
  }

  void run(const float* lse, const float* grad_output) {
    const bool dw = call_.gradients && call_.out.d_weight.data != nullptr;
    if (dw) start_d_weight();
    for (int64_t i = 0; i < plan_.info.chunks; ++i) {
      const int64_t r0 = plan_.first(i), c = plan_.count(i, call_.p.rows);
      const int64_t m = c * plan_.ranks_in_chunk;
      inputs(r0, c);
      float* pad = scratch_.get<float>(kPad);
      host::sgemm_nt_row_invariant(m, real_, H_, h_, ldh_, w_, ldw_, logits_, V_, pad,
                                   pad + host::kRowBlock * H_);
      core::Problem pc = call_.p;  // the chunk's logits as the logits path sees a shard
      pc.rows = m;
      pc.row_stride = V_;
      const LogitsView lv{logits_, DType::f32, m, V_, V_};
      const float* lse_c =
          pass_ == Pass::forward ? finalize(pc, lv, r0, c) : mine_to_chunk(lse, r0, c, rows(0));
      if (!call_.gradients) continue;
      const float* go = grad_output;
      if (go != nullptr && call_.p.reduction == Reduction::none)
        go = mine_to_chunk(go, r0, c, rows(3));
      cpu::gradient(pc, lv, lv, tv_, lse_c, ws_.scalars, go);
      if (call_.out.d_hidden.data != nullptr) d_hidden(m, r0, c);
      if (dw) host::sgemm(true, false, real_, H_, m, logits_, V_, h_, ldh_, 1.0f, acc_, ldacc_);
    }
    if (pass_ == Pass::forward) reduce_loss();
    if (dw) finish_d_weight();
  }

 private:
  // The chunk's hidden rows in fp32 (h_, ldh_), its targets (tv_) and its logits buffer.
  void inputs(int64_t r0, int64_t c) {
    const int64_t m = c * plan_.ranks_in_chunk;
    logits_ = scratch_.get<float>(kLogits);
    const TargetsView& t = call_.targets;
    if (!call_.sequence_parallel) {
      h_ = as_f32(call_.hidden, r0, c, scratch_.get<float>(kMine), &ldh_);
      const size_t tsize = core::target_size(t.type);
      tv_ = TargetsView{static_cast<const char*>(t.data) + r0 * tsize, t.type, c};
      return;
    }
    float* rows = scratch_.get<float>(kMine);
    host::to_f32(call_.hidden, r0, c, rows);
    h_ = scratch_.get<float>(kHidden);
    comm_.all_gather(rows, const_cast<float*>(h_), sizeof(float) * c * H_, nullptr);
    ldh_ = H_;
    int64_t* mine = scratch_.get<int64_t>(kTargets);
    int64_t* all = mine + plan_.info.chunk_rows;
    for (int64_t i = 0; i < c; ++i) mine[i] = core::load_target(t.data, t.type, r0 + i);
    comm_.all_gather(mine, all, sizeof(int64_t) * c, nullptr);
    tv_ = TargetsView{all, IndexType::i64, m};
  }

  // This rank's c floats from row r0 for every row of the chunk: gathered from every rank with
  // sequence parallelism, else the rows themselves.
  const float* mine_to_chunk(const float* rows, int64_t r0, int64_t c, float* all) {
    if (!call_.sequence_parallel) return rows + r0;
    comm_.all_gather(rows + r0, all, sizeof(float) * c, nullptr);
    return all;
  }

  // Per-row scratch k of the chunk's rows: 0 lse, 1 loss, 2 z-loss, 3 grad_output.
  float* rows(int k) const { return scratch_.get<float>(kRows) + k * plan_.logits_rows(); }

  // Statistics, exchange and finalize of the chunk; this rank's rows of the per-row outputs
  // copied out. Returns the chunk's lse.
  const float* finalize(const core::Problem& pc, LogitsView lv, int64_t r0, int64_t c) {
    const int ranks = comm_.size();
    float* send = scratch_.get<float>(kSend);
    float* recv = ranks > 1 ? scratch_.get<float>(kRecv) : send;
    cpu::stats(pc, lv, tv_, send);
    if (ranks > 1) comm_.all_gather(send, recv, pc.layout.bytes_per_row() * pc.rows, nullptr);
    const LinearOutputs& out = call_.out;
    Outputs o;
    o.loss = rows(1);
    o.z_loss = out.z_loss != nullptr ? rows(2) : nullptr;
    o.argmax = out.argmax != nullptr ? scratch_.get<int64_t>(kArgmax) : nullptr;
    float* lse = rows(0);
    // Each rank's rows into its own totals, in order: the reduced loss is then the same for any
    // chunk size (reduce_loss).
    for (int64_t b = 0; b < plan_.ranks_in_chunk; ++b)
      cpu::finalize_rows(pc, tv_, recv, ranks, b * c, (b + 1) * c, o, lse, totals_[b]);
    const int64_t own = call_.sequence_parallel ? comm_.rank() * c : 0;
    const auto copy = [&](const auto* from, auto* to) {
      if (to != nullptr) std::copy(from + own, from + own + c, to + r0);
    };
    copy(lse, out.lse);
    if (pc.reduction == Reduction::none) copy(o.loss, out.loss);
    copy(o.z_loss, out.z_loss);
    copy(o.argmax, out.argmax);
    return lse;
  }

  // The chunk's d_hidden: this rank's partial, summed over the ranks (all of the chunk's rows,
  // or with sequence parallelism this rank's), rounded once into out.d_hidden.
  void d_hidden(int64_t m, int64_t r0, int64_t c) {
    float* partial = scratch_.get<float>(kPartial);
    host::sgemm(false, false, m, H_, real_, logits_, V_, w_, ldw_, 0.0f, partial, H_);
    float* gathered = scratch_.get<float>(kGathered);
    float* sum = scratch_.get<float>(kDHidden);
    const float* rows =
        sum_over_ranks(comm_, call_.sequence_parallel, partial, c * H_, gathered, sum);
    host::store(rows, H_, call_.out.d_hidden, r0, c);
  }

  // The fp32 accumulator of d_weight's real rows: d_weight itself where it is f32 (zeroed
  // first unless accumulate_d_weight), else scratch, rounded once at the end.
  void start_d_weight() {
    const MatrixView& dw = call_.out.d_weight;
    if (dw.dtype == DType::f32) {
      acc_ = static_cast<float*>(dw.data);
      ldacc_ = dw.row_stride;
      if (!call_.accumulate_d_weight) host::zero_rows(dw, 0, dw.rows);
      return;
    }
    acc_ = scratch_.get<float>(kDWeight);
    ldacc_ = H_;
    std::fill(acc_, acc_ + real_ * H_, 0.0f);
  }
  void finish_d_weight() {
    const MatrixView& dw = call_.out.d_weight;
    if (dw.dtype == DType::f32) return;
    host::store(acc_, ldacc_, dw, 0, real_);
    host::zero_rows(dw, real_, dw.rows - real_);  // padding: no gradient
  }

  // Every rank's rows' totals in rank order, in double: the reduced loss over the whole problem.
  void reduce_loss() {
    cpu::Totals t;
    for (const cpu::Totals& b : totals_) {
      t.loss += b.loss;
      t.valid += b.valid;
      t.correct += b.correct;
    }
    Outputs o;
    o.loss = call_.out.loss;
    o.accuracy = call_.out.accuracy;
    core::finalize_totals(call_.p, t.loss, static_cast<float>(t.valid),
                          static_cast<float>(t.correct), o);
  }

  Communicator& comm_;
  const Call& call_;
  const Plan& plan_;
  const Pass pass_;
  Workspace& ws_;
  Scratch scratch_;
  const int64_t H_, V_, real_;
  const float* w_ = nullptr;
  int64_t ldw_ = 0;
  const float* h_ = nullptr;
  int64_t ldh_ = 0;
  TargetsView tv_{};
  float* logits_ = nullptr;
  float* acc_ = nullptr;
  int64_t ldacc_ = 0;
  std::vector<cpu::Totals> totals_;
};

}  // namespace

void run_cpu(const Group& group, const Call& call, const Agreed& agreed, Pass pass,
             const float* lse, const float* grad_output) {
  Chunks chunks(group, call, agreed, pass);
  chunks.run(lse, grad_output);
}

}  // namespace xent::linear
