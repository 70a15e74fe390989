// The same training, bit for bit, on any number of ranks (README, "The same training on any number
// of ranks"): with the same micro-batch size B and samples per step E, amp_train on R ranks x K
// micro-batches (E = B K R) gives the same metrics (every figure but the time), the same
// param_checksum and the same saved weights for R = 1, 2, 4 (8 for one case). Each run is the
// control of the others: nothing here is compared with a tolerance. The models: the MLP in fp32,
// bf16, and fp16 with dynamic scaling and an injected overflow; the multi-task model with UPGrad; the
// GPT with dropout, AdamW, clipping and the validation loss; over MPI's shared memory, over its TCP
// transport, and on the emulated GPU over NCCL. A checkpoint written on 2 ranks resumes on 1 and on 4
// as the uninterrupted run goes on; another micro-batch size, or a number of ranks that cannot split
// the step, is refused.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "cli_util.h"
#include "invariance_util.h"
#include "test_util.h"

namespace amp {
namespace {

using namespace cli;
using namespace invariance;

const std::string kMlp = "--width 32 --layers 3 --batch-size 4 --steps 6";
const std::string kMlpShort = "--width 32 --layers 3 --batch-size 4";
// Growth every 2 steps from 2^10, and an inf in step 3's gradients: the scale rises, the step is
// skipped and the scale backs off.
const std::string kMlpFp16Overflow = kMlp + " --amp fp16 --init-scale 1024 --growth-interval 2 --inject-nonfinite 3";

int count(const std::vector<std::string>& records, const std::string& what) {
  int n = 0;
  for (const std::string& r : records) n += r.find(what) != std::string::npos;
  return n;
}

TEST(RankInvariance, MlpFp32OnOneTwoFourAndEightRanks) {
  expect_invariant(kMlp + " --log-grad-norm --momentum 0.9", 8, {1, 2, 4, 8});
}

TEST(RankInvariance, MlpBf16) { expect_invariant(kMlp + " --amp bf16 --clip-grad-norm 0.5", 4, {1, 2, 4}); }

TEST(RankInvariance, MlpFp16WithDynamicScalingAndAnInjectedOverflow) {
  const Outcome o = expect_invariant(kMlpFp16Overflow + " --log-grad-norm", 4, {1, 2, 4});
  EXPECT_EQ(count(o.records, "\"skipped\":true"), 1);
  std::set<std::string> scales;
  for (const std::string& r : o.records)
    if (const auto at = r.find("\"scale\":"); at != std::string::npos) scales.insert(r.substr(at, 16));
  EXPECT_GE(scales.size(), 2u);  // the scale changed along the way
}

TEST(RankInvariance, MultiTaskWithUpgrad) {
  const Outcome o = expect_invariant(
      "--model mtl --tasks 3 --aggregator upgrad --amp fp16 --batch-size 4 --steps 5 "
      "--lr 0.05",
      4, {1, 2, 4});
  EXPECT_EQ(count(o.records, "task_losses"), 5);
}

std::string gpt_args() {
  return "--model gpt --data " + test::generated_text_file("rank_invariance", 30000) +
         " --n-layer 2 --n-head 2 --n-embd 16 --block-size 16 --dropout 0.1 --optimizer adamw --lr 3e-3"
         " --clip-grad-norm 0.5 --amp bf16 --batch-size 2 --eval-every 2 --eval-batches 2";
}

TEST(RankInvariance, GptWithDropoutAdamwClippingAndTheValidationLoss) {
  const Outcome o = expect_invariant(gpt_args() + " --steps 4", 4, {1, 2, 4});
  EXPECT_EQ(count(o.records, "val_loss"), 3);  // before training, after step 2 and step 4
}

// The default --threads is the node's cores over its ranks, so 1 rank and 2 ranks of a node run on
// other thread counts; they still train identically, the CPU's results not depending on the thread
// count. Given here (3 threads on 1 rank, 2 on each of 2), so that the test means the same on any
// node; the model is large enough for oneDNN to have split its GEMMs by the threads (2 layers, 128
// wide, 8 x 64 bytes: the runs parted within 10 steps when it did).
TEST(RankInvariance, OneRankAndTwoRanksOnOtherThreadCounts) {
  const std::string args = "--model gpt --data " + test::generated_text_file("rank_threads", 60000) +
                           " --n-layer 2 --n-head 4 --n-embd 128 --block-size 64 --batch-size 8 --optimizer adamw"
                           " --amp bf16 --clip-grad-norm 1 --steps 10 --log-every 0";
  TempDir d;
  std::vector<std::vector<std::string>> records;
  std::vector<std::string> weights;
  for (int ranks : {1, 2}) {
    const std::string tag = std::to_string(ranks);
    const RunResult r = run(args + " --threads " + std::to_string(4 - ranks) + " --micro-batches " +
                                std::to_string(2 / ranks) + " --metrics " + d.file("m" + tag + ".jsonl") +
                                " --save-weights " + d.file("w" + tag + ".safetensors"),
                            launcher(ranks));
    ASSERT_EQ(r.code, 0) << r.out;
    records.push_back(records_of(d.file("m" + tag + ".jsonl")));
    weights.push_back(bytes_of(d.file("w" + tag + ".safetensors")));
  }
  EXPECT_EQ(records[0].size(), 11u);  // 10 steps and the end
  EXPECT_EQ(records[0], records[1]);
  EXPECT_TRUE(weights[0] == weights[1]) << "the weights differ";
}

// Token shards (llm.c's format, 6 shards of 100 tokens): sequences that run from one shard into the
// next, and a stream that wraps around, on 1, 2 and 4 ranks.
TEST(RankInvariance, GptOnTokenShards) {
  const std::string shards = test::generated_token_shards("rank_invariance", 6, 100);
  expect_invariant("--model gpt --data '" + shards + "' --vocab-size 300 --n-layer 1 --n-head 2 --n-embd 16 "
                   "--block-size 16 --batch-size 2 --optimizer adamw --lr 3e-3 --clip-grad-norm 0.5 --amp bf16 "
                   "--steps 6 --eval-every 3 --eval-batches 1 --val-data '" + shards + "'",
                   4, {1, 2, 4});
}

TEST(RankInvariance, OverTcp) {
  // MPI's TCP transport, not the shared-memory sum: each case against the shared-memory run too.
  for (const std::string& args : {kMlpFp16Overflow, gpt_args() + " --steps 2"}) {
    SCOPED_TRACE(args);
    TempDir d;
    const Outcome shm = train(d, args, 2, 4);
    for (int ranks : {1, 2, 4}) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks over TCP");
      const Outcome tcp = train(d, args, ranks, 4, true);
      EXPECT_EQ(shm.records, tcp.records);
      EXPECT_TRUE(shm.weights == tcp.weights) << "the saved weights differ";
    }
  }
}

// Many buckets in flight at once over TCP (one or two a layer here): each ordered sum's all-gather is issued
// by the wait, in bucket order on every rank, not by whichever poll first sees its all-to-all done
// (then ranks issued collectives in different orders and MPI matched the wrong ones: a crash).
TEST(RankInvariance, ManyBucketsInFlightOverTcp) {
  expect_invariant("--width 64 --layers 6 --batch-size 4 --steps 4 --bucket-mb 0.01", 4, {1, 2, 4}, true);
}

// What a rank sends per step over TCP is a ring all-reduce's bytes of the gradients (the metrics'
// comm_bytes, counted from the collectives' sizes): within 5 % of 2 (R - 1)/R x G, where gathering
// every rank's gradients would send (R - 1) x G. G from the model's shape: 3 Linear layers 32 x 32
// with biases, float32.
TEST(RankInvariance, AStepSendsARingAllReducesBytesOverTcp) {
  const double G = 3 * (32 * 32 + 32) * 4;
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    TempDir d;
    const RunResult r = run(kMlp + " --log-every 0 --threads 1 --metrics " + d.file("m.jsonl"), launcher(ranks, true));
    ASSERT_EQ(r.code, 0) << r.out;
    const double ring = 2.0 * (ranks - 1) / ranks * G;
    int steps = 0;
    for (const auto& rec : read_jsonl(d.file("m.jsonl"))) {
      if (!rec.contains("comm_bytes")) continue;
      ++steps;
      const double sent = rec["comm_bytes"].get<double>();
      EXPECT_GE(sent, ring) << rec.dump();
      EXPECT_LE(sent, 1.05 * ring) << rec.dump();
    }
    EXPECT_EQ(steps, 6);
  }
}

