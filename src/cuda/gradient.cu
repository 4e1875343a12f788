// The gradient kernels: d loss / d logits of each row (fused forward and deferred backward), and
// the fused backward's scaling of finished gradient rows by grad_output / grad_scale.
//
// The gradient walks the rows last to first, so that the rows the statistics kernel read last
// are still in L2 when it starts. With GradRows::rescaled (the fused backward out of place) the
// same kernel recomputes from the logits only the rows whose factor grad_output / grad_scale is
// not 1; each row's threads read that factor first and return when it is 1, so a backward whose
// grad_output is grad_scale reads grad_output and no logits. scale_rows is a grid-stride loop over
// at most 4 blocks per SM; each block first reads a scalar grad_output and returns when its
// factor is 1.
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "backend.h"
#include "core/dtype.h"
#include "cuda/launch.cuh"
#include "cuda/row_agents.cuh"

namespace xent::cuda {
namespace {

using namespace detail;

// The pointers of one gradient launch (the problem and the views travel whole).
struct GradPointers {
  const float* lse;
  const float* scalars;
  const float* grad_output;  // nullptr: 1; per row for Reduction::none
  bool rescaled_only;        // GradRows::rescaled
};

template <typename E, typename EO, int kGroup, bool kCap>
__global__ void __launch_bounds__(kBlock, RowPolicy::kGradBlocksPerSm)
    gradient_kernel(const core::Problem p, const LogitsView in, const LogitsView out,
                    const TargetsView targets, const GradPointers ptr) {
  using T = typename E::type;
  using Walk = RowWalk<typename EO::type, kGroup>;
  pdl_trigger();
  pdl_wait();
  const int64_t g = group_index<kGroup>();
  if (g >= p.rows) return;
  const int64_t row = p.rows - 1 - g;  // last row first: it is the likeliest to be in L2
  const int t = group_lane<kGroup>();
  const T* x = static_cast<const T*>(in.data) + row * in.row_stride;
  typename EO::type* dx = static_cast<typename EO::type*>(out.data) + row * out.row_stride;
  const int n = static_cast<int>(p.cols);

  const core::RowFactor f = core::gradient_row_factor(
      ptr.grad_output, p.reduction == Reduction::none ? row : 0, p.grad_scale, ptr.rescaled_only);
  if (!f.write) return;
  const int64_t target = core::load_target(targets.data, targets.type, row);
  if (!has_gradient(p, target)) {
    if (!ptr.rescaled_only) Walk::zero(dx, n, t);  // rescaled: forward zeroed it
    return;
  }
  const GradAgent<E, kCap, EO> grad(p, target, ptr.lse[row],
                                    ptr.scalars[Workspace::kScale] * f.factor);
  Walk::transform(x, dx, n, t, grad);
}

template <typename E, int kGroup>
__global__ void __launch_bounds__(kBlock)
    scale_rows_kernel(const core::Problem p, const LogitsView grad, const float* grad_output) {
  using T = typename E::type;
  pdl_trigger();
  pdl_wait();
  const bool per_row = p.reduction == Reduction::none;
  float f0 = 1.0f;
  if (!per_row) {
    f0 = core::fused_backward_factor(grad_output, 0, p.grad_scale);
    if (f0 == 1.0f) return;  // the common case: nothing to do
  }
  constexpr int kRows = kBlock / kGroup;
  const int t = group_lane<kGroup>();
  for (int64_t row = group_index<kGroup>(); row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * kRows) {
    const float f = per_row ? core::fused_backward_factor(grad_output, row, p.grad_scale) : f0;
    if (f == 1.0f) continue;
    T* q = static_cast<T*>(grad.data) + row * grad.row_stride;
    RowWalk<T, kGroup>::transform(q, q, static_cast<int>(p.cols), t,
                                  [&](T v, int) { return E::store(E::load(v) * f); });
  }
}

}  // namespace

void gradient(const core::Problem& p, LogitsView in, LogitsView out, TargetsView targets,
              const float* lse, const float* scalars, const float* grad_output, cudaStream_t stream,
              GradRows rows) {
  if (p.rows == 0) return;
  check_shape(p, in);
  if (out.data != in.data) check_shape(p, out, "grad");
  const GradPointers ptr{lse, scalars, grad_output, rows == GradRows::rescaled};
  // The gradient in the logits' dtype, or in 16 bits from fp32 logits (the fused lm head).
  if (out.dtype != in.dtype && in.dtype != DType::f32)
    fail(std::string("gradient: grad.dtype = ") + to_string(out.dtype) + " with logits.dtype = " +
         to_string(in.dtype) + ": a gradient of another dtype needs f32 logits");
  core::dispatch_dtype(in.dtype, [&](auto e) {
    using E = decltype(e);
    core::dispatch_dtype(in.dtype == out.dtype ? in.dtype : out.dtype, [&](auto eo) {
      using EO = decltype(eo);
      if constexpr (std::is_same_v<E, EO> || std::is_same_v<typename E::type, float>) {
        dispatch_group<typename E::type>(p.cols, [&](auto group) {
          dispatch_bool(p.softcap > 0.0f, [&](auto cap) {
            launch("xent gradient kernel", gradient_kernel<E, EO, group(), cap()>,
                   row_blocks<group()>(p.rows), kBlock, p.programmatic_launch, stream, p, in, out,
                   targets, ptr);
          });
        });
      }
    });
  });
}

void scale_rows(const core::Problem& p, LogitsView grad, const float* grad_output,
                cudaStream_t stream) {
  if (p.rows == 0) return;
  check_shape(p, grad);
  const unsigned max_blocks = static_cast<unsigned>(device_info().sms) * 4u;
  core::dispatch_dtype(grad.dtype, [&](auto e) {
    using E = decltype(e);
    dispatch_group<typename E::type>(p.cols, [&](auto group) {
      const unsigned blocks = std::min(row_blocks<group()>(p.rows), max_blocks);
      launch("xent scale_rows kernel", scale_rows_kernel<E, group()>, blocks, kBlock,
             p.programmatic_launch, stream, p, grad, grad_output);
    });
  });
}

}  // namespace xent::cuda
