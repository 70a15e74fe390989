// How amp_train fails, as a reliability probe meets it: a run must never end with exit 0 and
// non-finite weights; an output that cannot be written costs no other output; two live runs never
// write one output; a checkpoint's trainer.json is checked like its tensors; interruptions and
// resumes keep the skipped-step bookkeeping of the uninterrupted run; pruning old checkpoints never
// leaves an incomplete step-*; and the small ones (wrong flags named, memory checked, extra data
// refused, no hang under a memory limit).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "cli_util.h"
#include "launch/training/checkpoint.h"
#include "runtime/ops/ops.h"
#include "runtime/core/safetensors.h"
#include "test_util.h"
#include "test_util.h"

namespace amp {
namespace {

namespace fs = std::filesystem;
using namespace cli;

const std::string kMlp = " --width 16 --layers 2 --batch-size 4 --log-every 0 --threads 1 ";

bool has(const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; }

// Every value of every tensor of a safetensors file is finite.
bool all_finite(const std::string& path) {
  for (const auto& [name, t] : safetensors::load(path))
    for (double v : t.to_vector())
      if (!std::isfinite(v)) return false;
  return true;
}

// --- 1. A NaN model, saved, exit 0 -------------------------------------------------------------

// A scale whose float32 inverse is infinite (below ~2.9e-39) unscales every gradient to inf or NaN:
// the flags that would start there are usage errors.
TEST(FailureModes, AScaleWithoutAFiniteInverseIsRefusedAtStart) {
  TempDir d;
  for (const std::string& flags : {std::string("--amp fp16 --init-scale 1e-45"), std::string("--amp fp16 --init-scale 1e-39"),
                                   std::string("--amp bf16 --loss-scale 1e-39")}) {
    const RunResult r = run(kMlp + "--steps 3 --save-weights " + d.file("w.safetensors") + " " + flags);
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.out;
    EXPECT_TRUE(has(r.out, flags.substr(flags.rfind("--"), flags.rfind(' ') - flags.rfind("--")))) << r.out;
    EXPECT_FALSE(fs::exists(d.file("w.safetensors"))) << flags;
  }
  // The smallest scale that is still usable is not refused at start (float32's smallest normal
  // number; under fp16, 2^-24: test_reliability).
  const RunResult ok = run(kMlp + "--steps 1 --amp bf16 --loss-scale dynamic --init-scale 1.2e-38 --save-weights " +
                           d.file("w.safetensors"));
  EXPECT_FALSE(has(ok.out, "--init-scale must")) << ok.out;
  if (fs::exists(d.file("w.safetensors"))) {
    EXPECT_TRUE(all_finite(d.file("w.safetensors"))) << ok.out;
  }
}

// A scale that backs off past that point is an error that says so (exit 1), and nothing is saved.
TEST(FailureModes, AScaleThatCollapsesStopsTheRun) {
  for (const std::string& launcher : {std::string(""), std::string(kMpirun)}) {
    TempDir d;
    // bf16 (fp32's range): 1.2e-38 halves to 6e-39, 3e-39, then 1.5e-39, whose inverse is infinite.
    const RunResult r = run(kMlp + "--steps 6 --amp bf16 --loss-scale dynamic --init-scale 1.2e-38 --inject-nonfinite 1 "
                                   "--inject-nonfinite 2 --inject-nonfinite 3 --metrics " +
                                d.file("m.jsonl") + " --save-weights " + d.file("w.safetensors"),
                            launcher);
    EXPECT_EQ(r.code, 1) << launcher << r.out;
    EXPECT_TRUE(has(r.out, "loss scale has collapsed")) << r.out;
    EXPECT_FALSE(fs::exists(d.file("w.safetensors"))) << r.out;
    const auto recs = read_jsonl(d.file("m.jsonl"));
    ASSERT_FALSE(recs.empty());
    EXPECT_EQ(recs.back().value("event", ""), "failed") << "the metrics end with the failure, not an end record";
  }
  // fp16: 6e-8 (at least 2^-24, so not refused at start) halves to 3e-8, below 2^-24, where every
  // scaled gradient under 1 flushes to zero: step 2 trains nothing (and is not skipped), and the run
  // goes no further (it used to train on to the end, and save).
  TempDir d;
  const RunResult r = run(kMlp + "--steps 4 --amp fp16 --init-scale 6e-8 --inject-nonfinite 1 --save-weights " +
                          d.file("w.safetensors"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "step 2: the loss scale has collapsed to 3e-08, below 2^-24")) << r.out;
  EXPECT_FALSE(fs::exists(d.file("w.safetensors"))) << r.out;
  // Nor is a checkpoint written of that state (it used to be, and pruning then deleted the last good
  // one, and --resume refused it as corrupt).
  const RunResult ck = run(kMlp + "--steps 4 --amp fp16 --init-scale 6e-8 --inject-nonfinite 1 --checkpoint-every 1 "
                                  "--checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(ck.code, 1) << ck.out;
  EXPECT_TRUE(has(ck.out, "after step 1: the loss scale has collapsed to 3e-08, below 2^-24")) << ck.out;
  EXPECT_TRUE(launch::list_checkpoints(d.file("ck")).empty()) << ck.out;
}

// Weights that went non-finite in the last step (whose loss was finite) are never saved, nor is the
// run's exit 0.
TEST(FailureModes, NonFiniteWeightsAreNeverSavedNorExitZero) {
  TempDir d;
  // Targets of 1e17: the loss (~1e34) is finite, and a step at lr 1e25 takes the weights past 3.4e38.
  safetensors::save(d.file("data.safetensors"), {{"x", ones({8, 16})}, {"y", full({8, 16}, 1e17)}});
  const RunResult r = run(kMlp + "--steps 1 --lr 1e25 --data " + d.file("data.safetensors") + " --save-weights " +
                          d.file("w.safetensors") + " --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "parameters hold inf or NaN")) << r.out;
  EXPECT_FALSE(fs::exists(d.file("w.safetensors")));
  EXPECT_TRUE(launch::list_checkpoints(d.file("ck")).empty());
}


// --- 2. A metrics failure loses the weights ----------------------------------------------------

// A file-size limit (ulimit -f, as a full disk: the write fails) stops the metrics at a whole line;
// training goes on, the weights are saved and are the control run's, and the job exits 1 naming
// the file, the step and the cause. No MPI abort on 2 ranks.
TEST(FailureModes, AMetricsFileThatCannotBeWrittenCostsNothingElse) {
  // Under mpirun the limit is set in each rank's shell, and MPI's own shared-memory files (which a
  // 4 KiB limit would refuse) are not used: TCP between the ranks, no shared-memory all-reduce.
  for (const std::string& launcher : {std::string("bash -c"), std::string("mpirun -np 2 --oversubscribe --mca btl self,tcp --mca btl_tcp_if_include lo -x AMP_COMM_SHM=0 bash -c")}) {
    TempDir d;
    // On the CPU: the emulated GPU's NCCL keeps shared files of its own, which the limit would refuse.
    const std::string args = kMlp + "--device cpu --steps 60 --save-weights w.safetensors --checkpoint-dir ck";
    const std::string out = shell(launcher + " \"ulimit -f 4; exec $AMP " + args + " --metrics m.jsonl\"; echo exit=$?", d);
    EXPECT_TRUE(has(out, "exit=1")) << launcher << out;
    EXPECT_TRUE(has(out, "--metrics: cannot write")) << out;
    EXPECT_TRUE(has(out, "at step ")) << out;
    EXPECT_TRUE(has(out, "File too large")) << out;
    EXPECT_FALSE(has(out, "MPI_ABORT")) << out;
    // Every line is whole (read_jsonl parses each), and the file stopped before the end.
    const auto recs = read_jsonl(d.file("m.jsonl"));
    ASSERT_FALSE(recs.empty());
    EXPECT_LT(recs.size(), 60u);
    EXPECT_FALSE(recs.back().contains("event"));
    // The weights and the checkpoint are there, and they are the control run's (no metrics).
    ASSERT_TRUE(fs::exists(d.file("w.safetensors"))) << out;
    EXPECT_TRUE(fs::exists(d.file("ck/step-00000060/trainer.json"))) << out;
    const std::string control = shell(launcher + " \"$AMP " + kMlp + "--device cpu --steps 60 --save-weights c.safetensors\"", d);
    const auto mine = safetensors::load(d.file("w.safetensors")), theirs = safetensors::load(d.file("c.safetensors"));
    ASSERT_EQ(mine.size(), theirs.size()) << control;
    for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(mine[i].second.to_vector(), theirs[i].second.to_vector());
  }
}

// The end record says the run finished only once its outputs are saved: when --save-weights fails,
// the metrics' last record says that, and the job exits 1.
TEST(FailureModes, TheEndRecordComesAfterTheOutputs) {
  TempDir d;
  const std::string out = shell("ulimit -f 8; $AMP --width 64 --layers 2 --batch-size 4 --log-every 0 --threads 1 "
                                "--steps 3 --metrics m.jsonl --save-weights w.safetensors; echo exit=$?", d);
  EXPECT_TRUE(has(out, "exit=1")) << out;
  EXPECT_TRUE(has(out, "--save-weights")) << out;
  EXPECT_TRUE(has(out, "write failed: File too large")) << "the cause, as the checkpoint's says it: " << out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  ASSERT_EQ(recs.size(), 4u) << out;
  EXPECT_EQ(recs.back().value("event", ""), "failed") << recs.back().dump();
  EXPECT_TRUE(has(recs.back().value("error", ""), "--save-weights")) << recs.back().dump();
}

// --- 3. Concurrent runs overwrite each other ---------------------------------------------------

// A live run's outputs are refused to a second run, naming the output and the process; a run killed
// with SIGKILL leaves nothing that blocks the next.
TEST(FailureModes, AnOutputInUseByALiveRunIsRefused) {
  TempDir d;
  const std::string first = kMlp + "--steps 100000000 --checkpoint-dir ck --metrics m.jsonl --save-weights w.safetensors";
  const std::string out = shell(
      ": > w.safetensors; $AMP " + first + " > first.log 2>&1 & p=$!; "
      "while [ $(wc -l < m.jsonl 2>/dev/null || echo 0) -lt 2 ]; do sleep 0.1; done; "
      "$AMP " + kMlp + "--steps 5 --checkpoint-dir ck; echo exit1=$?; "
      "$AMP " + kMlp + "--steps 5 --metrics ./m.jsonl; echo exit2=$?; "
      "mpirun -np 2 --oversubscribe $AMP " + kMlp + "--steps 5 --comm-timeout 20 --checkpoint-dir ck > mpi.log 2>&1; "
      "echo exit5=$?; cat mpi.log; "
      "ln -s w.safetensors link.safetensors; $AMP " + kMlp + "--steps 5 --save-weights link.safetensors; echo exit3=$?; "
      "echo pid=$p; kill -KILL $p; wait $p; "
      "$AMP " + kMlp + "--steps 5 --metrics m.jsonl --save-weights w.safetensors; echo exit4=$?", d);
  for (const char* code : {"exit1=2", "exit2=2", "exit3=2", "exit4=0"}) EXPECT_TRUE(has(out, code)) << code << "\n" << out;
  // Under mpirun the other rank learns it at once: exit 2, no timeout.
  EXPECT_FALSE(has(out, "exit5=0")) << out;
  EXPECT_TRUE(has(out, "error (rank 0): --checkpoint-dir: 'ck': in use by another run")) << out;
  EXPECT_FALSE(has(out, "did not complete")) << out;
  const std::string pid = out.substr(out.find("pid=") + 4, out.find('\n', out.find("pid=")) - out.find("pid=") - 4);
  EXPECT_TRUE(has(out, "--checkpoint-dir: 'ck': in use by another run, process " + pid)) << out;
  EXPECT_TRUE(has(out, "--metrics: './m.jsonl': in use by another run, process " + pid)) << out;
  EXPECT_TRUE(has(out, "--save-weights: 'link.safetensors': in use by another run, process " + pid)) << out;
  // The refused runs wrote nothing: the first run's metrics are still its own, whole lines.
  EXPECT_FALSE(fs::exists(d.file("ck/step-00000005")));
  // One run may not name one file twice either.
  const RunResult twice = run(kMlp + "--steps 2 --metrics " + d.file("x") + " --save-weights " + d.file("x"));
  EXPECT_EQ(twice.code, 2) << twice.out;
  EXPECT_TRUE(has(twice.out, "are the same file: give each output its own")) << twice.out;
}

// --- 4. trainer.json is checked ----------------------------------------------------------------

// FNV-1a 64, written out here from its definition (an oracle apart from the runtime's).
std::string fnv1a64_hex(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void write_json(const std::string& path, const nlohmann::json& j, bool fix_checksum) {
  nlohmann::json out = j;
  if (fix_checksum) {
    out.erase("checksum");
    out["checksum"] = fnv1a64_hex(out.dump());
  }
  std::ofstream(path) << out.dump(2) << "\n";
}

TEST(FailureModes, TrainerJsonIsCheckedLikeTheTensors) {
  TempDir d;
  const std::string args = kMlp + "--amp fp16 --growth-interval 2 --checkpoint-dir " + d.file("ck");
  ASSERT_EQ(run(args + " --steps 10 --keep-checkpoints 1").code, 0);
  const std::string meta = d.file("ck/step-00000010/trainer.json");
  const nlohmann::json good = read_json(meta);
  ASSERT_TRUE(good.contains("checksum"));
  EXPECT_EQ(good["checksum"], fnv1a64_hex([&] { auto j = good; j.erase("checksum"); return j.dump(); }()));
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> change;
    bool fix_checksum;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"step 10 -> 5", [](nlohmann::json& j) { j["step"] = 5; }, false, "checksum mismatch"},
      {"scale 1e-45", [](nlohmann::json& j) { j["scaler"]["scale"] = 1e-45; }, false, "checksum mismatch"},
      {"step 5 in step-10, checksum fixed", [](nlohmann::json& j) { j["step"] = 5; }, true, "in a directory named"},
      {"scale 1e-45, checksum fixed", [](nlohmann::json& j) { j["scaler"]["scale"] = 1e-45; }, true, "not a usable loss scale"},
      {"tracker 1e300", [](nlohmann::json& j) { j["scaler"]["_growth_tracker"] = 1e300; }, true, "_growth_tracker"},
      // What GradScaler::load_state_dict takes (as PyTorch's does) but this program never writes.
      {"tracker 2 at interval 2", [](nlohmann::json& j) { j["scaler"]["_growth_tracker"] = 2; }, true, "_growth_tracker"},
      {"tracker 0.5", [](nlohmann::json& j) { j["scaler"]["_growth_tracker"] = 0.5; }, true, "_growth_tracker"},
      {"interval 1e30", [](nlohmann::json& j) { j["scaler"]["growth_interval"] = 1e30; }, true, "growth_interval"},
      {"scaler an array", [](nlohmann::json& j) { j["scaler"] = {1, 2}; }, true, "scaler is not an object"},
      {"must_match an array", [](nlohmann::json& j) { j["must_match"] = {1, 2}; }, true, "corrupt"},
      {"data position", [](nlohmann::json& j) { j["data_position"]["next_sample"] = 4; }, true, "data_position"},
      {"skipped 11", [](nlohmann::json& j) { j["skipped_steps"] = 11; }, true, "skipped_steps"},
      // Fields missing or out of range (each was a raw JSON error, a step shown as -1, or accepted).
      {"no data position", [](nlohmann::json& j) { j.erase("data_position"); }, true, "no data_position.next_sample"},
      {"no skipped steps", [](nlohmann::json& j) { j.erase("skipped_steps"); }, true, "no skipped_steps"},
      {"step 2^64 - 1", [](nlohmann::json& j) { j["step"] = ~uint64_t{0}; }, true, "step 18446744073709551615 is not a step"},
      {"ranks 0", [](nlohmann::json& j) { j["batch_layout"]["ranks"] = 0; }, true, "batch_layout.ranks 0 is not a count"},
      {"micro-batches -3", [](nlohmann::json& j) { j["batch_layout"]["micro_batches"] = -3; }, true, "batch_layout.micro_batches"},
      {"layout a string", [](nlohmann::json& j) { j["batch_layout"] = "2x4"; }, true, "batch_layout \"2x4\" is not an object"},
      {"no checksum", [](nlohmann::json& j) { j.erase("checksum"); }, false, "no checksum"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    nlohmann::json j = good;
    c.change(j);
    write_json(meta, j, c.fix_checksum);
    const RunResult r = run(args + " --steps 12 --resume");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r.out, meta)) << "the file is named: " << r.out;
    EXPECT_TRUE(has(r.out, c.expect)) << r.out;
    EXPECT_FALSE(has(r.out, "[json.exception")) << "the JSON library's raw text: " << r.out;
  }
  write_json(meta, good, false);
  EXPECT_EQ(run(args + " --steps 11 --resume").code, 0) << "the restored file resumes";
}

// The scaler's hyperparameters come from this run's flags, as the optimizer's do (and it says so):
// with --growth-interval 1000 the scale stops growing every 2 steps.
TEST(FailureModes, AResumedRunTakesTheScalersFlags) {
  TempDir d;
  const std::string args = kMlp + "--amp fp16 --checkpoint-dir " + d.file("ck") + " --metrics " + d.file("m.jsonl");
  ASSERT_EQ(run(args + " --growth-interval 2 --steps 4").code, 0);
  const RunResult r = run(args + " --growth-interval 1000 --steps 12 --resume");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "--growth-interval 1000 (the checkpoint's run had 2)")) << r.out;
  std::vector<double> scales;
  for (const auto& rec : read_jsonl(d.file("m.jsonl")))
    if (!rec.contains("event") && rec["step"].get<int>() >= 6) scales.push_back(rec["scale"].get<double>());
  ASSERT_EQ(scales.size(), 7u);
  for (double s : scales) EXPECT_EQ(s, scales.front()) << "the scale grew after the resume";
}

