// Data-parallel training under mpirun (CTest runs this with -np 1, 2 and 4). Each check compares
// against an independent run: one rank with the whole batch, one micro-batch with the whole batch,
// or another bucket size.
#include <gtest/gtest.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mpi.h>
#include <sched.h>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "amp/grad_scaler.h"
#include "comm/local_communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/mpi_session.h"
#include "comm/reducer.h"
#include "comm/replica_check.h"
#include "comm/sum_tree.h"
#include "launch/training/trainer.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "runtime/optim/sgd.h"
#include "test_util.h"

namespace amp {
namespace {

using launch::TrainConfig;

TrainConfig base_config() {
  TrainConfig c;
  c.model_flags = {{"width", "24"}, {"layers", "3"}};
  c.steps = 6;
  c.batch_size = 4;
  c.lr = 0.05f;
  c.log_every = 0;
  c.seed = 5;
  return c;
}

comm::MpiCommunicator& world() {
  static comm::MpiCommunicator w(MPI_COMM_WORLD);
  w.set_timeout(120);
  return w;
}

launch::TrainResult train(const TrainConfig& c, comm::Communicator& comm, nn::Module** model_out = nullptr,
                          std::unique_ptr<launch::Trainer>* keep = nullptr) {
  auto t = std::make_unique<launch::Trainer>(c, comm, kCPU);
  launch::TrainResult r = t->run();
  if (model_out) *model_out = &t->model();
  if (keep) *keep = std::move(t);
  return r;
}

void expect_same_training(const launch::TrainResult& a, nn::Module& ma, const launch::TrainResult& b,
                          nn::Module& mb, double tol) {
  ASSERT_EQ(a.records.size(), b.records.size());
  for (size_t i = 0; i < a.records.size(); ++i) {
    EXPECT_NEAR(a.records[i].loss, b.records[i].loss, tol * std::fabs(b.records[i].loss)) << "step " << i + 1;
    EXPECT_EQ(a.records[i].skipped, b.records[i].skipped) << "step " << i + 1;
    EXPECT_EQ(a.records[i].scale, b.records[i].scale) << "step " << i + 1;
  }
  const auto pa = ma.parameters(), pb = mb.parameters();
  for (size_t k = 0; k < pa.size(); ++k) EXPECT_TRUE(test::all_close(pa[k], pb[k], tol, tol)) << "parameter " << k;
}

// `many` on every rank against the same with one rank and the whole batch; the two runs' results.
struct Pair {
  launch::TrainResult many, one;
  std::unique_ptr<launch::Trainer> tm, to;
};
Pair ranks_against_one_rank(const TrainConfig& many) {
  TrainConfig one = many;
  one.batch_size = many.batch_size * world().size();
  Pair p;
  p.many = train(many, world(), nullptr, &p.tm);
  comm::LocalCommunicator local;
  p.one = train(one, local, nullptr, &p.to);
  return p;
}

// K micro-batches against one micro-batch of K times the batch, both on every rank: the sample
// layout makes them equal.
void expect_micro_batches_equal_one(TrainConfig k, int64_t K) {
  k.micro_batches = K;
  TrainConfig one = k;
  one.micro_batches = 1;
  one.batch_size = k.batch_size * K;
  std::unique_ptr<launch::Trainer> ta, tb;
  nn::Module *ma = nullptr, *mb = nullptr;
  const auto ra = train(k, world(), &ma, &ta);
  const auto rb = train(one, world(), &mb, &tb);
  expect_same_training(ra, *ma, rb, *mb, 2e-5);
}

// The node-local rank a launcher's environment gives before MPI_Init (amp_train selects its GPU from
// it): Open MPI's pair first, MPICH's otherwise, nothing without a launcher, and a value that is not a
// count (or a rank not below the node's size) refused naming the variable.
TEST(NodePlace, ReadFromTheLaunchersEnvironment) {
  const char* names[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                         "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE"};
  std::vector<std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved.push_back(v ? std::optional<std::string>(v) : std::nullopt);
    unsetenv(n);
  }
  auto place = [] { return comm::node_place_from_launcher(); };
  EXPECT_FALSE(place().has_value());  // not launched by MPI
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  EXPECT_FALSE(place().has_value());  // launched, but no node-local pair
  setenv("MPI_LOCALRANKID", "2", 1);
  setenv("MPI_LOCALNRANKS", "3", 1);
  ASSERT_TRUE(place().has_value());
  EXPECT_EQ(place()->local_rank, 2);
  EXPECT_EQ(place()->local_size, 3);
  EXPECT_EQ(place()->source, "MPI_LOCALRANKID");
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  EXPECT_EQ(place()->local_rank, 1);
  EXPECT_EQ(place()->local_size, 2);
  EXPECT_EQ(place()->source, "OMPI_COMM_WORLD_LOCAL_RANK");
  for (const char* bad : {"", "x", "1x", "-1", "+1", " 1", "99999999999999999999"}) {
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", bad, 1);
    try {
      place();
      ADD_FAILURE() << "accepted OMPI_COMM_WORLD_LOCAL_RANK='" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_LOCAL_RANK='" + std::string(bad) + "' is not a count"),
                std::string::npos) << e.what();
    }
  }
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2", 1);
  EXPECT_THROW(place(), std::invalid_argument);  // not below OMPI_COMM_WORLD_LOCAL_SIZE=2
  // Slurm's srun (issue 42): after the MPI launchers' pairs, which win inside an allocation.
  for (const char* n : {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"})
    unsetenv(n);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NODEID", "3", 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2),2,3(x5)", 1);  // nodes 0-1: 4 tasks, node 2: 2, nodes 3-7: 3
  ASSERT_TRUE(place().has_value());
  EXPECT_EQ(place()->local_rank, 1);
  EXPECT_EQ(place()->local_size, 3);
  EXPECT_EQ(place()->source, "SLURM_LOCALID");
  setenv("SLURM_NODEID", "2", 1);
  EXPECT_EQ(place()->local_size, 2);
  setenv("SLURM_NODEID", "0", 1);
  EXPECT_EQ(place()->local_size, 4);
  setenv("SLURM_NODEID", "8", 1);  // beyond the list
  EXPECT_THROW(place(), std::invalid_argument);
  setenv("SLURM_NODEID", "2", 1);
  setenv("SLURM_LOCALID", "2", 1);  // node 2 has 2 tasks
  EXPECT_THROW(place(), std::invalid_argument);
  setenv("SLURM_LOCALID", "0", 1);
  for (const char* bad : {"", "4(x2", "4(2)", "x", "4,,2", "4(x)"}) {
    setenv("SLURM_STEP_TASKS_PER_NODE", bad, 1);
    EXPECT_THROW(place(), std::invalid_argument) << "accepted SLURM_STEP_TASKS_PER_NODE='" << bad << "'";
  }
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);  // mpirun inside an sbatch allocation: its own pair wins
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  EXPECT_EQ(place()->source, "OMPI_COMM_WORLD_LOCAL_RANK");
  for (size_t i = 0; i < saved.size(); ++i) {
    if (saved[i]) setenv(names[i], saved[i]->c_str(), 1);
    else unsetenv(names[i]);
  }
}

