// ZeRO-1 (--zero 1, comm/zero_shards.h): each rank steps the optimizer on its shard of the summed
// gradients and the parameters are all-gathered, and the run is the unsharded run's, bit for bit.
// The control of every case is the run with --zero 0 on one rank: the sharded runs on 1, 2, 4 and 8
// ranks, over shared memory, MPI's TCP transport and the emulated GPU's NCCL, give the same
// metrics (the losses, the gradient norm, the scale, the skips), the same param_checksum and the
// same saved weights; their checkpoints are the unsharded run's files byte for byte and resume
// either way; and the optimizer's state on a rank is its share. Nothing is compared with a tolerance.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "cli_util.h"
#include "comm/local_communicator.h"
#include "comm/zero_shards.h"
#include "runtime/optim/adam.h"
#include "invariance_util.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace cli;
using namespace invariance;

// The sharded runs against the unsharded one on one rank.
void expect_sharded_equals_unsharded(const std::string& args, int64_t M, const std::vector<int>& ranks, bool tcp = false) {
  TempDir control_dir;
  const Outcome control = train(control_dir, args + " --zero 0", 1, M);
  ASSERT_GE(control.records.size(), 3u);
  for (int r : ranks) {
    SCOPED_TRACE("--zero 1 on " + std::to_string(r) + " ranks" + (tcp ? " over TCP" : ""));
    TempDir d;
    const Outcome sharded = train(d, args + " --zero 1", r, M, tcp);
    EXPECT_EQ(control.records, sharded.records);
    EXPECT_TRUE(control.weights == sharded.weights) << "the saved weights differ";
  }
}

const std::string kMlp = "--width 32 --layers 3 --batch-size 4 --steps 6 --optimizer adamw --lr 0.01";
// Growth every 2 steps from 2^10, an inf in step 3's gradients (on rank 1 where there is one): the
// scale rises, the step is skipped everywhere and the scale backs off.
const std::string kMlpFp16Overflow =
    kMlp + " --amp fp16 --init-scale 1024 --growth-interval 2 --inject-nonfinite 3 --log-grad-norm";

std::string gpt_args() {
  return "--model gpt --data " + test::generated_text_file("zero", 30000) +
         " --n-layer 2 --n-head 2 --n-embd 16 --block-size 16 --dropout 0.1 --optimizer adamw --lr 3e-3"
         " --weight-decay 0.1 --clip-grad-norm 0.5 --batch-size 2 --eval-every 2 --eval-batches 2";
}

int count(const std::vector<std::string>& records, const std::string& what) {
  int n = 0;
  for (const std::string& r : records) n += r.find(what) != std::string::npos;
  return n;
}

TEST(Zero, MlpFp16WithAnOverflowAndAScaleChangeOnOneTwoFourAndEightRanks) {
  expect_sharded_equals_unsharded(kMlpFp16Overflow, 8, {1, 2, 4, 8});
  TempDir d;
  const Outcome o = train(d, kMlpFp16Overflow + " --zero 1", 4, 8);
  EXPECT_EQ(count(o.records, "\"skipped\":true"), 1);
  EXPECT_GE(count(o.records, "\"scale\":2048.0"), 1);  // grown after steps 1 and 2, backed off by the skip
}

// A step skipped for an inf on rank 1 only has no norm, sharded or not: with --zero 0 rank 0 logged
// the norm of its own, finite, copy of the gradients (--zero 1's all-reduced shards saw the inf).
TEST(Zero, ASkippedStepHasNoNormWhicheverRankOverflowed) {
  for (const char* zero : {"0", "1"}) {
    SCOPED_TRACE(std::string("--zero ") + zero);
    TempDir d;
    const Outcome o = train(d, kMlp + " --amp fp16 --inject-nonfinite 3:1 --log-grad-norm --zero " + zero, 2, 2);
    ASSERT_EQ(count(o.records, "\"skipped\":true"), 1);
    for (const std::string& r : o.records) {
      if (r.find("\"skipped\":true") != std::string::npos) {
        EXPECT_NE(r.find("\"grad_norm\":null"), std::string::npos) << r;
      }
    }
  }
}

TEST(Zero, GptWithWeightDecayGroupsClippingAndTheValidationLoss) {
  expect_sharded_equals_unsharded(gpt_args() + " --amp bf16 --steps 4", 4, {1, 2, 4});
}