// --- 5. Interruptions and the skip bookkeeping -------------------------------------------------

// Every step so far skipped, then SIGTERM: an interruption (exit 143, weights, checkpoint,
// interrupted_by), not the all-skipped failure.
TEST(FailureModes, SigtermWhileEveryStepSkipsIsAnInterruption) {
  TempDir d;
  const std::string out = shell("$AMP " + kMlp + "--amp fp16 --init-scale 3e38 --backoff-factor 0.999 --steps 100000000 "
                                "--metrics m.jsonl --save-weights w.safetensors --checkpoint-dir ck & p=$!; "
                                "while [ $(wc -l < m.jsonl 2>/dev/null || echo 0) -lt 3 ]; do sleep 0.1; done; "
                                "kill -TERM $p; wait $p; echo exit=$?", d);
  EXPECT_TRUE(has(out, "exit=143")) << out;
  EXPECT_FALSE(has(out, "was skipped")) << out;
  EXPECT_TRUE(fs::exists(d.file("w.safetensors"))) << out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  ASSERT_FALSE(recs.empty());
  EXPECT_EQ(recs.back().value("interrupted_by", ""), "SIGTERM") << recs.back().dump();
  EXPECT_EQ(recs.back()["skipped_steps"], recs.back()["steps"]);
  EXPECT_FALSE(launch::list_checkpoints(d.file("ck")).empty());
}

