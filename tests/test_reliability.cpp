// A third reliability probe (issue 41), each finding as a test that fails on the code it was found
// in: outputs written over inputs or over each other under other names, lock files that follow links,
// duplicate stop signals taken as "stop now", sampling and evaluation that ignore a stop, integer
// flags whose products overflow, a newer checkpoint format read silently, resumes whose layout cannot
// be bitwise said nothing of, config files that ignore keys, loss scales that train nothing, and a
// requeued command that fails where nothing is left to do. (The memory estimates have their own
// suite, test_memory_estimate; the scripts', tests/scripts/scripts_check.sh.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>

#include "cli_util.h"
#include "runtime/core/fnv1a.h"
#include "runtime/core/safetensors.h"

namespace amp {
namespace {

namespace fs = std::filesystem;
using namespace cli;

const std::string kMlpFlags = " --width 8 --layers 2 --batch-size 4 --log-every 0 --threads 1 ";
const std::string kMlp = kMlpFlags + "--steps 2 ";

bool has(const std::string& out, const std::string& what) { return out.find(what) != std::string::npos; }

size_t safetensors_size(const std::string& path) { return safetensors::load(path).size(); }

// A usage error (exit 2) whose message names `what`; context says which case it was.
void expect_usage_error(const RunResult& r, const std::string& what, const std::string& context = "") {
  EXPECT_EQ(r.code, 2) << context << ": " << r.out;
  EXPECT_TRUE(r.out.find(what) != std::string::npos) << context << ": no '" << what << "' in: " << r.out;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// A text the GPT can train on: 40 KB of verses.
std::string corpus(const TempDir& d) {
  std::string text;
  for (int i = 0; i < 600; ++i) text += "And God said, Let there be light: and there was light. ";
  write(d.file("text.txt"), text);
  return d.file("text.txt");
}

const std::string kGpt = " --model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --log-every 0 "
                         "--threads 1 ";

// --- 1. and 5. An output over an input, or over another output, under any name ------------------

TEST(Reliability, AnOutputThatIsAnInputIsRefusedAndTheInputKept) {
  TempDir d;
  const std::string text = corpus(d);
  const std::string before = bytes_of(text);
  RunResult r = run(kGpt + "--steps 1 --data " + text + " --metrics " + text);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--metrics") && has(r.out, "--data")) << r.out;
  EXPECT_EQ(bytes_of(text), before) << "the corpus was overwritten";
  r = run(kGpt + "--steps 1 --data " + text + " --save-weights " + text);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--save-weights") && has(r.out, "--data")) << r.out;
  EXPECT_EQ(bytes_of(text), before);

  ASSERT_EQ(run(kMlp + "--save-weights " + d.file("w.st")).code, 0);
  const std::string weights = bytes_of(d.file("w.st"));
  fs::create_symlink(d.file("w.st"), d.file("link.st"));
  fs::create_hard_link(d.file("w.st"), d.file("hard.st"));
  for (const std::string& name : std::vector<std::string>{d.file("w.st"), d.file("link.st"), d.file("hard.st"), d.path.string() + "/./w.st"}) {
    r = run(kMlp + "--init-weights " + d.file("w.st") + " --metrics " + name);
    expect_usage_error(r, "--init-weights", name);
    EXPECT_EQ(bytes_of(d.file("w.st")), weights) << "the pretrained weights were overwritten through " << name;
  }
  // The config file is an input too.
  write(d.file("run.cfg"), "lr = 0.1\n");
  r = run(kMlp + "--config " + d.file("run.cfg") + " --metrics " + d.file("run.cfg"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(bytes_of(d.file("run.cfg")), "lr = 0.1\n");
}

TEST(Reliability, OneFileUnderTwoNamesIsOneOutput) {
  TempDir d;
  fs::create_symlink("x.out", d.file("xl.out"));  // dangling: the file does not exist yet
  RunResult r = run(kMlp + "--metrics " + d.file("x.out") + " --save-weights " + d.file("xl.out"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--metrics") && has(r.out, "--save-weights")) << r.out;
  // A lock file named as an output: the run would delete it at its end.
  r = run(kMlp + "--metrics " + d.file(".w.st.lock") + " --save-weights " + d.file("w.st"));
  expect_usage_error(r, "lock file of --save-weights");
  // A metrics file of its own beside the checkpoints is fine ...
  r = run(kMlp + "--checkpoint-dir " + d.file("cm") + " --metrics " + d.file("cm/metrics.jsonl"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_jsonl(d.file("cm/metrics.jsonl")).back()["event"], "end");
  r = run(kMlpFlags + "--resume --steps 3 --checkpoint-dir " + d.file("cm") + " --metrics " + d.file("cm/step-size-sweep.jsonl"));
  EXPECT_EQ(r.code, 0) << "not a checkpoint's name: " << r.out;
  // ... but not the checkpoint directory's own entries, nor what is in them.
  for (const std::string inside : {"cm/.lock", "cm/step-00000001", "cm/step-00000003/model.safetensors"}) {
    r = run(kMlpFlags + "--steps 4 --resume --checkpoint-dir " + d.file("cm") + " --metrics " + d.file(inside));
    expect_usage_error(r, "--checkpoint-dir", inside);
  }
  EXPECT_EQ(safetensors_size(d.file("cm/step-00000003/model.safetensors")), 4u);
  // An output inside the checkpoint a run resumes from.
  r = run(kMlpFlags + "--steps 3 --resume-from " + d.file("cm/step-00000002") + " --checkpoint-dir " + d.file("cm2") +
          " --metrics " + d.file("cm/step-00000002/trainer.json"));
  expect_usage_error(r, "--resume-from");
}

// Two live runs, one writing g1 and one given g2, a hard link to it: the second is refused.
TEST(Reliability, AHardLinkToAnotherRunsMetricsIsRefused) {
  TempDir d;
  write(d.file("g1"), "");
  fs::create_hard_link(d.file("g1"), d.file("g2"));
  const std::string out = shell(
      "$AMP --width 8 --layers 2 --batch-size 4 --log-every 0 --threads 1 --steps 100000000 --metrics g1 & p=$!; "
      "while [ $(wc -l < g1) -lt 2 ]; do sleep 0.1; done; "
      "$AMP --width 8 --layers 2 --batch-size 4 --threads 1 --steps 2 --metrics g2; echo second=$?; "
      "kill -TERM $p; wait $p", d);
  EXPECT_TRUE(has(out, "second=2")) << out;
  EXPECT_TRUE(has(out, "hard link")) << out;
  for (const auto& rec : read_jsonl(d.file("g1"))) EXPECT_TRUE(rec.is_object());  // no NUL-filled lines
}

// --- 2. Lock files are never followed, and only a run's own are removed ---------------------------

TEST(Reliability, ALockFileThatIsALinkIsRefusedAndNothingWritten) {
  TempDir d;
  write(d.file("victim"), "precious\n");
  struct Case {
    std::string lock, flags;
  };
  fs::create_directories(d.file("ck"));
  for (const Case& c : {Case{".m.jsonl.lock", "--metrics " + d.file("m.jsonl")},
                        Case{".w.st.lock", "--save-weights " + d.file("w.st")},
                        Case{"ck/.lock", "--checkpoint-dir " + d.file("ck")}}) {
    fs::create_symlink(d.file("victim"), d.file(c.lock));
    const RunResult r = run(kMlp + c.flags);
    expect_usage_error(r, "symbolic link", c.lock);
    EXPECT_EQ(bytes_of(d.file("victim")), "precious\n") << "written through " << c.lock;
    EXPECT_TRUE(fs::is_symlink(d.file(c.lock))) << "the link was deleted";
    fs::remove(d.file(c.lock));
  }
  // Not a regular file: refused, naming it.
  fs::create_directories(d.file(".n.jsonl.lock"));
  RunResult r = run(kMlp + "--metrics " + d.file("n.jsonl"));
  expect_usage_error(r, "not a regular file");
  // A file that is not a lock (it holds no process id) is the user's: refused, kept as it was; an
  // empty one is used and kept; a lock left by a run that is gone is taken over and removed at the end.
  write(d.file(".k.jsonl.lock"), "notes the user keeps here\n");
  r = run(kMlp + "--metrics " + d.file("k.jsonl"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(bytes_of(d.file(".k.jsonl.lock")), "notes the user keeps here\n");
  EXPECT_FALSE(fs::exists(d.file("k.jsonl"))) << "a refused run left its metrics file";
  write(d.file(".e.jsonl.lock"), "");
  r = run(kMlp + "--metrics " + d.file("e.jsonl"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(d.file(".e.jsonl.lock"))) << "a file the run did not create was deleted";
  write(d.file(".s.jsonl.lock"), std::to_string(gone_pid()) + "\n");
  r = run(kMlp + "--metrics " + d.file("s.jsonl"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(fs::exists(d.file(".s.jsonl.lock"))) << "a dead run's lock was left behind";
}

// --- 4. One stop request, however many copies arrive ----------------------------------------------

// A shell line that waits for a run in the background to write three metrics lines (m.jsonl).
const std::string kAfterThreeSteps = "while [ $(wc -l < m.jsonl 2>/dev/null || echo 0) -lt 3 ]; do sleep 0.05; done; ";

// What a SIGTERM leaves: exit 143 (the script echoes exit=$?), the weights w.st, and metrics m.jsonl
// that end with the end record naming the signal.
void expect_stopped_by(const std::string& out, const TempDir& d, const std::string& signal = "SIGTERM", int code = 143) {
  EXPECT_TRUE(has(out, "exit=" + std::to_string(code))) << out;
  EXPECT_TRUE(fs::exists(d.file("w.st"))) << out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  ASSERT_FALSE(recs.empty()) << out;
  EXPECT_EQ(recs.back()["event"], "end") << out;
  EXPECT_EQ(recs.back()["interrupted_by"], signal) << out;
}

// Runs $AMP with AMP_DEBUG_STALL=stall (a pause that waits for a stop) and flags in the background,
// sends SIGTERM once it says it is pausing, and returns "exit=N", what `listing` prints, and its output.
std::string sigterm_when_paused(const std::string& stall, const std::string& flags, const std::string& listing,
                                const TempDir& d) {
  return shell("AMP_DEBUG_STALL=" + stall + " $AMP " + flags + " > out.txt 2>&1 & p=$!; until grep -q pausing out.txt; "
               "do sleep 0.05; done; kill -TERM $p; wait $p; echo exit=$?; " + listing + "; cat out.txt", d);
}

const std::string kPausedMlp = "--width 16 --layers 1 --batch-size 2 --log-every 0 --threads 1 --steps 10 ";

// A SIGTERM during the set-up (a requeue's, while a large checkpoint loads; here rank 0 pauses once
// its outputs are checked until a stop comes: AMP_DEBUG_STALL=0:0:setup) stops the run before the
// first step, saying so, exit 143, with nothing written: no metrics, weights or lock, and the
// checkpoint directory it made removed. It ended the process with no word and its lock file left.
TEST(Reliability, ASigtermDuringTheSetUpStopsBeforeTheFirstStepSayingSo) {
  TempDir d;
  const std::string out =
      sigterm_when_paused("0:0:setup", kPausedMlp + "--checkpoint-dir ck --metrics m.jsonl --save-weights w.st", "ls -A", d);
  EXPECT_TRUE(has(out, "exit=143")) << out;
  EXPECT_TRUE(has(out, "amp_train: interrupted (SIGTERM): stopping before the first step")) << out;
  EXPECT_TRUE(has(out, "amp_train: stopped: interrupted (SIGTERM) during the set-up")) << out;
  for (const char* f : {"m.jsonl", "w.st", "ck", ".w.st.lock", ".m.jsonl.lock"})
    EXPECT_FALSE(fs::exists(d.file(f))) << f << " was left: " << out;
}

// A SIGTERM that arrives while a checkpoint is written (rank 0 pauses there until a stop comes:
// AMP_DEBUG_STALL=0:3:checkpoint) stops the run at that step, whose checkpoint it has. It trained
// one more step and wrote that step's checkpoint too: seconds more against a scheduler's grace.
TEST(Reliability, ASigtermDuringACheckpointStopsAtItsStep) {
  TempDir d;
  const std::string out = sigterm_when_paused(
      "0:3:checkpoint", kPausedMlp + "--checkpoint-dir ck --checkpoint-every 1 --metrics m.jsonl --save-weights w.st", "ls ck", d);
  expect_stopped_by(out, d);
  EXPECT_EQ(read_jsonl(d.file("m.jsonl")).back()["steps"], 3) << out;
  EXPECT_TRUE(has(out, "step-00000003")) << out;
  EXPECT_FALSE(has(out, "step-00000004")) << "a step trained after the stop, and its checkpoint written: " << out;
}

// timeout(1), like Slurm, signals the child and its process group: two SIGTERMs within
// milliseconds. They are one request: the step finishes, the weights and the checkpoint are saved,
// the metrics end, nothing is left behind.
TEST(Reliability, ASigtermToTheProcessGroupSavesEverything) {
  TempDir d;
  const std::string out = shell(
      "setsid $AMP --width 64 --layers 2 --batch-size 4 --log-every 0 --threads 1 --steps 100000000 "
      "--checkpoint-dir ck --checkpoint-every 1 --save-weights w.st --metrics m.jsonl > out.txt 2>&1 & p=$!; " +
      kAfterThreeSteps + "kill -TERM -- -$p; kill -TERM $p; kill -TERM -- -$p; wait $p; echo exit=$?; cat out.txt", d);
  expect_stopped_by(out, d);
  for (const auto& e : fs::directory_iterator(d.file("ck")))
    EXPECT_EQ(e.path().filename().string().rfind("step-", 0), 0u) << "left behind: " << e.path();
  EXPECT_FALSE(fs::exists(d.file(".m.jsonl.lock")));
  EXPECT_FALSE(fs::exists(d.file(".w.st.lock")));
}

// A long run's ETA is in hours or days, not 20000s or 1185395620s.
TEST(Reliability, ALongRunsEtaIsInHoursOrDays) {
  TempDir d;
  const std::string out = shell(
      "$AMP --width 64 --layers 2 --batch-size 4 --log-every 1 --threads 1 --steps 100000000 --metrics m.jsonl "
      "> out.txt 2>&1 & p=$!; " + kAfterThreeSteps + "kill -TERM $p; wait $p; cat out.txt",
      d);
  EXPECT_TRUE(std::regex_search(out, std::regex("ETA [0-9]+(h[0-9][0-9]m|d)\\s"))) << out;
  EXPECT_FALSE(std::regex_search(out, std::regex("ETA [0-9]{4,}s"))) << out;
}

// SIGUSR1 and SIGUSR2, which other tools have Slurm send before a time limit (--signal=USR1@120),
// are stop requests as SIGTERM is: their default action ended the run with nothing saved.
TEST(Reliability, ASigusr1OrSigusr2StopsAfterTheStepAndSaves) {
  // SIGHUP too: a terminal, or an ssh session, that went away.
  for (const auto& [name, code] : {std::pair{"USR1", 138}, std::pair{"USR2", 140}, std::pair{"HUP", 129}}) {
    SCOPED_TRACE(name);
    TempDir d;
    const std::string out = shell(
        "$AMP --width 64 --layers 2 --batch-size 4 --log-every 0 --threads 1 --steps 100000000 "
        "--checkpoint-dir ck --checkpoint-every 1000000 --save-weights w.st --metrics m.jsonl > out.txt 2>&1 & p=$!; " +
        kAfterThreeSteps + "kill -" + std::string(name) + " $p; wait $p; echo exit=$?; cat out.txt; ls ck", d);
    expect_stopped_by(out, d, std::string("SIG") + name, code);
    EXPECT_TRUE(has(out, std::string("interrupted (SIG") + name + ")")) << out;
    EXPECT_TRUE(has(out, "step-")) << "no checkpoint of the step it stopped after:\n" << out;
  }
}

// A stop signal was run on whichever thread it found, often one inside a oneDNN JIT GEMM, whose stack
// pointer points into the heap while it runs (oneDNN issue 4845): the signal's frame was written over
// the heap, and the run aborted ("corrupted size vs. prev_size", "free(): invalid pointer") with
// nothing saved. The stop signals are now blocked in every thread but one of their own, which
// computes nothing: the main thread and OpenMP's workers (--threads 2) block them all.
TEST(Reliability, StopSignalsAreTakenByAThreadThatComputesNothing) {
  TempDir d;
  const std::string out = shell(
      "$AMP --width 64 --layers 2 --batch-size 4 --log-every 0 --threads 2 --steps 100000000 --save-weights w.st "
      "--metrics m.jsonl > out.txt 2>&1 & p=$!; " + kAfterThreeSteps +
      "for t in /proc/$p/task/*; do echo \"task ${t##*/} $( [ ${t##*/} = $p ] && echo main) "
      "blocked=$(grep ^SigBlk $t/status | cut -f2)\"; done; kill -TERM $p; wait $p; echo exit=$?; cat out.txt", d);
  expect_stopped_by(out, d);
  const std::regex task("task [0-9]+ (main)? ?blocked=([0-9a-f]+)");
  int threads = 0, receivers = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), task); it != std::sregex_iterator(); ++it) {
    ++threads;
    const unsigned long long mask = std::stoull((*it)[2].str(), nullptr, 16);
    int open = 0;
    for (const int s : {SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP}) open += (mask >> (s - 1) & 1) == 0;
    if (open == 0) continue;
    ++receivers;
    EXPECT_EQ(open, 5) << "a thread takes some stop signals, not all: " << it->str();
    EXPECT_FALSE((*it)[1].matched) << "the main thread takes stop signals:\n" << out;
  }
  EXPECT_GE(threads, 3) << "no OpenMP worker to check (main, the signals' thread, a worker):\n" << out;
  EXPECT_EQ(receivers, 1) << out;
}

// The crash itself, as a user met it: SIGTERM while the synthetic pool is made (thousands of small
// GEMMs, about 2 s) aborted 1 run in 4 here. Ten stops, each at a random moment of it: each one saves.
TEST(Reliability, ASigtermDuringTheCpuGemmsCorruptsNothing) {
  for (int i = 0; i < 10; ++i) {
    SCOPED_TRACE("stop " + std::to_string(i));
    TempDir d;
    const std::string out = shell(
        "$AMP --width 256 --batch-size 16 --micro-batches 2 --amp fp16 --log-every 0 --threads 1 --steps 150000 "
        "--save-weights w.st --metrics m.jsonl > out.txt 2>&1 & p=$!; "
        "for i in $(seq 1500); do grep -q \"rank(s)\" out.txt && break; sleep 0.02; done; "
        "sleep 0.$((RANDOM % 9 + 1)); kill -TERM $p; wait $p; "
        "echo exit=$?; cat out.txt", d);
    EXPECT_FALSE(has(out, "corrupted") || has(out, "free()") || has(out, "malloc")) << out;
    expect_stopped_by(out, d);
  }
}

// A default --threads cut by the affinity (mpirun binds each of 2 or fewer ranks to one core; taskset)
// said only "1 thread(s) a rank": a user on a 16-core node trained on one core, not knowing why.
TEST(Reliability, AThreadCountCutByTheAffinitySaysWhy) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one CPU: no thread count to cut";
  TempDir d;
  const std::string flags = " --device cpu --width 16 --layers 1 --batch-size 2 --steps 1 --log-every 0 ";
  // One CPU of those this process may run on (a container's cpuset need not hold CPU 0).
  const std::string one = "taskset -c $(grep ^Cpus_allowed_list /proc/self/status | cut -f2 | cut -d, -f1 | cut -d- -f1) ";
  const std::string out = shell(one + "$AMP" + flags + "; echo ---; mpirun -np 1 --oversubscribe $AMP" + flags +
                                "; echo ---; " + one + "$AMP" + flags + "--threads 1", d);
  const size_t first = out.find("---"), second = out.find("---", first + 3);
  ASSERT_NE(second, std::string::npos) << out;
  const std::string taskset = out.substr(0, first), mpirun = out.substr(first, second - first), asked = out.substr(second);
  EXPECT_TRUE(has(taskset, "notice: 1 thread(s) a rank: each rank may run on 1 of the node's")) << taskset;
  EXPECT_TRUE(has(taskset, "taskset, a cpuset or the launcher's binding")) << "blames another: " << taskset;
  EXPECT_TRUE(has(mpirun, "notice: 1 thread(s) a rank: each rank may run on 1 of the node's")) << mpirun;
  EXPECT_TRUE(has(mpirun, "mpirun binds each rank to one core")) << mpirun;
  EXPECT_FALSE(has(asked, "notice: 1 thread(s)")) << "--threads given: nothing to explain\n" << asked;
}

// srun --mpi=none's tasks are refused (each a world of its own), but --help is help, however started:
// it printed the refusal.
TEST(Reliability, HelpIsHelpUnderAnSrunThatMpiDoesNotSpeak) {
  TempDir d;
  const std::string out = shell("export SLURM_STEP_NUM_TASKS=4 SLURM_PROCID=3; $AMP --help > help.txt 2>&1; echo help=$?; "
                                "$AMP --steps 1 > run.txt 2>&1; echo run=$?; cat help.txt run.txt", d);
  EXPECT_TRUE(has(out, "help=0")) << out;
  EXPECT_TRUE(has(out, "--steps")) << "no flags listed: " << out;
  EXPECT_TRUE(has(out, "run=2")) << out;
  EXPECT_TRUE(has(out, "a world of its own")) << out;
}

// Under nohup (SIGHUP ignored), a SIGHUP is no stop request: the run outlives the terminal, as asked.
TEST(Reliability, NohupsSighupStaysIgnored) {
  TempDir d;
  const std::string out = shell(
      "(trap \"\" HUP; exec $AMP --width 16 --layers 1 --batch-size 2 --log-every 0 --threads 1 --steps 100000000 "
      "--metrics m.jsonl --save-weights w.st > out.txt 2>&1) & p=$!; " +
      kAfterThreeSteps + "kill -HUP $p; sleep 0.5; kill -0 $p && echo alive; kill -TERM $p; wait $p; echo exit=$?; cat out.txt",
      d);
  EXPECT_TRUE(has(out, "alive")) << out;
  expect_stopped_by(out, d, "SIGTERM", 143);
}

// `amp_train ... | head` (here a grep that stops at step 3's line, so that the header lines written
// before training are read): the reader gone, the next progress line raised SIGPIPE, whose default
// ended the run at once with nothing saved (no weights, no checkpoint, no end record). It is a stop
// request as SIGTERM is.
TEST(Reliability, StandardOutputsReaderGoneStopsAfterTheStepAndSaves) {
  TempDir d;
  const std::string out = shell(
      "$AMP --width 64 --layers 2 --batch-size 4 --log-every 1 --threads 1 --steps 100000000 --checkpoint-dir ck "
      "--checkpoint-every 1000000 --save-weights w.st --metrics m.jsonl 2> err.txt | grep -m 1 \"^step 3/\" > /dev/null; "
      "echo exit=${PIPESTATUS[0]}; cat err.txt; ls ck",
      d);
  expect_stopped_by(out, d, "SIGPIPE", 141);
  EXPECT_TRUE(has(out, "interrupted (SIGPIPE, standard output's reader is gone)")) << out;
  EXPECT_TRUE(has(out, "step-")) << "no checkpoint of the step it stopped after:\n" << out;
}

// A stop is acknowledged as it comes, not when the step in flight ends: here that step never ends
// (rank 0 stalls in it), and a user who saw nothing would press Ctrl-C again and lose the save. Ctrl-C
// again, more than 2 s after the first, then stops at once (exit 130): the second SIGINT is raised
// again, with its default action, by the one thread that takes the stop signals.
TEST(Reliability, AStopIsAcknowledgedAsItArrivesAndCtrlCAgainStopsAtOnce) {
  TempDir d;
  const std::string out = shell(
      "AMP_DEBUG_STALL=0:3 $AMP --width 16 --layers 1 --batch-size 2 --log-every 0 --threads 1 --steps 10 "
      "> out.txt 2>&1 & p=$!; until grep -q stalling out.txt; do sleep 0.05; done; kill -INT $p; "
      "for i in $(seq 100); do grep -q interrupted out.txt && break; sleep 0.05; done; sleep 2.3; kill -INT $p; "
      "for i in $(seq 100); do kill -0 $p 2>/dev/null || break; sleep 0.05; done; "
      "kill -0 $p 2>/dev/null && { echo still_running; kill -KILL $p; }; wait $p; echo exit=$?; cat out.txt",
      d);
  EXPECT_TRUE(has(out, "stalling at step 3")) << out;
  EXPECT_TRUE(has(out, "amp_train: interrupted (SIGINT): stopping after the step in flight; Ctrl-C again (after 2 s) "
                       "stops at once")) << out;
  EXPECT_FALSE(has(out, "still_running")) << out;
  EXPECT_TRUE(has(out, "exit=130")) << "the stalled step was not the one Ctrl-C again stopped: " << out;
}

// Output that nobody reads (mpirun, signalled, stops reading its ranks' output, then kills them a
// second later): the run's progress lines fill the pipe and its write blocks; a SIGTERM then still
// stops it after the step, with its weights and the metrics' end. It used to stay blocked in that
// write (restarted after the handler) until killed, saving nothing.
TEST(Reliability, ASigtermStopsARunBlockedOnOutputThatNobodyReads) {
  TempDir d;
  const std::string out = shell(
      "mkfifo out.fifo; sleep 600 < out.fifo & r=$!; "  // a reader that never reads
      "$AMP --width 16 --layers 1 --batch-size 2 --log-every 1 --threads 1 --steps 100000000 --save-weights w.st "
      "--metrics m.jsonl > out.fifo 2>&1 & p=$!; "
      "n=0; m=-1; t=0; while [ $n = 0 ] || [ $n != $m ]; do m=$n; sleep 1; t=$((t+1)); [ $t -gt 60 ] && break; "
      "n=$(wc -l < m.jsonl 2>/dev/null || echo 0); done; "
      "echo blocked_at=$n; kill -TERM $p; "
      "for i in $(seq 150); do kill -0 $p 2>/dev/null || break; sleep 0.1; done; "
      "kill -0 $p 2>/dev/null && { echo still_blocked; kill -KILL $p; }; wait $p; echo exit=$?; kill $r", d);
  ASSERT_TRUE(has(out, "blocked_at=")) << out;
  EXPECT_FALSE(has(out, "blocked_at=0\n")) << out;
  EXPECT_FALSE(has(out, "still_blocked")) << out;
  expect_stopped_by(out, d);
}

// --- 7. Sampling prints every byte, and stops when asked ------------------------------------------

TEST(Reliability, SamplingPrintsEveryByteAndItsClosingLine) {
  TempDir d;
  const RunResult r = run(kGpt + "--steps 1 --data " + corpus(d) + " --sample-tokens 3000 --temperature 5 --prompt x");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string head = "continuing the prompt:\nx";
  const size_t from = r.out.find(head), to = r.out.rfind("\n---\n");
  ASSERT_NE(from, std::string::npos) << r.out;
  ASSERT_NE(to, std::string::npos) << "no closing line";
  EXPECT_EQ(to - (from + head.size()), 3000u) << "bytes printed";
}

// A sample that cannot be written (a full disk, /dev/full) is a requested output lost: exit 1, said.
// It exited 0 with nothing on standard error.
TEST(Reliability, ASampleThatCannotBeWrittenIsAFailure) {
  TempDir d;
  const std::string out = shell("$AMP" + kGpt + "--steps 1 --data " + corpus(d) + " --sample-tokens 400 > /dev/full; echo exit=$?", d);
  EXPECT_TRUE(has(out, "exit=1")) << out;
  EXPECT_TRUE(has(out, "error: the sample (")) << out;
  EXPECT_TRUE(has(out, "bytes) could not be written to standard output: No space left on device")) << out;
}

TEST(Reliability, SamplingAndEvaluationStopAtTheNextTokenOrBatch) {
  TempDir d;
  const std::string text = corpus(d);
  // Sampling: a million bytes would take many minutes; the stop comes at the next one.
  std::string out = shell("$AMP" + kGpt + "--steps 1 --data " + text +
                              " --sample-tokens 1000000 --metrics m.jsonl > out.txt 2>&1 & p=$!; "
                              "until grep -q end m.jsonl 2>/dev/null; do sleep 0.05; done; sleep 0.3; "
                              "kill -TERM $p; wait $p; echo exit=$?; cat out.txt",
                          d);
  EXPECT_TRUE(has(out, "exit=143")) << out;
  EXPECT_TRUE(has(out, "--- interrupted:")) << out;
  // Evaluation: a million batches at step 0.
  out = shell("$AMP" + kGpt + "--steps 5 --data " + text +
                  " --eval-every 1 --eval-batches 1000000 --metrics e.jsonl --save-weights w.st > out.txt 2>&1 & p=$!; "
                  "until grep -q scaling out.txt 2>/dev/null; do sleep 0.05; done; sleep 1; "
                  "kill -TERM $p; wait $p; echo exit=$?; cat out.txt",
              d);
  EXPECT_TRUE(has(out, "exit=143")) << out;
  EXPECT_TRUE(has(out, "during the evaluation")) << out;
  const auto recs = read_jsonl(d.file("e.jsonl"));
  ASSERT_FALSE(recs.empty()) << out;
  EXPECT_EQ(recs.back()["interrupted_by"], "SIGTERM") << out;
  // Stopped before its first step: the weights it started from are not saved (they were, over
  // whatever the file held).
  EXPECT_FALSE(fs::exists(d.file("w.st"))) << out;
  EXPECT_TRUE(has(out, "stopped before the first step: --save-weights w.st is not written")) << out;
}

// --- 6. and 8. Integer flags against what their products need -------------------------------------

TEST(Reliability, ThreadsAndMicroBatchesBeyondTheirLimitsAreUsageErrors) {
  for (const std::string threads : {"40000", "70000"}) {
    const RunResult r = run(kMlp + "--threads " + threads);
    expect_usage_error(r, "--threads", threads);
  }
  const RunResult eval = run(kMlp + "--eval-batches 4611686018427387904");
  expect_usage_error(eval, "--eval-batches");
  for (const std::string k : {"9223372036854775807", "4611686018427387904"}) {
    const RunResult r = run(kMlp + "--micro-batches " + k);
    expect_usage_error(r, "--micro-batches", k);
  }
  // A step of a trillion micro-batches never ends, and a stop request waits for the step in flight:
  // it ran on, ignoring SIGTERM. At most 65536.
  for (const std::string k : {"1000000000000", "65537"}) {
    const RunResult r = run(kMlp + "--micro-batches " + k);
    expect_usage_error(r, "--micro-batches", k);
    EXPECT_NE(r.out.find("must be at most 65536"), std::string::npos) << r.out;
  }
}

// --- 9., 10. and 13. Checkpoints and resumes ---------------------------------------------------

// trainer.json changed and its checksum made again (by hand, or by a tool): what it says is still checked.
void forge_trainer_json(const std::string& path, const std::function<void(nlohmann::json&)>& change) {
  nlohmann::json meta = nlohmann::json::parse(bytes_of(path));
  change(meta);
  meta.erase("checksum");
  const std::string compact = meta.dump();
  meta["checksum"] = hex64(fnv1a(compact.data(), compact.size()));  // a valid checksum
  write(path, meta.dump(2));
}

TEST(Reliability, ACheckpointOfANewerFormatIsRefused) {
  TempDir d;
  ASSERT_EQ(run(kMlp + "--checkpoint-dir " + d.file("ck")).code, 0);
  const std::string meta_path = d.file("ck/step-00000002/trainer.json");
  const std::string whole = bytes_of(meta_path);
  forge_trainer_json(meta_path, [](nlohmann::json& m) { m["format"] = 3; });  // only the format is new
  RunResult r = run(kMlpFlags + "--steps 4 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "format 3") && has(r.out, "newer")) << r.out;
  // No must_match: named as such (it was read as empty: "amp \"off\" does not match the checkpoint's nothing").
  write(meta_path, whole);
  forge_trainer_json(meta_path, [](nlohmann::json& m) { m.erase("must_match"); });
  r = run(kMlpFlags + "--steps 4 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "corrupt: no must_match object")) << r.out;
}

TEST(Reliability, ARequeuedCommandWithNothingLeftWritesOnlyWhatThatRunLacks) {
  TempDir d;
  const std::string args = kMlp + "--checkpoint-dir " + d.file("ck") + " --metrics " + d.file("m.jsonl") +
                           " --save-weights " + d.file("w.st") + " --resume";
  ASSERT_EQ(run(args).code, 0);
  const std::string metrics = bytes_of(d.file("m.jsonl")), weights = bytes_of(d.file("w.st"));
  const RunResult again = run(args);  // the same command, as a requeue reruns it
  EXPECT_EQ(again.code, 0) << again.out;
  EXPECT_TRUE(has(again.out, "nothing left")) << again.out;
  EXPECT_EQ(bytes_of(d.file("m.jsonl")), metrics);
  EXPECT_EQ(bytes_of(d.file("w.st")), weights);
  // That run's last checkpoint written, then its weights lost to a full disk (exit 1, a failed
  // record): the requeued command wrote nothing and exited 0, the weights missing. Now they are
  // written from the checkpoint, the same bytes, and the metrics end as a finished run's.
  const auto records = read_jsonl(d.file("m.jsonl"));
  nlohmann::ordered_json end = records.back();
  end.erase("device_memory_bytes");  // a GPU's peak: a run that trains nothing has none
  std::string failed = metrics.substr(0, metrics.rfind('\n', metrics.size() - 2) + 1);
  write(d.file("m.jsonl"), failed + "{\"event\":\"failed\",\"steps\":2,\"error\":\"--save-weights: disk full\"}\n");
  fs::remove(d.file("w.st"));
  const RunResult requeued = run(args);
  EXPECT_EQ(requeued.code, 0) << requeued.out;
  EXPECT_TRUE(has(requeued.out, "writing that run's outputs from it")) << requeued.out;
  ASSERT_TRUE(fs::exists(d.file("w.st"))) << "the weights of a run that ended were never written";
  EXPECT_EQ(bytes_of(d.file("w.st")), weights);
  const auto after = read_jsonl(d.file("m.jsonl"));
  EXPECT_EQ(after.back(), end) << "the metrics do not end with the finished run's end record";
  // A requeue after that writes nothing more to the metrics.
  const std::string finished = bytes_of(d.file("m.jsonl"));
  ASSERT_EQ(run(args).code, 0);
  EXPECT_EQ(bytes_of(d.file("m.jsonl")), finished);
  // Past it, the flags ask for fewer steps than were trained: still a usage error.
  const RunResult fewer = run(kMlpFlags + "--steps 1 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(fewer.code, 2) << fewer.out;
  // A constant schedule resumed for more steps is the same schedule: no note says it differs.
  const RunResult longer = run(kMlpFlags + "--steps 4 --resume --checkpoint-dir " + d.file("ck"));
  EXPECT_EQ(longer.code, 0) << longer.out;
  EXPECT_FALSE(has(longer.out, "schedule differs")) << longer.out;
}

// A resume appends its records to the metrics: after a line cut short (the file truncated since), on a
// line of their own. The resume record was glued onto the cut line, and both were lost. A fresh run
// that replaces a file's records says so.
TEST(Reliability, AResumeAppendsAfterACutLineAndAFreshRunSaysItReplaces) {
  TempDir d;
  const std::string args = kMlpFlags + "--checkpoint-dir " + d.file("ck") + " --metrics " + d.file("m.jsonl");
  const RunResult first = run(args + " --steps 2");
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_FALSE(has(first.out, "replacing")) << first.out;
  const std::string whole = bytes_of(d.file("m.jsonl"));
  write(d.file("m.jsonl"), whole.substr(0, whole.size() - 10));
  const RunResult resumed = run(args + " --steps 4 --resume");
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  std::ifstream in(d.file("m.jsonl"));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3u + 1u + 2u + 1u) << bytes_of(d.file("m.jsonl"));  // 2 steps, the cut end, resume, 2 steps, end
  EXPECT_EQ(lines[2], whole.substr(whole.find("{\"event\":\"end\""), lines[2].size()));
  EXPECT_EQ(nlohmann::json::parse(lines[3])["event"], "resume");
  EXPECT_EQ(nlohmann::json::parse(lines[4])["step"], 3);
  const RunResult fresh = run(kMlpFlags + "--steps 1 --metrics " + d.file("m.jsonl"));
  ASSERT_EQ(fresh.code, 0) << fresh.out;
  EXPECT_TRUE(has(fresh.out, "notice: --metrics " + d.file("m.jsonl") + ": replacing what it holds")) << fresh.out;
}

TEST(Reliability, AResumeThatCannotBeBitwiseSaysSo) {
  TempDir d;
  const std::string args = " --width 8 --layers 2 --batch-size 2 --log-every 0 --threads 1 --checkpoint-dir " + d.file("ck");
  const RunResult first = run(args + " --micro-batches 3 --steps 2", kMpirun);
  ASSERT_EQ(first.code, 0) << first.out;
  const RunResult r = run(args + " --micro-batches 6 --steps 3 --resume");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "not bit for bit")) << r.out;
}

// --- 11. Config files -----------------------------------------------------------------------------

TEST(Reliability, ConfigFilesRefuseWhatOnlyACommandLineSaysAndReadAByteOrderMark) {
  TempDir d;
  write(d.file("inc.cfg"), "config = /nonexistent\n");
  RunResult r = run(kMlp + "--config " + d.file("inc.cfg"));
  expect_usage_error(r, "'config'");
  write(d.file("help.cfg"), "help = 1\n");
  r = run(kMlp + "--config " + d.file("help.cfg"));
  expect_usage_error(r, "'help'");
  write(d.file("bom.cfg"), "\xEF\xBB\xBFlr = 0.5\n");
  r = run(kMlp + "--config " + d.file("bom.cfg") + " --metrics " + d.file("m.jsonl"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_jsonl(d.file("m.jsonl")).front()["lr"], 0.5);
}

// --- 12. Loss scales that cannot train ------------------------------------------------------------

TEST(Reliability, LossScalesThatCannotTrainAreRefusedAlike) {
  for (const std::string flags : {"--amp fp16 --init-scale 1e-38", "--amp fp16 --loss-scale 1e-38",
                                   "--amp fp16 --init-scale 1e-10", "--amp fp16 --loss-scale 1e-10",
                                   "--amp bf16 --loss-scale 1e-39", "--amp bf16 --loss-scale dynamic --init-scale 1e-39"}) {
    const RunResult r = run(kMlp + flags);
    EXPECT_EQ(r.code, 2) << flags << ": " << r.out;
    const std::string flag = has(flags, "--init-scale") ? "--init-scale" : "--loss-scale";
    EXPECT_TRUE(has(r.out, flag)) << flags << ": " << r.out;
  }
  EXPECT_EQ(run(kMlp + "--amp bf16 --loss-scale 1e-10").code, 0) << "bf16 has fp32's range";
}

}  // namespace
}  // namespace amp