// srun's tasks that MPI left a world of one rank each (srun --mpi=none, or a plugin this MPI does
// not speak) are refused: each would train alone, writing the same files. mpirun -np 1 (or
// mpiexec -n 1) inside a step of several tasks asked for that world, and a step of one task is one.
TEST(NodePlace, SrunTasksThatMpiLeftAloneAreNamed) {
  const char* names[] = {"SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
  std::vector<std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved.push_back(v ? std::optional<std::string>(v) : std::nullopt);
    unsetenv(n);
  }
  EXPECT_EQ(comm::srun_tasks_without_world(1), "");  // not srun
  setenv("SLURM_STEP_NUM_TASKS", "1", 1);
  EXPECT_EQ(comm::srun_tasks_without_world(1), "");
  setenv("SLURM_STEP_NUM_TASKS", "4", 1);
  setenv("SLURM_PROCID", "3", 1);
  const std::string alone = comm::srun_tasks_without_world(1);
  EXPECT_NE(alone.find("srun started 4 tasks (SLURM_STEP_NUM_TASKS=4), but MPI made task 3 a world of its own"),
            std::string::npos) << alone;
  EXPECT_NE(alone.find("srun --mpi=pmix"), std::string::npos) << alone;
  EXPECT_EQ(comm::srun_tasks_without_world(4), "");  // srun's tasks in one world
  setenv("PMI_SIZE", "4", 1);  // srun --mpi=pmi2 set it, and this MPI did not read it
  EXPECT_NE(comm::srun_tasks_without_world(1), "");
  setenv("PMI_SIZE", "1", 1);  // mpiexec -n 1
  EXPECT_EQ(comm::srun_tasks_without_world(1), "");
  unsetenv("PMI_SIZE");
  setenv("OMPI_COMM_WORLD_SIZE", "1", 1);  // mpirun -np 1
  EXPECT_EQ(comm::srun_tasks_without_world(1), "");
  for (size_t i = 0; i < saved.size(); ++i) {
    if (saved[i]) setenv(names[i], saved[i]->c_str(), 1);
    else unsetenv(names[i]);
  }
}