// A resumed run counts skipped steps from step 1: its end record is the uninterrupted run's, and
// overflows after a resume are not "nothing was trained".
TEST(FailureModes, AResumedRunKeepsTheSkippedStepsOfItsCheckpoint) {
  TempDir d;
  const std::string first = kMlp + "--amp fp16 --inject-nonfinite 2 --inject-nonfinite 3";
  const std::string args = first + " --inject-nonfinite 11 --inject-nonfinite 12";
  ASSERT_EQ(run(args + " --steps 12 --metrics " + d.file("full.jsonl")).code, 0);
  ASSERT_EQ(run(first + " --steps 10 --checkpoint-dir " + d.file("ck")).code, 0);
  const RunResult r = run(args + " --steps 12 --resume --checkpoint-dir " + d.file("ck") + " --metrics " +
                          d.file("res.jsonl") + " --save-weights " + d.file("w.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(d.file("ck/step-00000012/trainer.json")));
  EXPECT_TRUE(fs::exists(d.file("w.safetensors")));
  const auto full = read_jsonl(d.file("full.jsonl")), res = read_jsonl(d.file("res.jsonl"));
  EXPECT_EQ(full.back()["skipped_steps"], 4);
  EXPECT_EQ(res.back()["skipped_steps"], full.back()["skipped_steps"]);
  EXPECT_EQ(res.back()["param_checksum"], full.back()["param_checksum"]);
}

// --- 6. Pruning old checkpoints -----------------------------------------------------------------

// A process killed while pruning (here: _exit after the first file it deletes) leaves every step-*
// complete; its half-deleted directory is a .old-step-* that the next run removes, saying so.
TEST(FailureModes, APruneKilledHalfwayLeavesNoIncompleteCheckpoint) {
  TempDir d;
  const std::string dir = d.file("ck");
  const RunResult r = run(kMlp + "--steps 3 --checkpoint-every 1 --keep-checkpoints 3 --checkpoint-dir " + dir);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_EQ(launch::list_checkpoints(dir).size(), 3u);
  const pid_t child = ::fork();
  if (child == 0) {
    launch::prune_checkpoints(dir, 1, [] { ::_exit(9); });
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 9) << "the prune was not interrupted";
  for (const std::string& ck : launch::list_checkpoints(dir)) EXPECT_NO_THROW(launch::load_checkpoint(ck)) << ck;
  const RunResult next = run(kMlp + "--steps 5 --resume --checkpoint-dir " + dir);
  ASSERT_EQ(next.code, 0) << next.out;
  EXPECT_TRUE(has(next.out, "killed while deleting")) << next.out;
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().rfind(".old-", 0), std::string::npos) << e.path();
}

// --- 7. Smaller ones ----------------------------------------------------------------------------

TEST(FailureModes, MultiTaskSizesNameTheirOwnFlags) {
  for (const std::string& flag : {std::string("--hidden"), std::string("--in-features"), std::string("--features")}) {
    const RunResult r = run("--model mtl --steps 1 --log-every 0 " + flag + " 999999999");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r.out, flag)) << r.out;
    EXPECT_FALSE(has(r.out, "--width")) << r.out;
  }
  // The probe's --hidden 99999999 (10 GB) on this machine kind; sizes past any machine's memory here.
  const RunResult big = run("--model mtl --steps 1 --log-every 0 --hidden 9999999999");
  EXPECT_EQ(big.code, 2) << "refused by the memory check, before allocating: " << big.out;
  EXPECT_TRUE(has(big.out, "--hidden 9999999999")) << big.out;
  // The aggregator's Gramian is tasks x tasks: counted before the aggregator is tried.
  const RunResult tasks = run("--model mtl --steps 1 --log-every 0 --tasks 3000000");
  EXPECT_EQ(tasks.code, 2) << tasks.out;
  EXPECT_TRUE(has(tasks.out, "--tasks 3000000")) << tasks.out;
}

