// Two ranks of the CUDA backend as threads of one process, through a custom communicator,
// against two ranks of the CPU backend on the same shards: the multi-rank merge of finalize, in
// both grad modes (loss and lse within 2e-5 relative, argmax equal, the gradient within
// backend_compare.h's bound). Skips itself when no CUDA device is visible (CI has none).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <xent/xent.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend_compare.h"
#include "cuda_test.h"
#include "inputs.h"  // element stores of each dtype

namespace xtest::gpu::compare {
namespace {

// Ranks as threads of one process: records staged through host memory (device buffers are
// copied after a stream sync). Enough to drive the multi-rank merge of finalize.
class ThreadComm : public xent::Communicator {
 public:
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    int arrived = 0;
    long generation = 0;
    std::vector<std::vector<uint8_t>> slots;
    explicit Shared(int n) : slots(n) {}
  };
  ThreadComm(std::shared_ptr<Shared> s, int rank, int size, Backend b, int device)
      : s_(std::move(s)), rank_(rank), size_(size), backend_(b), device_(device) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return backend_; }
  int device() const override { return device_; }
  void all_gather(const void* send, void* recv, size_t bytes, cudaStream_t stream) override {
    std::vector<uint8_t>& mine = s_->slots[rank_];
    mine.resize(bytes);
    if (backend_ == Backend::cuda) {
      ck(cudaStreamSynchronize(stream), "sync");
      if (bytes) ck(cudaMemcpy(mine.data(), send, bytes, cudaMemcpyDeviceToHost), "D2H");
    } else if (bytes) {
      std::memcpy(mine.data(), send, bytes);
    }
    barrier();
    for (int r = 0; r < size_; ++r) {
      uint8_t* dst = static_cast<uint8_t*>(recv) + r * bytes;
      if (!bytes) continue;
      if (backend_ == Backend::cuda)
        ck(cudaMemcpy(dst, s_->slots[r].data(), bytes, cudaMemcpyHostToDevice), "H2D");
      else
        std::memcpy(dst, s_->slots[r].data(), bytes);
    }
    barrier();
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(s_->m);
    const long gen = s_->generation;
    if (++s_->arrived == size_) {
      s_->arrived = 0;
      ++s_->generation;
      s_->cv.notify_all();
    } else {
      s_->cv.wait(lock, [&] { return s_->generation != gen; });
    }
  }
  std::shared_ptr<Shared> s_;
  int rank_, size_;
  Backend backend_;
  int device_;
};