// One rank and one micro-batch: the unsharded run keeps no gradient buckets (nothing is summed; the
// reducer passes the gradients through) and its norm reads each gradient at the slot the buckets
// would give it (comm/chunked_norm.h); --zero 1 on one rank reads its buckets. The same norms, clips,
// skips and weights, bit for bit: fp16 with a scale that rounds the unscaled gradients, and the GPT
// clipping; on the CPU and the emulated GPU (its gathering kernel).
TEST(Zero, OneRankWithoutBucketsTakesTheBucketsNorm) {
  std::vector<std::string> devices = {"cpu"};
#ifdef AMP_TEST_EMULATED_GPU
  devices.push_back("cuda");
#endif
  for (const std::string& device : devices) {
    SCOPED_TRACE(device);
    expect_sharded_equals_unsharded(kMlpFp16Overflow + " --clip-grad-norm 0.5 --device " + device, 1, {1});
    expect_sharded_equals_unsharded(gpt_args() + " --amp bf16 --steps 4 --device " + device, 1, {1});
  }
}

TEST(Zero, OverTcp) {
  expect_sharded_equals_unsharded(kMlpFp16Overflow + " --bucket-mb 0.002", 8, {2, 4, 8}, true);  // a bucket a layer
  expect_sharded_equals_unsharded(gpt_args() + " --amp fp16 --steps 3", 4, {2, 4}, true);
}

TEST(Zero, EmulatedGpuOverNccl) {
#ifndef AMP_TEST_EMULATED_GPU
  GTEST_SKIP() << "the emulated GPU is built by the cuda-emu preset";
#endif
  expect_sharded_equals_unsharded(kMlpFp16Overflow + " --device cuda", 8, {1, 2, 4, 8});
  expect_sharded_equals_unsharded(gpt_args() + " --amp bf16 --steps 2 --device cuda", 4, {2, 4});
}

// A checkpoint of a sharded run holds the unsharded run's files, byte for byte (the optimizer's
// state gathered to the writer), and resumes unsharded on 1 rank and sharded on 4, ending where the
// uninterrupted run ends; an unsharded checkpoint resumes sharded.
TEST(Zero, CheckpointsAreTheUnshardedFilesAndResumeEitherWay) {
  const std::string args = gpt_args() + " --amp fp16 --growth-interval 2 --log-every 0 --threads 1";
  TempDir d;
  const RunResult full = run(args + " --steps 6 --micro-batches 2 --zero 0 --metrics " + d.file("full.jsonl") +
                                 " --save-weights " + d.file("full.safetensors"),
                             launcher(2));
  ASSERT_EQ(full.code, 0) << full.out;
  for (int zero : {0, 1}) {
    const RunResult first = run(args + " --steps 3 --micro-batches 2 --zero " + std::to_string(zero) +
                                    " --checkpoint-dir " + d.file("ck" + std::to_string(zero)) + " --metrics " +
                                    d.file("part" + std::to_string(zero) + ".jsonl"),
                                launcher(2));
    ASSERT_EQ(first.code, 0) << first.out;
  }
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "trainer.json"}) {
    SCOPED_TRACE(file);
    const std::string unsharded = bytes_of(d.file("ck0/step-00000003/") + file);
    EXPECT_FALSE(unsharded.empty());
    EXPECT_TRUE(unsharded == bytes_of(d.file("ck1/step-00000003/") + file)) << "the files differ";
  }
  struct Resume {
    int from_zero, ranks, zero;
  };
  for (const Resume c : {Resume{1, 1, 0}, Resume{1, 4, 1}, Resume{0, 4, 1}}) {
    SCOPED_TRACE("the checkpoint of --zero " + std::to_string(c.from_zero) + " resumed on " + std::to_string(c.ranks) +
                 " ranks with --zero " + std::to_string(c.zero));
    const std::string tag = std::to_string(c.from_zero) + std::to_string(c.ranks) + std::to_string(c.zero);
    const std::string ck = d.file("ck" + tag), metrics = d.file("res" + tag + ".jsonl");
    std::filesystem::copy(d.file("ck" + std::to_string(c.from_zero)), ck, std::filesystem::copy_options::recursive);
    std::filesystem::copy_file(d.file("part" + std::to_string(c.from_zero) + ".jsonl"), metrics);
    const RunResult second = run(args + " --steps 6 --micro-batches " + std::to_string(4 / c.ranks) + " --zero " +
                                     std::to_string(c.zero) + " --resume --checkpoint-dir " + ck + " --metrics " +
                                     metrics + " --save-weights " + d.file("w" + tag + ".safetensors"),
                                 launcher(c.ranks));
    ASSERT_EQ(second.code, 0) << second.out;
    EXPECT_EQ(steps_and_end(d.file("full.jsonl")), steps_and_end(metrics));
    EXPECT_TRUE(bytes_of(d.file("full.safetensors")) == bytes_of(d.file("w" + tag + ".safetensors")))
        << "the weights differ";
  }
}