// The default threads: the node's CPUs over its ranks, or the CPUs this process may run on where
// fewer (Slurm's --cpus-per-task, taskset): one CPU, one thread, whatever the node has.
TEST(NodePlace, DefaultThreadsFollowTheCpusTheProcessMayRunOn) {
  cpu_set_t all;
  ASSERT_EQ(sched_getaffinity(0, sizeof all, &all), 0);
  const int cpus = CPU_COUNT(&all);
  EXPECT_EQ(comm::default_threads_per_rank(1), std::min<int>(cpus, std::thread::hardware_concurrency()));
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &all)) {
      CPU_SET(c, &one);
      break;
    }
  ASSERT_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  const int bound = comm::default_threads_per_rank(1);
  ASSERT_EQ(sched_setaffinity(0, sizeof all, &all), 0);
  EXPECT_EQ(bound, 1);
}

TEST(Distributed, RanksTimesBatchEqualsOneRankWithTheWholeBatch) {
  if (world().size() < 2) GTEST_SKIP() << "needs at least 2 ranks: with one, both runs are the same run";
  Pair p = ranks_against_one_rank(base_config());
  expect_same_training(p.many, p.tm->model(), p.one, p.to->model(), 2e-5);
}

TEST(Distributed, MicroBatchesTimesBatchEqualsOneMicroBatch) { expect_micro_batches_equal_one(base_config(), 3); }

// --model mtl: the Jacobian is averaged over ranks before the aggregation, so R ranks × batch B
// train like 1 rank × batch R·B, and micro-batches like one; per-task losses and UPGrad's weights
// agree too, for fp32 and fp16 with dynamic scaling.
TrainConfig mtl_config() {
  TrainConfig c = base_config();
  c.model = "mtl";
  c.model_flags = {{"tasks", "3"}};
  c.batch_size = 8;
  c.lr = 0.05;
  return c;
}

void expect_same_tasks(const launch::TrainResult& a, const launch::TrainResult& b, double tol) {
  ASSERT_EQ(a.records.size(), b.records.size());
  for (size_t i = 0; i < a.records.size(); ++i) {
    ASSERT_EQ(a.records[i].task_losses.size(), 3u);
    ASSERT_EQ(a.records[i].weights.size(), 3u);
    for (size_t t = 0; t < 3; ++t) {
      EXPECT_NEAR(a.records[i].task_losses[t], b.records[i].task_losses[t], tol * std::fabs(b.records[i].task_losses[t]));
      EXPECT_NEAR(a.records[i].weights[t], b.records[i].weights[t], tol * (1 + std::fabs(b.records[i].weights[t])));
    }
  }
}

TEST(Distributed, MultiTaskRanksTimesBatchEqualsOneRank) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks: with one, both runs are the same run";
  for (launch::AmpMode amp : {launch::AmpMode::off, launch::AmpMode::fp16}) {
    TrainConfig many = mtl_config();
    many.amp = amp;
    many.init_scale = 1024.0;
    Pair p = ranks_against_one_rank(many);
    const double tol = amp == launch::AmpMode::off ? 2e-5 : 2e-3;
    expect_same_training(p.many, p.tm->model(), p.one, p.to->model(), tol);
    expect_same_tasks(p.many, p.one, tol);
    EXPECT_TRUE(comm::check_replicas(w, p.tm->model().parameters()).consistent);
  }
}

TEST(Distributed, MultiTaskMicroBatchesEqualOneMicroBatch) {
  comm::MpiCommunicator& w = world();
  TrainConfig k = mtl_config();
  k.micro_batches = 2;
  TrainConfig one = k;
  one.micro_batches = 1;
  one.batch_size = k.batch_size * 2;
  std::unique_ptr<launch::Trainer> ta, tb;
  nn::Module *ma = nullptr, *mb = nullptr;
  const auto ra = train(k, w, &ma, &ta);
  const auto rb = train(one, w, &mb, &tb);
  expect_same_training(ra, *ma, rb, *mb, 2e-5);
  expect_same_tasks(ra, rb, 2e-5);
}

// --model gpt on a generated text: R ranks x batch B train like 1 rank x batch R·B, and K
// micro-batches like one, with dropout too (its counters follow the samples, not the ranks).
TrainConfig gpt_config() {
  TrainConfig c = base_config();
  c.model = "gpt";
  c.model_flags = {{"n-layer", "2"}, {"n-head", "2"}, {"n-embd", "16"}, {"block-size", "16"}};
  c.batch_size = 2;
  c.steps = 4;
  c.optimizer = launch::OptimizerKind::adamw;
  c.lr = 3e-3;
  c.data = test::generated_text_file("gpt_distributed_" + std::to_string(world().rank()), 20000);
  return c;
}

