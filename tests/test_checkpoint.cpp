// Checkpoints and --resume, as users run amp_train --model gpt: a run of 2S steps and a run of S
// steps resumed for S more end with bitwise identical weights and metrics (1 and 2 ranks; fp32, and
// fp16 whose dynamic scale changes along the way, with dropout and a cosine schedule); another rank
// count with the same micro-batch size and effective batch resumes and says so; partial, corrupt and mismatched
// checkpoints are refused naming the file; an older one is used only when asked; an interrupted
// run checkpoints the step it stopped after; the last K are kept.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <fstream>
#include <string>

#include "cli_util.h"
#include "runtime/core/fnv1a.h"
#include "test_util.h"

namespace amp {
namespace {

namespace fs = std::filesystem;
using namespace cli;

std::string gpt_args(const std::string& amp) {
  // Growth every 2 steps from 2^16: the fp16 scale rises and overflows back within the run.
  return "--model gpt --data " + test::generated_text_file("checkpoint", 30000) +
         " --n-layer 2 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --optimizer adamw --lr 3e-3"
         " --lr-schedule cosine --warmup-steps 2 --decay-steps 12 --dropout 0.1 --log-every 0 --threads 1 --amp " +
         amp + (amp == "fp16" ? " --growth-interval 2" : "");
}

// The step records without their timing and device counters: everything that must be identical.
std::vector<std::string> steps_of(const std::string& metrics) {
  std::vector<std::string> out;
  for (auto r : read_jsonl(metrics)) {
    if (r.contains("event")) continue;
    r.erase("step_ms");
    // On a GPU the resumed run's first steps are eager where the uninterrupted run replays a CUDA
    // graph, and its first step fills the allocator's cache afresh: how the work was issued differs.
    for (const char* k : {"device_launches", "device_host_syncs", "device_d2h_copies", "device_graph_launches",
                          "device_graph_ops", "device_allocations"})
      r.erase(k);
    out.push_back(r.dump());
  }
  return out;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST(Checkpoint, ResumedRunIsBitwiseTheUninterruptedOne) {
  for (const std::string& launcher : {std::string(""), std::string(kMpirun)}) {
    for (const std::string& amp : {std::string("off"), std::string("fp16")}) {
      SCOPED_TRACE(launcher + " amp " + amp);
      TempDir d;
      const std::string args = gpt_args(amp);
      const RunResult full = run(args + " --steps 12 --metrics " + d.file("full.jsonl") + " --save-weights " +
                                     d.file("full.safetensors"), launcher);
      ASSERT_EQ(full.code, 0) << full.out;
      const RunResult first = run(args + " --steps 6 --checkpoint-dir " + d.file("ck") + " --metrics " + d.file("res.jsonl"),
                                  launcher);
      ASSERT_EQ(first.code, 0) << first.out;
      EXPECT_NE(first.out.find("checkpoint of step 6 written"), std::string::npos) << first.out;
      const RunResult second = run(args + " --steps 12 --resume --checkpoint-dir " + d.file("ck") + " --metrics " +
                                       d.file("res.jsonl") + " --save-weights " + d.file("res.safetensors"),
                                   launcher);
      ASSERT_EQ(second.code, 0) << second.out;
      EXPECT_NE(second.out.find("resuming from"), std::string::npos) << second.out;
      EXPECT_TRUE(bytes_of(d.file("full.safetensors")) == bytes_of(d.file("res.safetensors"))) << "weights differ";
      const auto a = steps_of(d.file("full.jsonl")), b = steps_of(d.file("res.jsonl"));
      ASSERT_EQ(a.size(), 12u);
      EXPECT_EQ(a, b);
      if (amp == "fp16") {  // the scale did change along the way (else this case would test nothing more)
        std::set<double> scales;
        for (const auto& r : read_jsonl(d.file("full.jsonl")))
          if (r.contains("scale")) scales.insert(r["scale"].get<double>());
        EXPECT_GE(scales.size(), 2u);
      }
    }
  }
}

// On token shards (llm.c's format) a run resumes bitwise where its data crosses from shard to shard
// (5 shards of 150 tokens; a step reads 4 x 17 tokens), with the position in trainer.json; a resume on
// another list of shards is refused, naming both lists.
TEST(Checkpoint, ATokenRunResumesAcrossShardsAndRefusesOtherShards) {
  const std::string shards = test::generated_token_shards("checkpoint", 5, 150);
  const std::string args = "--model gpt --data '" + shards + "' --vocab-size 300 --n-layer 1 --n-head 2 --n-embd 16 "
                           "--block-size 16 --batch-size 4 --optimizer adamw --lr 3e-3 --log-every 0 --threads 1";
  TempDir d;
  ASSERT_EQ(run(args + " --steps 12 --metrics " + d.file("full.jsonl") + " --save-weights " + d.file("full.safetensors")).code, 0);
  const RunResult first = run(args + " --steps 6 --checkpoint-dir " + d.file("ck") + " --metrics " + d.file("res.jsonl"));
  ASSERT_EQ(first.code, 0) << first.out;
  // The vocabulary of 300 is trained padded to 384 rows (a multiple of 128): the files hold the 300,
  // the weights' and the optimizer's state's alike (its moments as PyTorch's AdamW has them).
  const std::string ck6 = d.file("ck/step-00000006");
  EXPECT_EQ(safetensors::find(safetensors::load(ck6 + "/model.safetensors"), "transformer.wte.weight", "model").shape(),
            (Shape{300, 16}));
  int with_vocab_rows = 0;
  for (const auto& [name, t] : safetensors::load(ck6 + "/optimizer.safetensors")) {
    EXPECT_FALSE(t.dim() > 0 && t.size(0) == 384) << name << " holds the padding";
    with_vocab_rows += t.dim() == 2 && t.size(0) == 300;
  }
  EXPECT_EQ(with_vocab_rows, 2) << "wte's exp_avg and exp_avg_sq";
  fs::copy(d.file("ck"), d.file("ck_zero"), fs::copy_options::recursive);
  // ZeRO-1 resumes the same checkpoint (its pieces of the padded state) to the same weights.
  const RunResult zero = run(args + " --steps 12 --resume --zero 1 --checkpoint-dir " + d.file("ck_zero") +
                             " --save-weights " + d.file("zero.safetensors"));
  ASSERT_EQ(zero.code, 0) << zero.out;
  EXPECT_TRUE(bytes_of(d.file("full.safetensors")) == bytes_of(d.file("zero.safetensors"))) << "weights differ";
  const RunResult second = run(args + " --steps 12 --resume --checkpoint-dir " + d.file("ck") + " --metrics " +
                               d.file("res.jsonl") + " --save-weights " + d.file("res.safetensors"));
  ASSERT_EQ(second.code, 0) << second.out;
  EXPECT_TRUE(bytes_of(d.file("full.safetensors")) == bytes_of(d.file("res.safetensors"))) << "weights differ";
  EXPECT_EQ(steps_of(d.file("full.jsonl")), steps_of(d.file("res.jsonl")));
  // The resumed run's records follow one that says where it resumed from (a stopped run's records
  // past its checkpoint would otherwise read as the same steps twice, unmarked).
  const auto res = read_jsonl(d.file("res.jsonl"));
  const auto at = std::find_if(res.begin(), res.end(), [](const auto& r) { return r.value("event", "") == "resume"; });
  ASSERT_NE(at, res.end()) << "no resume record";
  EXPECT_EQ((*at)["step"], 6);
  EXPECT_EQ((*at)["checkpoint"], ck6);
  ASSERT_NE(at + 1, res.end());
  EXPECT_EQ((*(at + 1))["step"], 7);
  // The same tokens in four shards: another list, refused with both named.
  const std::string other = test::generated_token_shards("checkpoint_other", 4, 150);
  std::string changed = args;
  changed.replace(changed.find(shards), shards.size(), other);
  const RunResult bad = run(changed + " --steps 12 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("data_shards"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("train_003.bin (150 tokens)\"] does not match the checkpoint's"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("train_004.bin (150 tokens)"), std::string::npos) << bad.out;
}

// A resume reads the data its checkpoint trained on: the same shards moved elsewhere resume; shards
// made again under the same names and sizes (one token changed in the second) are refused naming the
// shard, and so is a text file changed in place to the same size.
TEST(Checkpoint, AResumeOnOtherBytesUnderTheSameNamesAndSizesIsRefused) {
  const std::string shards = test::generated_token_shards("checkpoint_bytes", 3, 150);
  const std::string args = "--model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 4 "
                           "--log-every 0 --threads 1";
  const std::string tokens = args + " --vocab-size 300 --data ";
  TempDir d;
  ASSERT_EQ(run(tokens + "'" + shards + "' --steps 2 --checkpoint-dir " + d.file("ck")).code, 0);
  fs::create_directories(d.file("copy"));
  for (const auto& e : fs::directory_iterator(fs::path(shards).parent_path()))
    fs::copy_file(e.path(), fs::path(d.file("copy")) / e.path().filename());
  const std::string copy = "'" + d.file("copy") + "/train_*.bin'";
  fs::copy(d.file("ck"), d.file("ck_moved"), fs::copy_options::recursive);
  const RunResult moved = run(tokens + copy + " --steps 3 --resume --checkpoint-dir " + d.file("ck_moved"));
  EXPECT_EQ(moved.code, 0) << moved.out;
  auto change_byte = [](const std::string& path, std::streamoff at) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.seekg(at);
    f.read(&c, 1);
    c = static_cast<char>(c ^ 1);  // a token below 256 stays below the vocabulary
    f.seekp(at);
    f.write(&c, 1);
    ASSERT_TRUE(f.good()) << path;
  };
  change_byte(d.file("copy") + "/train_001.bin", 1024 + 2 * 100);  // token 100, after llm.c's header
  const RunResult bad = run(tokens + copy + " --steps 3 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("shard 2 of 3, train_001.bin (150 tokens), holds other tokens than the checkpoint"),
            std::string::npos)
      << bad.out;
  // Text: one checksum of the file.
  const std::string text = d.file("a.txt");
  fs::copy_file(test::generated_text_file("checkpoint_bytes", 4000), text);
  ASSERT_EQ(run(args + " --data " + text + " --steps 2 --checkpoint-dir " + d.file("ck_text")).code, 0);
  change_byte(text, 3999);  // the validation split's last byte: every byte counts
  const RunResult bad_text = run(args + " --data " + text + " --steps 3 --resume --checkpoint-dir " + d.file("ck_text"));
  EXPECT_EQ(bad_text.code, 2) << bad_text.out;
  EXPECT_NE(bad_text.out.find("--data " + text + ": its bytes are not those of the file the checkpoint"),
            std::string::npos)
      << bad_text.out;
  // A safetensors file (the MLP's x and y): one checksum of its values, and its samples (a resume on
  // another file trained on, silently: the checkpoint recorded 0 samples and no checksum).
  const std::string mlp = " --width 8 --layers 2 --batch-size 4 --threads 1 --log-every 0 --data ";
  const auto write_xy = [](const std::string& path, int64_t n, double y0) {
    std::vector<double> x(static_cast<size_t>(n * 8)), y(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.1 * static_cast<double>(i)), y[i] = i ? 0.5 * x[i] : y0;
    safetensors::save(path, {{"x", from_vector(x, {n, 8})}, {"y", from_vector(y, {n, 8})}});
  };
  write_xy(d.file("xy.safetensors"), 32, 0.0);
  ASSERT_EQ(run(mlp + d.file("xy.safetensors") + " --steps 2 --checkpoint-dir " + d.file("ck_xy")).code, 0);
  write_xy(d.file("xy.safetensors"), 32, 1.0);  // one target changed
  const RunResult bad_xy = run(mlp + d.file("xy.safetensors") + " --steps 3 --resume --checkpoint-dir " + d.file("ck_xy"));
  EXPECT_EQ(bad_xy.code, 2) << bad_xy.out;
  EXPECT_NE(bad_xy.out.find("its bytes are not those of the file the checkpoint"), std::string::npos) << bad_xy.out;
  write_xy(d.file("xy.safetensors"), 16, 0.0);  // half the samples
  const RunResult fewer = run(mlp + d.file("xy.safetensors") + " --steps 3 --resume --checkpoint-dir " + d.file("ck_xy"));
  EXPECT_EQ(fewer.code, 2) << fewer.out;
  EXPECT_NE(fewer.out.find("data_samples 16 does not match the checkpoint's 32"), std::string::npos) << fewer.out;
  // A checkpoint written before these were recorded (0 samples, no checksum) still resumes.
  const std::string meta_path = d.file("ck_xy/step-00000002/trainer.json");
  nlohmann::json meta = nlohmann::json::parse(std::ifstream(meta_path));
  meta["must_match"]["data_samples"] = 0;
  meta["data_checksums"] = nullptr;
  meta.erase("checksum");
  const std::string compact = meta.dump();
  meta["checksum"] = hex64(fnv1a(compact.data(), compact.size()));  // trainer.json's own, as written
  std::ofstream(meta_path) << meta.dump(2);
  const RunResult old = run(mlp + d.file("xy.safetensors") + " --steps 3 --resume --checkpoint-dir " + d.file("ck_xy"));
  EXPECT_EQ(old.code, 0) << old.out;
}

// Every model resumes bitwise, and an aggregator that draws (Random) continues its stream.
TEST(Checkpoint, MlpAndMultiTaskWithARandomAggregatorResumeBitwise) {
  for (const std::string& args : {std::string("--width 16 --amp fp16 --log-every 0 --threads 1"),
                                  std::string("--model mtl --aggregator random --amp fp16 --log-every 0 --threads 1")}) {
    SCOPED_TRACE(args);
    TempDir d;
    ASSERT_EQ(run(args + " --steps 10 --save-weights " + d.file("full.safetensors")).code, 0);
    ASSERT_EQ(run(args + " --steps 5 --checkpoint-dir " + d.file("ck")).code, 0);
    const RunResult r = run(args + " --steps 10 --resume --checkpoint-dir " + d.file("ck") + " --save-weights " +
                            d.file("res.safetensors"));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(bytes_of(d.file("full.safetensors")) == bytes_of(d.file("res.safetensors"))) << "weights differ";
  }
}

TEST(Checkpoint, AnotherRankCountWithTheSameEffectiveBatchResumesAndSaysSo) {
  TempDir d;
  const std::string args = gpt_args("off");
  ASSERT_EQ(run(args + " --steps 4 --checkpoint-dir " + d.file("ck"), kMpirun).code, 0);
  // 2 ranks x batch 2 -> 1 rank x batch 2 x 2 micro-batches (bitwise the same training:
  // test_rank_invariance).
  const RunResult ok = run(args + " --micro-batches 2 --steps 8 --resume --checkpoint-dir " + d.file("ck"));
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("on another layout: 1 ranks x batch 2 x 2 micro-batches"), std::string::npos) << ok.out;
  // A different effective batch would read other samples: refused, naming the checkpoint's file.
  const RunResult bad = run(args + " --micro-batches 3 --steps 12 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("effective_batch"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("trainer.json"), std::string::npos) << bad.out;
  // So would another micro-batch size with the same samples per step: refused, naming both.
  std::string four = args;
  four.replace(four.find("--batch-size 2"), 14, "--batch-size 4");
  const RunResult b4 = run(four + " --steps 12 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(b4.code, 2) << b4.out;
  EXPECT_NE(b4.out.find("--batch-size 4 does not match the checkpoint's 2"), std::string::npos) << b4.out;
}

// The CPU's GEMMs and sums give the same bits on any thread count (runtime/kernels/cpu/cpu_tiled_gemm.h),
// so a run stopped on 3 threads and resumed on 2 is bitwise the run on 1. (oneDNN split its GEMMs by
// the thread count, and these runs parted in the last bits: the model is large enough for that, 2
// layers 128 wide on 8 x 64 bytes.) The default --threads is the node's cores over its ranks, which
// another rank count changes.
TEST(Checkpoint, AResumeOnAnotherThreadCountIsBitwise) {
  TempDir d;
  const std::string args = "--model gpt --data " + test::generated_text_file("threads", 60000) +
                           " --n-layer 2 --n-head 4 --n-embd 128 --block-size 64 --batch-size 8 --optimizer adamw "
                           "--amp bf16 --log-every 0 --device cpu";
  const RunResult full = run(args + " --threads 1 --steps 12 --metrics " + d.file("full.jsonl") + " --save-weights " +
                             d.file("full.safetensors"));
  ASSERT_EQ(full.code, 0) << full.out;
  const RunResult first = run(args + " --threads 3 --steps 6 --checkpoint-dir " + d.file("ck") + " --metrics " +
                              d.file("res.jsonl"));
  ASSERT_EQ(first.code, 0) << first.out;
  const RunResult second = run(args + " --threads 2 --steps 12 --resume --checkpoint-dir " + d.file("ck") + " --metrics " +
                               d.file("res.jsonl") + " --save-weights " + d.file("res.safetensors"));
  ASSERT_EQ(second.code, 0) << second.out;
  EXPECT_TRUE(bytes_of(d.file("full.safetensors")) == bytes_of(d.file("res.safetensors"))) << "weights differ";
  const auto a = steps_of(d.file("full.jsonl")), b = steps_of(d.file("res.jsonl"));
  ASSERT_EQ(a.size(), 12u);
  EXPECT_EQ(a, b);
}

TEST(Checkpoint, DamagedOrMismatchedCheckpointsAreRefusedByName) {
  TempDir d;
  const std::string args = gpt_args("off") + " --checkpoint-dir " + d.file("ck");
  ASSERT_EQ(run(args + " --steps 6 --checkpoint-every 3").code, 0);
  const std::string older = d.file("ck/step-00000003"), newest = d.file("ck/step-00000006");
  ASSERT_TRUE(fs::exists(older) && fs::exists(newest));

  // A model shape that differs.
  std::string deeper = args;
  deeper.replace(deeper.find("--n-layer 2"), 11, "--n-layer 3");
  RunResult r = run(deeper + " --steps 9 --resume");
  EXPECT_EQ(r.code, 2) << r.out;
  // By its flag, not as the model's whole JSON object (which it was).
  EXPECT_NE(r.out.find("model does not match the checkpoint's: --n-layer 3 (the checkpoint's: 2)"), std::string::npos) << r.out;
  // Another kind of model: that alone (not each model's fields, as if the other had them at "the default").
  const std::string mlp_dir = d.file("ck_mlp");
  ASSERT_EQ(run("--steps 2 --log-every 0 --device cpu --threads 1 --checkpoint-dir " + mlp_dir).code, 0);
  r = run("--model mtl --steps 4 --log-every 0 --device cpu --threads 1 --resume --checkpoint-dir " + mlp_dir);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("model does not match the checkpoint's: --model mtl (the checkpoint's: mlp)\n"), std::string::npos)
      << r.out;
  // Another GELU (--gelu tanh is another model; the erf run's checkpoint says nothing of it).
  r = run(args + " --gelu tanh --steps 9 --resume");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--gelu tanh (the checkpoint's: the default)"), std::string::npos) << r.out;

  // A truncated model file: refused by name, and the older complete one is offered, not taken.
  const std::string model = newest + "/model.safetensors";
  const std::string whole = bytes_of(model);
  std::ofstream(model, std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() / 2);
  r = run(args + " --steps 9 --resume");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(model), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--resume-from " + older), std::string::npos) << r.out;
  // Resuming from the older one while the newer (damaged) one is still in --checkpoint-dir would
  // interleave this run's checkpoints with it: refused, naming it.
  r = run(args + " --steps 9 --resume-from " + older);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("holds " + newest), std::string::npos) << r.out;
  // A damaged byte of the same size.
  std::string flipped = whole;
  flipped[flipped.size() - 3] ^= 0x40;
  std::ofstream(model, std::ios::binary | std::ios::trunc) << flipped;
  r = run(args + " --steps 9 --resume");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("checksum"), std::string::npos) << r.out;
  // No trainer.json: a checkpoint that never completed.
  fs::remove(newest + "/trainer.json");
  r = run(args + " --steps 9 --resume");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(newest + "/trainer.json"), std::string::npos) << r.out;
  // The older one, when the user asks for it (and has moved the newer one away).
  fs::rename(newest, d.file("newest-moved"));
  r = run(args + " --steps 9 --resume-from " + older);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resuming from " + older), std::string::npos) << r.out;
  // A trainer.json whose step was changed by hand: its own checksum refuses it (test_failure_modes.cpp
  // checks each field behind the checksum).
  const std::string meta = older + "/trainer.json";
  std::string text = bytes_of(meta);
  const std::string step3 = "\"step\": 3";
  ASSERT_NE(text.find(step3), std::string::npos) << text.substr(0, 200);
  text.replace(text.find(step3), step3.size(), "\"step\": -3");
  std::ofstream(meta, std::ios::binary | std::ios::trunc) << text;
  r = run(args + " --steps 9 --resume-from " + older);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(meta + ": checksum mismatch"), std::string::npos) << r.out;
}

