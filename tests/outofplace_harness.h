// Shared by the out-of-place suites on the CPU backend (test_outofplace_deferred.cpp: OutOfPlace,
// test_outofplace_fused.cpp: OutOfPlaceFused, both in xtest): the xent names they use, a gradient
// buffer with its own row stride, one forward that keeps loss and lse for the backward, and a
// valid problem for the misuse tests.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "harness.h"

namespace xtest {

using xent::DType;
using xent::GradMode;
using xent::IndexType;
using xent::Reduction;

// A buffer shaped like `like` but with its own row stride, every element (gap included) holding
// `fill`, so that tests can see what was written.
inline HostLogits blank_like(const HostLogits& like, int64_t stride, double fill) {
  HostLogits h;
  h.dtype = like.dtype;
  h.rows = like.rows;
  h.cols = like.cols;
  h.stride = stride;
  h.bytes.assign(static_cast<size_t>(std::max<int64_t>(1, h.rows * h.stride)) * elem_size(h.dtype),
                 0);
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.stride; ++j) h.set(i, j, fill);
  return h;
}

// One forward on `buf` (deferred, or fused with its gradient in `grad`, or over the logits where
// grad is null), then lse for the backward. The view overload serves tests that lay the logits
// out in a buffer of their own.
struct Forward {
  xent::Group g = xent::Group::local(xent::Backend::cpu);
  xent::Options opt;
  std::vector<float> loss, lse;
  void forward(const xent::LogitsView& buf, const HostTargets& tg,
               xent::GradMode mode = xent::GradMode::deferred, HostLogits* grad = nullptr) {
    opt.grad_mode = mode;
    loss.assign(opt.reduction == xent::Reduction::none ? std::max<int64_t>(1, buf.rows) : 1, 0.0f);
    lse.assign(std::max<int64_t>(1, buf.rows), 0.0f);
    xent::Outputs out;
    out.loss = loss.data();
    out.lse = lse.data();
    if (grad != nullptr) out.grad = grad->view();
    xent::forward(g, buf, tg.view(), opt, out);
  }
  void forward(HostLogits& buf, const HostTargets& tg,
               xent::GradMode mode = xent::GradMode::deferred, HostLogits* grad = nullptr) {
    forward(buf.view(), tg, mode, grad);
  }
};

// A valid out-of-place problem that each misuse test breaks in one way.
struct Misuse {
  int64_t N = 4, V = 6;
  Matrix x = random_logits(4, 6, 1, xent::DType::f32);
  std::vector<int64_t> t = {1, 2, 3, 4};
  HostLogits logits = make_shard(x, 0, 6, xent::DType::f32);
  HostLogits grad = blank_like(logits, 6, 0.0);
  HostTargets tg{t, xent::IndexType::i64};
  Forward d;
  Misuse() { d.forward(logits, tg); }
  std::string error_with(xent::LogitsView g) {
    return error_of(
        [&] { xent::backward(d.g, logits.view(), g, tg.view(), d.lse.data(), nullptr, d.opt); });
  }
};

}  // namespace xtest