TEST(Distributed, GptRanksTimesBatchEqualsOneRank) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks: with one, both runs are the same run";
  for (double dropout : {0.0, 0.2}) {
    TrainConfig many = gpt_config();
    many.model_flags["dropout"] = std::to_string(dropout);
    Pair p = ranks_against_one_rank(many);
    expect_same_training(p.many, p.tm->model(), p.one, p.to->model(), 2e-5);
    EXPECT_TRUE(comm::check_replicas(w, p.tm->model().parameters()).consistent);
  }
}

TEST(Distributed, GptMicroBatchesEqualOneMicroBatch) {
  TrainConfig k = gpt_config();
  k.model_flags["dropout"] = "0.1";
  expect_micro_batches_equal_one(k, 3);
  // A control: dropout does change the training (so the equality is not of runs without it).
  TrainConfig with = k, without = k;
  without.model_flags["dropout"] = "0";
  std::unique_ptr<launch::Trainer> ta, tb;
  const auto ra = train(with, world(), nullptr, &ta), rb = train(without, world(), nullptr, &tb);
  EXPECT_GT(std::fabs(ra.records.back().loss - rb.records.back().loss), 1e-4);
}

TEST(Distributed, InjectedInfOnOneRankMakesEveryRankSkip) {
  comm::MpiCommunicator& w = world();
  TrainConfig c = base_config();
  c.amp = launch::AmpMode::fp16;
  c.init_scale = 1024.0f;
  c.growth_interval = 2;
  c.steps = 8;
  const int64_t s = 3;
  c.inject_nonfinite = {{s, w.size() - 1}};  // only the last rank sees the inf
  std::unique_ptr<launch::Trainer> t;
  nn::Module* m = nullptr;
  const auto r = train(c, w, &m, &t);
  for (const auto& rec : r.records) EXPECT_EQ(rec.skipped, rec.step == s) << "rank " << w.rank() << " step " << rec.step;
  // Scales used by each step's backward: 2 clean steps grow it, the overflow halves it, and the
  // update rule goes on from there (growth_interval 2).
  const std::vector<double> expected = {1024, 1024, 2048, 1024, 1024, 2048, 2048, 4096};
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(r.records[i].scale, expected[i]) << "step " << i + 1;
  // The same on 1 rank with the inf on rank 0: the decision does not depend on the rank count.
  TrainConfig single = c;
  single.batch_size = c.batch_size * w.size();
  single.inject_nonfinite = {{s, 0}};
  comm::LocalCommunicator local;
  std::unique_ptr<launch::Trainer> t1;
  nn::Module* m1 = nullptr;
  const auto r1 = train(single, local, &m1, &t1);
  expect_same_training(r, *m, r1, *m1, 2e-3);
  // Replicas stay bitwise equal.
  const auto rep = comm::check_replicas(w, m->parameters());
  EXPECT_TRUE(rep.consistent);
  EXPECT_TRUE(r.replicas_consistent);
}

// Under autocast the forward reads the optimizer's low-precision copies instead of casting the
// parameters (TrainConfig::low_precision_copies): not one number changes, against the control that
// casts. bf16 SGD with momentum and micro-batches; fp16 with clipping and an injected overflow (a
// skipped step must leave the copies right); the GPT with AdamW, dropout and evaluations.
TEST(Distributed, LowPrecisionCopiesChangeNoNumber) {
  comm::MpiCommunicator& w = world();
  std::vector<TrainConfig> configs;
  TrainConfig c = base_config();
  c.amp = launch::AmpMode::bf16;
  c.momentum = 0.9;
  c.micro_batches = 2;
  configs.push_back(c);
  c = base_config();
  c.amp = launch::AmpMode::fp16;
  c.init_scale = 1024.0;
  c.clip_grad_norm = 1.0;
  c.inject_nonfinite = {{2, 0}};
  configs.push_back(c);
  c = gpt_config();
  c.amp = launch::AmpMode::bf16;
  c.model_flags["dropout"] = "0.1";
  c.eval_every = 2;
  c.eval_batches = 2;
  configs.push_back(c);
  for (size_t k = 0; k < configs.size(); ++k) {
    TrainConfig with = configs[k], without = configs[k];
    without.low_precision_copies = false;
    std::unique_ptr<launch::Trainer> ta, tb;
    const auto ra = train(with, w, nullptr, &ta), rb = train(without, w, nullptr, &tb);
    SCOPED_TRACE("config " + std::to_string(k));
    // The copies were kept, and are the parameters' casts: so the forward read them (Autocast tests).
    ASSERT_EQ(ta->optimizer().low_precision_copies().size(), ta->optimizer().params().size());
    EXPECT_TRUE(tb->optimizer().low_precision_copies().empty());
    for (size_t i = 0; i < ta->optimizer().params().size(); ++i)
      EXPECT_TRUE(test::bitwise_equal(ta->optimizer().low_precision_copies()[i],
                                      cast(ta->optimizer().params()[i].detach(), with.amp == launch::AmpMode::bf16 ? DType::bf16 : DType::f16)))
          << "parameter " << i;
    expect_same_training(ra, ta->model(), rb, tb->model(), 0.0);
    EXPECT_EQ(ra.param_checksum, rb.param_checksum);
    EXPECT_EQ(ra.skipped_steps, k == 1 ? 1 : 0);
  }
}

