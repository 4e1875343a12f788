// The lean schedule's steps on the CPU backend (steps.h): fp32 GEMMs (blas.h), the logits path's
// own CPU steps on each chunk's fp32 logits (one block of every row: the gradient is made in
// place over them), and d_hidden's sum over the ranks in rank order (reduce.h). The scratch is
// the call's (scratch.h).
#include <algorithm>
#include <vector>

#include "backend.h"
#include "core/dtype.h"
#include "linear/blas.h"
#include "linear/lean.h"
#include "linear/reduce.h"
#include "linear/scratch.h"

namespace xent::linear {

namespace {

class CpuLean final : public LeanSteps {
 public:
  CpuLean(const Group& group, const Call& call, const Plan& plan, Pass pass, const float* lse,
          const float* grad_output)
      : comm_(group.comm()),
        call_(call),
        plan_(plan),
        pass_(pass),
        ws_(group.workspace()),
        scratch_(Backend::cpu, call.allocator, plan, nullptr),
        G_(comm_.size()),
        N_(call.p.rows),
        M_(call.p.rows * (call.sequence_parallel ? comm_.size() : 1)),
        H_(call.hidden.cols),
        vc_(plan.info.chunk_cols),
        lse_(lse),
        go_(grad_output) {
    ws_.prepare(1, call.p.layout.fields, G_, nullptr);  // the scalars
    logits_ = scratch_.get<float>(kLogits);
    rows_ = scratch_.get<float>(kRows);
    h_ = scratch_.get<float>(kHidden);
    targets_ = scratch_.get<int64_t>(kTargets);
  }

  void begin() override {
    const TargetsView& t = call_.targets;
    std::vector<int64_t> mine(static_cast<size_t>(N_));
    for (int64_t i = 0; i < N_; ++i) mine[i] = core::load_target(t.data, t.type, i);
    if (sp()) {
      float* rows = scratch_.get<float>(kMine);
      host::to_f32(call_.hidden, 0, N_, rows);
      comm_.all_gather(rows, h_, sizeof(float) * static_cast<size_t>(N_ * H_), nullptr);
      comm_.all_gather(mine.data(), targets_, sizeof(int64_t) * mine.size(), nullptr);
    } else {
      host::to_f32(call_.hidden, 0, N_, h_);
      std::copy(mine.begin(), mine.end(), targets_);
    }
    tv_ = TargetsView{targets_, IndexType::i64, M_};
    all_ = call_.p;
    all_.rows = M_;
    if (pass_ == Pass::forward) return;
    lse_ = gathered_rows(lse_, rows_);
    if (call_.p.reduction == Reduction::none) go_ = gathered_rows(go_, rows_ + 3 * M_);
    cpu::count_valid(all_, tv_, ws_.scalars);
  }

  void phase(bool) override {}  // one block of every row in chunks of vc_ columns, throughout

  void logits(int64_t r0, int64_t rows, int64_t v0, int64_t cols) override {
    weight_rows(v0, cols);
    float* pad = scratch_.get<float>(kPad);
    host::sgemm_nt_row_invariant(rows, cols, H_, h_ + r0 * H_, H_, w_, ldw_, logits_ + r0 * vc_,
                                 vc_, r0, pad, pad + host::kRowBlock * H_);
  }

  void stats(int64_t c, int64_t r0, int64_t rows, int64_t v0, int64_t cols) override {
    // One block of every row (plan.cpp): the chunk's records are written where they go.
    const core::Problem pc = chunk_problem(rows, v0, cols);
    const LogitsView lv{logits_ + r0 * vc_, DType::f32, rows, pc.cols, vc_};
    cpu::stats(pc, lv, targets_from(r0, rows),
               scratch_.get<float>(kSend) + c * call_.p.layout.fields * M_);
  }

  void finalize() override {
    const LinearOutputs& out = call_.out;
    const float* gathered = scratch_.get<float>(kSend);
    if (G_ > 1) {
      comm_.all_gather(gathered, scratch_.get<float>(kRecv), scratch_.bytes(kSend), nullptr);
      gathered = scratch_.get<float>(kRecv);
    }
    const LeanRowOutputs r = lean_row_outputs(call_, M_, rows_, scratch_.get<int64_t>(kArgmax));
    const int records = G_ * static_cast<int>(plan_.stats_chunks);
    cpu::finalize(all_, tv_, gathered, records, r.o, r.lse, ws_.scalars);
    lse_ = r.lse;
    go_ = nullptr;  // fused: grad_output = grad_scale, folded into the scale
    if (!sp()) return;
    const int64_t own = comm_.rank() * N_;
    const auto copy = [&](const auto* from, auto* to) {
      if (to != nullptr) std::copy(from + own, from + own + N_, to);
    };
    copy(rows_, out.lse);
    if (call_.p.reduction == Reduction::none) copy(rows_ + M_, out.loss);
    copy(r.o.z_loss, out.z_loss);
    copy(r.o.argmax, out.argmax);
  }

