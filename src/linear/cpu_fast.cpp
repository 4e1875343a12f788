// The fast schedule's steps on the CPU backend (steps.h, fast.cpp). Per chunk of rows: the hidden
// rows in fp32 (gathered from every rank with sequence parallelism), logits = hidden @ weight^T
// (fp32 GEMMs of a fixed number of rows, so that a row's logits do not depend on the chunking),
// then the logits path's own steps on them (cpu::stats, the all-gather of the records,
// cpu::finalize_rows), then the gradient over the logits (cpu::gradient, in place) and the two
// GEMMs that consume it: d_hidden's partial (summed over the ranks) and d_weight's (accumulated
// in fp32 over the chunks). One sub-chunk: the whole chunk.
#include <algorithm>
#include <memory>
#include <vector>

#include "backend.h"
#include "core/dtype.h"
#include "core/finalize.h"
#include "linear/blas.h"
#include "linear/cpu.h"
#include "linear/fast.h"
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

class CpuFast final : public FastSteps {
 public:
  CpuFast(const Group& group, const Call& call, const Agreed& agreed, Pass pass, const float* lse,
          const float* grad_output)
      : comm_(group.comm()),
        call_(call),
        agreed_(agreed),
        plan_(agreed.plan),
        pass_(pass),
        ws_(group.workspace()),
        scratch_(Backend::cpu, call.allocator, agreed.plan, nullptr),
        H_(call.hidden.cols),
        V_(call.p.cols),
        real_(call.p.real_cols),
        lse_in_(lse),
        go_in_(grad_output) {}

  void begin() override {
    // The gradient's scale of the whole problem, known before the first chunk.
    ws_.prepare(1, call_.p.layout.fields, comm_.size(), nullptr);
    ws_.scalars[Workspace::kScale] =
        core::gradient_scale(call_.p.reduction == Reduction::mean,
                             static_cast<float>(agreed_.valid_rows), call_.p.grad_scale);
    w_ = as_f32(call_.weight, 0, real_, scratch_.get<float>(kWeight), &ldw_);  // once per call
    totals_.resize(static_cast<size_t>(plan_.ranks_in_chunk));
    if (call_.gradients && call_.out.d_weight.data != nullptr) start_d_weight();
  }

  // The chunk's hidden rows in fp32 (h_, ldh_), its targets (tv_), its logits buffer, and in
  // backward its rows' lse and per-row grad_output.
  void rows(int64_t r0, int64_t c) override {
    r0_ = r0;
    c_ = c;
    m_ = c * plan_.ranks_in_chunk;
    logits_ = scratch_.get<float>(kLogits);
    const TargetsView& t = call_.targets;
    if (!call_.sequence_parallel) {
      h_ = as_f32(call_.hidden, r0, c, scratch_.get<float>(kMine), &ldh_);
      const size_t tsize = core::target_size(t.type);
      tv_ = TargetsView{static_cast<const char*>(t.data) + r0 * tsize, t.type, c};
    } else {
      float* mine_rows = scratch_.get<float>(kMine);
      host::to_f32(call_.hidden, r0, c, mine_rows);
      h_ = scratch_.get<float>(kHidden);
      comm_.all_gather(mine_rows, const_cast<float*>(h_), sizeof(float) * c * H_, nullptr);
      ldh_ = H_;
      int64_t* mine = scratch_.get<int64_t>(kTargets);
      int64_t* all = mine + plan_.info.chunk_rows;
      for (int64_t i = 0; i < c; ++i) mine[i] = core::load_target(t.data, t.type, r0 + i);
      comm_.all_gather(mine, all, sizeof(int64_t) * c, nullptr);
      tv_ = TargetsView{all, IndexType::i64, m_};
    }
    if (pass_ == Pass::backward) lse_ = mine_to_chunk(lse_in_, r0, c, per_row(0));
    go_ = go_in_;
    if (go_ != nullptr && call_.p.reduction == Reduction::none)
      go_ = mine_to_chunk(go_in_, r0, c, per_row(3));
  }

  // Every rank's rows of the chunk (one call each: each rank's row r0 + i keeps its position i).
  void logits(int64_t, int64_t) override {
    float* pad = scratch_.get<float>(kPad);
    for (int64_t k = 0; k < plan_.ranks_in_chunk; ++k)
      host::sgemm_nt_row_invariant(c_, real_, H_, h_ + k * c_ * ldh_, ldh_, w_, ldw_,
                                   logits_ + k * c_ * V_, V_, r0_, pad, pad + host::kRowBlock * H_);
  }