// Without clipping or a logged norm, nothing reads an unscaled gradient before the step: the scaler
// checks the gradients read-only and the optimizer's pass unscales each as it reads it, not writing
// it back (the trainer reads no gradient after the step). Against the same run made to unscale first
// (a --clip-grad-value too large to clip anything): the same losses, scales, skips and weights, bit
// for bit, with overflows injected and the scale growing; and the gradients left scaled: the
// control's times the last step's scale (a power of 2: exact).
TEST(Distributed, TheOptimizersPassUnscalesAsTheScalersWould) {
  comm::MpiCommunicator& w = world();
  for (bool adam : {false, true}) {
    TrainConfig fused = base_config();
    fused.amp = launch::AmpMode::fp16;
    fused.init_scale = 1024.0;
    fused.growth_interval = 2;
    fused.momentum = 0.9;
    if (adam) fused.optimizer = launch::OptimizerKind::adamw;
    fused.inject_nonfinite = {{3, 0}};
    TrainConfig control = fused;
    control.clip_grad_value = 1e30;
    std::unique_ptr<launch::Trainer> ta, tb;
    const auto ra = train(fused, w, nullptr, &ta), rb = train(control, w, nullptr, &tb);
    SCOPED_TRACE(adam ? "AdamW" : "SGD");
    expect_same_training(ra, ta->model(), rb, tb->model(), 0.0);
    EXPECT_EQ(ra.param_checksum, rb.param_checksum);
    EXPECT_EQ(ra.skipped_steps, 1);
    const double scale = ra.records.back().scale;
    EXPECT_GT(scale, 1024.0);  // grew after the skip
    const std::vector<Tensor> ga = ta->optimizer().grads(), gb = tb->optimizer().grads();
    ASSERT_EQ(ga.size(), gb.size());
    for (size_t k = 0; k < ga.size(); ++k)
      EXPECT_TRUE(test::bitwise_equal(ga[k], mul(gb[k], full({}, scale, DType::f32)))) << "gradient " << k;
  }
}

TEST(Distributed, BucketSizeDoesNotChangeTheResultBitwise) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks: one rank reduces nothing";
  TrainConfig big = base_config();
  TrainConfig small = big;
  small.bucket_mb = 512.0 / (1024 * 1024);  // 512-byte buckets: one per parameter, or nearly
  std::unique_ptr<launch::Trainer> ta, tb;
  nn::Module *ma = nullptr, *mb = nullptr;
  train(big, w, &ma, &ta);
  train(small, w, &mb, &tb);
  EXPECT_EQ(ta->reducer().num_buckets(), 1u);
  EXPECT_GT(tb->reducer().num_buckets(), 3u);
  const auto pa = ma->parameters(), pb = mb->parameters();
  for (size_t k = 0; k < pa.size(); ++k) EXPECT_TRUE(test::bitwise_equal(pa[k], pb[k])) << "parameter " << k;
}

TEST(Distributed, BucketsLaunchDuringBackward) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks: one rank has nothing to reduce";
  TrainConfig c = base_config();
  c.bucket_mb = 512.0 / (1024 * 1024);
  std::unique_ptr<launch::Trainer> t;
  train(c, w, nullptr, &t);
  // Every bucket but those whose gradients arrive last was launched by a hook, before backward ended.
  EXPECT_GE(t->reducer().launched_during_backward(), t->reducer().num_buckets() - 1);
  c.overlap = false;
  std::unique_ptr<launch::Trainer> t2;
  train(c, w, nullptr, &t2);
  EXPECT_EQ(t2->reducer().launched_during_backward(), 0u);
}

