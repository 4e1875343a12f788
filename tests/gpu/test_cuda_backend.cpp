// The CUDA backend against the CPU backend, through the public API (forward/backward), on the
// same host inputs (backend_compare.h: the harness and its tolerances): every V_local shape and
// dtype, each option, finalize's reduction over many blocks, and an empty batch. Every test skips
// itself when no CUDA device is visible (CI has none).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "backend_compare.h"
#include "cuda_test.h"

namespace xtest::gpu::compare {
namespace {

// c on the CPU and on the GPU, compared; with `determinism`, a second GPU run on the same stream
// gives the same bits.
void check_case(const Case& c, bool determinism = true) {
  SCOPED_TRACE(describe(c));
  const Inputs in = make_inputs(c);
  const Result cpu = run(Backend::cpu, c, in);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  const Result gpu = run(Backend::cuda, c, in, s);
  EXPECT_TRUE(matches(c, in, gpu, cpu));
  if (determinism) {
    const Result again = run(Backend::cuda, c, in, s);
    EXPECT_TRUE(bitwise_equal(gpu, again)) << "two GPU runs differ: " << describe(c);
  }
  ck(cudaStreamDestroy(s), "cudaStreamDestroy");
}

// ---------------------------------------------------------------------------------- tests

TEST(CudaBackend, DeviceCount) {
  SKIP_WITHOUT_GPU();
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  EXPECT_GT(n, 0);
}

// Every V_local shape, both launch shapes (warp per row, block per row), all dtypes.
TEST(CudaBackend, VocabSweepAllDtypes) {
  SKIP_WITHOUT_GPU();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {8192, 1},   {8192, 7},   {3, 1000},   {1000, 1000}, {1, 16032}, {3, 32064},
      {3, 128256}, {1, 262144}, {2, 262150}, {0, 1000},    {50, 4096}, {50, 4104}};
  for (DType d : {DType::f32, DType::bf16, DType::f16})
    for (auto [n, v] : shapes) {
      Case c = base("sweep", d, n, v);
      check_case(c, /*determinism=*/n * v < 5000000);
    }
}

// The benchmark shape, bf16, both grad modes (mean): large enough to cross many blocks.
TEST(CudaBackend, LargeBf16) {
  SKIP_WITHOUT_GPU();
  for (GradMode m : {GradMode::fused, GradMode::deferred}) {
    Case c = base("large", DType::bf16, 8192, 16032);
    c.opt.grad_mode = m;
    check_case(c);
  }
  Case c = base("large-f16-unaligned", DType::f16, 257, 32064);
  c.stride_extra = 3;
  c.opt.label_smoothing = 0.05f;
  c.opt.compute_accuracy = true;
  check_case(c);
}

// Each option, unaligned row strides, padded vocabularies, both index types, both grad modes.
TEST(CudaBackend, Options) {
  SKIP_WITHOUT_GPU();
  std::vector<Case> cases;
  {
    Case c = base("all-options-warp", DType::bf16, 300, 1000);
    c.stride_extra = 3;
    c.vocab_size = 990;
    c.itype = IndexType::i32;
    c.opt.label_smoothing = 0.1f;
    c.opt.z_loss = 1e-3f;
    c.opt.softcap = 30.0f;
    c.opt.compute_accuracy = true;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("all-options-block", DType::bf16, 120, 20000);
    c.stride_extra = 3;
    c.vocab_size = 19990;
    c.opt.label_smoothing = 0.1f;
    c.opt.z_loss = 1e-4f;
    c.opt.softcap = 15.0f;
    c.opt.compute_accuracy = true;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("none-per-row-go", DType::f32, 200, 5000);
    c.stride_extra = 1;
    c.opt.reduction = Reduction::none;
    c.ignore_frac = 0.3;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("none-per-row-go-deferred", DType::bf16, 333, 777);
    c.stride_extra = 5;
    c.opt.reduction = Reduction::none;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    c.itype = IndexType::i32;
    cases.push_back(c);
  }
  {
    Case c = base("sum-softcap-deferred", DType::f16, 77, 3001);
    c.stride_extra = 5;
    c.opt.reduction = Reduction::sum;
    c.opt.softcap = 20.0f;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    // One rank's shard is the whole vocabulary (offsets need several ranks: TwoRanksMatchCpu);
    // here its last columns are padding.
    Case c = base("padded-one-rank", DType::f32, 1000, 33);
    c.stride_extra = 3;
    c.vocab_size = 30;
    c.opt.reduction = Reduction::none;
    c.opt.label_smoothing = 0.2f;
    c.opt.compute_accuracy = true;
    c.opt.grad_mode = GradMode::deferred;
    cases.push_back(c);
  }
  {
    Case c = base("grad-none-accuracy", DType::bf16, 50, 4104);
    c.opt.grad_mode = GradMode::none;
    c.opt.compute_accuracy = true;
    c.opt.z_loss = 1e-2f;
    cases.push_back(c);
  }
  {
    Case c = base("fused-go-one", DType::bf16, 64, 9000);
    c.stride_extra = 7;
    c.go_kind = 1;
    cases.push_back(c);
  }
  {
    Case c = base("fused-go-scalar", DType::f32, 64, 9000);
    c.opt.reduction = Reduction::sum;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    // grad_scale: per-row factors grad_output / 0.37, exactly 1 on some rows (left alone).
    Case c = base("fused-grad-scale-per-row", DType::bf16, 300, 3001);
    c.opt.reduction = Reduction::none;
    c.opt.grad_scale = 0.37f;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    // One rank, 9000 bf16 columns: the single-pass path; backward with grad_output null (1).
    Case c = base("fused-grad-scale-single-pass", DType::bf16, 64, 9000);
    c.opt.grad_scale = 0.25f;
    c.go_kind = 0;
    cases.push_back(c);
  }
  {
    Case c = base("fused-grad-scale-two-pass-scalar", DType::f16, 64, 9000);
    c.opt.reduction = Reduction::sum;
    c.opt.single_pass = false;
    c.opt.grad_scale = 0.47f;
    c.go_kind = 2;
    cases.push_back(c);
  }
  {
    Case c = base("all-ignored", DType::bf16, 100, 2000);
    c.ignore_frac = 1.0;
    c.opt.compute_accuracy = true;
    cases.push_back(c);
  }
  {
    Case c = base("ignore-index-is-a-class", DType::f32, 500, 64);
    c.opt.ignore_index = 5;
    c.ignore_frac = 0.2;
    c.opt.compute_accuracy = true;
    cases.push_back(c);
  }
  {
    Case c = base("softcap-plain-large", DType::f32, 40, 70000);
    c.opt.softcap = 30.0f;
    c.logit_scale = 10.0f;
    cases.push_back(c);
  }
  {
    Case c = base("padding-only-shard-rows", DType::bf16, 16, 64);
    c.vocab_size = 60;
    c.stride_extra = 1;
    c.opt.label_smoothing = 0.3f;
    cases.push_back(c);
  }
  for (const Case& c : cases) check_case(c);
}

// finalize reduces over many blocks through the workspace's partials and a counter that the last
// block resets: one group, calls of different row counts (one block, several, the cap of 256
// blocks with rows left over), each matching the CPU and repeatable bit for bit.
TEST(CudaBackend, FinalizeBlocksReuseOneGroup) {
  SKIP_WITHOUT_GPU();
  xent::Group g = xent::Group::local(Backend::cuda, 0);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int64_t rows : {300, 70001, 1, 8192, 257, 70001}) {
    Case c = base("finalize-blocks", DType::bf16, rows, 96);
    c.opt.compute_accuracy = true;
    c.opt.z_loss = 1e-3f;
    c.ignore_frac = 0.2;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c);
    const Result cpu = run(Backend::cpu, c, in);
    const Result gpu = run(Backend::cuda, c, in, s, &g);
    EXPECT_TRUE(matches(c, in, gpu, cpu));
    const Result again = run(Backend::cuda, c, in, s, &g);
    EXPECT_TRUE(bitwise_equal(gpu, again)) << "two GPU runs differ: " << describe(c);
  }
  ck(cudaStreamDestroy(s), "cudaStreamDestroy");
}

// The loss of an empty batch, on both backends.
TEST(CudaBackend, EmptyBatch) {
  SKIP_WITHOUT_GPU();
  for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
    Case c = base("empty", DType::bf16, 0, 512);
    c.opt.reduction = red;
    c.opt.compute_accuracy = true;
    c.opt.grad_mode = GradMode::deferred;
    c.go_kind = 2;
    check_case(c);
  }
}

}  // namespace
}  // namespace xtest::gpu::compare
