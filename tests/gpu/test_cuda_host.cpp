// The CUDA backend's host-side contracts, each with a way to fail: the group's device is made
// current for a call and the caller's restored; the workspace never grows inside CUDA graph
// capture; an earlier, unrelated CUDA error is neither reported as xent's nor swallowed; host
// buffers given to a CUDA group are refused by name before any kernel faults on them. Every test
// skips itself when it lacks the GPUs it needs (CI has none).
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xent/linear.h>
#include <xent/xent.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_test.h"
#include "inputs.h"

namespace {

using ::testing::HasSubstr;
using xent::Backend;

using xtest::gpu::ck;
using xtest::gpu::device_count;

// A small fp32 problem on one device: logits, targets and outputs there, a CPU-backend loss to
// compare with.
struct Problem {
  static constexpr int64_t kRows = 64, kCols = 1000;
  int device;
  std::vector<float> logits;
  std::vector<int64_t> targets;
  void *d_logits = nullptr, *d_targets = nullptr, *d_loss = nullptr, *d_lse = nullptr;

  explicit Problem(int dev) : device(dev), logits(kRows * kCols), targets(kRows) {
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0.0f, 2.0f);
    for (float& x : logits) x = n(rng);
    for (int64_t r = 0; r < kRows; ++r) targets[r] = (r * 37) % kCols;
    int saved = 0;
    ck(cudaGetDevice(&saved), "cudaGetDevice");
    ck(cudaSetDevice(device), "cudaSetDevice");
    ck(cudaMalloc(&d_logits, logits.size() * 4), "cudaMalloc");
    ck(cudaMalloc(&d_targets, targets.size() * 8), "cudaMalloc");
    ck(cudaMalloc(&d_loss, 4), "cudaMalloc");
    ck(cudaMalloc(&d_lse, kRows * 4), "cudaMalloc");
    ck(cudaMemcpy(d_logits, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice), "H2D");
    ck(cudaMemcpy(d_targets, targets.data(), targets.size() * 8, cudaMemcpyHostToDevice), "H2D");
    ck(cudaSetDevice(saved), "cudaSetDevice");
  }
  ~Problem() {
    for (void* p : {d_logits, d_targets, d_loss, d_lse}) cudaFree(p);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  xent::LogitsView view(void* data) { return {data, xent::DType::f32, kRows, kCols, kCols}; }
  xent::TargetsView target_view(const void* data) { return {data, xent::IndexType::i64, kRows}; }
  xent::Outputs outputs() {
    xent::Outputs o;
    o.loss = static_cast<float*>(d_loss);
    o.lse = static_cast<float*>(d_lse);
    return o;
  }
  void forward(const xent::Group& g, cudaStream_t s) {
    xent::forward(g, view(d_logits), target_view(d_targets), xent::Options{}, outputs(), s);
  }
  float loss_on_gpu(cudaStream_t s) {
    float loss = 0.0f;
    ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    ck(cudaMemcpy(&loss, d_loss, 4, cudaMemcpyDeviceToHost), "D2H");
    return loss;
  }
  float loss_on_cpu() {
    std::vector<float> x = logits, lse(kRows);
    float loss = 0.0f;
    xent::Outputs o;
    o.loss = &loss;
    o.lse = lse.data();
    xent::forward(xent::Group::local(Backend::cpu), view(x.data()), target_view(targets.data()),
                  xent::Options{}, o);
    return loss;
  }
};

TEST(CudaHost, CallOnAnotherDevicesGroupRunsThereAndRestoresTheCallers) {
  if (device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  Problem p(1);
  ck(cudaSetDevice(0), "cudaSetDevice");
  const xent::Group g = xent::Group::local(Backend::cuda, 1);
  int current = -1;
  ck(cudaGetDevice(&current), "cudaGetDevice");
  EXPECT_EQ(current, 0) << "Group::local changed the current device";
  // The workspace is allocated, and the kernels run, on device 1 while device 0 is current: any
  // of them on device 0 would touch device 1's memory without peer access and fail.
  p.forward(g, nullptr);
  g.check_errors(nullptr);
  ck(cudaGetDevice(&current), "cudaGetDevice");
  EXPECT_EQ(current, 0) << "a call did not restore the caller's device";
  ck(cudaSetDevice(1), "cudaSetDevice");
  const float got = p.loss_on_gpu(nullptr);
  ck(cudaSetDevice(0), "cudaSetDevice");
  const float want = p.loss_on_cpu();
  EXPECT_NEAR(got, want, 2e-5 * std::fabs(want));
}

TEST(CudaHost, WorkspaceGrowthInsideGraphCaptureIsRefused) {
  if (device_count() < 1) GTEST_SKIP() << "no CUDA device visible";
  ck(cudaSetDevice(0), "cudaSetDevice");
  Problem p(0);
  const xent::Group g = xent::Group::local(Backend::cuda, 0);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  std::string message;
  try {
    p.forward(g, s);
  } catch (const xent::Error& e) {
    message = e.what();
  }
  cudaGraph_t graph = nullptr;
  // The capture is intact: nothing was allocated or synchronised inside it.
  ck(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
  if (graph) cudaGraphDestroy(graph);
  EXPECT_THAT(message, HasSubstr("Group::reserve"));
  EXPECT_THAT(message, HasSubstr("CUDA graph"));
  EXPECT_EQ(g.workspace_bytes(), 0u);
  // After reserve, a first call on the non-blocking stream sees an initialised workspace.
  g.reserve(Problem::kRows, xent::Options{});
  p.forward(g, s);
  g.check_errors(s);
  EXPECT_NEAR(p.loss_on_gpu(s), p.loss_on_cpu(), 2e-5 * std::fabs(p.loss_on_cpu()));
  ck(cudaStreamDestroy(s), "cudaStreamDestroy");
}

TEST(CudaHost, EarlierUnrelatedErrorIsNeitherReportedNorSwallowed) {
  if (device_count() < 1) GTEST_SKIP() << "no CUDA device visible";
  ck(cudaSetDevice(0), "cudaSetDevice");
  Problem p(0);
  const xent::Group g = xent::Group::local(Backend::cuda, 0);
  void* huge = nullptr;
  // A failed allocation leaves a (non-sticky) error for the caller's next cudaGetLastError.
  ASSERT_EQ(cudaMalloc(&huge, size_t{1} << 62), cudaErrorMemoryAllocation);
  EXPECT_NO_THROW(p.forward(g, nullptr));
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation) << "xent cleared the caller's error";
  g.check_errors(nullptr);
  EXPECT_NEAR(p.loss_on_gpu(nullptr), p.loss_on_cpu(), 2e-5 * std::fabs(p.loss_on_cpu()));
}

TEST(CudaHost, HostBuffersAreRefusedByName) {
  if (device_count() < 1) GTEST_SKIP() << "no CUDA device visible";
  ck(cudaSetDevice(0), "cudaSetDevice");
  const xent::Group g = xent::Group::local(Backend::cuda, 0);
  // The logits path: host logits.
  Problem p(0);
  std::vector<float> host_logits = p.logits;
  EXPECT_THAT(xtest::error_of([&] {
                xent::forward(g, p.view(host_logits.data()), p.target_view(p.d_targets),
                              xent::Options{}, p.outputs());
              }),
              HasSubstr("logits.data is host memory, but the group's backend is cuda"));
  // The fused lm head: 4 rows, hidden 6, 10 columns, every buffer on the device but the one named.
  constexpr int64_t N = 4, H = 6, V = 10;
  std::vector<void*> device;
  const auto on_device = [&](size_t bytes) {
    void* d = nullptr;
    ck(cudaMalloc(&d, bytes), "cudaMalloc");
    ck(cudaMemset(d, 0, bytes), "cudaMemset");
    device.push_back(d);
    return d;
  };
  std::vector<float> host(V * H, 0.0f);
  const xent::MatrixView hidden{on_device(N * H * 4), xent::DType::f32, N, H, H};
  const xent::MatrixView weight{on_device(V * H * 4), xent::DType::f32, V, H, H};
  const xent::TargetsView targets{on_device(N * 8), xent::IndexType::i64, N};
  xent::LinearOutputs out;
  out.loss = static_cast<float*>(on_device(4));
  out.d_hidden = {on_device(N * H * 4), xent::DType::f32, N, H, H};
  out.d_weight = {on_device(V * H * 4), xent::DType::f32, V, H, H};
  const auto linear = [&](xent::MatrixView h, const xent::LinearOutputs& o) {
    xent::linear_forward(g, h, weight, targets, xent::Options{}, xent::LinearOptions{}, o);
  };
  EXPECT_THAT(xtest::error_of([&] {
                linear({host.data(), xent::DType::f32, N, H, H}, out);
              }),
              HasSubstr("hidden.data is host memory, but the group's backend is cuda"));
  xent::LinearOutputs host_dw = out;
  host_dw.d_weight.data = host.data();
  EXPECT_THAT(xtest::error_of([&] { linear(hidden, host_dw); }),
              HasSubstr("out.d_weight.data is host memory"));
  EXPECT_NO_THROW(linear(hidden, out));  // all on the device: it runs
  g.check_errors(nullptr);
  ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (void* d : device) cudaFree(d);
}

}  // namespace
