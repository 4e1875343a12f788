// The fast schedule's steps on the CUDA backend (steps.h, fast.cpp). Per chunk of rows: the hidden
// rows (gathered from every rank with sequence parallelism), logits = hidden @ weight^T in fp32 (a
// cuBLASLt GEMM, fp32 accumulation) a sub-chunk of rows at a time, then the logits path's own
// steps on them (cuda::stats, the all-gather of the records, cuda::finalize of the rows), then
// the gradient over the logits (cuda::gradient, in the inputs' dtype: the GEMMs that consume it
// run on the tensor cores as the unfused path's do; one rank's forward: cuda::single_pass,
// statistics and gradient in one read, then finalize) and the two GEMMs: d_hidden's partial
// (summed over the ranks) and d_weight's (accumulated in fp32 over the chunks). The reduced loss
// comes from every row's loss once the chunks are done (cuda::reduce_rows), the gradient's scale
// from every row's target before the first.
//
// Rows of a chunk are in "chunk order": with sequence parallelism rank b's rows of the chunk
// come b-th; the per-row scratch over all rows keeps that order (chunk after chunk), so that a
// chunk's targets, losses and argmax are one contiguous slice of it.
#include <algorithm>
#include <memory>
#include <string>

#include "backend.h"
#include "core/finalize.h"
#include "error.h"
#include "linear/cuda.h"
#include "linear/fast.h"
#include "linear/gemm.h"
#include "linear/scratch.h"

namespace xent::linear {

namespace {

class CudaFast final : public FastSteps {
 public:
  CudaFast(const Group& group, const Call& call, const Agreed& agreed, Pass pass, const float* lse,
           const float* grad_output, cudaStream_t stream)
      : comm_(group.comm()),
        call_(call),
        plan_(agreed.plan),
        pass_(pass),
        ws_(group.workspace()),
        state_(cuda_state(group)),
        stream_(stream),
        scratch_(Backend::cuda, call.allocator, agreed.plan, stream),
        H_(call.hidden.cols),
        V_(call.p.cols),
        real_(call.p.real_cols),
        ranks_(comm_.size()),
        all_rows_(call.p.rows * plan_.ranks_in_chunk),
        lse_in_(lse),
        go_in_(grad_output) {}

  void begin() override {
    ws_.prepare(1, call_.p.layout.fields, ranks_, stream_);  // scalars, partials, error
    state_.gemm.set_workspace(scratch_.get<char>(kGemmWorkspace));
    // The whole problem's scalars, beside those of finalize (a chunk's, Reduction::none).
    gscalars_ = ws_.scalars + Workspace::kSet;
    gdtype_ = call_.hidden.dtype;  // the gradient's, as the GEMMs that consume it take it
    // f32 inputs: the logits are made and turned into their gradient in place, a whole chunk at
    // once. 16-bit: the chunk's gradient [m, V] in 16 bits, its fp32 logits a sub-chunk at a time.
    logits_ = scratch_.get<float>(kLogits);
    grad_ = gdtype_ == DType::f32 ? static_cast<void*>(logits_) : scratch_.get<char>(kGrad);
    per_row_ = scratch_.get<float>(kRows) + all_rows_;
    targets_ = all_targets();
    // The gradient's scale of the whole problem, before the first chunk.
    core::Problem all = call_.p;
    all.rows = all_rows_;
    cuda::count_valid(all, targets_all_, gscalars_, stream_);

    const bool reduced = call_.p.reduction != Reduction::none;
    const bool accuracy = call_.out.accuracy != nullptr || call_.out.argmax != nullptr;
    if (pass_ == Pass::forward && (reduced || sp())) row_loss_ = scratch_.get<float>(kRows);
    if (pass_ == Pass::forward && accuracy && (sp() || call_.out.argmax == nullptr))
      argmax_ = scratch_.get<int64_t>(kArgmax);
    if (dw()) start_d_weight();
    go_all_ = go_in_;
    if (call_.gradients) {  // the scale, a scalar grad_output with it, goes to the GEMMs' alpha
      const bool none = call_.p.reduction == Reduction::none;
      device::take_gemm_scale(gscalars_, none ? nullptr : go_in_, stream_);
      if (!none) go_all_ = nullptr;
    }
    // One rank's forward: statistics and gradient in one pass over each sub-chunk's logits where
    // the rows fit on chip (as the logits path's single pass), finalize after it. The fit depends
    // on the columns alone, the same for every sub-chunk.
    single_ = pass_ == Pass::forward && call_.gradients && ranks_ == 1 && call_.single_pass &&
              cuda::single_pass_fits(call_.p, DType::f32);
  }

