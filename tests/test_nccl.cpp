// NcclCommunicator under mpirun: the distributed skip decision (all-reduce MAX of found_inf, every
// rank skips and backs off together), stream ordering, averaging, grouped launches, broadcast and
// all-gather, and a stuck collective turned into a CommError. Needs one GPU per rank; otherwise
// every rank skips with the reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nccl.h>

#include "comm/nccl_communicator.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/random.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/kernels/cuda/cuda_context.h"
#include "runtime/kernels/cuda/cuda_graph.h"

namespace amp {
namespace {

constexpr Device kGPU{DeviceType::cuda, 0};

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Local rank and size from a shared-memory split, as the launcher computes them.
std::pair<int, int> local_rank_and_size() {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank(), MPI_INFO_NULL, &node);
  int r = 0, s = 1;
  MPI_Comm_rank(node, &r);
  MPI_Comm_size(node, &s);
  MPI_Comm_free(&node);
  return {r, s};
}

// Every rank takes the same decision: skip unless all ranks have their own GPU.
class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    int ok = cuda_usable(&reason) ? 1 : 0;
    if (!ok) (void)cudaGetLastError();
    const auto [local_rank, local_size] = local_rank_and_size();
    int devices = 0;
    if (ok && cudaGetDeviceCount(&devices) == cudaSuccess && devices < local_size) {
      ok = 0;
      reason = std::to_string(local_size) + " ranks on this node but " + std::to_string(devices) +
               " GPUs (NCCL needs one GPU per rank)";
    }
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_ok) GTEST_SKIP() << "NCCL tests need a GPU per rank: " << (reason.empty() ? "another rank has none" : reason);
    local_rank_ = local_rank;
    if (!comm_) comm_ = std::make_unique<comm::NcclCommunicator>(MPI_COMM_WORLD, local_rank_);
  }
  static void TearDownTestSuite() { comm_.reset(); }

  int local_rank_ = 0;
  static std::unique_ptr<comm::NcclCommunicator> comm_;
};
std::unique_ptr<comm::NcclCommunicator> NcclTest::comm_;

// The tensors every rank must hold identically, gathered and compared element-wise.
void expect_same_on_every_rank(comm::Communicator& c, const Tensor& t, const std::string& what) {
  const std::vector<double> all = c.all_gather(t).to_vector();
  const size_t n = static_cast<size_t>(t.numel());
  for (int r = 1; r < c.size(); ++r)
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(all[static_cast<size_t>(r) * n + i], all[i]) << what << ": rank " << r << " differs at " << i;
}

