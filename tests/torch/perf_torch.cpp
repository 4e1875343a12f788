// xent_perf_torch: the LibTorch adapter's overhead. Forward + backward through
// xent::torch::vocab_parallel_cross_entropy (autograd, torch-allocated outputs) against the raw
// xent::forward + xent::backward on the same logits, same stream, one GPU, one rank.
//
//   xent_perf_torch [--rows 8192] [--vocab 16032,32064,128256] [--iters 50] [--reps 5]
//
// Each timing is CUDA events around `iters` back-to-back iterations (host overhead included
// where it leaves the GPU idle), the median of `reps` alternating repetitions. Rows printed:
//   raw               xent::forward (fused) + xent::backward, gradient in place
//   op inplace        the torch API, grad_mode fused, inplace_grad = true (what raw does)
//   op deferred/inpl  grad_mode deferred, inplace_grad = true
//   op no-inpl        grad_mode fused, inplace_grad = false (the gradient goes into a new
//                     tensor in forward, the logits are only read; no copy)
// ratio = op time / raw time; the target is op inplace <= 1.05.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/torch.h>
#include <xent/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace {

double time_ms(const std::function<void()>& step, int iters) {
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  const auto stream = at::cuda::getCurrentCUDAStream();
  start.record(stream);
  for (int i = 0; i < iters; ++i) step();
  stop.record(stream);
  stop.synchronize();
  return start.elapsed_time(stop) / iters;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 8192;
  std::vector<int64_t> vocabs{16032, 32064, 128256};
  int iters = 50, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rows"))
      rows = std::atoll(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--vocab"))
      vocabs = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters"))
      iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps"))
      reps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--rows N] [--vocab V1,V2,..] [--iters I] [--reps R]\n",
                   argv[0]);
      return 2;
    }
  }
  if (c10::cuda::device_count() == 0) {
    std::printf("xent_perf_torch: no GPU, nothing to time\n");
    return 0;
  }
  const at::Device dev(at::kCUDA, 0);
  c10::cuda::set_device(0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "# xent_perf_torch on %s: bf16, mean, forward + backward, %d iterations x %d reps "
      "(median), ms per iteration\n",
      prop.name, iters, reps);
  std::printf("%8s %8s %10s %12s %10s %16s %10s %10s %8s\n", "rows", "vocab", "raw", "op inplace",
              "ratio", "op deferred/inpl", "ratio", "op no-inpl", "ratio");

  int worst_rc = 0;
  for (int64_t vocab : vocabs) {
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(dev);
    const at::Tensor target =
        at::randint(0, vocab, {rows}, at::TensorOptions().dtype(at::kLong).device(dev));
    const c10::intrusive_ptr<c10d::ProcessGroup> no_group;

    // raw API
    const at::Tensor raw_logits = at::randn({rows, vocab}, bf16);
    const at::Tensor raw_loss = at::empty({}, bf16.dtype(at::kFloat));
    const at::Tensor raw_go = at::ones({}, bf16.dtype(at::kFloat));
    xent::Group group = xent::torch::group_for(no_group, dev);
    xent::Options opt;
    opt.vocab_size = vocab;
    group.reserve(rows, opt);
    xent::LogitsView lv{raw_logits.data_ptr(), xent::DType::bf16, rows, vocab, vocab};
    xent::TargetsView tv{target.data_ptr(), xent::IndexType::i64, rows};
    xent::Outputs out;
    out.loss = raw_loss.data_ptr<float>();
    auto raw_step = [&] {
      const cudaStream_t s = at::cuda::getCurrentCUDAStream().stream();
      xent::forward(group, lv, tv, opt, out, s);
      xent::backward(group, lv, tv, nullptr, raw_go.data_ptr<float>(), opt, s);
    };

    // the torch API: logits that are a layer's output (a non-leaf), gradient taken for them
    const at::Tensor leaf = at::randn({rows, vocab}, bf16).requires_grad_();
    const at::Tensor logits = leaf * 1.0;
    auto inplace_step = [&](xent::GradMode mode) {
      xent::torch::CrossEntropyOptions o;
      o.grad_mode = mode;
      o.inplace_grad = true;
      return [&, o] {
        const at::Tensor loss =
            xent::torch::vocab_parallel_cross_entropy_loss(logits, target, no_group, o);
        (void)torch::autograd::grad({loss}, {logits});
      };
    };
    // Not in place: with respect to a leaf alias of the same logits (read only, the gradient
    // into a new tensor).
    auto copy_step = [&](xent::GradMode mode) {
      xent::torch::CrossEntropyOptions o;
      o.grad_mode = mode;
      return [&, o] {
        const at::Tensor x = logits.detach().requires_grad_();
        const at::Tensor loss =
            xent::torch::vocab_parallel_cross_entropy_loss(x, target, no_group, o);
        (void)torch::autograd::grad({loss}, {x});
      };
    };
    auto inplace_fused = inplace_step(xent::GradMode::fused);
    auto inplace_deferred = inplace_step(xent::GradMode::deferred);
    auto copied = copy_step(xent::GradMode::fused);

    for (int w = 0; w < 3; ++w) {  // warm-up: workspace, allocator, autograd threads
      raw_step();
      inplace_fused();
      inplace_deferred();
      copied();
    }
    std::vector<double> t_raw, t_op, t_def, t_copy;
    for (int r = 0; r < reps; ++r) {
      t_raw.push_back(time_ms(raw_step, iters));
      t_op.push_back(time_ms(inplace_fused, iters));
      t_def.push_back(time_ms(inplace_deferred, iters));
      t_copy.push_back(time_ms(copied, iters));
    }
    group.check_errors(at::cuda::getCurrentCUDAStream().stream());
    const double raw = median(t_raw), op = median(t_op), def = median(t_def), cp = median(t_copy);
    std::printf("%8lld %8lld %10.4f %12.4f %10.3f %16.4f %10.3f %10.4f %8.3f\n",
                static_cast<long long>(rows), static_cast<long long>(vocab), raw, op, op / raw, def,
                def / raw, cp, cp / raw);
    if (op / raw > 1.05) worst_rc = 1;
  }
  std::printf("# target: op inplace within 5%% of raw: %s\n", worst_rc ? "MISSED" : "met");
  return worst_rc;
}
