// The device exchange's paths (Options::device_exchange) on one rank, against the fp64 reference:
// with Group::local's peer memory, and with an NCCL communicator's (a symmetric window, else CUDA
// IPC): its records go through its own peer memory, as every rank's do on several ranks. Several
// ranks: the dist tests (dist_exchange_np2 to np4 run 2 to 4 ranks as processes sharing one GPU,
// which the GPU time-slices; ranks as threads of one process, on streams of one context,
// deadlocked now and then, since CUDA does not promise that kernels of one context run
// concurrently).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <xent/xent.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda_test.h"
#include "harness.h"

namespace {

using xent::DType;
using xtest::gpu::ck;

struct Variant {
  const char* name;
  float softcap, label_smoothing, z_loss;
  xent::Reduction reduction;
  bool accuracy;
  double sigma;
};

const Variant kVariants[] = {
    {"plain-mean", 0.0f, 0.0f, 0.0f, xent::Reduction::mean, false, 2.0},
    {"capped-30-none", 30.0f, 0.0f, 0.0f, xent::Reduction::none, false, 12.0},
    {"general-smoothing-zloss-accuracy", 0.0f, 0.1f, 1e-3f, xent::Reduction::sum, true, 2.0},
};

// The options of a variant, with the device exchange on.
xent::Options exchange_options(const Variant& v) {
  xent::Options opt;
  opt.softcap = v.softcap;
  opt.label_smoothing = v.label_smoothing;
  opt.z_loss = v.z_loss;
  opt.reduction = v.reduction;
  opt.compute_accuracy = v.accuracy;
  opt.device_exchange = true;
  return opt;
}

// One rank's call: its shard of x on the device, forward with the exchange on a stream of its own
// (go), outputs back (finish).
struct RankRun {
  xtest::HostLogits grad;
  xtest::HostTargets tg;
  xtest::GotOutputs out;
  xent::Options opt;
  xent::Group group;
  std::unique_ptr<xtest::gpu::DevBuf> d_x, d_t, d_loss, d_lse, d_arg, d_acc;
  cudaStream_t stream = nullptr;
  std::string path, error;

  RankRun(const xtest::Matrix& x, const std::vector<int64_t>& targets, DType d, xent::Options o,
          int64_t col0, int64_t width, xent::Group g)
      : grad(xtest::make_shard(x, col0, width, d, width + 1)),  // unaligned rows
        tg(targets, xent::IndexType::i64),
        opt(o),
        group(std::move(g)) {
    const int64_t n = x.rows;
    const size_t nloss = opt.reduction == xent::Reduction::none ? static_cast<size_t>(n) : 1;
    using xtest::gpu::DevBuf;
    d_x = std::make_unique<DevBuf>(grad.bytes.size());
    d_t = std::make_unique<DevBuf>(tg.bytes());
    d_loss = std::make_unique<DevBuf>(nloss * 4);
    d_lse = std::make_unique<DevBuf>(n * 4);
    d_arg = std::make_unique<DevBuf>(n * 8);
    d_acc = std::make_unique<DevBuf>(4);
    d_x->up(grad.bytes.data());
    d_t->up(tg.i64.data());
    d_loss->poison();
    d_lse->poison();
    opt.vocab_start = col0;
    opt.vocab_size = x.cols;
    out.loss.resize(nloss);
    out.lse.resize(n);
    if (opt.compute_accuracy) {
      out.argmax.resize(n);
      out.accuracy.resize(1);
    }
    group.reserve(n, opt);
    ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  ~RankRun() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  xent::LogitsView logits() {
    xent::LogitsView lv = grad.view();
    lv.data = d_x->p;
    return lv;
  }
  void go() {
    xent::TargetsView tv = tg.view();
    tv.data = d_t->p;
    xent::Outputs o;
    o.loss = static_cast<float*>(d_loss->p);
    o.lse = static_cast<float*>(d_lse->p);
    if (opt.compute_accuracy) {
      o.argmax = static_cast<int64_t*>(d_arg->p);
      o.accuracy = static_cast<float*>(d_acc->p);
    }
    path = xent::forward_path(group, logits(), opt);
    xent::forward(group, logits(), tv, opt, o, stream);
    ck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  void finish() {
    try {
      group.check_errors(nullptr);
    } catch (const xent::Error& e) {
      error = e.what();
    }
    d_loss->down(out.loss.data());
    d_lse->down(out.lse.data());
    if (opt.compute_accuracy) {
      d_arg->down(out.argmax.data());
      d_acc->down(out.accuracy.data());
    }
    d_x->down(grad.bytes.data());
  }
};

// One rank exchanging with itself through g's peer memory, both paths (the single pass, and the
// statistics kernel then exchange_records), every variant, calls in a row against the fp64
// reference. Returns false where g turned out to have no peer memory (its first reserve could
// not make any).
bool expect_self_exchange(const xent::Group& g) {
  const int64_t rows = 400, cols = 32064;
  for (const bool single : {true, false})
    for (const Variant& v : kVariants) {
      SCOPED_TRACE(std::string(v.name) + (single ? " single-pass" : " two-pass"));
      xent::Options opt = exchange_options(v);
      opt.single_pass = single;
      const xtest::RefOptions ro = xtest::ref_options(opt, cols);
      for (int c = 0; c < 3; ++c) {
        xtest::Matrix x = xtest::random_logits(rows, cols, 31 + c, DType::bf16, v.sigma);
        std::vector<int64_t> targets = xtest::random_targets(rows, cols, 17 + c, 0.1);
        const xtest::RefResult ref = xtest::reference(x, targets, ro);
        RankRun r(x, targets, DType::bf16, opt, 0, cols, g);  // reserve makes the peer memory
        if (!g.comm().has_peer_memory()) return false;
        r.go();
        r.finish();
        const bool takes_single =
            single && (v.softcap <= 0.0f || xtest::gpu::capped_rows_take_single_pass(2, cols));
        EXPECT_EQ(r.path,
                  takes_single ? "single-pass, device exchange" : "two-pass, device exchange");
        EXPECT_EQ(r.error, "");
        xtest::expect_outputs(r.out, ref, targets, ro);
        EXPECT_TRUE(xtest::grad_matches(r.grad, ref, 0, {}, true));
      }
    }
  return true;
}

// One rank: the exchange with itself through Group::local's peer memory (plain device memory).
TEST(DeviceExchange, OneRankSelfExchange) {
  SKIP_WITHOUT_GPU();
  EXPECT_TRUE(expect_self_exchange(xent::Group::local(xent::Backend::cuda, 0)));
}

// The same through an NCCL communicator's peer memory, which Group::reserve makes: a symmetric
// window where NCCL makes one (2.28 and newer, with symmetric memory support), else CUDA IPC.
TEST(DeviceExchange, NcclPeerMemoryOneRank) {
  SKIP_WITHOUT_GPU();
  ncclComm_t comm = nullptr;
  int dev = 0;
  ASSERT_EQ(ncclCommInitAll(&comm, 1, &dev), ncclSuccess);
  const xent::Group g = xent::Group::own(comm, 0);
  EXPECT_TRUE(expect_self_exchange(g)) << "NCCL " << NCCL_VERSION_CODE << " made no peer memory";
}

}  // namespace
