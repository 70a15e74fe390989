// Every model's memory estimate (models/model_spec.h) bounds what a run uses: amp_train runs at a size
// its model dominates, and its peak resident memory (wait4's ru_maxrss) above the process's own (a
// tiny run's: the libraries a build loads differ, CUDA's among them) must lie within the estimate
// above MemoryEstimate::kProcessBytes, and that within 1.5 times it; kProcessBytes bounds the
// process's own. The check refuses a machine just smaller than the estimate, and passes one just
// larger. And a size far beyond any machine's memory exits 2 before allocating.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "models/model_spec.h"
#include "runtime/core/safetensors.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"

namespace {

using amp::models::MemoryEstimate;
using amp::models::RunShape;

// Runs amp_train with args (a data file, when given, is written first); its peak resident bytes, or
// -1 when it failed.
long double peak_resident_bytes(const std::vector<std::string>& args) {
  std::vector<std::string> argv_s = {AMP_TRAIN_BIN, "--device", "cpu", "--threads", "2", "--steps", "2", "--log-every", "0"};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    if (std::freopen("/dev/null", "w", stdout) == nullptr) ::_exit(127);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  rusage ru{};
  if (::wait4(child, &status, 0, &ru) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return static_cast<long double>(ru.ru_maxrss) * 1024;  // kilobytes on Linux
}

// The process alone: a tiny run's peak.
long double process_bytes() {
  static const long double bytes = peak_resident_bytes({"--width", "8", "--layers", "2", "--batch-size", "1"});
  return bytes;
}

struct Case {
  std::string model;
  amp::models::ModelFlagValues flags;
  RunShape run;
  std::vector<std::string> extra;  // the same run's other flags
};

void expect_estimate_bounds_the_run(const Case& c) {
  auto spec = amp::models::configure_model(c.model, c.flags);
  const MemoryEstimate m = spec->memory_estimate(c.run);
  const long double estimate = m.total();
  ASSERT_GT(m.model + m.activations, 0.0L) << c.model << " says nothing of its memory";
  // Just under and just over: the machine's memory is what the check compares with.
  EXPECT_NO_THROW(spec->check(c.run, estimate * 1.01L)) << c.model;
  EXPECT_THROW(spec->check(c.run, estimate * 0.99L), std::invalid_argument) << c.model;
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's shadow memory and quarantine are not the run's";
#else
  std::vector<std::string> args = {"--model", c.model, "--batch-size", std::to_string(c.run.batch_size)};
  for (const auto& [flag, value] : c.flags) args.insert(args.end(), {"--" + flag, value});
  args.insert(args.end(), c.extra.begin(), c.extra.end());
  if (c.run.data != "synthetic") args.insert(args.end(), {"--data", c.run.data});
  const long double process = process_bytes(), peak = peak_resident_bytes(args);
  ASSERT_GT(process, 0.0L) << "the tiny run failed";
  ASSERT_GT(peak, 0.0L) << c.model << ": the run failed";
  const long double mib = 1024.0L * 1024.0L, used = peak - process, said = estimate - MemoryEstimate::kProcessBytes;
  EXPECT_GE(MemoryEstimate::kProcessBytes, process) << "the process alone uses " << process / mib << " MiB";
  EXPECT_GE(said, used) << c.model << ": estimated " << said / mib << " MiB, used " << used / mib << " MiB";
  EXPECT_LE(said, 1.5L * used) << c.model << ": estimated " << said / mib << " MiB, used " << used / mib << " MiB";
  std::printf("%s: estimated %.0Lf MiB above the process, used %.0Lf MiB (%.2Lf x); the process %.0Lf MiB\n",
              c.model.c_str(), said / mib, used / mib, said / used, process / mib);
#endif
}

// A data file of n samples: x [n, in] and, for each name in ys, [n, cols] (seeded normal values).
std::string data_file(const amp::cli::TempDir& d, int64_t n, int64_t in, const std::vector<std::pair<std::string, int64_t>>& ys) {
  amp::Generator gen(7);
  amp::safetensors::NamedTensors t = {{"x", amp::randn({n, in}, gen)}};
  for (const auto& [name, cols] : ys) t.emplace_back(name, amp::randn({n, cols}, gen));
  amp::safetensors::save(d.file("data.safetensors"), t);
  return d.file("data.safetensors");
}

TEST(MemoryEstimate, MlpWithAdamW) {
  amp::cli::TempDir d;
  RunShape run;
  run.data = data_file(d, 64, 3072, {{"y", 3072}});
  run.batch_size = 16;
  run.optimizer_slots = 2;
  expect_estimate_bounds_the_run({"mlp", {{"width", "3072"}, {"layers", "2"}}, run, {"--optimizer", "adamw"}});
}

TEST(MemoryEstimate, MlpWithLargeBatches) {
  amp::cli::TempDir d;
  RunShape run;
  run.data = data_file(d, 8192, 1024, {{"y", 1024}});
  run.batch_size = 4096;
  run.optimizer_slots = 0;
  expect_estimate_bounds_the_run({"mlp", {{"width", "1024"}, {"layers", "8"}}, run, {}});
}

TEST(MemoryEstimate, MultiTaskWithItsJacobian) {
  amp::cli::TempDir d;
  std::vector<std::pair<std::string, int64_t>> ys;
  for (int t = 1; t <= 48; ++t) ys.emplace_back("y" + std::to_string(t), 1);
  RunShape run;
  run.data = data_file(d, 128, 1000, ys);
  run.batch_size = 64;
  run.optimizer_slots = 0;
  expect_estimate_bounds_the_run(
      {"mtl", {{"in-features", "1000"}, {"hidden", "1000"}, {"features", "1000"}, {"tasks", "48"}}, run, {}});
}

// Synthetic data is a bound for a whole run (its pool fills as the steps go), not a 2-step run's.
TEST(MemoryEstimate, SyntheticDataCountsItsTeacherAndItsPool) {
  auto spec = amp::models::configure_model("mlp", {{"width", "1024"}, {"layers", "2"}});
  RunShape run;
  run.data = "synthetic";
  const long double teacher = (2.0L * 1024 * 1024 + 2 * 1024) * 4;
  const long double pool = static_cast<long double>(amp::models::pool_samples(2048)) * 2048 * 4;
  EXPECT_EQ(spec->memory_estimate(run).data, teacher + pool);
  EXPECT_LE(pool, 256.0L * 1024 * 1024) << "dataset.cpp's budget";
}

// A text for the GPT: a verse 4000 times.
std::string text_file(const amp::cli::TempDir& d, const std::string& verse) {
  std::ofstream out(d.file("text.txt"));
  for (int i = 0; i < 4000; ++i) out << verse;
  return d.file("text.txt");
}

// The attention weights [B, H, T, T]: what the probe's 17 GiB run underestimated (issue 41).
TEST(MemoryEstimate, GptWithLongBlocks) {
  amp::cli::TempDir d;
  RunShape run;
  run.data = text_file(d, "In the beginning God created the heaven and the earth. ");
  run.batch_size = 8;
  run.optimizer_slots = 0;
  expect_estimate_bounds_the_run(
      {"gpt", {{"n-layer", "2"}, {"n-head", "2"}, {"n-embd", "32"}, {"block-size", "1024"}}, run, {}});
}

TEST(MemoryEstimate, GptUnderAutocast) {
  amp::cli::TempDir d;
  RunShape run;
  run.data = text_file(d, "And the earth was without form, and void. ");
  run.batch_size = 8;
  run.optimizer_slots = 2;
  run.autocast = true;
  expect_estimate_bounds_the_run({"gpt", {{"n-layer", "1"}, {"n-head", "4"}, {"n-embd", "64"}, {"block-size", "1024"}},
                                  run, {"--optimizer", "adamw", "--amp", "bf16"}});
}

// Far beyond any machine: refused at set-up, naming the flag, before anything is allocated.
TEST(MemoryEstimate, ASizeNoMachineHasIsRefusedBeforeAllocating) {
  amp::cli::TempDir d;
  std::ofstream(d.file("t.txt")) << std::string(100000, 'a');
  const amp::cli::RunResult r =
      amp::cli::run("--model gpt --n-layer 1 --n-head 2 --n-embd 32 --block-size 4096 --batch-size 65536 --data " +
                    d.file("t.txt"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--batch-size 65536"), std::string::npos) << r.out;
}

}  // namespace