// A checkpoint gathers the optimizer's whole state to its writer, rank 0, in host memory: on its GPU
// the state of a model that fits only because ZeRO-1 shards it would not fit. Two layers of 2048
// (AdamW's state 67 MB): the run that checkpoints after each step holds at most one bucket more
// device memory than the run that does not (the bucket staged for the gather, each under 25 MB).
TEST(Zero, ACheckpointGathersTheStateIntoHostMemory) {
#ifndef AMP_TEST_EMULATED_GPU
  GTEST_SKIP() << "device memory is the emulated GPU's (the cuda-emu preset)";
#endif
  const std::string args = "--device cuda --width 2048 --layers 2 --batch-size 2 --steps 2 --optimizer adamw "
                           "--log-every 0 --threads 1 --zero 1";
  TempDir d;
  auto peak = [&](const std::string& extra, const std::string& metrics) {
    const RunResult r = run(args + extra + " --metrics " + d.file(metrics), launcher(2));
    EXPECT_EQ(r.code, 0) << r.out;
    const auto recs = read_jsonl(d.file(metrics));
    return recs.empty() ? 0.0 : recs.back().value("device_memory_bytes", 0.0);
  };
  const double plain = peak("", "plain.jsonl");
  const double saving = peak(" --checkpoint-dir " + d.file("ck") + " --checkpoint-every 1", "saving.jsonl");
  ASSERT_GT(plain, 0.0);
  EXPECT_LT(saving - plain, 40e6) << "device memory: " << plain << " bytes without checkpoints, " << saving << " with";
  EXPECT_TRUE(std::filesystem::exists(d.file("ck/step-00000002/optimizer.safetensors")));
}

// The optimizer's state on a rank is its share: AdamW's two moments (8 bytes) for each element of
// its pieces, and the pieces about 1/R of the parameters (the shards are whole chunks of 1024
// elements of each bucket, so a rank's share is at most one chunk per bucket above 1/R).
TEST(Zero, EachRankHoldsItsShareOfTheOptimizersState) {
  const std::string args = "--width 256 --layers 3 --batch-size 4 --steps 2 --optimizer adamw --log-every 0 --threads 1";
  const std::regex said("rank 0 steps (\\d+) of the (\\d+) parameter elements, with (\\d+) bytes of optimizer state");
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    const RunResult r = run(args + " --zero 1", launcher(ranks));
    ASSERT_EQ(r.code, 0) << r.out;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, said)) << r.out;
    const long long mine = std::stoll(m[1]), total = std::stoll(m[2]), bytes = std::stoll(m[3]);
    EXPECT_EQ(total, 3 * (256 * 256 + 256));
    EXPECT_EQ(bytes, 8 * mine);
    EXPECT_GE(mine, total / ranks);
    EXPECT_LE(mine, total / ranks + 1024);  // one bucket here
  }
}

// A sharded step sends a ring all-reduce's bytes: the all-to-all of the gradients and the
// all-gather of the parameters, (R - 1)/R x G each (G the buckets' bytes, padded to R chunks of
// 1024 elements), plus the step's few figures and the norm's chunk sums.
TEST(Zero, AShardedStepSendsARingAllReducesBytes) {
  const double G = 3 * (256 * 256 + 256) * 4;
  for (const auto& [ranks, tcp] : {std::pair{2, true}, std::pair{4, true}, std::pair{2, false}, std::pair{4, false}}) {
    // Over TCP, and through one node's shared memory (where the gradients' reduce-scatter summed
    // every shard, an all-reduce: 1.5 times a ring's bytes with the parameters' all-gather).
    SCOPED_TRACE(std::to_string(ranks) + (tcp ? " ranks over TCP" : " ranks through shared memory"));
    TempDir d;
    const RunResult r = run("--width 256 --layers 3 --batch-size 4 --steps 3 --optimizer adamw --log-every 0 "
                            "--threads 1 --zero 1 --metrics " + d.file("m.jsonl"),
                            launcher(ranks, tcp));
    ASSERT_EQ(r.code, 0) << r.out;
    const double ring = 2.0 * (ranks - 1) / ranks * G;
    int steps = 0;
    for (const auto& rec : read_jsonl(d.file("m.jsonl"))) {
      if (!rec.contains("comm_bytes")) continue;
      ++steps;
      EXPECT_GE(rec["comm_bytes"].get<double>(), ring) << rec.dump();
      EXPECT_LE(rec["comm_bytes"].get<double>(), 1.05 * ring) << rec.dump();
    }
    EXPECT_EQ(steps, 3);
  }
}