  // Statistics, exchange and finalize of the chunk; each rank's rows into its own totals, in
  // order: the reduced loss is then the same for any chunk size (end).
  void finalize(int64_t, int64_t) override {
    const int ranks = comm_.size();
    const core::Problem pc = chunk_problem();
    float* send = scratch_.get<float>(kSend);
    float* recv = ranks > 1 ? scratch_.get<float>(kRecv) : send;
    cpu::stats(pc, view(), tv_, send);
    if (ranks > 1) comm_.all_gather(send, recv, pc.layout.bytes_per_row() * pc.rows, nullptr);
    const Outputs o = row_outputs();
    for (int64_t b = 0; b < plan_.ranks_in_chunk; ++b)
      cpu::finalize_rows(pc, tv_, recv, ranks, b * c_, (b + 1) * c_, o, per_row(0), totals_[b]);
    lse_ = per_row(0);
  }

  void gradient(int64_t, int64_t) override {
    cpu::gradient(chunk_problem(), view(), view(), tv_, lse_, ws_.scalars, go_);
  }

  // This rank's rows of the chunk's per-row outputs, copied out.
  void own_rows(int64_t r0, int64_t c) override {
    const LinearOutputs& out = call_.out;
    const Outputs o = row_outputs();
    const int64_t own = call_.sequence_parallel ? comm_.rank() * c : 0;
    const auto copy = [&](const auto* from, auto* to) {
      if (to != nullptr) std::copy(from + own, from + own + c, to + r0);
    };
    copy(per_row(0), out.lse);
    if (call_.p.reduction == Reduction::none) copy(o.loss, out.loss);
    copy(o.z_loss, out.z_loss);
    copy(o.argmax, out.argmax);
  }

  // The chunk's d_hidden: this rank's partial, summed over the ranks (all of the chunk's rows,
  // or with sequence parallelism this rank's), rounded once into out.d_hidden.
  void d_hidden(int64_t, int64_t r0, int64_t c) override {
    float* partial = scratch_.get<float>(kPartial);
    host::sgemm(false, false, m_, H_, real_, logits_, V_, w_, ldw_, 0.0f, partial, H_);
    float* gathered = scratch_.get<float>(kGathered);
    float* sum = scratch_.get<float>(kDHidden);
    const float* rows =
        sum_over_ranks(comm_, call_.sequence_parallel, partial, c * H_, gathered, sum);
    host::store(rows, H_, call_.out.d_hidden, r0, c);
  }

  void d_weight(int64_t) override {
    host::sgemm(true, false, real_, H_, m_, logits_, V_, h_, ldh_, 1.0f, acc_, ldacc_);
  }

  void end() override {
    if (pass_ == Pass::forward) reduce_loss();
    if (call_.gradients && call_.out.d_weight.data != nullptr) finish_d_weight();
  }

 private:
  // The chunk's logits as the logits path sees a shard.
  core::Problem chunk_problem() const {
    core::Problem pc = call_.p;
    pc.rows = m_;
    pc.row_stride = V_;
    return pc;
  }
  LogitsView view() const { return LogitsView{logits_, DType::f32, m_, V_, V_}; }

  // This rank's c floats from row r0 for every row of the chunk: gathered from every rank with
  // sequence parallelism, else the rows themselves.
  const float* mine_to_chunk(const float* rows, int64_t r0, int64_t c, float* all) {
    if (!call_.sequence_parallel) return rows + r0;
    comm_.all_gather(rows + r0, all, sizeof(float) * c, nullptr);
    return all;
  }

  // Per-row scratch k of the chunk's rows: 0 lse, 1 loss, 2 z-loss, 3 grad_output.
  float* per_row(int k) const { return scratch_.get<float>(kRows) + k * plan_.logits_rows(); }
  // Where finalize writes the chunk's per-row outputs (scratch, copied out by own_rows).
  Outputs row_outputs() const {
    Outputs o;
    o.loss = per_row(1);
    o.z_loss = call_.out.z_loss != nullptr ? per_row(2) : nullptr;
    o.argmax = call_.out.argmax != nullptr ? scratch_.get<int64_t>(kArgmax) : nullptr;
    return o;
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
  const Agreed& agreed_;
  const Plan& plan_;
  const Pass pass_;
  Workspace& ws_;
  Scratch scratch_;
  const int64_t H_, V_, real_;
  const float* lse_in_;
  const float* go_in_;
  int64_t r0_ = 0, c_ = 0, m_ = 0;  // the chunk's first row, its rows: this rank's, and all
  const float* lse_ = nullptr;
  const float* go_ = nullptr;
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
  CpuFast steps(group, call, agreed, pass, lse, grad_output);
  run_fast(steps, call, agreed.plan, pass);
}

}  // namespace xent::linear