  void rows(int64_t r0, int64_t c) override {
    r0_ = r0;
    m_ = c * plan_.ranks_in_chunk;
    at_ = r0 * plan_.ranks_in_chunk;  // the chunk's rows in chunk order
    h_ = inputs(r0, c);
    if (pass_ == Pass::backward) lse_c_ = mine_to_chunk(lse_in_, r0, c, per_row_ + 2 * m_);
    go_c_ = go_all_;
    if (call_.gradients && go_c_ != nullptr && call_.p.reduction == Reduction::none)
      go_c_ = mine_to_chunk(go_c_, r0, c, per_row_ + 3 * m_);
  }

  void logits(int64_t s0, int64_t k) override {
    const device::Operand hs{
        static_cast<const char*>(h_.data) + s0 * h_.ld * static_cast<int64_t>(dtype_size(h_.dtype)),
        h_.dtype, h_.ld};
    state_.gemm.run(false, true, k, real_, H_, hs, weight(), 0.0f, logits_, DType::f32, V_,
                    stream_);
  }

  // Statistics, exchange and finalize of the sub-chunk (Reduction::none: each row's loss into
  // row_loss_, or the output), the first of its rows at r0_ + s0 of this rank's rows (without
  // sequence parallelism), at_ + s0 of all rows and s0 of the chunk's m_ (chunk order). With
  // sequence parallelism the per-row outputs stay in chunk-order scratch until own_rows copies
  // this rank's out. The single pass (one rank): its records, and its gradient, in place of
  // the statistics.
  void finalize(int64_t s0, int64_t k) override {
    const core::Problem pc = sub_problem(k);
    const TargetsView tv = sub_targets(s0, k);
    float* send = scratch_.get<float>(kSend);
    float* recv = ranks_ > 1 ? scratch_.get<float>(kRecv) : send;
    if (single_)
      cuda::single_pass(pc, logits_view(k), grad_view(s0, k), tv, send, ws_.error, gscalars_,
                        stream_);
    else
      cuda::stats(pc, logits_view(k), tv, send, ws_.error, stream_);
    if (ranks_ > 1) comm_.all_gather(send, recv, pc.layout.bytes_per_row() * pc.rows, stream_);
    const LinearOutputs& out = call_.out;
    const int64_t row = r0_ + s0, at = at_ + s0;
    core::Problem pn = pc;
    pn.reduction = Reduction::none;
    Outputs o;
    float* lse = sp() || out.lse == nullptr ? per_row_ + s0 : out.lse + row;
    o.loss = row_loss_ != nullptr ? row_loss_ + at : out.loss + row;
    o.z_loss = out.z_loss == nullptr ? nullptr : sp() ? per_row_ + m_ + s0 : out.z_loss + row;
    o.argmax = argmax_ != nullptr      ? argmax_ + at
               : out.argmax != nullptr ? out.argmax + row
                                       : nullptr;
    cuda::finalize(pn, tv, recv, ranks_, o, lse, ws_.scalars, ws_.partials, stream_);
    lse_c_ = lse - s0;  // the chunk's lse, at row 0 of the chunk
  }

  void gradient(int64_t s0, int64_t k) override {
    if (single_) return;
    const float* go = go_c_ != nullptr && call_.p.reduction == Reduction::none ? go_c_ + s0 : go_c_;
    cuda::gradient(sub_problem(k), logits_view(k), grad_view(s0, k), sub_targets(s0, k),
                   lse_c_ + s0, gscalars_, go, stream_);
  }

