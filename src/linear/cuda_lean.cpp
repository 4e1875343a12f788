// The lean schedule's steps on the CUDA backend (steps.h): cuBLASLt GEMMs with fp32 accumulation,
// the logits path's own kernels (cuda::stats, cuda::finalize, cuda::gradient) on each block of
// fp32 logits, the gradient of a chunk in the inputs' dtype for the two GEMMs that consume it (as
// the unfused path's), and d_hidden's sum over the ranks (device::sum_over_ranks, sums.cpp).
// On the epilogue engine (plan: LinearGemm::epilogue) both logits GEMMs are sm90's: forward's
// writes each tile's statistics (merged into the chunk's records), the sweep's the chunk's 16-bit
// gradient over every row: no fp32 logits exist.
// Every step on the call's stream; the scratch is the call's (scratch.h).
#include <algorithm>

#include "backend.h"
#include "core/finalize.h"
#include "error.h"
#include "linear/cuda.h"
#include "linear/lean.h"
#include "linear/scratch.h"
#include "linear/sm90/epilogue_gemm.h"

namespace xent::linear {

namespace {

class CudaLean final : public LeanSteps {
 public:
  CudaLean(const Group& group, const Call& call, const Plan& plan, Pass pass, const float* lse,
           const float* grad_output, cudaStream_t stream)
      : comm_(group.comm()),
        call_(call),
        plan_(plan),
        pass_(pass),
        ws_(group.workspace()),
        state_(cuda_state(group)),
        stream_(stream),
        scratch_(Backend::cuda, call.allocator, plan, stream),
        G_(comm_.size()),
        N_(call.p.rows),
        M_(call.p.rows * (call.sequence_parallel ? comm_.size() : 1)),
        H_(call.hidden.cols),
        vc_(plan.info.chunk_cols),
        f32_(call.hidden.dtype == DType::f32),
        epilogue_(plan.info.gemm == LinearGemm::epilogue),
        lse_in_(lse),
        go_in_(grad_output) {
    ws_.prepare(1, call.p.layout.fields, G_, stream_);  // scalars, partials, error
    state_.gemm.set_workspace(scratch_.get<char>(kGemmWorkspace));
    logits_ = scratch_.get<float>(kLogits);
    grad_ = f32_ ? static_cast<void*>(logits_) : scratch_.get<char>(kGrad);
    rows_ = scratch_.get<float>(kRows);
  }

