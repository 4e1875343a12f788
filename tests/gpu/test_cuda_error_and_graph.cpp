// The CUDA backend on a bad target (check_errors reports it; the row's loss is NaN, its gradient
// 0) and under CUDA graph capture (replays give the eager run's bits), through the public API,
// with backend_compare.h's harness. Every test skips itself when no CUDA device is visible (CI
// has none).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend_compare.h"
#include "cuda_test.h"

namespace xtest::gpu::compare {
namespace {

// A target outside [0, vocab_size) that is not ignore_index: check_errors throws and names the
// smallest such row; the row's loss is NaN, its gradient 0; no crash, later calls work.
TEST(CudaBackend, BadTargetIsReported) {
  SKIP_WITHOUT_GPU();
  for (IndexType it : {IndexType::i64, IndexType::i32}) {
    Case c = base("bad-target", DType::bf16, 4096, 1000);
    c.itype = it;
    c.opt.reduction = Reduction::none;
    Inputs in = make_inputs(c);
    // Many bad rows racing in one launch; the smallest is 37.
    for (int64_t r = 37; r < c.rows; r += 5) in.t64[r] = (r % 2) ? 1000 + r : -7 - r;
    for (int64_t r = 0; r < c.rows; ++r) {
      if (it == IndexType::i32) {
        const int32_t v = static_cast<int32_t>(in.t64[r]);
        std::memcpy(&in.targets[r * 4], &v, 4);
      } else {
        std::memcpy(&in.targets[r * 8], &in.t64[r], 8);
      }
    }
    std::string msg;
    try {
      run(Backend::cuda, c, in);
    } catch (const xent::Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("targets[37] = 1037"), std::string::npos) << "message: " << msg;

    // The outputs of such a run, without the throwing check.
    xent::Group g = xent::Group::local(Backend::cuda, 0);
    DevBuf d_logits(in.logits.size()), d_t(in.targets.size()), d_loss(c.rows * 4),
        d_lse(c.rows * 4);
    d_logits.up(in.logits.data());
    d_t.up(in.targets.data());
    xent::LogitsView lv{d_logits.p, c.dtype, c.rows, c.cols, c.cols};
    xent::TargetsView tv{d_t.p, c.itype, c.rows};
    xent::Outputs out;
    out.loss = static_cast<float*>(d_loss.p);
    out.lse = static_cast<float*>(d_lse.p);
    xent::forward(g, lv, tv, c.opt, out);
    ck(cudaDeviceSynchronize(), "sync");
    std::vector<float> loss(c.rows);
    d_loss.down(loss.data());
    std::vector<uint8_t> grad(in.logits.size());
    d_logits.down(grad.data());
    for (int64_t r = 0; r < c.rows; ++r) {
      const bool badrow = r >= 37 && (r - 37) % 5 == 0;
      const bool ignored = in.t64[r] == c.opt.ignore_index;
      if (badrow) {
        EXPECT_TRUE(std::isnan(loss[r])) << "row " << r;
      } else {
        EXPECT_TRUE(std::isfinite(loss[r])) << "row " << r;
      }
      if (badrow || ignored) {
        bool zero = true;
        for (int64_t j = 0; j < c.cols; ++j)
          zero = zero && load_as_float(c.dtype, &grad[(r * c.cols + j) * 2]) == 0.0f;
        EXPECT_TRUE(zero) << "row " << r << " has a nonzero gradient";
      }
    }
    EXPECT_THROW(g.check_errors(nullptr), xent::Error);
    EXPECT_NO_THROW(g.check_errors(nullptr));  // reported once, then re-armed
    // A clean call on the same group afterwards.
    Case ok = base("after-bad", DType::bf16, 64, 1000);
    const Inputs good = make_inputs(ok);
    EXPECT_NO_THROW(run(Backend::cuda, ok, good));
  }
}

// forward + backward captured in a CUDA graph and replayed give the eager run's bits.
TEST(CudaBackend, GraphCaptureMatchesEager) {
  SKIP_WITHOUT_GPU();
  for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
    Case c = base("graph", DType::bf16, 512, 5000);
    c.stride_extra = 3;
    c.opt.grad_mode = mode;
    c.opt.label_smoothing = 0.1f;
    c.opt.compute_accuracy = true;
    c.go_kind = 2;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c);
    cudaStream_t s;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    const Result eager = run(Backend::cuda, c, in, s);

    xent::Group g = xent::Group::local(Backend::cuda, 0);
    g.reserve(c.rows, c.opt);  // no allocation inside the capture
    DevBuf d_x(in.logits.size()), d_t(in.targets.size()), d_loss(4), d_lse(c.rows * 4),
        d_zl(c.rows * 4), d_am(c.rows * 8), d_acc(4), d_go(in.grad_output.size() * 4);
    d_t.up(in.targets.data());
    d_go.up(in.grad_output.data());
    xent::LogitsView lv{d_x.p, c.dtype, c.rows, c.cols, c.stride()};
    xent::TargetsView tv{d_t.p, c.itype, c.rows};
    xent::Outputs out;
    out.loss = static_cast<float*>(d_loss.p);
    out.lse = static_cast<float*>(d_lse.p);
    out.z_loss = static_cast<float*>(d_zl.p);
    out.argmax = static_cast<int64_t*>(d_am.p);
    out.accuracy = static_cast<float*>(d_acc.p);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    xent::forward(g, lv, tv, c.opt, out, s);
    xent::backward(g, lv, tv, out.lse, static_cast<const float*>(d_go.p), c.opt, s);
    ck(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
    ck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int rep = 0; rep < 2; ++rep) {
      d_x.up(in.logits.data());
      for (DevBuf* b : {&d_loss, &d_lse, &d_zl, &d_am, &d_acc}) b->poison();
      ck(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
      ck(cudaStreamSynchronize(s), "sync");
      Result r;
      r.loss.resize(1);
      r.lse.resize(c.rows);
      r.zl.resize(c.rows);
      r.argmax.resize(c.rows);
      r.logits.resize(in.logits.size());
      d_x.down(r.logits.data());
      d_loss.down(r.loss.data());
      d_lse.down(r.lse.data());
      d_zl.down(r.zl.data());
      d_am.down(r.argmax.data());
      d_acc.down(&r.accuracy);
      EXPECT_TRUE(bitwise_equal(r, eager)) << "graph replay " << rep << " differs from eager";
    }
    g.check_errors(s);
    ck(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    ck(cudaGraphDestroy(graph), "cudaGraphDestroy");
    ck(cudaStreamDestroy(s), "cudaStreamDestroy");
  }
}

}  // namespace
}  // namespace xtest::gpu::compare
