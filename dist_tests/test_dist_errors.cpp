// Multi-rank tests of bad input, run under mpirun with 2, 3 and 4 ranks (dist_main.cpp sets the
// ranks' group up): where the ranks' calls are wrong or disagree, every rank must throw
// xent::Error (none may hang), with a message that names what is wrong, and the group must still
// work afterwards (run_dist, dist_harness.h).
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <xent/mpi.h>
#include <xent/xent.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "dist_harness.h"

namespace xdist {
namespace {

// Every rank calls this: true on every rank iff `mine` holds on all ranks.
bool all_ranks(bool mine) {
  int v = mine ? 1 : 0, all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// Runs f on every rank; every rank must throw xent::Error, none may hang; returns the message.
template <typename F>
std::string every_rank_throws(F&& f) {
  std::string msg;
  bool threw = false;
  try {
    f();
  } catch (const xent::Error& e) {
    threw = true;
    msg = e.what();
  }
  EXPECT_TRUE(threw) << "rank " << env().rank << " did not throw";
  EXPECT_TRUE(all_ranks(threw)) << "not every rank threw";
  return msg;
}

// After a failed call the group still works (no rank is left behind in a collective).
void expect_group_still_works() {
  DistCase c = make_case(4, growing(env().size, 3), 199);
  run_dist(c);
}

struct Small {
  std::vector<int64_t> w;
  DistCase c;
  xent::Shard shard;
  xent::Options opt;
  xtest::HostLogits host;
  std::unique_ptr<Buf> dlog, dtgt, dloss;
  std::vector<int64_t> targets;
  Small() {
    w = growing(env().size, 4);
    c = make_case(6, w, 150);
    targets = c.targets;
    shard = xent::plan_shard(*env().group, w[env().rank]);
    xent::apply(shard, opt);
    opt.device_exchange = env().exchange;
    host = xtest::make_shard(c.x, shard.start, shard.width, DType::f32);
    dlog = std::make_unique<Buf>(host.bytes.size());
    dlog->put(host.bytes.data(), host.bytes.size());
    dloss = std::make_unique<Buf>(64);
  }
  void forward(int64_t rows, const std::vector<int64_t>& t, const xent::Options& o,
               DType dtype = DType::f32) {
    xtest::HostTargets tg(t, IndexType::i64);
    dtgt = std::make_unique<Buf>(tg.bytes());
    dtgt->put(tg.view().data, tg.bytes());
    xent::LogitsView lv = host.view();
    lv.data = dlog->ptr();
    lv.rows = rows;
    lv.dtype = dtype;  // (a narrower dtype reads fewer bytes of the same buffer)
    xent::TargetsView tv = tg.view();
    tv.data = dtgt->ptr();
    tv.rows = rows;
    xent::Outputs out;
    out.loss = dloss->as<float>();
    xent::forward(*env().group, lv, tv, o, out, env().stream);
    if (env().cuda) env().group->check_errors(env().stream);  // device-side bad targets
  }
};

// NCCL needs one GPU per rank: ranks that would share one are refused on every rank with a
// message that says so and names the group for them, rather than NCCL's bare "invalid usage".
// Runs where the ranks share GPU 0 (XENT_TEST_BACKEND=cuda-mpi, dist_exchange_np*).
TEST_F(Dist, NcclGroupOnASharedGpuIsRefused) {
  const char* be = std::getenv("XENT_TEST_BACKEND");
  if (be == nullptr || std::string(be) != "cuda-mpi" || size() < 2)
    GTEST_SKIP() << "needs ranks sharing a GPU (XENT_TEST_BACKEND=cuda-mpi)";
  int before = -1, after = -1;
  ASSERT_EQ(cudaGetDevice(&before), cudaSuccess);
  const std::string msg = every_rank_throws([] { xent::mpi::nccl_group(MPI_COMM_WORLD, 0); });
  EXPECT_THAT(msg, ::testing::HasSubstr("NCCL needs one GPU per rank"));
  EXPECT_THAT(msg, ::testing::HasSubstr("xent::mpi::cuda_group"));
  EXPECT_THAT(msg, ::testing::HasSubstr("(device 0)"));
  // The refusal leaves this rank's device current: on a host of several GPUs, rank 1's buffers
  // are on device 1, and the group's calls below read them (an illegal address from device 0's
  // kernels, as dist_exchange_np2 saw on two GPUs before the device was restored).
  ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
  EXPECT_EQ(after, before);
  expect_group_still_works();
}

TEST_F(Dist, TargetOutOfRangeEveryRankThrows) {
  {
    Small s;
    const int64_t V = s.shard.vocab_size;
    std::vector<int64_t> t = s.targets;
    t[3] = V + 2;
    const std::string msg = every_rank_throws([&] { s.forward(6, t, s.opt); });
    EXPECT_THAT(msg, HasSubstr("targets[3]"));
    EXPECT_THAT(msg, HasSubstr(std::to_string(V + 2)));
  }
  expect_group_still_works();
}

TEST_F(Dist, RowsDisagreeEveryRankThrows) {
  {
    Small s;
    const int64_t rows = rank() == size() - 1 ? 5 : 6;  // the last rank passes one row less
    std::string msg;
    if (env().cuda) {  // the CUDA forward does not check: check_layout is the collective that does
      msg = every_rank_throws([&] { xent::check_layout(g(), s.shard, rows); });
    } else {
      msg = every_rank_throws([&] { s.forward(rows, s.targets, s.opt); });
    }
    EXPECT_THAT(msg, HasSubstr("rows"));
    EXPECT_THAT(msg, HasSubstr("5"));
  }
  expect_group_still_works();
}

TEST_F(Dist, VocabStartNotTilingEveryRankThrows) {
  {
    Small s;
    xent::Shard bad = s.shard;
    xent::Options o = s.opt;
    if (rank() == 1) {  // rank 1 claims to start one column later: a hole in the vocabulary
      bad.start += 1;
      o.vocab_start += 1;
    }
    std::string msg = every_rank_throws([&] { xent::check_layout(g(), bad, 6); });
    EXPECT_THAT(msg, HasSubstr("vocab_start"));
    EXPECT_THAT(msg, HasSubstr(std::to_string(s.w[0] + 1)));
    if (!env().cuda) {
      msg = every_rank_throws([&] { s.forward(6, s.targets, o); });
      EXPECT_THAT(msg, HasSubstr("vocab_start"));
      EXPECT_THAT(msg, HasSubstr(std::to_string(s.w[0] + 1)));
    }
  }
  expect_group_still_works();
}

TEST_F(Dist, PlanShardCannotCoverVocabEveryRankThrows) {
  int64_t total = 0;
  for (auto x : growing(size(), 4)) total += x;
  const std::string msg =
      every_rank_throws([&] { xent::plan_shard(g(), growing(size(), 4)[rank()], total + 1); });
  EXPECT_THAT(msg, HasSubstr("vocab_size"));
  EXPECT_THAT(msg, HasSubstr(std::to_string(total + 1)));
  expect_group_still_works();
}

// The NCCL forward exchanges nothing on the host unless XENT_CHECK_RANKS=1 asks it to.
bool host_checks() {
  const char* e = std::getenv("XENT_CHECK_RANKS");
  return !env().cuda || (e != nullptr && e[0] == '1');
}

TEST_F(Dist, OptionsDisagreeEveryRankThrows) {
  if (!host_checks()) GTEST_SKIP() << "the CUDA forward checks no options (XENT_CHECK_RANKS=1)";
  {
    Small s;
    xent::Options o = s.opt;
    if (rank() == size() - 1) o.label_smoothing = 0.1f;  // one rank smooths, the others do not
    const std::string msg = every_rank_throws([&] { s.forward(6, s.targets, o); });
    EXPECT_THAT(msg, HasSubstr("label_smoothing"));
  }
  expect_group_still_works();
}

// Ranks that pass different targets, or logits of different dtypes, used to get a loss each
// computed from mixed records, silently.
TEST_F(Dist, TargetsDisagreeEveryRankThrows) {
  if (!host_checks()) GTEST_SKIP() << "the CUDA forward checks no targets (XENT_CHECK_RANKS=1)";
  {
    Small s;
    std::vector<int64_t> t = s.targets;
    if (rank() == size() - 1) t[2] = (t[2] + 1) % s.shard.vocab_size;  // still in range
    const std::string msg = every_rank_throws([&] { s.forward(6, t, s.opt); });
    EXPECT_THAT(msg, HasSubstr("targets differ between rank " + std::to_string(size() - 1)));
  }
  expect_group_still_works();
}

TEST_F(Dist, DtypeDisagreeEveryRankThrows) {
  if (!host_checks()) GTEST_SKIP() << "the CUDA forward checks no dtype (XENT_CHECK_RANKS=1)";
  {
    Small s;
    const DType mine = rank() == size() - 1 ? DType::bf16 : DType::f32;
    const std::string msg = every_rank_throws([&] { s.forward(6, s.targets, s.opt, mine); });
    EXPECT_THAT(msg, HasSubstr("logits.dtype = bf16 on rank " + std::to_string(size() - 1)));
    EXPECT_THAT(msg, HasSubstr("f32 on rank 0"));
  }
  expect_group_still_works();
}

}  // namespace
}  // namespace xdist