  void begin() override {
    const MatrixView& x = call_.hidden;
    const size_t es = dtype_size(x.dtype);
    h_ = device::Operand{x.data, x.dtype, x.row_stride};
    tv_ = call_.targets;
    if (sp()) {
      const void* send = x.data;
      if (x.row_stride != H_) {
        char* mine = scratch_.get<char>(kMine);
        check_cuda(cudaMemcpy2DAsync(mine, H_ * es, x.data, x.row_stride * es, H_ * es, N_,
                                     cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpy2DAsync (hidden rows)");
        send = mine;
      }
      char* all = scratch_.get<char>(kHidden);
      comm_.all_gather(send, all, static_cast<size_t>(N_ * H_) * es, stream_);
      h_ = device::Operand{all, x.dtype, H_};
      const size_t ts = core::target_size(tv_.type);
      char* targets = scratch_.get<char>(kTargets);
      comm_.all_gather(tv_.data, targets, static_cast<size_t>(N_) * ts, stream_);
      tv_ = TargetsView{targets, tv_.type, M_};
    }
    all_ = call_.p;
    all_.rows = M_;
    if (pass_ == Pass::forward) return;
    lse_ = gathered_rows(lse_in_, rows_);
    // A scalar grad_output joins the scale in the GEMMs' alpha; per row, it is the gradient's.
    const bool none = call_.p.reduction == Reduction::none;
    go_ = none ? gathered_rows(go_in_, rows_ + 3 * M_) : nullptr;
    cuda::count_valid(all_, tv_, ws_.scalars, stream_);
    device::take_gemm_scale(ws_.scalars, none ? nullptr : go_in_, stream_);
  }

  void phase(bool stats) override {
    stats_ = stats;
    ld_ = stats ? plan_.stats_cols : vc_;
  }

  void logits(int64_t r0, int64_t rows, int64_t v0, int64_t cols) override {
    const device::Operand a = rows_of(h_, r0);
    if (epilogue_) {
      const device::Operand w = weight_rows(v0);
      const sm90::Operands g{a.data, a.ld, w.data, w.ld, rows, cols, H_};
      if (stats_)  // the statistics straight from the accumulators (every row: stats_rows = M)
        sm90::stats_gemm(g, chunk_problem(rows, v0, cols), targets_from(r0, rows), logits_,
                         stream_);
      else  // the gradient straight from the accumulators
        sm90::gradient_gemm(g, chunk_problem(rows, v0, cols), targets_from(r0, rows), lse_ + r0,
                            ws_.scalars, row_go(r0), grad_rows(r0), vc_, stream_);
      return;
    }
    state_.gemm.run(false, true, rows, cols, H_, a, weight_rows(v0), 0.0f, block(r0), DType::f32,
                    ld_, stream_);
  }

  void stats(int64_t c, int64_t r0, int64_t rows, int64_t v0, int64_t cols) override {
    const core::Problem pc = chunk_problem(rows, v0, cols);
    const LogitsView lv{block(r0), DType::f32, rows, pc.cols, ld_};
    const int fields = call_.p.layout.fields;
    float* records = scratch_.get<float>(kSend) + c * fields * M_;
    float* record = rows == M_ ? records : scratch_.get<float>(kBlockRecord);
    if (epilogue_)  // the statistics GEMM's partials, at logits_
      sm90::merge_stats(pc, targets_from(r0, rows), logits_, record, ws_.error, stream_);
    else
      cuda::stats(pc, lv, targets_from(r0, rows), record, ws_.error, stream_);
    if (record != records)  // field-major [fields][rows] into [fields][M] at row r0
      check_cuda(cudaMemcpy2DAsync(records + r0, sizeof(float) * M_, record, sizeof(float) * rows,
                                   sizeof(float) * rows, fields, cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpy2DAsync (records)");
  }

  void finalize() override {
    const LinearOutputs& out = call_.out;
    const float* gathered = scratch_.get<float>(kSend);
    if (G_ > 1) {
      comm_.all_gather(gathered, scratch_.get<float>(kRecv), scratch_.bytes(kSend), stream_);
      gathered = scratch_.get<float>(kRecv);
    }
    const LeanRowOutputs r = lean_row_outputs(call_, M_, rows_, scratch_.get<int64_t>(kArgmax));
    const int records = G_ * static_cast<int>(plan_.stats_chunks);
    cuda::finalize(all_, tv_, gathered, records, r.o, r.lse, ws_.scalars, ws_.partials, stream_);
    lse_ = r.lse;
    go_ = nullptr;  // fused: grad_output = grad_scale, folded into the scale
    device::take_gemm_scale(ws_.scalars, nullptr, stream_);
    if (!sp()) return;
    const int64_t own = comm_.rank() * N_;
    copy(rows_ + own, out.lse);
    if (call_.p.reduction == Reduction::none) copy(rows_ + M_ + own, out.loss);
    if (out.z_loss != nullptr) copy(r.o.z_loss + own, out.z_loss);
    if (out.argmax != nullptr) copy(r.o.argmax + own, out.argmax);
  }

  void gradient(int64_t r0, int64_t rows, int64_t v0, int64_t cols) override {
    if (epilogue_) return;  // the logits GEMM's epilogue wrote it
    const core::Problem pc = chunk_problem(rows, v0, cols);
    const LogitsView lv{block(r0), DType::f32, rows, cols, vc_};
    const LogitsView gv{grad_rows(r0), call_.hidden.dtype, rows, cols, vc_};
    cuda::gradient(pc, lv, gv, targets_from(r0, rows), lse_ + r0, ws_.scalars, row_go(r0), stream_);
  }

  void d_weight(int64_t v0, int64_t cols) override {
    const MatrixView& dw = call_.out.d_weight;
    char* rows = static_cast<char*>(dw.data) + v0 * dw.row_stride * dtype_size(dw.dtype);
    state_.gemm.run(true, false, cols, H_, M_, gradient_operand(), h_,
                    call_.accumulate_d_weight ? 1.0f : 0.0f, rows, dw.dtype, dw.row_stride, stream_,
                    gemm_scale());
  }

  void d_hidden(int64_t v0, int64_t cols, bool first) override {
    float* acc = accumulator();
    state_.gemm.run(false, false, M_, H_, cols, gradient_operand(), weight_rows(v0),
                    first ? 0.0f : 1.0f, acc, DType::f32, ld_accumulator(), stream_, gemm_scale());
  }

  void end(bool any_chunk) override {
    const MatrixView& dh = call_.out.d_hidden;
    if (dh.data != nullptr) {
      float* acc = accumulator();
      const int64_t ld = ld_accumulator();
      if (!any_chunk)  // a rank of padding only: its part of d_hidden is 0
        check_cuda(cudaMemset2DAsync(acc, ld * sizeof(float), 0, H_ * sizeof(float), M_, stream_),
                   "cudaMemset2DAsync (d_hidden)");
      if (G_ > 1)
        summed(acc);
      else if (acc != dh.data)
        device::store_sum(acc, 1, 0, H_, dh, 0, N_, stream_);
    }
    const MatrixView& dw = call_.out.d_weight;
    if (dw.data != nullptr && !call_.accumulate_d_weight)  // padding: no gradient
      device::zero_rows(dw, call_.p.real_cols, dw.rows - call_.p.real_cols, stream_);
  }

 private:
  bool sp() const { return call_.sequence_parallel; }

  // The fp32 logits of rows from r0: where every row's are made at once (forward's statistics
  // over every row; the sweep's of fp32 inputs, whose gradient is made in place) at row r0 of
  // them, else the one block's.
  float* block(int64_t r0) const {
    return (stats_ ? plan_.stats_rows == M_ : f32_) ? logits_ + r0 * ld_ : logits_;
  }

  device::Operand rows_of(device::Operand m, int64_t r0) const {
    return device::Operand{
        static_cast<const char*>(m.data) + r0 * m.ld * static_cast<int64_t>(dtype_size(m.dtype)),
        m.dtype, m.ld};
  }
  device::Operand weight_rows(int64_t v0) const {
    const MatrixView& w = call_.weight;
    return rows_of(device::Operand{w.data, w.dtype, w.row_stride}, v0);
  }
  // The chunk's gradient from row r0, and the grad_output of those rows (per row: reduction none).
  void* grad_rows(int64_t r0) const {
    return static_cast<char*>(grad_) +
           r0 * vc_ * static_cast<int64_t>(dtype_size(call_.hidden.dtype));
  }
  const float* row_go(int64_t r0) const {
    return go_ != nullptr && call_.p.reduction == Reduction::none ? go_ + r0 : go_;
  }

  // The gradient's scale, which its GEMMs apply (take_gemm_scale).
  const float* gemm_scale() const { return ws_.scalars + Workspace::kGemmScale; }
  device::Operand gradient_operand() const {
    return device::Operand{grad_, call_.hidden.dtype, vc_};
  }

  core::Problem chunk_problem(int64_t rows, int64_t v0, int64_t cols) const {
    return lean_chunk_problem(all_, rows, v0, cols, ld_);
  }

  TargetsView targets_from(int64_t r0, int64_t rows) const {
    const size_t ts = core::target_size(tv_.type);
    return TargetsView{static_cast<const char*>(tv_.data) + r0 * static_cast<int64_t>(ts), tv_.type,
                       rows};
  }

  // This rank's N floats for every row: gathered from every rank with sequence parallelism.
  const float* gathered_rows(const float* mine, float* buf) {
    if (!sp() || mine == nullptr) return mine;
    comm_.all_gather(mine, buf, sizeof(float) * static_cast<size_t>(N_), stream_);
    return buf;
  }

  // d_hidden's fp32 accumulator: d_hidden itself where it is f32 on one rank, else scratch.
  float* accumulator() const {
    float* acc = scratch_.get<float>(kDHidden);
    return acc != nullptr ? acc : static_cast<float*>(call_.out.d_hidden.data);
  }
  int64_t ld_accumulator() const {
    return scratch_.get<float>(kDHidden) != nullptr ? H_ : call_.out.d_hidden.row_stride;
  }

  // The accumulator (scratch, ld H) summed over the ranks into d_hidden, rounded once: by the
  // communicator's sums (device::sum_over_ranks), else every rank's gathered and summed in rank
  // order.
  void summed(float* acc) {
    if (comm_.has_sums()) {
      device::sum_over_ranks(comm_, sp(), acc, N_, call_.out.d_hidden, 0, stream_);
      return;
    }
    const int64_t own = sp() ? comm_.rank() * N_ * H_ : 0;
    float* all = scratch_.get<float>(kGathered);
    comm_.all_gather(acc, all, sizeof(float) * static_cast<size_t>(M_ * H_), stream_);
    device::store_sum(all + own, G_, M_ * H_, H_, call_.out.d_hidden, 0, N_, stream_);
  }

  template <typename T>
  void copy(const T* from, T* to) {
    if (to == nullptr || N_ == 0) return;
    check_cuda(cudaMemcpyAsync(to, from, sizeof(T) * static_cast<size_t>(N_),
                               cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync (per-row outputs)");
  }

  Communicator& comm_;
  const Call& call_;
  const Plan& plan_;
  const Pass pass_;
  Workspace& ws_;
  CudaState& state_;
  cudaStream_t stream_;
  Scratch scratch_;
  const int G_;
  const int64_t N_, M_, H_, vc_;
  const bool f32_;
  const bool epilogue_;  // both logits GEMMs are sm90's (no fp32 logits; forward: partials)
  bool stats_ = false;
  int64_t ld_ = 0;  // the logits' row stride in this phase
  const float* lse_in_;
  const float* go_in_;
  float* logits_ = nullptr;
  void* grad_ = nullptr;
  float* rows_ = nullptr;  // [4][M]: lse, loss, z-loss, grad_output
  core::Problem all_;
  device::Operand h_{};
  TargetsView tv_{};
  const float* lse_ = nullptr;
  const float* go_ = nullptr;
};

}  // namespace

void run_lean_cuda(const Group& group, const Call& call, const Plan& plan, Pass pass,
                   const float* lse, const float* grad_output, cudaStream_t stream) {
  CudaLean steps(group, call, plan, pass, lse, grad_output, stream);
  run_lean(steps, call, plan, pass);
}

}  // namespace xent::linear