// Every gradient's slice of a bucket starts on a 16-byte boundary, whatever the sizes before it, and
// the padding between slices changes no sum: one rank, two micro-batches (so the buckets are used),
// odd sizes; each gradient is the sum of the two micro-batches' (exact here). Fails with slices packed.
TEST(Distributed, GradientSlicesStartOnSixteenByteBoundaries) {
  comm::LocalCommunicator local;
  const std::vector<int64_t> sizes = {3, 5, 1, 7, 6, 2};
  std::vector<Tensor> params;
  for (int64_t n : sizes) {
    Tensor p = zeros({n});
    p.set_requires_grad(true);
    params.push_back(p);
  }
  comm::ReducerOptions o;
  o.micro_batches = 2;
  comm::GradientReducer reducer(params, local, o);
  auto coef = [](size_t i, int64_t j, int k) { return static_cast<double>(k * (static_cast<int64_t>(i) + 1) * (j + 1)); };
  for (int k = 1; k <= 2; ++k) {
    reducer.prepare_for_backward(k == 2);
    Tensor loss = zeros({1});
    for (size_t i = 0; i < params.size(); ++i) {
      std::vector<double> c;
      for (int64_t j = 0; j < sizes[i]; ++j) c.push_back(coef(i, j, k));
      loss = add(loss, sum(mul(params[i], from_vector(c, {sizes[i]}))));
    }
    loss.backward();
  }
  reducer.finish();
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor g = params[i].grad();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(g.data_ptr()) % 16, 0u) << "parameter " << i;
    const std::vector<double> v = g.to_vector();
    for (int64_t j = 0; j < sizes[i]; ++j)
      EXPECT_EQ(v[static_cast<size_t>(j)], coef(i, j, 1) + coef(i, j, 2)) << "parameter " << i << " element " << j;
  }
}

// Forwards to a communicator and counts the collectives the trainer issues.
class CountingCommunicator final : public comm::Communicator {
 public:
  explicit CountingCommunicator(comm::Communicator& inner) : inner_(inner) { set_timeout(inner.timeout()); }
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int local_rank() const override { return inner_.local_rank(); }
  int local_size() const override { return inner_.local_size(); }
  std::string name() const override { return "counting " + inner_.name(); }
  std::unique_ptr<comm::Work> all_reduce_async(Tensor& t, comm::ReduceOp op) override {
    ++all_reduces;
    return inner_.all_reduce_async(t, op);
  }
  std::unique_ptr<comm::Work> ordered_sum_async(Tensor& t) override {  // the gradients' and figures' sums
    ++all_reduces;
    return inner_.ordered_sum_async(t);
  }
  void broadcast(Tensor& t, int root) override { inner_.broadcast(t, root); }
  Tensor all_gather(const Tensor& t) override { return inner_.all_gather(t); }
  void barrier() override { inner_.barrier(); }
  Tensor make_buffer(int64_t numel, DType dtype, Device device) override {
    return inner_.make_buffer(numel, dtype, device);
  }
  int all_reduces = 0;

 private:
  comm::Communicator& inner_;
};

// A step costs the gradient buckets plus one small collective: found_inf and the loss travel
// together (they used to be two, each a round trip, and on NCCL a host poll).
TEST(Distributed, AStepIsTheBucketsPlusOneSmallCollective) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks: one rank runs no collective";
  for (int variant = 0; variant < 3; ++variant) {
    const bool scaled = variant != 1;
    TrainConfig c = base_config();
    c.steps = 3;
    c.check_every = 0;
    if (scaled) c.amp = launch::AmpMode::fp16;
    if (variant == 2) c.clip_grad_norm = 1.0;  // unscale_ before the figures' collective, not the step's check
    CountingCommunicator counting(w);
    std::unique_ptr<launch::Trainer> t;
    train(c, counting, nullptr, &t);
    const int per_step_buckets = static_cast<int>(t->reducer().num_buckets());
    // The end-of-run replica check is an all-gather, not counted here; the end-of-run check that the
    // parameters are finite (every rank's verdict summed) is one more small all-reduce.
    EXPECT_EQ(counting.all_reduces, c.steps * (per_step_buckets + 1) + 1) << "variant " << variant;
  }
}

// The GradScaler of a library user who gives it a communicator agrees on found_inf itself: an
// overflow on one rank skips the step on every rank, in one collective of the scaler's.
TEST(Distributed, AScalerWithACommunicatorAgreesOnFoundInf) {
  comm::MpiCommunicator& w = world();
  CountingCommunicator counting(w);
  Tensor p = zeros({4}).set_requires_grad(true);
  optim::SGD opt({p}, optim::SgdOptions{.lr = 1.0});
  GradScaler scaler(GradScalerOptions{.init_scale = 2.0}, &counting);
  scaler.scale(zeros({}));
  const bool mine = w.rank() == w.size() - 1;  // the last rank overflows
  p.set_grad(from_vector({2.0, mine ? INFINITY : 2.0, 2.0, 2.0}, {4}));
  scaler.step(opt);
  EXPECT_TRUE(scaler.found_inf(opt)) << "rank " << w.rank();
  EXPECT_EQ(p.to_vector(), std::vector<double>(4, 0.0)) << "skipped on every rank";
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0) << "backed off on every rank";
  EXPECT_EQ(counting.all_reduces, w.size() > 1 ? 1 : 0) << "one collective for the step and the update";
}