TEST_F(NcclTest, EveryRankSkipsWhenOneRankOverflows) {
  Backend& gpu = backend_for(kGPU);
  const int rank = comm_->rank(), last = comm_->size() - 1;
  std::vector<Tensor> params = {full({1000}, 1.0, DType::f32, kGPU), full({77}, -2.0, DType::f32, kGPU)};
  std::vector<Tensor> bufs = {zeros({1000}, DType::f32, kGPU), zeros({77}, DType::f32, kGPU)};
  Tensor step = zeros({1}, DType::f32, kGPU);
  Tensor scaler = full({}, 65536.0, DType::f32, kGPU);
  Tensor tracker = from_vector({0.0, 1.0}, {2}, DType::i64, kGPU);
  const ScaleUpdateHyper h{2.0, 0.5, 2000, 1, 0.0f, std::numeric_limits<float>::infinity()};
  const SgdHyper sgd{0.1, 0.9, 0.0, 0.0, false, false};

  for (int iteration = 0; iteration < 2; ++iteration) {
    const bool inject = iteration == 0;
    const double scale = scaler.item();
    // Scaled gradients, averaged over ranks.
    std::vector<Tensor> grads = {full({1000}, scale * 0.5, DType::f32, kGPU), full({77}, scale, DType::f32, kGPU)};
    for (Tensor& g : grads) comm_->all_reduce_async(g, comm::ReduceOp::avg)->wait();
    // A local overflow on the last rank only: just that rank's found_inf is set before the MAX.
    if (inject && rank == last) memory_for(kGPU).fill(grads[1], std::numeric_limits<double>::infinity());

    Tensor found_inf = zeros({1}, DType::f32, kGPU);
    gpu.unscale_and_check(grads, scaler, found_inf);  // reads the scale on the device
    EXPECT_EQ(found_inf.item(), inject && rank == last ? 1.0 : 0.0) << "rank " << rank << " before the all-reduce";
    comm_->all_reduce(found_inf, comm::ReduceOp::max);
    EXPECT_EQ(found_inf.item(), inject ? 1.0 : 0.0) << "rank " << rank;

    gpu.sgd_step(params, grads, bufs, step, sgd, found_inf, Tensor(), {});
    gpu.update_scale(scaler, tracker, found_inf, h);
    if (inject) {
      EXPECT_EQ(params[0].to_vector()[0], 1.0) << "parameters moved on a skipped step";
      EXPECT_EQ(step.item(), 0.0) << "the step count moved on a skipped step";
      EXPECT_EQ(scaler.item(), 32768.0) << "the scale did not back off";
    } else {
      EXPECT_FLOAT_EQ(static_cast<float>(params[0].to_vector()[0]), 1.0f - 0.1f * 0.5f);
      EXPECT_EQ(step.item(), 1.0);
      EXPECT_EQ(tracker.to_vector()[0], 1.0) << "the growth tracker did not count the good step";
    }
    expect_same_on_every_rank(*comm_, params[0], "parameters");
    expect_same_on_every_rank(*comm_, params[1], "parameters");
    expect_same_on_every_rank(*comm_, scaler, "scaler state");
  }
}