TEST(CudaBackend, TwoRanksMatchCpu) {
  SKIP_WITHOUT_GPU();
  for (GradMode mode : {GradMode::fused, GradMode::deferred}) {
    const int ranks = 2;
    const int64_t N = 500, W = 3000, V = 2 * W - 10, S = W + 3;
    const DType dt = DType::bf16;
    Case c = base("two-ranks", dt, N, 2 * W);
    const Inputs full = make_inputs(c);  // targets in [0, 2W): clamp into [0, V)
    std::vector<int64_t> t = full.t64;
    for (auto& y : t)
      if (y != c.opt.ignore_index) y %= V;
    xent::Options opt;
    opt.label_smoothing = 0.1f;
    opt.z_loss = 1e-3f;
    opt.compute_accuracy = true;
    opt.vocab_size = V;
    opt.grad_mode = mode;
    struct RankOut {
      float loss = 0, acc = 0;
      std::vector<float> lse;
      std::vector<int64_t> argmax;
      std::vector<uint8_t> grad;
    };
    auto run_ranks = [&](Backend b) {
      auto shared = std::make_shared<ThreadComm::Shared>(ranks);
      std::vector<RankOut> res(ranks);
      std::vector<std::exception_ptr> errs(ranks);
      std::vector<std::thread> th;
      for (int k = 0; k < ranks; ++k)
        th.emplace_back([&, k] {
          try {
            if (b == Backend::cuda) ck(cudaSetDevice(0), "cudaSetDevice");
            xent::Group g = xent::Group::custom(
                std::make_shared<ThreadComm>(shared, k, ranks, b, b == Backend::cuda ? 0 : -1));
            xent::Options o = opt;
            o.vocab_start = k * W;
            std::vector<uint8_t> shard(N * S * 2);
            for (int64_t i = 0; i < N; ++i)
              for (int64_t j = 0; j < S; ++j) {
                const float v =
                    j < W ? load_as_float(dt, &full.logits[(i * c.stride() + k * W + j) * 2])
                          : 99.0f;
                xtest::store_elem(dt, &shard[(i * S + j) * 2], v);
              }
            RankOut& r = res[k];
            r.lse.assign(N, 0);
            r.argmax.assign(N, 0);
            const float go = 0.5f;
            if (b == Backend::cpu) {
              xent::LogitsView lv{shard.data(), dt, N, W, S};
              xent::TargetsView tv{t.data(), IndexType::i64, N};
              xent::Outputs out;
              out.loss = &r.loss;
              out.lse = r.lse.data();
              out.argmax = r.argmax.data();
              out.accuracy = &r.acc;
              xent::forward(g, lv, tv, o, out);
              xent::backward(g, lv, tv, out.lse, &go, o);
              r.grad = shard;
            } else {
              DevBuf d_x(shard.size()), d_t(N * 8), d_loss(4), d_lse(N * 4), d_am(N * 8), d_acc(4),
                  d_go(4);
              d_x.up(shard.data());
              d_t.up(t.data());
              d_go.up(&go);
              xent::LogitsView lv{d_x.p, dt, N, W, S};
              xent::TargetsView tv{d_t.p, IndexType::i64, N};
              xent::Outputs out;
              out.loss = static_cast<float*>(d_loss.p);
              out.lse = static_cast<float*>(d_lse.p);
              out.argmax = static_cast<int64_t*>(d_am.p);
              out.accuracy = static_cast<float*>(d_acc.p);
              xent::forward(g, lv, tv, o, out);
              xent::backward(g, lv, tv, out.lse, static_cast<const float*>(d_go.p), o);
              g.check_errors(nullptr);
              r.grad.resize(shard.size());
              d_x.down(r.grad.data());
              d_loss.down(&r.loss);
              d_acc.down(&r.acc);
              d_lse.down(r.lse.data());
              d_am.down(r.argmax.data());
            }
          } catch (...) {
            errs[k] = std::current_exception();
          }
        });
      for (auto& x : th) x.join();
      for (auto& e : errs)
        if (e) std::rethrow_exception(e);
      return res;
    };
    const auto cpu = run_ranks(Backend::cpu);
    const auto gpu = run_ranks(Backend::cuda);
    for (int k = 0; k < ranks; ++k) {
      SCOPED_TRACE("rank " + std::to_string(k) +
                   (mode == GradMode::fused ? " fused" : " deferred"));
      EXPECT_EQ(std::memcmp(&gpu[k].loss, &gpu[0].loss, 4), 0) << "ranks disagree on the loss";
      EXPECT_NEAR(gpu[k].loss, cpu[k].loss, 2e-5 * std::max(1.0f, std::fabs(cpu[k].loss)));
      EXPECT_NEAR(gpu[k].acc, cpu[k].acc, 1e-6);
      int bad = 0;
      for (int64_t i = 0; i < N; ++i) {
        if (std::fabs(gpu[k].lse[i] - cpu[k].lse[i]) >
            2e-5 * std::max(1.0f, std::fabs(cpu[k].lse[i])))
          ++bad;
        if (gpu[k].argmax[i] != cpu[k].argmax[i]) ++bad;
        double rowmax = 0;
        for (int64_t j = 0; j < W; ++j)
          rowmax =
              std::max(rowmax, std::fabs((double)load_as_float(dt, &cpu[k].grad[(i * S + j) * 2])));
        for (int64_t j = 0; j < S; ++j) {
          const double a = load_as_float(dt, &gpu[k].grad[(i * S + j) * 2]);
          const double b = load_as_float(dt, &cpu[k].grad[(i * S + j) * 2]);
          if (!close(a, b,
                     1e-5 * rowmax + 2e-5 * std::fabs(b) +
                         1.01 * ulp(dt, std::max(std::fabs(a), std::fabs(b)))))
            ++bad;
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

}  // namespace
}  // namespace xtest::gpu::compare