  void gradient(int64_t r0, int64_t rows, int64_t v0, int64_t cols) override {
    const core::Problem pc = chunk_problem(rows, v0, cols);
    const LogitsView lv{logits_ + r0 * vc_, DType::f32, rows, cols, vc_};
    const float* go = go_ != nullptr && call_.p.reduction == Reduction::none ? go_ + r0 : go_;
    cpu::gradient(pc, lv, lv, targets_from(r0, rows), lse_ + r0, ws_.scalars, go);
  }

  void d_weight(int64_t v0, int64_t cols) override {
    const MatrixView& dw = call_.out.d_weight;
    if (dw.dtype == DType::f32) {
      host::sgemm(true, false, cols, H_, M_, logits_, vc_, h_, H_,
                  call_.accumulate_d_weight ? 1.0f : 0.0f,
                  static_cast<float*>(dw.data) + v0 * dw.row_stride, dw.row_stride);
      return;
    }
    float* rows = scratch_.get<float>(kDWeight);
    host::sgemm(true, false, cols, H_, M_, logits_, vc_, h_, H_, 0.0f, rows, H_);
    host::store(rows, H_, dw, v0, cols);
  }

  void d_hidden(int64_t v0, int64_t cols, bool first) override {
    weight_rows(v0, cols);
    host::sgemm(false, false, M_, H_, cols, logits_, vc_, w_, ldw_, first ? 0.0f : 1.0f,
                scratch_.get<float>(kDHidden), H_);
  }

  void end(bool any_chunk) override {
    const MatrixView& dh = call_.out.d_hidden;
    if (dh.data != nullptr) {
      float* acc = scratch_.get<float>(kDHidden);
      if (!any_chunk) std::fill(acc, acc + M_ * H_, 0.0f);  // a rank of padding only
      float* gathered = scratch_.get<float>(kGathered);
      float* out = scratch_.get<float>(kPartial);
      const float* sum = sum_over_ranks(comm_, sp(), acc, N_ * H_, gathered, out);
      host::store(sum, H_, dh, 0, N_);
    }
    const MatrixView& dw = call_.out.d_weight;
    if (dw.data != nullptr && !call_.accumulate_d_weight)
      host::zero_rows(dw, call_.p.real_cols, dw.rows - call_.p.real_cols);  // padding
  }

 private:
  bool sp() const { return call_.sequence_parallel; }

  // The weight's rows [v0, v0 + cols) in fp32 (w_, ldw_): the weight itself where it is f32,
  // else converted once per chunk.
  void weight_rows(int64_t v0, int64_t cols) {
    const MatrixView& w = call_.weight;
    if (w.dtype == DType::f32) {
      w_ = static_cast<const float*>(w.data) + v0 * w.row_stride;
      ldw_ = w.row_stride;
      return;
    }
    if (converted_ == v0) return;
    float* buf = scratch_.get<float>(kWeight);
    host::to_f32(w, v0, cols, buf);
    w_ = buf;
    ldw_ = H_;
    converted_ = v0;
  }

  core::Problem chunk_problem(int64_t rows, int64_t v0, int64_t cols) const {
    return lean_chunk_problem(all_, rows, v0, cols, vc_);
  }

  TargetsView targets_from(int64_t r0, int64_t rows) const {
    return TargetsView{targets_ + r0, IndexType::i64, rows};
  }

  const float* gathered_rows(const float* mine, float* buf) {
    if (!sp() || mine == nullptr) return mine;
    comm_.all_gather(mine, buf, sizeof(float) * static_cast<size_t>(N_), nullptr);
    return buf;
  }

  Communicator& comm_;
  const Call& call_;
  const Plan& plan_;
  const Pass pass_;
  Workspace& ws_;
  Scratch scratch_;
  const int G_;
  const int64_t N_, M_, H_, vc_;
  const float* lse_;
  const float* go_;
  float* logits_ = nullptr;
  float* rows_ = nullptr;  // [4][M]: lse, loss, z-loss, grad_output
  float* h_ = nullptr;     // [M, H] fp32
  int64_t* targets_ = nullptr;
  const float* w_ = nullptr;
  int64_t ldw_ = 0;
  int64_t converted_ = -1;
  core::Problem all_;
  TargetsView tv_{};
};

}  // namespace

void run_lean_cpu(const Group& group, const Call& call, const Plan& plan, Pass pass,
                  const float* lse, const float* grad_output) {
  CpuLean steps(group, call, plan, pass, lse, grad_output);
  run_lean(steps, call, plan, pass);
}

}  // namespace xent::linear