// An fp16 overflow in one task's backward makes its row of the shared parameters' Jacobian inf. Every
// aggregator but one passed that on to the gradient, and the scaler skipped the step; trimmedmean trims
// the row away and trained on a finite, wrong step, the scale never backing off (a stranger's finding).
// Here task3's head (weights 300) overflows at every step: every step is skipped, whatever the
// aggregator, naming the task; without a scaler the run stops.
TEST(FailureModes, AnInfInOneTasksJacobianRowSkipsTheStepWhateverTheAggregator) {
  TempDir d;
  const int64_t n = 64;
  std::vector<double> x, y;
  for (int64_t i = 0; i < n * 10; ++i) x.push_back(std::sin(0.37 * static_cast<double>(i)));
  for (int64_t i = 0; i < n; ++i) y.push_back(std::cos(0.11 * static_cast<double>(i)));
  safetensors::save(d.file("data.safetensors"), {{"x", from_vector(x, {n, 10})}, {"y1", from_vector(y, {n, 1})},
                                                  {"y2", from_vector(y, {n, 1})}, {"y3", from_vector(y, {n, 1})}});
  auto wave = [](int64_t count, double amplitude, bool positive) {
    std::vector<double> v;
    for (int64_t i = 0; i < count; ++i) v.push_back(amplitude * (positive ? std::fabs(std::sin(1.3 * i + 0.2)) : std::sin(1.3 * i + 0.2)));
    return v;
  };
  safetensors::save(d.file("init.safetensors"),
                    {{"shared.0.weight", from_vector(wave(50, 0.3, false), {5, 10})}, {"shared.0.bias", from_vector(std::vector<double>(5, 0.5), {5})},
                     {"shared.2.weight", from_vector(wave(15, 0.4, true), {3, 5})}, {"shared.2.bias", from_vector(std::vector<double>(3, 0.1), {3})},
                     {"task1.weight", from_vector(wave(3, 0.5, false), {1, 3})}, {"task1.bias", zeros({1})},
                     {"task2.weight", from_vector(wave(3, 0.5, false), {1, 3})}, {"task2.bias", zeros({1})},
                     {"task3.weight", from_vector({300.0, 300.0, 300.0}, {1, 3})}, {"task3.bias", zeros({1})}});
  const std::string flags = "--model mtl --tasks 3 --in-features 10 --hidden 5 --features 3 --data " + d.file("data.safetensors") +
                            " --init-weights " + d.file("init.safetensors") + " --amp fp16 --steps 4 --batch-size 16 "
                            "--lr 0.0001 --log-every 0 --threads 1 --aggregator ";
  for (const std::string& aggregator : {std::string("trimmedmean:1"), std::string("mean"), std::string("upgrad")}) {
    const RunResult r = run(flags + aggregator + " --init-scale 8");
    EXPECT_EQ(r.code, 1) << aggregator << ": " << r.out;
    EXPECT_TRUE(has(r.out, "every one of the 4 steps was skipped")) << aggregator << ": " << r.out;
    EXPECT_TRUE(has(r.out, "step 1 skipped: inf or NaN in the shared parameters' Jacobian, in the rows of task3\n"))
        << aggregator << ": " << r.out;
  }
  const RunResult unscaled = run(flags + "trimmedmean:1 --loss-scale off");
  EXPECT_EQ(unscaled.code, 1) << unscaled.out;
  EXPECT_TRUE(has(unscaled.out, "step 1: the shared parameters' Jacobian is not finite (task3) and no loss scaler")) << unscaled.out;
}