  // Sequence parallelism: this rank's rows of the chunk ([rank * c, rank * c + c) in chunk
  // order) of the per-row outputs, copied out to its rows [r0, r0 + c).
  void own_rows(int64_t r0, int64_t c) override {
    if (!sp()) return;
    const LinearOutputs& out = call_.out;
    const int64_t own = comm_.rank() * c;
    copy(per_row_ + own, out.lse, r0, c);
    if (call_.p.reduction == Reduction::none) copy(row_loss_ + at_ + own, out.loss, r0, c);
    if (out.z_loss != nullptr) copy(per_row_ + m_ + own, out.z_loss, r0, c);
    if (out.argmax != nullptr) copy(argmax_ + at_ + own, out.argmax, r0, c);
  }

  void d_weight(int64_t chunk) override {
    const bool first = chunk == 0 && !call_.accumulate_d_weight;
    state_.gemm.run(true, false, real_, H_, m_, gradient_operand(), h_, first ? 0.0f : 1.0f, acc_,
                    acc_dtype_, ldacc_, stream_, gemm_scale());
  }

  void end() override {
    join_sums();
    if (pass_ == Pass::forward) reduce_loss();
    if (dw()) finish_d_weight();
  }

 private:
  bool sp() const { return call_.sequence_parallel; }
  // The gradient's scale, which its GEMMs apply (take_gemm_scale).
  const float* gemm_scale() const { return gscalars_ + Workspace::kGemmScale; }
  int64_t tsize() const { return static_cast<int64_t>(core::target_size(call_.targets.type)); }

  // Every row's targets in chunk order: the call's own without sequence parallelism; else every
  // rank's gathered (rank order, targets_all_, for the gradient's scale) and rearranged.
  TargetsView all_targets() {
    const TargetsView& t = call_.targets;
    if (!sp()) {
      targets_all_ = t;
      return t;
    }
    const int64_t n = call_.p.rows, ts = tsize();
    char* buf = scratch_.get<char>(kTargets);
    comm_.all_gather(t.data, buf, static_cast<size_t>(n * ts), stream_);
    targets_all_ = TargetsView{buf, t.type, all_rows_};
    char* chunked = buf + all_rows_ * ts;
    for (int64_t i = 0; i < plan_.info.chunks; ++i) {
      const int64_t r0 = plan_.first(i), c = plan_.count(i, n);
      // Rank b's rows [r0, r0 + c) to chunk position r0 * ranks + b * c.
      check_cuda(
          cudaMemcpy2DAsync(chunked + r0 * plan_.ranks_in_chunk * ts, c * ts, buf + r0 * ts, n * ts,
                            c * ts, plan_.ranks_in_chunk, cudaMemcpyDeviceToDevice, stream_),
          "cudaMemcpy2DAsync (targets)");
    }
    return TargetsView{chunked, t.type, all_rows_};
  }