// Which of --checkpoint-dir's checkpoints are newer than the one resumed from goes by their steps,
// not their names: a copy of step 3 named otherwise must not slip past step 6 (keeping the last one,
// each of its checkpoints would be deleted as older than step 6, and step 6 replaced), and the
// checkpoint itself spelt with a trailing slash, as a shell completes it, is not newer than itself.
TEST(Checkpoint, NewerCheckpointsAreFoundByTheirSteps) {
  TempDir d;
  const std::string args = gpt_args("off") + " --checkpoint-dir " + d.file("ck");
  ASSERT_EQ(run(args + " --steps 6 --checkpoint-every 3").code, 0);
  const std::string newest = d.file("ck/step-00000006");
  fs::create_directories(d.file("saved"));
  fs::copy(d.file("ck/step-00000003"), d.file("saved/zz"));
  RunResult r = run(args + " --steps 9 --keep-checkpoints 1 --resume-from " + d.file("saved/zz"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("holds " + newest + ", newer than"), std::string::npos) << r.out;
  // The directory of checkpoints given as one: which to take is said (it was "trainer.json: missing
  // (the checkpoint never completed)"); and a path that is not there is said so.
  r = run(args + " --steps 9 --resume-from " + d.file("ck"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(d.file("ck") + ": holds checkpoints (step-0000000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("give --resume --checkpoint-dir " + d.file("ck")), std::string::npos) << r.out;
  r = run(args + " --steps 9 --resume-from " + d.file("ck/step-00000007"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("step-00000007: no such checkpoint (it does not exist)"), std::string::npos) << r.out;
  r = run(args + " --steps 9 --resume-from " + newest + "/");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(d.file("ck/step-00000009"))) << r.out;
}

TEST(Checkpoint, KeepsTheLastKAndRemovesStaleTemporaries) {
  TempDir d;
  const pid_t child = gone_pid();
  const std::string stale = d.file("ck/.tmp-step-00000002." + std::to_string(child));
  fs::create_directories(stale);
  std::ofstream(stale + "/model.safetensors") << "partial";
  const RunResult r = run(gpt_args("off") + " --steps 8 --checkpoint-every 2 --keep-checkpoints 2 --checkpoint-dir " +
                          d.file("ck"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_NE(r.out.find("removed '" + stale + "'"), std::string::npos) << r.out;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(d.file("ck"))) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step-00000006", "step-00000008"}));
}

// A writer killed with nobody yet to reap it (timeout -s KILL kills itself with it; a container's
// PID 1 may reap late) is a zombie, which answers kill(pid, 0): its temporary is stale all the same
// (it was kept until the zombie was reaped, a run later).
TEST(Checkpoint, AZombieWritersTemporaryIsStale) {
  TempDir d;
  const pid_t zombie = ::fork();
  if (zombie == 0) ::_exit(0);
  while (true) {  // until it has exited (waitid with WNOWAIT leaves it a zombie)
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(zombie), &info, WEXITED | WNOWAIT) == 0) break;
  }
  const std::string stale = d.file("ck/.tmp-step-00000002." + std::to_string(zombie));
  fs::create_directories(stale);
  const RunResult r = run(gpt_args("off") + " --steps 1 --checkpoint-dir " + d.file("ck"));
  ::waitpid(zombie, nullptr, 0);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(fs::exists(stale)) << r.out;
}

TEST(Checkpoint, InterruptedRunCheckpointsWhereItStoppedAndResumes) {
  TempDir d;
  const std::string args = gpt_args("off") + " --checkpoint-dir ck --metrics m.jsonl";
  const std::string out = shell("$AMP " + args + " --steps 100000 & p=$!; "
                                "while [ $(wc -l < m.jsonl 2>/dev/null || echo 0) -lt 3 ]; do sleep 0.1; done; "
                                "kill -TERM $p; wait $p; echo exit=$?", d);
  EXPECT_NE(out.find("exit=143"), std::string::npos) << out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  ASSERT_FALSE(recs.empty());
  const int64_t steps = recs.back()["steps"];
  char name[32];
  std::snprintf(name, sizeof name, "ck/step-%08lld", static_cast<long long>(steps));
  ASSERT_TRUE(fs::exists(d.file(name) + "/trainer.json")) << out;
  const std::string resumed = shell("$AMP " + args + " --steps " + std::to_string(steps + 2) + " --resume; echo exit=$?", d);
  EXPECT_NE(resumed.find("exit=0"), std::string::npos) << resumed;
  EXPECT_NE(resumed.find("(step " + std::to_string(steps) + ")"), std::string::npos) << resumed;
}

// The data must be the same size, not at the same path: a moved corpus resumes, a different one does not.
TEST(Checkpoint, DataIsMatchedBySizeNotPath) {
  TempDir d;
  const std::string args = gpt_args("off");
  const std::string file = test::generated_text_file("checkpoint", 30000);
  ASSERT_EQ(run(args + " --steps 2 --checkpoint-dir " + d.file("ck")).code, 0);
  std::filesystem::copy_file(file, d.file("moved.txt"));
  std::string moved = args;
  moved.replace(moved.find(file), file.size(), d.file("moved.txt"));
  const RunResult ok = run(moved + " --steps 4 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(ok.code, 0) << ok.out;
  std::string other = args;
  other.replace(other.find(file), file.size(), test::generated_text_file("checkpoint_other", 20000));
  const RunResult bad = run(other + " --steps 6 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("data_samples"), std::string::npos) << bad.out;
}

// The checkpoint gives the optimizer's state; this run's flags give its hyperparameters: a resumed
// run with another --lr trains at that lr (and says the schedule differs).
TEST(Checkpoint, ResumedRunTakesItsOwnLearningRate) {
  TempDir d;
  std::string args = gpt_args("off") + " --checkpoint-dir " + d.file("ck") + " --metrics " + d.file("m.jsonl");
  const std::string cosine = " --lr-schedule cosine --warmup-steps 2 --decay-steps 12";
  args.replace(args.find(cosine), cosine.size(), "");
  ASSERT_EQ(run(args + " --steps 3").code, 0);
  std::string other = args;
  other.replace(other.find("--lr 3e-3"), 9, "--lr 1e-3");
  const RunResult r = run(other + " --steps 5 --resume");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("schedule differs"), std::string::npos) << r.out;
  std::vector<double> lrs;
  for (const auto& rec : read_jsonl(d.file("m.jsonl")))
    if (!rec.contains("event")) lrs.push_back(rec.at("lr").get<double>());
  EXPECT_EQ(lrs, (std::vector<double>{3e-3, 3e-3, 3e-3, 1e-3, 1e-3}));
}

// A checkpoint kept elsewhere and linked into --checkpoint-dir is resumed through the link, and
// pruning removes the link, never the files of what it names; an entry with a checkpoint's name that
// is not a directory is refused before any step (exit 2), not replaced by the checkpoint of its step.
TEST(Checkpoint, PruningRemovesALinkNotWhatItNamesAndAFileWithACheckpointsNameIsRefused) {
  TempDir d;
  ASSERT_EQ(run(gpt_args("off") + " --steps 4 --checkpoint-every 2 --checkpoint-dir " + d.file("ck")).code, 0);
  fs::create_directories(d.file("kept"));
  fs::rename(d.file("ck/step-00000002"), d.file("kept/step-00000002"));
  fs::create_directory_symlink(d.file("kept/step-00000002"), d.file("ck/step-00000002"));
  fs::remove_all(d.file("ck/step-00000004"));
  std::ofstream(d.file("ck/step-5")) << "notes";  // no name a checkpoint is written under: left alone
  const RunResult r = run(gpt_args("off") + " --steps 6 --checkpoint-every 2 --keep-checkpoints 1 --resume " +
                          "--checkpoint-dir " + d.file("ck"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step-00000002"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(fs::symlink_status(d.file("ck/step-00000002")))) << "the link was kept";
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer.json"})
    EXPECT_TRUE(fs::exists(d.file("kept/step-00000002/") + f)) << f << " of the linked checkpoint was deleted";
  EXPECT_EQ(bytes_of(d.file("ck/step-5")), "notes");
  std::ofstream(d.file("ck/step-00000008")) << "mine";
  const RunResult f = run(gpt_args("off") + " --steps 10 --checkpoint-every 2 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(f.code, 2) << f.out;
  EXPECT_NE(f.out.find("step-00000008 has a checkpoint's name but is not a directory"), std::string::npos) << f.out;
  EXPECT_EQ(f.out.find("step 7"), std::string::npos) << "trained before refusing:\n" << f.out;
  EXPECT_EQ(bytes_of(d.file("ck/step-00000008")), "mine");
}

TEST(Checkpoint, FlagsAreChecked) {
  EXPECT_EQ(run(gpt_args("off") + " --steps 2 --resume").code, 2);             // no --checkpoint-dir
  EXPECT_EQ(run(gpt_args("off") + " --steps 2 --checkpoint-every 1").code, 2);  // likewise
  TempDir d;
  // A directory that cannot be made is found before the first step, not at the first checkpoint.
  std::ofstream(d.file("a-file")) << "x";
  for (const std::string& bad : {d.file("a-file"), d.file("a-file") + "/sub"}) {
    const RunResult r = run(gpt_args("off") + " --steps 2 --checkpoint-dir " + bad);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("--checkpoint-dir " + bad), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << "trained before refusing:\n" << r.out;
  }
  const RunResult r = run(gpt_args("off") + " --steps 2 --resume --checkpoint-dir " + d.file("none"));
  EXPECT_EQ(r.code, 0) << r.out;  // nothing to resume yet: a fresh run, said so
  EXPECT_NE(r.out.find("no checkpoint"), std::string::npos) << r.out;
  // A fresh run into a directory of another run's checkpoints would mix them: refused.
  const RunResult fresh = run(gpt_args("off") + " --steps 4 --checkpoint-dir " + d.file("none"));
  EXPECT_EQ(fresh.code, 2) << fresh.out;
  EXPECT_NE(fresh.out.find("already holds checkpoints"), std::string::npos) << fresh.out;
}

}  // namespace
}  // namespace amp
