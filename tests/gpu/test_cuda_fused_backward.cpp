// The CUDA backend's fused backward out of place: a fused forward writes its gradient into
// Outputs::grad, then backward(group, logits, grad, ...) with grad_mode fused recomputes the rows
// whose grad_output is not grad_scale from the intact logits. Against the CPU backend's on the
// same host inputs (backend_compare.h's tolerance), bit for bit the CUDA deferred gradient from
// the same lse where grad_scale is 1, the other rows left as forward wrote them (even over logits
// made NaN since), and the errors: no lse, grad = logits. Skips itself when no GPU is visible.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend_compare.h"
#include "cuda_test.h"
#include "inputs.h"

namespace xtest::gpu::compare {
namespace {

// grad_output of a case: per row for none (every third row exactly grad_scale), else one value
// (2.5 times grad_scale, or grad_scale itself: `kept`).
std::vector<float> grad_output_of(const Case& c, bool kept) {
  const float gs = c.opt.grad_scale;
  if (c.opt.reduction != Reduction::none) return {kept ? gs : 2.5f * gs};
  std::vector<float> go(static_cast<size_t>(c.rows));
  for (size_t i = 0; i < go.size(); ++i)
    go[i] = kept || i % 3 == 1 ? gs : 0.37f + 0.1f * static_cast<float>(i % 7);
  return go;
}

bool row_kept(const std::vector<float>& go, int64_t r, float grad_scale) {
  return go[go.size() == 1 ? 0 : static_cast<size_t>(r)] / grad_scale == 1.0f;
}

// Buffers in the logits' layout (the gradient buffers start as copies of the logits, so that
// their row-stride gaps hold the logits' sentinel): forward's gradient, the fused backward's, and
// (CUDA) the deferred backward's from the same lse.
struct FusedRun {
  Result forward_grad, grad, deferred;
};

FusedRun run_fused(Backend backend, const Case& c, const Inputs& in, const std::vector<float>& go,
                   bool poison_logits = false) {
  xent::Options opt = c.opt;
  opt.vocab_start = c.vocab_start;
  opt.vocab_size = c.vocab_size;
  opt.grad_mode = GradMode::fused;
  xent::Options dopt = opt;
  dopt.grad_mode = GradMode::deferred;
  dopt.grad_scale = 1.0f;
  const size_t rows = static_cast<size_t>(c.rows);
  const bool none = opt.reduction == Reduction::none;
  std::vector<float> loss(none ? std::max<size_t>(1, rows) : 1), lse(std::max<size_t>(1, rows));
  FusedRun f;
  f.grad.logits = f.deferred.logits = in.logits;
  xent::LogitsView lv{nullptr, c.dtype, c.rows, c.cols, c.stride()}, gv = lv, dv = lv;
  xent::TargetsView tv{nullptr, c.itype, c.rows};
  xent::Outputs out;
  if (backend == Backend::cpu) {
    xent::Group g = xent::Group::local(Backend::cpu);
    std::vector<uint8_t> logits = in.logits;
    lv.data = logits.data();
    gv.data = f.grad.logits.data();
    tv.data = in.targets.data();
    out.loss = loss.data();
    out.lse = lse.data();
    out.grad = gv;
    xent::forward(g, lv, tv, opt, out);
    f.forward_grad = f.grad;
    xent::backward(g, lv, gv, tv, out.lse, go.data(), opt);
    return f;
  }
  xent::Group g = xent::Group::local(Backend::cuda, 0);
  DevBuf d_logits(in.logits.size()), d_grad(in.logits.size()), d_def(in.logits.size()),
      d_targets(in.targets.size()), d_loss(loss.size() * 4), d_lse(lse.size() * 4),
      d_go(go.size() * 4);
  d_logits.up(in.logits.data());
  d_grad.up(in.logits.data());
  d_def.up(in.logits.data());
  d_targets.up(in.targets.data());
  d_go.up(go.data());
  lv.data = d_logits.p;
  gv.data = d_grad.p;
  dv.data = d_def.p;
  tv.data = d_targets.p;
  out.loss = static_cast<float*>(d_loss.p);
  out.lse = static_cast<float*>(d_lse.p);
  out.grad = gv;
  const auto* d_go_p = static_cast<const float*>(d_go.p);
  xent::forward(g, lv, tv, opt, out);
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  f.forward_grad.logits.resize(in.logits.size());
  d_grad.down(f.forward_grad.logits.data());
  xent::backward(g, lv, dv, tv, out.lse, d_go_p, dopt);
  if (poison_logits) ck(cudaMemset(d_logits.p, 0xff, d_logits.bytes), "cudaMemset");  // NaN
  xent::backward(g, lv, gv, tv, out.lse, d_go_p, opt);
  g.check_errors(nullptr);
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  d_grad.down(f.grad.logits.data());
  d_def.down(f.deferred.logits.data());
  return f;
}

// Rows of two buffers in the logits' layout that differ in bits, for rows where `which` holds.
template <typename F>
int rows_differing(const Case& c, const Result& a, const Result& b, F&& which) {
  const size_t row_bytes = static_cast<size_t>(c.cols) * esize(c.dtype);
  int n = 0;
  for (int64_t r = 0; r < c.rows; ++r) {
    const size_t off = static_cast<size_t>(r * c.stride()) * esize(c.dtype);
    if (which(r)) n += std::memcmp(&a.logits[off], &b.logits[off], row_bytes) != 0;
  }
  return n;
}

TEST(CudaBackend, FusedBackwardOutOfPlaceMatchesCpu) {
  SKIP_WITHOUT_GPU();
  // 64 x 4099 and 3 x 32064 take the single pass in forward (one rank, fused).
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {300, 1000}, {64, 4099}, {3, 32064}, {1, 7}, {0, 100}};
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (auto [n, v] : shapes)
      for (Reduction red : {Reduction::mean, Reduction::none})
        for (float gs : {1.0f, 0.25f}) {
          Case c = base("fused out-of-place", d, n, v);
          c.stride_extra = 3;
          c.opt.reduction = red;
          c.opt.grad_scale = gs;
          c.opt.label_smoothing = 0.05f;
          c.opt.z_loss = 1e-4f;
          if (v == 4099) c.opt.softcap = 15.0f;
          SCOPED_TRACE(describe(c));
          const Inputs in = make_inputs(c);
          const std::vector<float> go = grad_output_of(c, false);
          const FusedRun cpu = run_fused(Backend::cpu, c, in, go);
          const FusedRun gpu = run_fused(Backend::cuda, c, in, go);
          EXPECT_TRUE(matches(c, in, gpu.forward_grad, cpu.forward_grad)) << "forward";
          EXPECT_TRUE(matches(c, in, gpu.grad, cpu.grad)) << "backward";
          const auto kept = [&](int64_t r) { return row_kept(go, r, gs); };
          EXPECT_EQ(rows_differing(c, gpu.grad, gpu.forward_grad, kept), 0)
              << "rows whose grad_output is grad_scale were rewritten";
          // Recomputed rows: with grad_scale 1, the deferred backward's arithmetic on the same
          // lse, to the bit (kept rows are forward's, which the single pass may have written).
          if (gs == 1.0f)
            EXPECT_EQ(
                rows_differing(c, gpu.grad, gpu.deferred, [&](int64_t r) { return !kept(r); }), 0)
                << "the recomputed rows differ in bits from the deferred gradient";
        }
}

TEST(CudaBackend, FusedBackwardWithGradOutputEqualToGradScaleReadsNoLogits) {
  SKIP_WITHOUT_GPU();
  for (Reduction red : {Reduction::mean, Reduction::none}) {
    Case c = base("fused kept", DType::bf16, 200, 3000);
    c.opt.reduction = red;
    c.opt.grad_scale = 0.25f;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c);
    const FusedRun gpu = run_fused(Backend::cuda, c, in, grad_output_of(c, true), true);
    EXPECT_EQ(rows_differing(c, gpu.grad, gpu.forward_grad, [](int64_t) { return true; }), 0)
        << "backward wrote rows (from logits made NaN after forward)";
  }
}