  // The chunk's hidden rows as the GEMMs read them: this rank's own (any row stride), or with
  // sequence parallelism every rank's, gathered.
  device::Operand inputs(int64_t r0, int64_t c) {
    const MatrixView& x = call_.hidden;
    const size_t es = dtype_size(x.dtype);
    const char* rows = static_cast<const char*>(x.data) + r0 * x.row_stride * es;
    if (!sp()) return device::Operand{rows, x.dtype, x.row_stride};
    const void* send = rows;
    if (x.row_stride != H_) {
      void* mine = scratch_.get<char>(kMine);
      check_cuda(cudaMemcpy2DAsync(mine, H_ * es, rows, x.row_stride * es, H_ * es, c,
                                   cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpy2DAsync (hidden rows)");
      send = mine;
    }
    char* all = scratch_.get<char>(kHidden);
    comm_.all_gather(send, all, static_cast<size_t>(c * H_) * es, stream_);
    return device::Operand{all, x.dtype, H_};
  }

  // This rank's c floats from row r0 for every row of the chunk: gathered from every rank with
  // sequence parallelism, else the rows themselves.
  const float* mine_to_chunk(const float* rows, int64_t r0, int64_t c, float* buf) {
    if (!sp()) return rows + r0;
    comm_.all_gather(rows + r0, buf, sizeof(float) * static_cast<size_t>(c), stream_);
    return buf;
  }

  template <typename T>
  void copy(const T* from, T* to, int64_t r0, int64_t c) {
    if (from == nullptr || to == nullptr || c == 0) return;
    check_cuda(cudaMemcpyAsync(to + r0, from, sizeof(T) * static_cast<size_t>(c),
                               cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync (per-row outputs)");
  }

  bool dw() const { return call_.gradients && call_.out.d_weight.data != nullptr; }
  device::Operand weight() const {
    return device::Operand{call_.weight.data, call_.weight.dtype, call_.weight.row_stride};
  }
  device::Operand gradient_operand() const { return device::Operand{grad_, gdtype_, V_}; }
  // The sub-chunk's k rows of logits as the logits path sees a shard, their targets, their fp32
  // logits and their gradient rows.
  core::Problem sub_problem(int64_t k) const {
    core::Problem pc = call_.p;
    pc.rows = k;
    pc.row_stride = V_;
    return pc;
  }
  TargetsView sub_targets(int64_t s0, int64_t k) const {
    return TargetsView{static_cast<const char*>(targets_.data) + (at_ + s0) * tsize(),
                       targets_.type, k};
  }
  LogitsView logits_view(int64_t k) const { return LogitsView{logits_, DType::f32, k, V_, V_}; }
  LogitsView grad_view(int64_t s0, int64_t k) const {
    return LogitsView{
        static_cast<char*>(grad_) + s0 * V_ * static_cast<int64_t>(dtype_size(gdtype_)), gdtype_, k,
        V_, V_};
  }

  // The chunk's d_hidden. One rank: the GEMM writes it, rounded once. Several: this rank's fp32
  // partial, summed over the ranks (all of the chunk's rows, or with sequence parallelism this
  // rank's: reduce-scatter), then rounded once. Where the communicator sums, the sum and its
  // store run on the side stream while the next chunk's GEMMs run on the call's: two partials,
  // alternate chunks, each reused only once the side stream is done with it (events). Else every
  // rank's partial is gathered and summed in rank order on the call's stream.
  void d_hidden(int64_t i, int64_t r0, int64_t c) override {
    const device::Operand g = gradient_operand(), w = weight();
    const int64_t m = m_;
    const MatrixView& dh = call_.out.d_hidden;
    if (ranks_ == 1) {
      char* rows = static_cast<char*>(dh.data) + r0 * dh.row_stride * dtype_size(dh.dtype);
      state_.gemm.run(false, false, m, H_, real_, g, w, 0.0f, rows, dh.dtype, dh.row_stride,
                      stream_, gemm_scale());
      return;
    }
    const int64_t own = sp() ? comm_.rank() * c * H_ : 0;
    const bool sums = comm_.has_sums();
    const int k = static_cast<int>(i % 2);
    float* partial = scratch_.get<float>(kPartial) + (sums ? k : 0) * plan_.logits_rows() * H_;
    if (!sums) {
      state_.gemm.run(false, false, m, H_, real_, g, w, 0.0f, partial, DType::f32, H_, stream_,
                      gemm_scale());
      float* all = scratch_.get<float>(kGathered);
      comm_.all_gather(partial, all, sizeof(float) * static_cast<size_t>(m * H_), stream_);
      device::store_sum(all + own, ranks_, m * H_, H_, dh, r0, c, stream_);
      return;
    }
    if (i >= 2) check_cuda(cudaStreamWaitEvent(stream_, state_.done[k], 0), "cudaStreamWaitEvent");
    state_.gemm.run(false, false, m, H_, real_, g, w, 0.0f, partial, DType::f32, H_, stream_,
                    gemm_scale());
    check_cuda(cudaEventRecord(state_.ready[k], stream_), "cudaEventRecord");
    cudaStream_t side = state_.side;
    check_cuda(cudaStreamWaitEvent(side, state_.ready[k], 0), "cudaStreamWaitEvent");
    device::sum_over_ranks(comm_, sp(), partial, c, dh, r0, side);
    check_cuda(cudaEventRecord(state_.done[k], side), "cudaEventRecord");
    sums_ = std::min<int64_t>(sums_ + 1, 2);
  }

  // The call's stream waits for the side stream's sums before it goes on.
  void join_sums() {
    for (int k = 0; k < sums_; ++k)
      check_cuda(cudaStreamWaitEvent(stream_, state_.done[k], 0), "cudaStreamWaitEvent");
  }

  // The fp32 accumulator of d_weight's real rows: d_weight itself where it is f32; else, with one
  // chunk, d_weight itself too (the GEMM rounds its fp32 sum once); else scratch, rounded once at
  // the end.
  void start_d_weight() {
    const MatrixView& dw = call_.out.d_weight;
    acc_ = dw.data;
    acc_dtype_ = dw.dtype;
    ldacc_ = dw.row_stride;
    if (dw.dtype == DType::f32 || plan_.info.chunks <= 1) return;
    acc_ = scratch_.get<float>(kDWeight);
    acc_dtype_ = DType::f32;
    ldacc_ = H_;
  }
  void finish_d_weight() {
    const MatrixView& dw = call_.out.d_weight;
    if (plan_.info.chunks == 0 && !call_.accumulate_d_weight) zero_rows(0, real_);
    if (acc_ != dw.data)
      device::store_sum(static_cast<const float*>(acc_), 1, 0, H_, dw, 0, real_, stream_);
    if (!call_.accumulate_d_weight) zero_rows(real_, dw.rows - real_);  // padding: no gradient
  }
  void zero_rows(int64_t r0, int64_t rows) {
    device::zero_rows(call_.out.d_weight, r0, rows, stream_);
  }

  // The reduced loss and the accuracy from every row's loss, target and argmax (chunk order).
  void reduce_loss() {
    const LinearOutputs& out = call_.out;
    const bool none = call_.p.reduction == Reduction::none;
    if (none && out.accuracy == nullptr) return;
    core::Problem all = call_.p;
    all.rows = all_rows_;
    Outputs o;
    o.loss = out.loss;  // written for mean and sum alone (core::finalize_totals)
    o.accuracy = out.accuracy;
    const float* losses = row_loss_ != nullptr ? row_loss_ : out.loss;  // none, one rank's rows
    const int64_t* am = argmax_ != nullptr ? argmax_ : out.argmax;
    cuda::reduce_rows(all, targets_, losses, out.accuracy != nullptr ? am : nullptr, o, ws_.scalars,
                      stream_);
  }

  Communicator& comm_;
  const Call& call_;
  const Plan& plan_;
  const Pass pass_;
  Workspace& ws_;
  CudaState& state_;
  cudaStream_t stream_;
  Scratch scratch_;
  const int64_t H_, V_, real_;
  const int ranks_;
  const int64_t all_rows_;
  const float* lse_in_;
  const float* go_in_;
  float* gscalars_ = nullptr;
  float* logits_ = nullptr;
  void* grad_ = nullptr;
  DType gdtype_ = DType::f32;
  float* per_row_ = nullptr;
  float* row_loss_ = nullptr;      // forward: every row's loss, chunk order (reduced, or SP)
  int64_t* argmax_ = nullptr;      // forward: every row's argmax, chunk order (where needed)
  const float* go_all_ = nullptr;  // a per-row grad_output (Reduction::none), else null
  bool single_ = false;            // one rank's forward through the single pass
  TargetsView targets_{}, targets_all_{};
  // The chunk: its first row of this rank's, its rows (all ranks'), their first in chunk
  // order, its hidden rows, lse and per-row grad_output.
  int64_t r0_ = 0, m_ = 0, at_ = 0;
  device::Operand h_{};
  const float* lse_c_ = nullptr;
  const float* go_c_ = nullptr;
  void* acc_ = nullptr;
  DType acc_dtype_ = DType::f32;
  int64_t ldacc_ = 0;
  int64_t sums_ = 0;  // events on the side stream to wait for (at most 2)
};

}  // namespace

void run_cuda(const Group& group, const Call& call, const Agreed& agreed, Pass pass,
              const float* lse, const float* grad_output, cudaStream_t stream) {
  CudaFast steps(group, call, agreed, pass, lse, grad_output, stream);
  run_fast(steps, call, agreed.plan, pass);
}

}  // namespace xent::linear