// The CUDA backend over NCCL, on the emulated GPU (preset cuda-emu): the same contract for the
// device's kernels and NCCL's transport.
TEST(RankInvariance, EmulatedGpuOverNccl) {
#ifndef AMP_TEST_EMULATED_GPU
  GTEST_SKIP() << "the emulated GPU is built by the cuda-emu preset";
#endif
  for (const std::string& args : {kMlpFp16Overflow, gpt_args() + " --steps 2"}) {
    SCOPED_TRACE(args);
    expect_invariant(args + " --device cuda", 4, {1, 2, 4});
  }
}

// A checkpoint written on 2 ranks resumes on 1 and on 4 ranks (same B and E) and ends where the
// uninterrupted run on 2 ranks ends, bit for bit: metrics, weights.
TEST(RankInvariance, CheckpointOfTwoRanksResumesOnOneAndFourBitwise) {
  const std::string args = gpt_args() + " --amp fp16 --growth-interval 2 --log-every 0 --threads 1";
  TempDir d;
  const RunResult full = run(args + " --steps 6 --micro-batches 2 --metrics " + d.file("full.jsonl") +
                                 " --save-weights " + d.file("full.safetensors"),
                             launcher(2));
  ASSERT_EQ(full.code, 0) << full.out;
  for (int ranks : {1, 4}) {
    SCOPED_TRACE("resumed on " + std::to_string(ranks) + " ranks");
    const std::string ck = d.file("ck" + std::to_string(ranks)),
                      metrics = d.file("res" + std::to_string(ranks) + ".jsonl"),
                      weights = d.file("res" + std::to_string(ranks) + ".safetensors");
    const RunResult first =
        run(args + " --steps 3 --micro-batches 2 --checkpoint-dir " + ck + " --metrics " + metrics, launcher(2));
    ASSERT_EQ(first.code, 0) << first.out;
    const RunResult second =
        run(args + " --steps 6 --micro-batches " + std::to_string(4 / ranks) + " --resume --checkpoint-dir " + ck +
                " --metrics " + metrics + " --save-weights " + weights,
            launcher(ranks));
    ASSERT_EQ(second.code, 0) << second.out;
    EXPECT_NE(second.out.find("on another layout"), std::string::npos) << second.out;
    EXPECT_EQ(steps_and_end(d.file("full.jsonl")), steps_and_end(metrics));
    EXPECT_TRUE(bytes_of(d.file("full.safetensors")) == bytes_of(weights)) << "the weights differ";
  }
}