// A resume with another --aggregator trained on silently (the checkpoint did not record it); it says so.
TEST(FailureModes, AResumeWithAnotherAggregatorSaysSo) {
  TempDir d;
  const std::string flags = "--model mtl --batch-size 8 --log-every 0 --threads 1 --checkpoint-dir " + d.file("ck");
  ASSERT_EQ(run(flags + " --steps 2 --aggregator random").code, 0);
  const RunResult other = run(flags + " --steps 3 --resume --aggregator upgrad");
  EXPECT_EQ(other.code, 0) << other.out;
  EXPECT_TRUE(has(other.out, "note: --aggregator upgrad differs from the checkpoint's run (random)")) << other.out;
  const RunResult same = run(flags + " --steps 4 --resume --aggregator upgrad");
  EXPECT_EQ(same.code, 0) << same.out;
  EXPECT_FALSE(has(same.out, "differs from the checkpoint")) << same.out;
}

TEST(FailureModes, ATensorThatNoRunReadsIsRefused) {
  TempDir d;
  const Tensor x = ones({8, 16}), y = ones({8, 16}), y1 = ones({8, 1});
  safetensors::save(d.file("mlp.safetensors"), {{"x", x}, {"y", y}, {"z", y}});
  const RunResult mlp = run(kMlp + "--steps 1 --data " + d.file("mlp.safetensors"));
  EXPECT_EQ(mlp.code, 2) << mlp.out;
  EXPECT_TRUE(has(mlp.out, "'z'")) << mlp.out;
  safetensors::save(d.file("mtl.safetensors"), {{"x", ones({8, 10})}, {"y1", y1}, {"y2", y1}, {"y3", y1}});
  const RunResult mtl = run("--model mtl --tasks 2 --steps 1 --log-every 0 --data " + d.file("mtl.safetensors"));
  EXPECT_EQ(mtl.code, 2) << mtl.out;
  EXPECT_TRUE(has(mtl.out, "'y3'")) << mtl.out;
  safetensors::save(d.file("ok.safetensors"), {{"x", ones({8, 10})}, {"y1", y1}, {"y2", y1}});
  EXPECT_EQ(run("--model mtl --tasks 2 --steps 1 --log-every 0 --data " + d.file("ok.safetensors")).code, 0);
}