// A captured data-parallel step (a kernel, two all-reduces through the communicator, a kernel)
// replays on every rank as its eager runs do. The captured collectives' events are graph nodes that
// cannot be queried: the watchdog must not take them for a fault, nor Work::test() query them, and
// the communicator works on afterwards. (Two collectives: on the emulated GPU, a replay's finished
// collective must let the next one run, as an eager one does.)
TEST_F(NcclTest, ACapturedAllReduceReplaysAsItsEagerRuns) {
  Backend& gpu = backend_for(kGPU);
  const auto step = [&](Tensor& t) {
    gpu.unary(UnaryOp::mul_scalar, t, t, 0.75);
    auto first = comm_->all_reduce_async(t, comm::ReduceOp::sum);
    (void)first->test();  // the reducer asks while capturing too: must not query a captured event
    first->wait();
    comm_->all_reduce_async(t, comm::ReduceOp::max)->wait();
    gpu.unary(UnaryOp::mul_scalar, t, t, 0.5);
  };
  const double first = comm_->rank() + 1;
  Tensor eager = full({1000}, first, DType::f32, kGPU), graphed = full({1000}, first, DType::f32, kGPU);
  const int replays = 4;
  for (int i = 0; i < 1 + replays; ++i) step(eager);
  step(graphed);  // the warm-up (NCCL connects on its first collective)
  {
    cuda::CudaGraph graph([&] { step(graphed); });
    for (int i = 0; i < replays; ++i) {
      graph.replay();
      comm_->watch_graph_launch("replay " + std::to_string(i));
    }
    memory_for(kGPU).synchronize();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a few of the watchdog's polls
  EXPECT_EQ(graphed.to_vector(), eager.to_vector());
  Tensor after = full({4}, 1.0, DType::f32, kGPU);
  EXPECT_NO_THROW(comm_->all_reduce(after, comm::ReduceOp::sum));
  EXPECT_EQ(after.to_vector()[0], comm_->size());
}

// The watchdog polls the events of the collectives in flight every 100 ms from its own thread. A
// global-mode capture on the main thread (the trainer's step, whose eager predecessor's collectives
// may still run) forbids other threads' event queries, and one would invalidate it
// (pytorch/pytorch#104487): the watchdog's thread runs in the relaxed mode. Here rank 0 captures
// for 400 ms while its all-reduce waits for rank 1, which joins 800 ms late.
TEST_F(NcclTest, TheWatchdogsPollsDoNotBreakACaptureOnTheMainThread) {
  if (comm_->size() < 2) GTEST_SKIP() << "an all-reduce kept in flight needs a late peer: 2 ranks or more";
  {
    comm::NcclCommunicator c(MPI_COMM_WORLD, local_rank_);  // of its own: a failure here aborts it
    c.set_timeout(5.0);
    Tensor t = ones({16}, DType::f32, kGPU);
    c.all_reduce(t, comm::ReduceOp::sum);  // connected
    if (c.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(800));
    try {
      auto work = c.all_reduce_async(t, comm::ReduceOp::sum);
      if (c.rank() == 0) {
        Tensor x = ones({8}, DType::f32, kGPU);
        EXPECT_NO_THROW({
          cuda::CudaGraph graph([&] {
            backend_for(kGPU).unary(UnaryOp::mul_scalar, x, x, 2.0);
            std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the watchdog polls meanwhile
          });
          graph.replay();
        });
        EXPECT_EQ(x.to_vector()[7], 2.0);
      }
      work->wait();
      c.raise_if_failed();
      const int n = c.size();
      EXPECT_EQ(t.to_vector()[0], static_cast<double>(n) * n);
    } catch (const comm::CommError& e) {
      ADD_FAILURE() << "rank " << c.rank() << ": " << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_F(NcclTest, AllReduceIsOrderedAgainstTheComputeStream) {
  Backend& gpu = backend_for(kGPU);
  const int n = comm_->size();
  // Written by a kernel just before the call and read by one just after wait(): without the
  // events in both directions these race with the collective.
  for (int round = 0; round < 5; ++round) {
    Tensor t = empty({8 << 20}, DType::f32, kGPU);
    memory_for(kGPU).fill(t, comm_->rank() + 1 + round);
    auto work = comm_->all_reduce_async(t, comm::ReduceOp::avg);
    work->wait();
    gpu.unary(UnaryOp::mul_scalar, t, t, 2.0);
    const double mean = (n + 1) / 2.0 + round;
    const std::vector<double> v = t.to_vector();
    EXPECT_EQ(v.front(), 2 * mean);
    EXPECT_EQ(v.back(), 2 * mean);
  }
}

// The collectives' stream has the device's highest priority (a bucket's all-reduce goes ahead of the
// backward's next kernels); the compute stream keeps the default.
TEST_F(NcclTest, CollectivesRunOnAHighPriorityStream) {
  int least = 0, greatest = 0, comm_priority = 1, compute_priority = 1;
  ASSERT_EQ(cudaDeviceGetStreamPriorityRange(&least, &greatest), cudaSuccess);
  ASSERT_EQ(cudaStreamGetPriority(comm_->comm_stream(), &comm_priority), cudaSuccess);
  ASSERT_EQ(cudaStreamGetPriority(cuda::context().stream(), &compute_priority), cudaSuccess);
  EXPECT_EQ(comm_priority, greatest);
  EXPECT_EQ(compute_priority, 0);
  EXPECT_LT(greatest, least) << "a device with one stream priority";
}

TEST_F(NcclTest, GroupedAllReduceBroadcastAndAllGather) {
  const int rank = comm_->rank(), n = comm_->size();
  std::vector<Tensor> bucket = {full({1000}, rank, DType::f32, kGPU), full({3}, 1.0, DType::bf16, kGPU),
                                full({70000}, 2.0 * rank, DType::f16, kGPU)};
  comm_->all_reduce_coalesced_async(bucket, comm::ReduceOp::sum)->wait();
  const double ranks_sum = n * (n - 1) / 2.0;
  EXPECT_EQ(bucket[0].to_vector()[999], ranks_sum);
  EXPECT_EQ(bucket[1].to_vector()[0], n);
  EXPECT_EQ(bucket[2].to_vector()[0], 2 * ranks_sum);

  Tensor b = full({5}, rank == n - 1 ? 42.0 : -1.0, DType::f32, kGPU);
  comm_->broadcast(b, n - 1);
  EXPECT_EQ(b.to_vector()[4], 42.0);

  const Tensor gathered = comm_->all_gather(full({2}, rank * 10.0, DType::f32, kGPU));
  ASSERT_EQ(gathered.shape(), (Shape{n, 2}));
  const std::vector<double> g = gathered.to_vector();
  for (int r = 0; r < n; ++r) EXPECT_EQ(g[static_cast<size_t>(2 * r + 1)], r * 10.0);
  comm_->barrier();
}

// The ordered sum of a buffer that splits into one shard per rank is an all-to-all, a sum on the
// compute stream and an all-gather in place: a ring all-reduce's bytes, the gather's bits (the base
// class's gather and tree sum is the control), larger than one of the emulator's chunks.
TEST_F(NcclTest, TheOrderedSumSendsARingsBytesWithTheGathersBits) {
  const int R = comm_->size();
  for (const int64_t n : {int64_t{R} * 4 * 300000, int64_t{R} * 4 * 3 + 1}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    Generator g(11 + static_cast<uint64_t>(comm_->rank()));
    std::vector<double> v = randn({n}, g).to_vector();
    for (size_t j = 0; j < v.size(); ++j) v[j] = std::ldexp(v[j], static_cast<int>((j * 5 + comm_->rank() * 3) % 41) - 20);
    Tensor ring = from_vector(v, {n}).to(kGPU), gathered = ring.clone();
    const uint64_t before = comm_->bytes_sent();
    comm_->ordered_sum(ring);
    const uint64_t sent = comm_->bytes_sent() - before;
    comm_->comm::Communicator::ordered_sum_async(gathered)->wait();
    const std::vector<double> a = ring.to_vector(), b = gathered.to_vector();
    int64_t differ = 0;
    for (size_t j = 0; j < a.size(); ++j) differ += a[j] != b[j];
    EXPECT_EQ(differ, 0);
    double sum0 = 0;  // and it is a sum: element 0 against the ranks' own numbers
    const std::vector<double> all = comm_->all_gather(from_vector({v[0]}, {1}).to(kGPU)).to_vector();
    for (double x : all) sum0 += x;
    EXPECT_NEAR(a[0], sum0, 1e-6 * std::fabs(sum0));
    const uint64_t B = static_cast<uint64_t>(n) * 4;
    EXPECT_EQ(sent, n % R == 0 ? 2 * uint64_t(R - 1) * B / uint64_t(R) : uint64_t(R - 1) * B);
  }
}

TEST_F(NcclTest, AStuckCollectiveBecomesACommErrorNamingRankOpAndContext) {
  // A communicator of its own: this test aborts it.
  // Alone, rank 0's all-reduce completes: nothing to wait for (gpu_check.sh's one-rank stage leaves
  // this test out; CTest runs the suite on 2 ranks).
  if (comm_->size() < 2) GTEST_SKIP() << "a stuck collective needs a peer that never joins: 2 ranks or more";
  comm::NcclCommunicator c(MPI_COMM_WORLD, local_rank_);
  c.set_timeout(2.0);
  c.set_context("step 7");
  if (c.rank() == 0) {
    Tensor t = ones({16}, DType::f32, kGPU);
    std::string message;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    // The call itself may be what times out: since NCCL 2.22 a fresh communicator connects on its
    // first collective, and that waits for the peers that never come. Either way it is a CommError,
    // and this rank still reaches the barrier below (else its peers wait there for ever).
    try {
      auto work = c.all_reduce_async(t, comm::ReduceOp::sum);  // the peers never join
      while (std::chrono::steady_clock::now() < deadline) {
        work->test();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    } catch (const comm::CommError& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
    EXPECT_NE(message.find("all_reduce"), std::string::npos) << message;
    EXPECT_NE(message.find("step 7"), std::string::npos) << message;
    EXPECT_THROW(c.barrier(), comm::CommError);  // the communicator stays failed
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

#if defined(AMP_CUDA_EMU)
// A replayed graph whose collective a peer never joins is bounded like an eager collective: the
// watchdog watches the launch (watch_graph_launch), aborts after the timeout, and the next call
// throws a CommError naming the rank and the launch. (The emulated GPU only: the aborted graph's
// collective then ends at once, so the stream stays usable for the tests after this one.)
TEST_F(NcclTest, AReplayThatAPeerNeverJoinsBecomesACommError) {
  if (comm_->size() < 2) GTEST_SKIP() << "a peer that never joins needs 2 ranks or more";
  {
    comm::NcclCommunicator c(MPI_COMM_WORLD, local_rank_);  // of its own: this test aborts it
    c.set_timeout(2.0);
    Tensor t = ones({16}, DType::f32, kGPU);
    c.all_reduce(t, comm::ReduceOp::sum);  // every rank connected
    if (c.rank() == 0) {
      cuda::CudaGraph graph([&] { c.all_reduce_async(t, comm::ReduceOp::sum)->wait(); });
      graph.replay();  // the other ranks never replay theirs
      c.watch_graph_launch("step 9 (a CUDA graph's replay)");
      std::string message;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      try {
        while (std::chrono::steady_clock::now() < deadline) {
          c.raise_if_failed();
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      } catch (const comm::CommError& e) {
        message = e.what();
      }
      if (message.empty()) {  // nothing bounds the replay: this process would wait for it for ever
        ADD_FAILURE() << "no CommError 30 s after a replay that a peer never joins (the launch is not watched)";
        std::fflush(stdout);
        std::_Exit(1);
      }
      EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
      EXPECT_NE(message.find("step 9 (a CUDA graph's replay)"), std::string::npos) << message;
      memory_for(kGPU).synchronize();  // the aborted collective has ended: the replay is done
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A call that fails between ncclGroupStart and ncclGroupEnd must not leave the group open: NCCL
// would defer every later call of this thread for ever. Only the emulated NCCL can make a call
// fail on demand, and tell the group depth.
TEST_F(NcclTest, AFailedCallInsideAGroupStillEndsTheGroup) {
  {
    comm::NcclCommunicator c(MPI_COMM_WORLD, local_rank_);  // of its own: the failure aborts it
    c.set_timeout(20.0);
    Tensor warm = ones({4}, DType::f32, kGPU);
    c.all_reduce(warm, comm::ReduceOp::sum);  // every rank connected
    std::vector<Tensor> bucket = {ones({8}, DType::f32, kGPU), ones({8}, DType::f32, kGPU)};
    emu::nccl_fail_next_call_for_testing(ncclInvalidArgument);  // on every rank: nobody waits for a peer
    EXPECT_THROW(c.all_reduce_coalesced_async(bucket, comm::ReduceOp::sum), comm::CommError);
    EXPECT_EQ(emu::nccl_group_depth(), 0) << "the failed call left its NCCL group open";
  }
  // This thread's next collective runs at once instead of being deferred to a group end that never comes.
  Tensor t = full({3}, comm_->rank() + 1.0, DType::f32, kGPU);
  comm_->all_reduce(t, comm::ReduceOp::sum);
  const int n = comm_->size();
  EXPECT_EQ(t.to_vector()[2], n * (n + 1) / 2.0);
}
#endif

}  // namespace
}  // namespace amp