// What a resume cannot keep bitwise is refused before anything runs, naming the flags and values;
// what a fresh run cannot keep is said at start.
TEST(RankInvariance, ResumeWithAnotherMicroBatchSizeOrASplitThatCannotBeIsRefused) {
  const std::string args = kMlpShort + " --log-every 0 --threads 1";
  TempDir d;
  ASSERT_EQ(run(args + " --steps 2 --micro-batches 2 --checkpoint-dir " + d.file("ck"), launcher(2)).code, 0);
  // B 4 -> 8 with the same E (1 rank x 8 x 2 = 2 ranks x 4 x 2): another micro-batch size.
  const std::string b8 = std::string(args).replace(args.find("--batch-size 4"), 14, "--batch-size 8");
  RunResult r = run(b8 + " --steps 4 --micro-batches 2 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--batch-size 8 does not match the checkpoint's 4"), std::string::npos) << r.out;
  // E = 16 samples = 4 micro-batches of 4: 3 ranks cannot split them; the message says what can.
  r = run(args + " --steps 4 --micro-batches 1 --resume --checkpoint-dir " + d.file("ck"), launcher(3));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("cannot be split over 3 ranks"), std::string::npos) << r.out;
  // The right K for 4 ranks is named.
  r = run(args + " --steps 4 --micro-batches 2 --resume --checkpoint-dir " + d.file("ck"), launcher(4));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("on 4 ranks, --micro-batches 1"), std::string::npos) << r.out;
  // A split whose micro-batches are no whole subtree of the step's tree trains, and says it is its own.
  r = run(args + " --steps 1 --micro-batches 3", launcher(2));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--micro-batches 3 is not a power of two"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace amp