// One thread pool, OpenMP's: no BLAS with threads of its own is loaded (OpenBLAS, whose Debian default
// is its pthreads build, and whose constructor loops forever on a failed allocation, is gone).
TEST(FailureModes, TheBinaryLoadsNoSecondThreadPool) {
  const std::string libs = capture(std::string("ldd ") + AMP_TRAIN_BIN + " 2>&1");
  ASSERT_TRUE(has(libs, "libgomp")) << libs;
  EXPECT_FALSE(has(libs, "openblas")) << libs;
  EXPECT_FALSE(has(libs, "libblas")) << libs;
}

// Under an address-space limit, threads that cannot be created are an error that ends the process,
// never a hang at exit.
// Token shards are read in place, two at a time: a dataset of 2 GiB (8 llm.c shards of 256 MiB,
// sparse files: nothing on the disk) trains under an address-space limit of 1.4 GiB, which reading
// it whole (or mapping every shard at once) would exceed. Every token is still checked at load.
TEST(FailureModes, TokenShardsLargerThanTheAddressSpaceLimitTrain) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: no ulimit -v applies";
#endif
  TempDir d;
  const int64_t tokens = int64_t{128} << 20;
  for (int i = 0; i < 8; ++i) {
    const std::string path = d.file("train_" + std::to_string(i) + ".bin");
    test::write_llmc_shard(path, {});
    std::string header(1024, '\0');
    std::ifstream(path, std::ios::binary).read(header.data(), 1024);
    for (int b = 0; b < 4; ++b) header[8 + static_cast<size_t>(b)] = static_cast<char>((tokens >> (8 * b)) & 0xff);
    std::ofstream(path, std::ios::binary | std::ios::in) << header;
    std::filesystem::resize_file(path, static_cast<uintmax_t>(1024 + 2 * tokens));  // a hole of zeros: token 0
  }
  const std::string out = shell("ulimit -v 1500000; timeout -s KILL 120 $AMP --model gpt --data \"train_*.bin\" "
                                "--vocab-size 50257 --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 "
                                "--steps 3 --log-every 1 --device cpu; echo exit=$?", d);
  EXPECT_TRUE(has(out, "exit=0")) << out;
  EXPECT_TRUE(has(out, "step 3/3")) << out;
}

TEST(FailureModes, AMemoryLimitEndsTheRunWithoutHanging) {
  TempDir d;
  const std::string out = shell("ulimit -v 1000000; timeout -s KILL 60 $AMP --width 2048 --layers 4 --steps 2 "
                                "--log-every 0; echo exit=$?", d);
  EXPECT_FALSE(has(out, "exit=137")) << "killed by the timeout: it hung\n" << out;
}

}  // namespace
}  // namespace amp