// The shared-memory all-reduce (large buffers on one node): the average over ranks, equal on every
// rank, independent of how the buffer is split, and equal to MPI's own all-reduce.
TEST(Distributed, SharedMemoryAllReduceMatchesMpi) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  const int64_t n = (int64_t{5} << 20) + 3;  // 20 MiB: more than one 16 MiB slot, an odd tail
  Generator g(100 + static_cast<uint64_t>(w.rank()));
  const Tensor mine = randn({n}, g);
  Tensor whole = mine.clone();
  w.all_reduce(whole, comm::ReduceOp::avg);
  // In two pieces: every element is summed in the same rank order, so the bits are the same.
  const int64_t half = n / 2 + 1;
  std::vector<double> v = mine.to_vector();
  Tensor lo = from_vector(std::vector<double>(v.begin(), v.begin() + half), {half});
  Tensor hi = from_vector(std::vector<double>(v.begin() + half, v.end()), {n - half});
  w.all_reduce(lo, comm::ReduceOp::avg);
  w.all_reduce(hi, comm::ReduceOp::avg);
  std::vector<double> joined = lo.to_vector();
  const std::vector<double> hv = hi.to_vector();
  joined.insert(joined.end(), hv.begin(), hv.end());
  EXPECT_TRUE(test::bitwise_equal(whole, from_vector(joined, {n})));
  // Every rank holds the same bits.
  EXPECT_TRUE(comm::check_replicas(w, {whole}).consistent);
  // Against MPI's own all-reduce (a second communicator with the shared-memory path off).
  setenv("AMP_COMM_SHM", "0", 1);
  comm::MpiCommunicator plain(MPI_COMM_WORLD);
  unsetenv("AMP_COMM_SHM");
  Tensor ref = mine.clone();
  plain.all_reduce(ref, comm::ReduceOp::avg);
  if (w.size() == 2) {
    EXPECT_TRUE(test::bitwise_equal(whole, ref)) << "a + b has one rounding either way";
  }
  EXPECT_TRUE(test::all_close(whole, ref, 1e-6, 1e-6));
  // MAX too.
  Tensor mx = mine.clone(), mref = mine.clone();
  w.all_reduce(mx, comm::ReduceOp::max);
  plain.all_reduce(mref, comm::ReduceOp::max);
  EXPECT_TRUE(test::bitwise_equal(mx, mref));
}

// A communicator over MPI's own transport, the shared-memory sum off (AMP_COMM_SHM=0 while it is made).
std::unique_ptr<comm::MpiCommunicator> over_mpis_transport() {
  setenv("AMP_COMM_SHM", "0", 1);
  auto c = std::make_unique<comm::MpiCommunicator>(MPI_COMM_WORLD);
  unsetenv("AMP_COMM_SHM");
  c->set_timeout(120);
  return c;
}

// The ordered sum over MPI's own transport (no shared memory: several nodes, TCP): a buffer that
// splits into one shard per rank goes as an all-to-all and an all-gather, which sends a ring
// all-reduce's bytes; its bits are the gather's, and both are the tree over ranks that this test
// computes itself from every rank's numbers. The numbers span 2^-24 .. 2^24, so that another order
// of the additions would give other bits (checked from 4 ranks: the left-to-right sum differs).
TEST(Distributed, TheOrderedSumSendsARingsBytesWithTheGathersBits) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  auto owned = over_mpis_transport();
  comm::MpiCommunicator& plain = *owned;
  const int R = w.size();
  for (const int64_t n : {int64_t{R} * 4 * 1000, int64_t{R} * 4 * 1000 + 1}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    Generator g(31 + static_cast<uint64_t>(w.rank()));
    Tensor mine = randn({n}, g);
    for (int64_t j = 0; j < n; ++j) mine.data<float>()[j] *= std::ldexp(1.0f, static_cast<int>((j * 7 + w.rank() * 13) % 49) - 24);
    Tensor ring = mine.clone();
    const uint64_t before = plain.bytes_sent();
    plain.ordered_sum(ring);
    const uint64_t sent = plain.bytes_sent() - before;
    Tensor gathered = mine.clone();
    plain.comm::Communicator::ordered_sum_async(gathered)->wait();
    EXPECT_TRUE(test::bitwise_equal(ring, gathered));
    const Tensor rows = plain.all_gather(mine);  // [R, n]: every rank's numbers
    const float* x = rows.data<float>();
    std::vector<double> tree(static_cast<size_t>(n));
    int64_t other_order_differs = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float t = comm::tree_sum<float>(R, [&](int64_t r) { return x[r * n + j]; });
      float seq = x[j];
      for (int r = 1; r < R; ++r) seq += x[r * n + j];
      other_order_differs += seq != t;
      tree[static_cast<size_t>(j)] = t;
    }
    EXPECT_TRUE(test::bitwise_equal(ring, from_vector(tree, {n})));
    if (R >= 4) {  // with 3 ranks the tree is (a + b) + c, the left-to-right order
      EXPECT_GT(other_order_differs, 0) << "the numbers cannot tell two orders apart";
    }
    const uint64_t B = static_cast<uint64_t>(n) * 4, ring_bytes = 2 * uint64_t(R - 1) * B / uint64_t(R);
    if (n % R == 0) {
      EXPECT_EQ(sent, ring_bytes) << "a ring all-reduce's bytes";
      EXPECT_LE(static_cast<double>(sent), 1.05 * static_cast<double>(ring_bytes));
    } else {
      EXPECT_EQ(sent, uint64_t(R - 1) * B) << "a buffer that does not split is gathered whole";
    }
  }
}