// A rank that stops answering (AMP_DEBUG_STALL=RANK:STEP[:gather]) ends a sharded job within
// --comm-timeout, naming the collective its peers wait in.
void expect_stall_named(const std::string& stall, const std::string& collective) {
  SCOPED_TRACE("AMP_DEBUG_STALL=" + stall);
  const RunResult r = run("--width 8 --layers 2 --batch-size 4 --log-every 0 --threads 1 --steps 5 --comm-timeout 3 "
                          "--zero 1",
                          "AMP_DEBUG_STALL=" + stall + " " + launcher(2, true));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "mpirun hung until the outer timeout";
  EXPECT_NE(r.out.find(collective + "("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did not complete within 3 s at step 3"), std::string::npos) << r.out;
}

// At the start of step 3: its peers wait in the gradients' reduce-scatter.
TEST(Zero, AStalledRankInTheReduceScatterIsNamed) { expect_stall_named("1:3", "ordered_reduce_scatter/all_to_all"); }

// Just before the parameters' all-gather: its peers wait inside it.
TEST(Zero, AStalledRankInTheParametersAllGatherIsNamed) { expect_stall_named("1:3:gather", "all_gather_shards/all_gather"); }

// ZeroShards as a library user meets it, on one rank. An empty group is refused (it read past the
// group's end). An unsharded state dict loads into the pieces' optimizer as into the unsharded one:
// its groups' hyperparameters taken (the pieces' own were kept), its ids mapped through its groups'
// 'params' lists (ids other than 0..n-1 were skipped: no state loaded), state for an unknown id refused.
TEST(Zero, AnUnshardedStateDictLoadsIntoThePiecesAsIntoTheWhole) {
  comm::LocalCommunicator local;
  Tensor a = ones({3}).set_requires_grad(true), b = ones({5}).set_requires_grad(true);
  const std::vector<Tensor> params{a, b};
  comm::ReducerOptions o;
  o.ordered_sum = true;
  o.shard = true;
  o.passthrough = false;
  EXPECT_THROW(comm::ZeroShards(comm::plan_buckets(params, o, 1), params, {{a, b}, {}}, local), std::invalid_argument);
  comm::ZeroShards zero(comm::plan_buckets(params, o, 1), params, {{a}, {b}}, local);

  Tensor wa = ones({3}).set_requires_grad(true), wb = ones({5}).set_requires_grad(true);
  optim::AdamW whole({{{wa}, {.lr = 0.25}}, {{wb}, {.lr = 0.5}}});
  wa.set_grad(full({3}, 2.0));
  wb.set_grad(full({5}, -3.0));
  whole.step();
  optim::OptimizerStateDict saved = whole.state_dict();
  // Ids as another writer may number them: the unsharded load maps them by the groups' lists.
  saved.param_groups[0]["params"] = {5};
  saved.param_groups[1]["params"] = {9};
  saved.state = {{5, saved.state.at(0)}, {9, saved.state.at(1)}};
  optim::AdamW unsharded({{{ones({3}).set_requires_grad(true)}, {}}, {{ones({5}).set_requires_grad(true)}, {}}});
  unsharded.load_state_dict(saved);

  const auto& pg = zero.piece_groups();
  optim::AdamW pieces({{pg[0], {}}, {pg[1], {}}});
  pieces.load_state_dict(zero.shard_state_dict(saved, pieces));
  EXPECT_EQ(pieces.lr(0), unsharded.lr(0));
  EXPECT_EQ(pieces.lr(1), 0.5);
  const optim::OptimizerStateDict got = pieces.state_dict(), want = unsharded.state_dict();
  ASSERT_EQ(got.state.size(), 2u) << "the state of ids 5 and 9 was loaded";
  for (int64_t k : {0, 1})
    for (const char* name : {"exp_avg", "exp_avg_sq", "step"})
      EXPECT_EQ(got.state.at(k).at(name).to_vector(), want.state.at(k).at(name).to_vector()) << k << " " << name;

  saved.state[7] = saved.state.at(5);
  EXPECT_THROW(zero.shard_state_dict(saved, pieces), std::invalid_argument);
}

TEST(Zero, WhatCannotBeShardedIsRefused) {
  RunResult r = run("--zero 2 --steps 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--zero must be 0"), std::string::npos) << r.out;
  r = run("--model mtl --tasks 2 --aggregator upgrad --steps 1 --zero 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--zero 1: --model mtl trains by Jacobian descent"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace amp