TEST(CudaBackend, FusedBackwardOutOfPlaceErrors) {
  SKIP_WITHOUT_GPU();
  Case c = base("fused errors", DType::f32, 8, 50);
  const Inputs in = make_inputs(c);
  xent::Group g = xent::Group::local(Backend::cuda, 0);
  DevBuf d_logits(in.logits.size()), d_grad(in.logits.size()), d_targets(in.targets.size()),
      d_lse(8 * 4), d_go(4);
  d_logits.up(in.logits.data());
  d_targets.up(in.targets.data());
  const float two = 2.0f;
  d_go.up(&two);
  xent::LogitsView lv{d_logits.p, c.dtype, c.rows, c.cols, c.stride()}, gv = lv;
  gv.data = d_grad.p;
  const xent::TargetsView tv{d_targets.p, c.itype, c.rows};
  const auto* go = static_cast<const float*>(d_go.p);
  const auto* lse = static_cast<const float*>(d_lse.p);
  EXPECT_THAT(error_of([&] { xent::backward(g, lv, lv, tv, lse, go, c.opt); }),
              ::testing::HasSubstr("grad_mode = fused and grad = logits"));
  EXPECT_THAT(error_of([&] { xent::backward(g, lv, gv, tv, nullptr, go, c.opt); }),
              ::testing::HasSubstr("lse = null"));
}

}  // namespace
}  // namespace xtest::gpu::compare