// ZeRO-1's halves of the ordered sum (MPI's all-to-all stage alone, then its in-place all-gather)
// against the base class's (the whole gather-and-sum, then the shards through all_gather()) and the
// whole ordered sum, over MPI's own transport and over the shared-memory sum: this rank's shard is
// the ordered sum's bits, the other shards untouched by the reduce-scatter; the all-gather puts every
// rank's shard in its place; a buffer that does not split is refused, naming the sizes.
TEST(Distributed, TheOrderedSumsHalvesAreItsBits) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  auto owned = over_mpis_transport();
  comm::MpiCommunicator& plain = *owned;
  const int R = w.size();
  const int64_t n = int64_t{R} * 4 * 500, shard = n / R, me = w.rank();
  for (comm::MpiCommunicator* c : {&plain, &w}) {
    SCOPED_TRACE(c == &plain ? "MPI's transport" : "shared memory");
    Generator g(57 + static_cast<uint64_t>(me));
    Tensor mine = randn({n}, g);
    for (int64_t j = 0; j < n; ++j) mine.data<float>()[j] *= std::ldexp(1.0f, static_cast<int>((j * 5 + me * 11) % 41) - 20);
    Tensor whole = mine.clone();
    c->ordered_sum(whole);
    Tensor scattered = mine.clone(), base = mine.clone();
    c->ordered_reduce_scatter_async(scattered)->wait();
    c->comm::Communicator::ordered_reduce_scatter_async(base)->wait();
    EXPECT_TRUE(test::bitwise_equal(scattered.view(me * shard, {shard}), whole.view(me * shard, {shard})));
    EXPECT_TRUE(test::bitwise_equal(base.view(me * shard, {shard}), whole.view(me * shard, {shard})));
    // Each rank's own shard in place, the rest garbage: the all-gather makes every rank's buffer whole.
    Tensor gathered = full({n}, std::nan("")), gathered_base = full({n}, std::nan(""));
    for (Tensor* t : {&gathered, &gathered_base}) {
      Tensor dst = t->view(me * shard, {shard});
      copy_(dst, whole.view(me * shard, {shard}));
    }
    c->all_gather_shards_async(gathered)->wait();
    c->comm::Communicator::all_gather_shards_async(gathered_base)->wait();
    EXPECT_TRUE(test::bitwise_equal(gathered, whole));
    EXPECT_TRUE(test::bitwise_equal(gathered_base, whole));
  }
  Tensor odd = zeros({n + 1});
  try {
    plain.ordered_reduce_scatter_async(odd)->wait();
    ADD_FAILURE() << "a buffer that does not split was reduce-scattered";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("do not split into " + std::to_string(R) + " equal shards"), std::string::npos)
        << e.what();
  }
}

TEST(Distributed, ReplicaCheckNamesTheRankThatDiffers) {
  comm::MpiCommunicator& w = world();
  if (w.size() < 2) GTEST_SKIP() << "needs at least 2 ranks";
  Tensor p = full({4}, 1.0);
  if (w.rank() == 1) p.data<float>()[2] = 2.0f;
  const auto rep = comm::check_replicas(w, {p});
  EXPECT_FALSE(rep.consistent);
  EXPECT_EQ(rep.differing_ranks, std::vector<int>{1});
}

}  // namespace
}  // namespace amp
