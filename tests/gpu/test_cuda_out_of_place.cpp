// The CUDA backend's out-of-place backward (backward with a gradient buffer apart from the
// logits) against the CPU backend's, through the public API, on the same host inputs, with
// backend_compare.h's gradient tolerance; and against the CUDA in-place backward, bit for bit.
// Skips itself when no CUDA device is visible (CI has none).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "backend_compare.h"
#include "cuda_test.h"
#include "inputs.h"  // element stores of each dtype

namespace xtest::gpu::compare {
namespace {

// The gradient of a deferred forward written by backward(group, logits, grad, ...) into a buffer
// of row stride cols + out_extra starting out_shift elements into its allocation (a sentinel in
// every element it must not write). `logits` comes back as the logits buffer after the call.
struct OopResult {
  std::vector<uint8_t> logits, grad;
};

OopResult run_out_of_place(Backend backend, const Case& c, const Inputs& in, int64_t out_extra,
                           int64_t out_shift) {
  const size_t es = esize(c.dtype);
  const int64_t os = c.cols + out_extra;
  const size_t rows = static_cast<size_t>(c.rows);
  xent::Options opt = c.opt;
  opt.vocab_start = c.vocab_start;
  opt.vocab_size = c.vocab_size;
  opt.grad_mode = GradMode::deferred;
  OopResult r;
  r.logits = in.logits;
  r.grad.resize(static_cast<size_t>(out_shift + c.rows * os) * es);
  for (size_t i = 0; i < r.grad.size() / es; ++i)
    xtest::store_elem(c.dtype, &r.grad[i * es], 77.0f);
  std::vector<float> loss(opt.reduction == Reduction::none ? std::max<size_t>(1, rows) : 1);
  std::vector<float> lse(std::max<size_t>(1, rows));

  xent::LogitsView lv, gv;
  lv.dtype = gv.dtype = c.dtype;
  lv.rows = gv.rows = c.rows;
  lv.cols = gv.cols = c.cols;
  lv.row_stride = c.stride();
  gv.row_stride = os;
  xent::TargetsView tv;
  tv.type = c.itype;
  tv.rows = c.rows;
  xent::Outputs out;
  if (backend == Backend::cpu) {
    xent::Group g = xent::Group::local(Backend::cpu);
    lv.data = r.logits.data();
    gv.data = r.grad.data() + out_shift * es;
    tv.data = in.targets.data();
    out.loss = loss.data();
    out.lse = lse.data();
    const float* go = in.grad_output.empty() ? nullptr : in.grad_output.data();
    xent::forward(g, lv, tv, opt, out);
    xent::backward(g, lv, gv, tv, out.lse, go, opt);
    return r;
  }
  xent::Group g = xent::Group::local(Backend::cuda, 0);
  DevBuf d_logits(r.logits.size()), d_grad(r.grad.size()), d_targets(in.targets.size()),
      d_loss(loss.size() * 4), d_lse(lse.size() * 4), d_go(in.grad_output.size() * 4);
  d_logits.up(r.logits.data());
  d_grad.up(r.grad.data());
  d_targets.up(in.targets.data());
  d_go.up(in.grad_output.data());
  lv.data = d_logits.p;
  gv.data = static_cast<uint8_t*>(d_grad.p) + out_shift * es;
  tv.data = d_targets.p;
  out.loss = static_cast<float*>(d_loss.p);
  out.lse = static_cast<float*>(d_lse.p);
  xent::forward(g, lv, tv, opt, out);
  xent::backward(g, lv, gv, tv, out.lse, static_cast<const float*>(d_go.p), opt);
  g.check_errors(nullptr);
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  d_logits.down(r.logits.data());
  d_grad.down(r.grad.data());
  return r;
}

// CUDA out of place against the CPU (out of place), for row strides +0 and +3 on either side and
// an output that starts off a 16-byte boundary (the kernel's element-load path); the logits and
// every element of the output outside the gradient are bitwise unchanged; and the CUDA gradient
// is bitwise the in-place CUDA gradient (the same arithmetic, whatever the load path).
TEST(CudaBackend, OutOfPlaceBackwardMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {300, 1000}, {64, 4099}, {3, 32064}, {1, 7}, {0, 100}};
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (auto [n, v] : shapes)
      for (int64_t in_extra : {0, 3})
        for (int64_t out_extra : {0, 3})
          for (int64_t out_shift : {0, 1}) {
            Case c = base("out-of-place", d, n, v);
            c.stride_extra = in_extra;
            c.opt.grad_mode = GradMode::deferred;
            c.opt.label_smoothing = 0.05f;
            c.opt.z_loss = 1e-4f;
            c.vocab_size = v > 10 ? v - 5 : -1;
            c.go_kind = 2;
            if (v == 4099) {
              c.opt.reduction = Reduction::none;
              c.opt.softcap = 15.0f;
            }
            SCOPED_TRACE(describe(c) + " out stride +" + std::to_string(out_extra) + " shift " +
                         std::to_string(out_shift));
            const Inputs in = make_inputs(c);
            const OopResult cpu = run_out_of_place(Backend::cpu, c, in, out_extra, out_shift);
            const OopResult gpu = run_out_of_place(Backend::cuda, c, in, out_extra, out_shift);
            EXPECT_TRUE(gpu.logits == in.logits) << "the logits were written";
            const size_t es = esize(d);
            const int64_t os = v + out_extra;
            int bad = 0;
            std::ostringstream err;
            auto note = [&](const std::string& what) {
              if (bad++ < 8) err << "\n  " << what;
            };
            for (size_t i = 0; i < static_cast<size_t>(out_shift) * es; ++i)
              if (gpu.grad[i] != cpu.grad[i]) note("the element before the output was written");
            for (int64_t r = 0; r < n; ++r) {
              double rowmax = 0.0;
              const size_t row0 = static_cast<size_t>(out_shift + r * os) * es;
              for (int64_t j = 0; j < v; ++j)
                rowmax =
                    std::max(rowmax, std::fabs((double)load_as_float(d, &cpu.grad[row0 + j * es])));
              for (int64_t j = 0; j < os; ++j) {
                const size_t off = row0 + static_cast<size_t>(j) * es;
                if (j >= v) {
                  if (std::memcmp(&gpu.grad[off], &cpu.grad[off], es) != 0)
                    note("row " + std::to_string(r) + " col " + std::to_string(j) +
                         ": the output's row-stride gap was written");
                  continue;
                }
                const double a = load_as_float(d, &gpu.grad[off]);
                const double b = load_as_float(d, &cpu.grad[off]);
                const double lim = c.tol_grad_row() * rowmax + c.tol_grad_rel() * std::fabs(b) +
                                   1.01 * ulp(d, std::max(std::fabs(a), std::fabs(b)));
                if (!close(a, b, lim)) {
                  std::ostringstream s;
                  s << "grad[" << r << "][" << j << "] gpu " << a << " cpu " << b << " (lim " << lim
                    << ")";
                  note(s.str());
                }
              }
            }
            EXPECT_EQ(bad, 0) << err.str();

            // The in-place CUDA backward on the same inputs: the same bits.
            Case ci = c;
            const Result inplace = run(Backend::cuda, ci, in);
            int differ = 0;
            for (int64_t r = 0; r < n; ++r)
              for (int64_t j = 0; j < v; ++j)
                differ += std::memcmp(&inplace.logits[static_cast<size_t>(r * c.stride() + j) * es],
                                      &gpu.grad[static_cast<size_t>(out_shift + r * os + j) * es],
                                      es) != 0;
            EXPECT_EQ(differ, 0) << "CUDA out-of-place and in-place gradients differ in bits";
          }
}

}  // namespace
}  // namespace xtest::gpu::compare
