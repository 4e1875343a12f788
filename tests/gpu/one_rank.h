// forward (fused gradient) of one rank on the GPU, through the public API, for the CUDA test
// files that check it against the fp64 reference: the logits with the row stride and the gradient
// buffer a RowShape asks for; the outputs, the gradient, the path taken and check_errors' message
// come back.
#pragma once

#include <cuda_runtime.h>
#include <xent/xent.h>

#include <string>
#include <vector>

#include "cuda_test.h"
#include "harness.h"

namespace xtest::gpu {

struct RowShape {
  int64_t cols;
  int64_t stride_extra;  // elements between rows beyond cols (unaligned rows when odd)
  bool separate_grad;    // Outputs::grad, one element off the logits' alignment
};

struct OneRankRun {
  xtest::GotOutputs out;
  xtest::HostLogits grad;
  std::string path;
  std::string error;  // check_errors' message, "" if none
};

inline OneRankRun run_one_rank(const xtest::Matrix& x, const std::vector<int64_t>& targets,
                               xent::DType dtype, const xent::Options& opt, const RowShape& s) {
  const int64_t n = x.rows;
  const size_t nloss = opt.reduction == xent::Reduction::none ? static_cast<size_t>(n) : 1;
  const double gap = 77.0;  // the stride gap of the gradient's buffer must keep it
  OneRankRun r;
  xtest::HostLogits logits = xtest::make_shard(x, 0, x.cols, dtype, x.cols + s.stride_extra, gap);
  r.grad = s.separate_grad ? xtest::make_shard(x, 0, x.cols, dtype, x.cols + 5, gap) : logits;
  const xtest::HostTargets tg(targets, xent::IndexType::i64);
  // One element more than the buffer, so that the separate gradient can start one element in.
  const size_t esz = xent::dtype_size(dtype);
  DevBuf d_x(logits.bytes.size()), d_g(r.grad.bytes.size() + esz), d_t(tg.bytes()),
      d_loss(nloss * 4), d_lse(n * 4);
  d_x.up(logits.bytes.data());
  d_t.up(tg.i64.data());
  d_loss.poison();
  d_lse.poison();
  char* g_data = static_cast<char*>(d_g.p) + esz;
  xtest::gpu::ck(
      cudaMemcpy(g_data, r.grad.bytes.data(), r.grad.bytes.size(), cudaMemcpyHostToDevice),
      "cudaMemcpy");
  xent::LogitsView lv = logits.view();
  lv.data = d_x.p;
  xent::TargetsView tv = tg.view();
  tv.data = d_t.p;
  xent::Outputs out;
  out.loss = static_cast<float*>(d_loss.p);
  out.lse = static_cast<float*>(d_lse.p);
  if (s.separate_grad) {
    out.grad = r.grad.view();
    out.grad.data = g_data;
  }
  xent::Group g = xent::Group::local(xent::Backend::cuda, 0);
  r.path = xent::forward_path(g, lv, opt);
  xent::forward(g, lv, tv, opt, out);
  xtest::gpu::ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  try {
    g.check_errors(nullptr);
  } catch (const xent::Error& e) {
    r.error = e.what();
  }
  r.out.loss.resize(nloss);
  r.out.lse.resize(n);
  d_loss.down(r.out.loss.data());
  d_lse.down(r.out.lse.data());
  if (s.separate_grad)
    xtest::gpu::ck(
        cudaMemcpy(r.grad.bytes.data(), g_data, r.grad.bytes.size(), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  else
    d_x.down(r.grad.bytes.data());
  return r;
}

}  // namespace xtest::gpu
