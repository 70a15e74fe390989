// amp_train as users run it: flag validation, --config layering, bad safetensors files, the
// weights round trip, the metrics format, --device cuda without a GPU, and a stalled rank.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/ops/ops.h"
#include "runtime/ops/random.h"
#include "runtime/core/safetensors.h"
#include "cli_util.h"
#include "emulated_counters.h"
#include "test_util.h"

namespace amp {
namespace {

namespace fs = std::filesystem;
using namespace cli;

const std::string kNoSteps = " --width 8 --layers 2 --batch-size 4 --log-every 0 --threads 1 ";
const std::string kSmall = kNoSteps + "--steps 2 ";

TEST(Cli, HelpListsEveryFlagWithDefaults) {
  const RunResult r = run("--help");
  EXPECT_EQ(r.code, 0);
  // The usage line ends with Boost's ':' (a line holding only ':' followed it).
  EXPECT_NE(r.out.find("Usage: mpirun -np N amp_train [options]:\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\n:\n"), std::string::npos) << r.out;
  for (const char* flag : {"--model", "--width", "--layers", "--data", "--init-weights", "--save-weights", "--steps",
                           "--batch-size", "--micro-batches", "--optimizer", "--lr", "--momentum", "--weight-decay",
                           "--seed", "--amp", "--loss-scale", "--init-scale", "--growth-factor", "--backoff-factor",
                           "--growth-interval", "--hysteresis", "--min-scale", "--max-scale", "--clip-grad-norm",
                           "--clip-grad-value", "--grad-penalty", "--device", "--metrics", "--log-every",
                           "--inject-nonfinite", "--bf16-rounded-weight-grads", "--comm-timeout", "--check-every", "--threads", "--config"})
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  EXPECT_NE(r.out.find("--growth-interval arg (=2000)"), std::string::npos);
  // Defaults as a person writes them, and PyTorch's: SGD's momentum 0, AdamW's weight decay 0.01.
  EXPECT_NE(r.out.find("--momentum arg (=0.0)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--beta2 arg (=0.999)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--init-scale arg (=65536.0)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--weight-decay arg (=sgd: 0.0, adamw: 0.01)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("0000000"), std::string::npos) << "a default printed with 17 digits:\n" << r.out;
  for (const char* flag : {"--lr-schedule", "--warmup-steps", "--min-lr", "--decay-steps", "--beta1"})
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  for (const char* flag : {"--n-layer arg (=4)", "--n-head arg (=4)", "--n-embd arg (=128)", "--block-size arg (=64)",
                           "--dropout arg (=0.0)", "--eval-every", "--eval-batches", "--sample-tokens",
                           "--temperature arg (=0.8)", "--top-k arg (=200)", "--prompt", "--checkpoint-dir",
                           "--checkpoint-every", "--keep-checkpoints arg (=3)", "--resume", "--resume-from",
                           "--attention arg (=auto)", "--gelu arg (=erf)", "--allow-tf32", "--profile-step arg (=0)", "--cuda-graphs arg (=auto)"})
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
}

TEST(Cli, EveryFlagIsValidated) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"--amp fp32", "'--amp'"},           {"--optimizer lamb", "'--optimizer'"},
      {"--device tpu", "'--device'"},       {"--loss-scale huge", "'--loss-scale'"},
      {"--loss-scale -4", "'--loss-scale'"}, {"--model gpt", "--model"},
      {"--model mtl --tasks 0", "--tasks"}, {"--model mtl --in-features 0", "--in-features"},
      {"--model mtl --aggregator upgrade", "--aggregator"}, {"--model mtl --aggregator krum", "n_byzantine + 3"},
      {"--model mtl --aggregator constant:1,2,3", "it needs --tasks 3, one weight a task"}, {"--model mtl --grad-penalty 0.1", "--grad-penalty"},
      // In the flag's terms, then TorchJD's message, with the Jacobian's shape as the run's (it named the
      // [2, 3] matrix tried).
      {"--model mtl --aggregator trimmedmean:1", "--aggregator trimmedmean:1 with --tasks 2: it needs --tasks 3 or more "
       "(TorchJD: Parameter `matrix` should be a matrix of at least 3 rows (i.e. `2 * trim_number + 1`). Found `matrix` of "
       "shape `[2, 73]`"},
      {"--model mtl --aggregator krum:1", "it needs --tasks 4 or more"},
      // Each argument in its own terms, strictly decimal (a space, hex and 1e-50, which float32 holds as
      // 0, were taken).
      {"--model mtl --aggregator trimmedmean:-1", "T (the values trimmed at each end of a column) must be 0 or more, got -1"},
      {"--model mtl --aggregator krum:1:0", "K (the rows selected) must be 1 or more, got 0"},
      {"--model mtl --aggregator krum:-1", "F (the rows taken as byzantine) must be 0 or more, got -1"},
      {"--model mtl --aggregator krum:+x", "'+x' is not an integer"},
      {"--model mtl --aggregator trimmedmean:0x1", "'0x1' is not an integer"},
      {"--model mtl --aggregator krum:99999999999", "'99999999999' is out of range"},
      {"--model mtl --aggregator constant:1e-50,1", "'1e-50' is not a decimal number in float32's range"},
      {"--model mtl --aggregator constant:0x10,1", "'0x10' is not a decimal number"},
      {"--model mtl --aggregator 'constant:1,2 '", "'2 ' is not a decimal number"},
      {"--model mtl --aggregator 'constant: 1,2'", "' 1' is not a decimal number"},
      {"--model mtl --aggregator constant:inf,1", "'inf' is not a decimal number"},
      {"--width 0", "--width"},             {"--layers 0", "--layers"},
      {"--steps 0", "--steps"},             {"--batch-size 0", "--batch-size"},
      {"--micro-batches 0", "--micro-batches"}, {"--lr -1", "--lr"},
      {"--momentum 1", "--momentum"},       {"--weight-decay -1", "--weight-decay"},
      {"--clip-grad-norm -1", "--clip-grad-norm"}, {"--clip-grad-value -1", "--clip-grad-value"},
      {"--grad-penalty -1", "--grad-penalty"}, {"--init-scale 0", "--init-scale"},
      {"--growth-factor 1", "--growth-factor"}, {"--backoff-factor 1", "--backoff-factor"},
      {"--growth-interval 0", "--growth-interval"}, {"--hysteresis 0", "--hysteresis"},
      {"--min-scale -1", "--min-scale"},    {"--min-scale 4 --max-scale 2", "--max-scale"},
      {"--threads -1", "--threads"},        {"--comm-timeout 0", "--comm-timeout"},
      {"--check-every -1", "--check-every"}, {"--log-every -1", "--log-every"},
      {"--bucket-mb 0", "--bucket-mb"},     {"--bucket-mb inf", "--bucket-mb"},
      {"--grad-penalty inf", "--grad-penalty"}, {"--clip-grad-norm inf", "--clip-grad-norm"},
      {"--min-scale inf", "--min-scale"},   {"--init-scale 8 --max-scale 4", "--init-scale"},
      {"--comm-timeout inf", "--comm-timeout"},     {"--inject-nonfinite 0", "--inject-nonfinite"},
      {"--amp fp16 --loss-scale 0x10", "--loss-scale"}, {"--amp fp16 --loss-scale ' 16'", "--loss-scale"},
      {"--amp fp16 --inject-nonfinite ' 1'", "--inject-nonfinite"}, {"--amp fp16 --inject-nonfinite 1:+x", "--inject-nonfinite"},
      {"--inject-nonfinite 1:5", "--inject-nonfinite"}, {"--inject-nonfinite x", "--inject-nonfinite"},
      {"--steps many", "--steps"},          {"--no-such-flag", "no-such-flag"},
      {"--config /nonexistent.cfg", "--config"}, {"--lr-schedule linear", "'--lr-schedule'"},
      {"--warmup-steps -1", "--warmup-steps"}, {"--min-lr 1", "--min-lr"},
      {"--beta1 1", "--beta1"},              {"--beta2 -0.1", "--beta2"},
      {"--decay-steps -1", "--decay-steps"},
      {"--lr-schedule cosine --warmup-steps 2", "--warmup-steps"},
      {"--profile-step 3", "--profile-step"}, {"--profile-step -1", "--profile-step"},
      {"--cuda-graphs sometimes", "'--cuda-graphs'"},
      {"--cuda-graphs on --device cpu", "--cuda-graphs on: the step cannot be captured: the device is the CPU"},
      // Flags that would change nothing in this run: refused, not ignored. A seed of -1 was read as 2^64 - 1.
      {"--optimizer adamw --momentum 0.9", "--momentum: only --optimizer sgd uses it"},
      {"--beta2 0.99", "--beta2: only --optimizer adamw uses it"},
      {"--warmup-steps 3", "--warmup-steps: only --lr-schedule cosine uses it"},
      {"--min-lr 0.001", "--min-lr: only --lr-schedule cosine uses it"},
      {"--amp bf16 --init-scale 8", "--init-scale: only a dynamic loss scale (--amp fp16, or --loss-scale dynamic; "
                                    "this run's scale is off) uses it"},
      {"--amp fp16 --loss-scale 1024 --growth-interval 5", "--growth-interval: only a dynamic loss scale"},
      {"--amp fp16 --loss-scale 1024 --init-scale 8", "this run's scale is the constant --loss-scale"},
      {"--seed -1", "--seed must be a whole number from 0 to 18446744073709551615, got '-1'"},
      {"--seed 18446744073709551616", "--seed must be a whole number"},
      {"--micro-batches 65537", "--micro-batches must be at most 65536"},
      {"--amp fp16 --growth-factor inf", "--growth-factor must be a number > 1 within float32's range"},
      // The scaler's factors in float32 (1e39 is inf there: the scale never grew; 1e-310 is 0: the first
      // backoff collapsed the scale), and Krum's F + 3 in 64 bits (it wrapped: krum:2147483647:1 trained
      // 3 tasks with wrong weights).
      {"--amp fp16 --growth-factor 1e39", "--growth-factor must be a number > 1 within float32's range"},
      {"--amp fp16 --backoff-factor 1e-310", "--backoff-factor must be in (0, 1), at least"},
      {"--model mtl --tasks 3 --aggregator krum:2147483647:1", "it needs --tasks 2147483650 or more"},
      {"--amp fp16 --max-scale 0", "--init-scale must lie in [--min-scale, --max-scale], here [0.0, 0.0] (its default "
                                   "is 65536.0), got 65536.0"}};
  for (const auto& [args, needle] : bad) {
    const RunResult r = run(args + kSmall);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << " -> " << r.out;
    EXPECT_NE(r.out.find("error"), std::string::npos) << args << " -> " << r.out;
  }
}


// The GPT's and the checkpoints' flags: out of range, given to a model that does not use them, or
// combined so that one would be silently ignored: each refused with exit 2, naming the flag.
// Many tasks: the flags' check tries the aggregator on 2 rows where its refusals do not count rows (on
// 6000 rows UPGrad's trial took most of an hour before the missing file was said), and a run whose
// aggregation grows steeply with the tasks says so before its first step (a stop waits for that step).
TEST(Cli, ManyTasksAreSaidAndCheckedQuickly) {
  RunResult r = run("--model mtl --tasks 6000 --steps 1 --data /nonexistent.safetensors");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("/nonexistent.safetensors"), std::string::npos) << r.out;
  r = run("--model mtl --tasks 5 --aggregator trimmedmean:3 --steps 1");  // its refusal still counts them
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("it needs --tasks 7 or more"), std::string::npos) << r.out;
  r = run("--model mtl --tasks 100 --steps 1 --log-every 0 --threads 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("note: at 100 tasks upgrad's aggregation may take seconds to minutes a step"), std::string::npos)
      << r.out;
  r = run("--model mtl --tasks 100 --aggregator mean --steps 1 --log-every 0 --threads 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("aggregation may take"), std::string::npos) << r.out;
}

TEST(Cli, GptAndCheckpointFlagsAreValidated) {
  const std::string gpt = " --model gpt --data " + test::generated_text_file("cli_flags", 4000) +
                          " --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --steps 2 --threads 1 ";
  const std::string mlp = " --steps 2 --batch-size 4 --threads 1 ";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {gpt + "--n-layer 0", "--n-layer"},          {gpt + "--n-head 0", "--n-head"},
      {gpt + "--n-embd 10 --n-head 3", "--n-embd"}, {gpt + "--block-size 0", "--block-size"},
      {gpt + "--dropout 1", "--dropout"},           {gpt + "--eval-every -1", "--eval-every"},
      {gpt + "--eval-batches 0", "--eval-batches"}, {gpt + "--sample-tokens -1", "--sample-tokens"},
      {gpt + "--temperature 0", "--temperature"},   {gpt + "--top-k 0", "--top-k"},
      {gpt + "--temperature 0.5", "--temperature: only a sample uses it, and --sample-tokens is 0"},
      {gpt + "--prompt hello", "--prompt: only a sample uses it"},
      {gpt + "--attention flash", "--attention"},   {mlp + "--attention composite", "--attention"},
      {gpt + "--gelu new", "--gelu"},               {mlp + "--gelu tanh", "--gelu"},
      // Numbers as typed (runtime/core/parse_number.h): a hexadecimal float (0x1p-3 was 0.125) and a
      // leading space were taken.
      {gpt + "--dropout 0x1p-3", "--dropout must be a finite number, got '0x1p-3'"},
      {gpt + "--sample-tokens ' 2'", "--sample-tokens must be a whole number, got ' 2'"},
      {gpt + "--sample-tokens 2 --temperature ' 0.5'", "--temperature must be a finite number, got ' 0.5'"},
      {mlp + "--eval-batches 3", "--eval-batches: only --eval-every N"},  // it was ignored
      {mlp + "--width 99999999999999999999", "--width 99999999999999999999 is out of range"},  // not "whole number"
      // cuDNN's attention where it cannot run: named with the reason, before any step.
      {gpt + "--attention cudnn --device cpu --amp bf16", "--attention cudnn: cuDNN runs on a GPU, and this run trains on the CPU"},
      {gpt + "--attention cudnn --dropout 0.1", "--attention cudnn: cuDNN's attention runs without dropout"},
      {gpt + "--attention cudnn --device cpu", "--attention cudnn: cuDNN runs on a GPU"},
      {gpt + "--attention cudnn", "--attention cudnn: "},  // --device auto: refused once the device is chosen
      {gpt + "--checkpoint-every -1", "--checkpoint-every"},
      {gpt + "--checkpoint-dir ck --keep-checkpoints 0", "--keep-checkpoints"},
      {gpt + "--width 64", "--width"},              {mlp + "--n-layer 2", "--n-layer"},
      {mlp + "--eval-every 2", "--eval-every"},     {mlp + "--prompt hello", "--prompt"},
      {mlp + "--tasks 3", "--tasks"},               {"--model mtl" + mlp + "--layers 3", "--layers"},
      {mlp + "--keep-checkpoints 2", "--keep-checkpoints"},
      {mlp + "--resume-from ck/step-00000001 --checkpoint-every 1", "--checkpoint-dir"},
      {mlp + "--resume-from ck/step-00000001 --init-weights w.safetensors", "--init-weights"},
      {mlp + "--resume --checkpoint-dir ck --resume-from ck/step-00000001", "--resume and --resume-from: give one"}};
  for (const auto& [args, needle] : bad) {
    const RunResult r = run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << " -> " << r.out;
  }
}

// --save-weights-format hf writes Hugging Face's GPT-2 layout, and --init-weights reads it back: a
// run of lr 0 saves what it loaded, byte for byte, and says that GPT-2's GELU is --gelu tanh; the MLP
// has no such format.
TEST(Cli, HuggingFacesGpt2LayoutRoundTrips) {
  TempDir d;
  const std::string gpt = " --model gpt --data " + test::generated_text_file("cli_hf", 4000) +
                          " --n-layer 2 --n-head 2 --n-embd 16 --block-size 8 --batch-size 2 --threads 1 --log-every 0 ";
  ASSERT_EQ(run(gpt + "--steps 2 --save-weights " + d.file("hf.safetensors") + " --save-weights-format hf").code, 0);
  const auto hf = safetensors::load(d.file("hf.safetensors"));
  EXPECT_EQ(hf.front().first, "h.0.attn.c_attn.bias") << "the hub's names, sorted";
  EXPECT_EQ(safetensors::find(hf, "h.0.attn.c_attn.weight", "hf").shape(), (Shape{16, 48})) << "Conv1D's [in, out]";
  const RunResult r = run(gpt + "--steps 1 --optimizer sgd --lr 0 --init-weights " + d.file("hf.safetensors") +
                          " --save-weights " + d.file("back.safetensors") + " --save-weights-format hf");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--gelu tanh computes what GPT-2 computes"), std::string::npos) << r.out;
  std::ifstream a(d.file("hf.safetensors"), std::ios::binary), b(d.file("back.safetensors"), std::ios::binary);
  EXPECT_TRUE(std::string(std::istreambuf_iterator<char>(a), {}) == std::string(std::istreambuf_iterator<char>(b), {}));
  const RunResult wrong = run(" --model gpt --data " + test::generated_text_file("cli_hf", 4000) +
                              " --n-layer 2 --n-head 2 --n-embd 32 --block-size 8 --steps 1 --init-weights " +
                              d.file("hf.safetensors"));
  EXPECT_EQ(wrong.code, 2) << wrong.out;
  EXPECT_NE(wrong.out.find("tensor 'h.0.attn.c_attn.bias' has shape [48], expected [96] (--n-layer 2, --n-embd 32"),
            std::string::npos)
      << wrong.out;
  // A weight that is not finite is named as the file names it (it was named as ours: transformer.ln_f.weight).
  auto nan = hf;
  for (auto& [n, t] : nan)
    if (n == "ln_f.weight") t = full({16}, std::numeric_limits<double>::quiet_NaN());
  safetensors::save(d.file("nan.safetensors"), nan);
  const RunResult bad = run(gpt + "--steps 1 --init-weights " + d.file("nan.safetensors"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("nan.safetensors: ln_f.weight holds inf or NaN"), std::string::npos) << bad.out;
  // nanoGPT's own layout with its blocks' causal-mask buffers (transformer.h.N.attn.bias, saved where
  // PyTorch had no flash attention) loads as without them: it was refused as an unexpected tensor.
  ASSERT_EQ(run(gpt + "--steps 1 --save-weights " + d.file("native.safetensors")).code, 0);
  auto with_masks = safetensors::load(d.file("native.safetensors"));
  for (const char* n : {"transformer.h.0.attn.bias", "transformer.h.1.attn.bias"}) with_masks.emplace_back(n, ones({1, 1, 8, 8}));
  safetensors::save(d.file("masks.safetensors"), with_masks);
  const RunResult masks = run(gpt + "--steps 1 --optimizer sgd --lr 0 --init-weights " + d.file("masks.safetensors") +
                              " --save-weights " + d.file("native_back.safetensors"));
  ASSERT_EQ(masks.code, 0) << masks.out;
  std::ifstream na(d.file("native.safetensors"), std::ios::binary), nb(d.file("native_back.safetensors"), std::ios::binary);
  EXPECT_TRUE(std::string(std::istreambuf_iterator<char>(na), {}) == std::string(std::istreambuf_iterator<char>(nb), {}));
  const RunResult mlp = run(" --steps 1 --save-weights " + d.file("m.safetensors") + " --save-weights-format hf");
  EXPECT_EQ(mlp.code, 2) << mlp.out;
  EXPECT_NE(mlp.out.find("--save-weights-format hf: --model mlp writes only its own layout"), std::string::npos) << mlp.out;
}

// A sample of token data prints ids, or text with GPT-2's vocab.json (--vocab-file; here one written
// from the byte map's definition for ids below 256, and names for the rest).
TEST(Cli, ASampleOfTokenDataIsIdsOrTextWithTheVocabFile) {
  TempDir d;
  std::string json = "{";
  for (int id = 0; id < 300; ++id) {
    std::string token;
    if (id >= 256) {
      token = "<|t" + std::to_string(id) + "|>";
    } else {
      int cp = id;
      const bool printable = (id >= 33 && id <= 126) || (id >= 161 && id <= 172) || (id >= 174 && id <= 255);
      if (!printable) {
        cp = 256;
        for (int b = 0; b < id; ++b) cp += !((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255));
      }
      char esc[16];
      std::snprintf(esc, sizeof esc, "\\u%04x", cp);
      token = esc;
    }
    json += (id ? ", \"" : "\"") + token + "\": " + std::to_string(id);
  }
  std::ofstream(d.file("vocab.json")) << json << "}";
  const std::string gpt = " --model gpt --data '" + test::generated_token_shards("cli_sample", 2, 300) +
                          "' --vocab-size 300 --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 "
                          "--steps 2 --threads 1 --log-every 0 --sample-tokens 5 --prompt-tokens 72,105 ";
  const RunResult ids = run(gpt);
  ASSERT_EQ(ids.code, 0) << ids.out;
  EXPECT_NE(ids.out.find("amp_train: data: 2 shard(s) of llm.c tokens (600 training tokens)"), std::string::npos) << ids.out;
  EXPECT_NE(ids.out.find("5 tokens sampled (temperature 0.8, top-k 200) after the prompt's 2 (token ids):\n"),
            std::string::npos) << ids.out;
  const RunResult text = run(gpt + "--vocab-file " + d.file("vocab.json"));
  ASSERT_EQ(text.code, 0) << text.out;
  EXPECT_NE(text.out.find("after the prompt's 2, decoded with --vocab-file:\nHi"), std::string::npos) << text.out;
  std::string wider = gpt;
  wider.replace(wider.find("--vocab-size 300"), 16, "--vocab-size 301");
  const RunResult bad = run(wider + "--vocab-file " + d.file("vocab.json"));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("no token has id 300, below --vocab-size 301"), std::string::npos) << bad.out;
}

// Token data's flags and files: each mistake refused before any step with exit 2, naming the flag or
// the file and what is wrong.
TEST(Cli, TokenDataMistakesAreRefusedNamingTheFlagOrFile) {
  TempDir d;
  const std::string shards = test::generated_token_shards("cli_tokens", 2, 200);
  const std::string dir = shards.substr(0, shards.rfind('/') + 1);
  const std::string text = test::generated_text_file("cli_tokens_text", 4000);
  const std::string gpt = " --model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --steps 2 --threads 1 ";
  std::ofstream(d.file("train.bin"), std::ios::binary) << std::string(400, '\1');  // headerless: nanoGPT's
  fs::create_directories(d.file("text"));
  std::ofstream(d.file("text/a.txt")) << std::string(400, 'a');
  test::write_llmc_shard(d.file("odd.bin"), std::vector<uint16_t>(40, 1));
  std::ofstream(d.file("odd.bin"), std::ios::binary | std::ios::app) << 'x';  // a byte past the header's count
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      // A glob that matches one text file named it 'no such file'; a directory or a device was called text.
      {gpt + "--data '" + d.file("text") + "/*.txt'", {"matches 1 file with no llm.c header: text is one file, named as it is"}},
      {gpt + "--data " + d.file("text") + " --vocab-size 300", {"--data: " + d.file("text") + ": is a directory"}},
      {gpt + "--data /dev/zero --vocab-size 300", {"--data: /dev/zero: is not a regular file"}},
      {gpt + "--data " + d.file("odd.bin") + " --vocab-size 300",
       {"odd.bin: the header says 40 tokens but the file holds 40 and one byte (81 bytes after the header)"}},
      {gpt + "--data '" + shards + "'", {"--vocab-size", "holds tokens"}},
      {gpt + "--data '" + shards + "' --vocab-size 100", {"train_000.bin: token 1", "is not below --vocab-size 100"}},
      {gpt + "--data '" + shards + "' --vocab-size 70000", {"--vocab-size must be at most 65536"}},
      {gpt + "--data '" + d.file("none_*.bin") + "' --vocab-size 300", {"--data", "matches no file"}},
      {gpt + "--data " + d.file("train.bin") + " --vocab-size 300", {"train.bin has no llm.c header", "--data-format u16"}},
      {gpt + "--data " + d.file("train.bin") + " --vocab-size 300 --data-format llmc", {"train.bin: not an llm.c token shard"}},
      {gpt + "--data " + text + " --eval-every 1 --val-data '" + shards + "'", {"--val-data", "is text"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --val-data '" + shards + "'",  // it was loaded, never used
       {"--val-data: only the validation loss uses it, and --eval-every is 0"}},
      {gpt + "--data " + text + " --vocab-size 100", {"--vocab-size", "is text (bytes)"}},
      {gpt + "--data " + text + " --vocab-size 512", {"--vocab-size", "the vocabulary is 256, got 512"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --sample-tokens 5", {"--prompt-tokens"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --prompt-tokens 5,x", {"--prompt-tokens", "'x'"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --prompt-tokens 300", {"--prompt-tokens", "below --vocab-size 300"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --sample-tokens 2 --prompt-tokens 1 --prompt Hi",
       {"--prompt: --data " + shards + " holds tokens: their prompt is --prompt-tokens"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --data-format bytes", {"--data-format"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --eval-every 1 --val-data '" + d.file("val_*.bin") + "'",
       {"--val-data", "matches no file"}},
      // An empty path (an unset variable in a script) turned the validation, or the decoding, off.
      {gpt + "--data '" + shards + "' --vocab-size 300 --val-data ''", {"--val-data: an empty path"}},
      {gpt + "--data '" + shards + "' --vocab-size 300 --sample-tokens 2 --prompt-tokens 1 --vocab-file ''",
       {"--vocab-file: an empty path"}},
      {" --steps 2 --batch-size 4 --threads 1 --data " + dir + "train_000.bin",
       {dir + "train_000.bin: --data is llm.c token data, which --model gpt trains on"}},
      // An output onto a file of the data's glob: refused before anything is written.
      {gpt + "--data '" + shards + "' --vocab-size 300 --save-weights " + dir + "train_001.bin",
       {"--save-weights", "train_001.bin", "--data"}},
  };
  for (const auto& [args, needles] : bad) {
    const RunResult r = run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    for (const std::string& n : needles) EXPECT_NE(r.out.find(n), std::string::npos) << args << " -> " << r.out;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << "trained: " << r.out;
  }
  // The same headerless file with --data-format u16 is nanoGPT's train.bin: 200 tokens of id 257.
  const RunResult u16 = run(gpt + "--data " + d.file("train.bin") + " --vocab-size 300 --data-format u16");
  EXPECT_EQ(u16.code, 0) << u16.out;
  EXPECT_NE(u16.out.find("1 shard(s) of uint16 tokens (200 training tokens)"), std::string::npos) << u16.out;
}

// --lr-schedule cosine is PyTorch's SequentialLR(LinearLR, CosineAnnealingLR, LambdaLR): the metrics'
// lr, step by step, equals the sequence PyTorch computed for the same chain (optim_pytorch.safetensors,
// "sched.warmup_cosine_floor": lr 0.1, 3 warmup steps, cosine to 1e-3 at step 10, then 1e-3).
// The GPU's own flags train on the CPU as if absent, and say so.
TEST(Cli, GpuOnlyFlagsOnTheCpuSaySoAndTrain) {
  const RunResult r = run(kSmall + "--device cpu --allow-tf32 --profile-step 1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("notice: --allow-tf32 has no effect on the CPU"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("notice: --profile-step has no effect on the CPU"), std::string::npos) << r.out;
}

TEST(Cli, CosineScheduleFollowsPyTorchsSequence) {
  TempDir d;
  const RunResult r = run(kNoSteps + "--steps 15 --lr 0.1 --lr-schedule cosine --warmup-steps 3 --min-lr 0.001 "
                          "--decay-steps 10 --metrics " + d.file("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  ASSERT_EQ(recs.size(), 16u);
  const std::vector<double> want = test::fixture_tensor("optim_pytorch.safetensors", "sched.warmup_cosine_floor").to_vector();
  for (size_t i = 0; i < 15; ++i) EXPECT_EQ(recs[i]["lr"].get<double>(), want[i]) << "step " << i + 1;
}

TEST(Cli, ConfigFileLayersUnderTheCommandLine) {
  TempDir d;
  std::ofstream(d.file("a.cfg")) << "# comment\nsteps = 5\nwidth = 6\nlayers = 2\nlr = 0.1\nlog-every = 0\n";
  const RunResult r = run("--config " + d.file("a.cfg") + " --steps 3 --threads 1 --metrics " + d.file("m.jsonl") +
                    " --save-weights " + d.file("w.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  EXPECT_EQ(recs.size(), 4u) << "the command line's --steps 3 wins over the file's 5";
  const auto w = safetensors::load(d.file("w.safetensors"));
  EXPECT_EQ(safetensors::find(w, "0.weight", "w").shape(), (Shape{6, 6})) << "the file's width applies";
  std::ofstream(d.file("bad.cfg")) << "stepz = 5\n";
  const RunResult b = run("--config " + d.file("bad.cfg") + kSmall);
  EXPECT_EQ(b.code, 2);
  EXPECT_NE(b.out.find("bad.cfg"), std::string::npos) << b.out;
}

// A skipped step names the gradients that were not finite: on the CPU from the gradients themselves,
// on a GPU (where the next step has run by the time the step's figures arrive) from the flags that
// the scaler's fused check writes per gradient, read back after a skipped step only; under a CUDA
// graph too (steps 6 and 7 are replays). The injection poisons the optimizer's first gradient. With
// clipping, the gradient norm's read is the check (GradScaler::check_inf_ with a fused pass), and the
// flags are written only where it found something.
TEST(Cli, ASkippedStepNamesItsNonFiniteGradients) {
  std::vector<std::string> devices = {"cpu"};
  if (cuda_usable(nullptr)) devices.push_back("cuda");
  std::vector<std::pair<std::string, std::string>> runs;  // device, extra flags
  for (const std::string& device : devices) runs.insert(runs.end(), {{device, ""}, {device, " --clip-grad-norm 1"}});
  for (const auto& [device, extra] : runs) {
    SCOPED_TRACE(device + extra);
    const RunResult r = run(kNoSteps + "--steps 8 --amp fp16 --inject-nonfinite 2 --inject-nonfinite 6 --device " + device + extra);
    ASSERT_EQ(r.code, 0) << r.out;
    for (const char* step : {"step 2", "step 6"})
      EXPECT_NE(r.out.find(std::string("rank 0: ") + step + " skipped: non-finite gradients in 0.weight\n"),
                std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("step 3 skipped"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("step 7 skipped"), std::string::npos) << r.out;
  }
}

TEST(Cli, MetricsHaveExactlyTheDesignedFields) {
  TempDir d;
  const RunResult r = run(kSmall + "--amp fp16 --inject-nonfinite 2 --metrics " + d.file("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  ASSERT_EQ(recs.size(), 3u);
  for (int i = 0; i < 2; ++i) {
    std::vector<std::string> keys;
    for (auto& [k, v] : recs[static_cast<size_t>(i)].items()) keys.push_back(k);
    std::vector<std::string> want = {"step", "loss", "scale", "skipped", "grad_norm", "lr", "step_ms", "comm_bytes"};
    if (emulated_device_counters() && cuda_usable(nullptr))  // --device auto trains on the emulated GPU
      for (const char* k : {"device_launches", "device_host_syncs", "device_d2h_copies", "device_graph_launches",
                            "device_graph_ops", "device_allocations"})
        want.push_back(k);
    EXPECT_EQ(keys, want);
  }
  EXPECT_EQ(recs[0]["scale"], 65536.0);
  EXPECT_EQ(recs[1]["skipped"], true);
  const auto& end = recs[2];
  EXPECT_EQ(end["event"], "end");
  EXPECT_EQ(end["steps"], 2);
  EXPECT_EQ(end["skipped_steps"], 1);
  EXPECT_EQ(end["final_scale"], 32768.0);
  EXPECT_EQ(end["param_checksum"].get<std::string>().size(), 16u);
  EXPECT_EQ(end["replicas_consistent"], true);
  int files = 0;
  for (auto& e : fs::directory_iterator(d.path)) files += e.is_regular_file();
  EXPECT_EQ(files, 1) << "no temporary file is left";
}

// The gradient norm costs a read of every gradient: reported when clipping computes it anyway, or
// when asked; otherwise null. Asking changes nothing else.
TEST(Cli, GradNormIsReportedWhenClippingOrAsked) {
  TempDir d;
  auto norms = [&](const std::string& extra, const std::string& name) {
    const RunResult r = run(kNoSteps + "--steps 3 --metrics " + d.file(name + ".jsonl") + " --save-weights " +
                            d.file(name + ".safetensors") + " " + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    std::vector<nlohmann::json> out;
    for (const auto& rec : read_jsonl(d.file(name + ".jsonl")))
      if (!rec.contains("event")) out.push_back(rec["grad_norm"]);
    return out;
  };
  const auto plain = norms("", "plain"), asked = norms("--log-grad-norm", "asked"), clipped = norms("--clip-grad-norm 1e9", "clip");
  ASSERT_EQ(plain.size(), 3u);
  ASSERT_EQ(asked.size(), 3u);
  ASSERT_EQ(clipped.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(plain[i].is_null()) << plain[i];
    ASSERT_TRUE(asked[i].is_number()) << asked[i];
    ASSERT_TRUE(clipped[i].is_number()) << clipped[i];
    EXPECT_GT(asked[i].get<double>(), 0.0);
    // clip_grad_norm_'s total norm (a norm per tensor, then their norm) against one fused pass
    EXPECT_NEAR(asked[i].get<double>(), clipped[i].get<double>(), 1e-5 * clipped[i].get<double>());
  }
  const auto a = safetensors::load(d.file("plain.safetensors")), b = safetensors::load(d.file("asked.safetensors"));
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bitwise_equal(a[i].second, b[i].second)) << a[i].first;
}

// fp16 with clipping by the norm: the gradients keep their loss scale until the optimizer's pass,
// their norm reading them unscaled (no pass writing them). The control: --clip-grad-value too large
// to act, which unscales them first, as before. The same norms and weights, bit for bit, with
// clipping acting at every step (a norm that kept the scale would clip 65536 times harder).
TEST(Cli, Fp16ClippingByNormNeedsNoUnscalePass) {
  TempDir d;
  auto train = [&](const std::string& extra, const std::string& name) {
    const RunResult r = run(kNoSteps + "--steps 4 --amp fp16 --clip-grad-norm 0.05 --lr 0.1 --metrics " +
                            d.file(name + ".jsonl") + " --save-weights " + d.file(name + ".safetensors") + " " + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    std::vector<double> out;
    for (const auto& rec : read_jsonl(d.file(name + ".jsonl")))
      if (!rec.contains("event") && rec["grad_norm"].is_number()) out.push_back(rec["grad_norm"].get<double>());
    return out;
  };
  const std::vector<double> fused = train("", "fused"), control = train("--clip-grad-value 1e30", "control");
  ASSERT_EQ(fused.size(), 4u);
  EXPECT_EQ(fused, control);
  for (double n : fused) EXPECT_GT(n, 0.05) << "clipping acts";
  const auto a = safetensors::load(d.file("fused.safetensors")), b = safetensors::load(d.file("control.safetensors"));
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(test::bitwise_equal(a[i].second, b[i].second)) << a[i].first;
}

TEST(Cli, SaveWeightsRoundTripsIntoInitWeights) {
  TempDir d;
  ASSERT_EQ(run(kSmall + "--save-weights " + d.file("a.safetensors")).code, 0);
  // lr 0 leaves the loaded weights untouched, so what is saved again must be bitwise the same.
  const RunResult r = run(kSmall + "--lr 0 --init-weights " + d.file("a.safetensors") + " --save-weights " + d.file("b.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto a = safetensors::load(d.file("a.safetensors")), b = safetensors::load(d.file("b.safetensors"));
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(test::bitwise_equal(a[i].second, b[i].second));
  }
  EXPECT_EQ(a[0].first, "0.weight");
  EXPECT_EQ(a[3].first, "2.bias");
}

// One command line for a job that is requeued (a Slurm script with --requeue): --resume with
// --init-weights starts from the weights while there is no checkpoint, and from the checkpoint after
// (it was refused, whether or not there was a checkpoint). Both runs end as the runs without the
// other flag do, bit for bit.
TEST(Cli, ResumeWithInitWeightsStartsFromTheWeightsUntilThereIsACheckpoint) {
  TempDir d;
  ASSERT_EQ(run(kSmall + "--save-weights " + d.file("w.safetensors")).code, 0);
  const std::string flags = kNoSteps + "--init-weights " + d.file("w.safetensors") + " --checkpoint-every 1 ";
  auto checksum = [&](const std::string& metrics) { return read_jsonl(metrics).back().at("param_checksum"); };
  ASSERT_EQ(run(flags + "--steps 4 --checkpoint-dir " + d.file("control") + " --metrics " + d.file("c4.jsonl")).code, 0);
  ASSERT_EQ(run(flags + "--steps 2 --checkpoint-dir " + d.file("control2") + " --metrics " + d.file("c2.jsonl")).code, 0);
  const std::string requeued = flags + "--resume --checkpoint-dir " + d.file("ck") + " --metrics " + d.file("m.jsonl") + " --steps ";
  RunResult r = run(requeued + "2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("no checkpoint in"), std::string::npos) << r.out;
  EXPECT_EQ(checksum(d.file("m.jsonl")), checksum(d.file("c2.jsonl"))) << "the fresh start did not start from the weights";
  fs::rename(d.file("w.safetensors"), d.file("moved.safetensors"));  // scratch cleaned: the checkpoint needs it not
  r = run(requeued + "4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--init-weights " + d.file("w.safetensors") + " is for a start with no checkpoint"), std::string::npos) << r.out;
  EXPECT_EQ(checksum(d.file("m.jsonl")), checksum(d.file("c4.jsonl"))) << "the resumed run is not the uninterrupted one";
}

// Exit 2 writes nothing: a --checkpoint-dir the run made before its set-up failed (here on a
// truncated --init-weights) is removed again; one that was there stays, as it was.
TEST(Cli, ASetUpRefusedLeavesNoCheckpointDirectoryBehind) {
  TempDir d;
  std::ofstream(d.file("trunc.safetensors"), std::ios::binary) << std::string(5, '\0');
  const std::string bad = kSmall + "--init-weights " + d.file("trunc.safetensors") + " --checkpoint-dir ";
  RunResult r = run(bad + d.file("new/ck"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_FALSE(fs::exists(d.file("new"))) << "the run made new/ck and left it, or new";
  fs::create_directories(d.file("old"));
  r = run(bad + d.file("old"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(fs::is_directory(d.file("old"))) << "a directory the run did not make was removed";
}

TEST(Cli, PyTorchStateDictLoadsWithoutConversion) {
  TempDir d;
  safetensors::NamedTensors sd;
  for (const char* n : {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"})
    sd.emplace_back(n, test::fixture_tensor("mlp_pytorch.safetensors", n));
  safetensors::save(d.file("torch.safetensors"), sd);
  const RunResult r = run("--width 16 --layers 3 --steps 1 --lr 0 --log-every 0 --threads 1 --init-weights " +
                    d.file("torch.safetensors") + " --save-weights " + d.file("out.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto out = safetensors::load(d.file("out.safetensors"));
  for (size_t i = 0; i < sd.size(); ++i) EXPECT_TRUE(test::bitwise_equal(out[i].second, sd[i].second)) << sd[i].first;
}

TEST(Cli, BadWeightAndDataFilesAreRejectedByName) {
  TempDir d;
  ASSERT_EQ(run(kSmall + "--save-weights " + d.file("w.safetensors")).code, 0);
  std::string bytes;
  {
    std::ifstream in(d.file("w.safetensors"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::ofstream(d.file("trunc.safetensors"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  std::string corrupt = bytes;
  corrupt[10] = '#';
  std::ofstream(d.file("corrupt.safetensors"), std::ios::binary) << corrupt;
  Generator g(1);
  safetensors::save(d.file("shape.safetensors"), {{"0.weight", randn({8, 7}, g)}, {"0.bias", randn({8}, g)},
                                                  {"2.weight", randn({8, 8}, g)}, {"2.bias", randn({8}, g)}});
  safetensors::save(d.file("names.safetensors"), {{"layer0.weight", randn({8, 8}, g)}});
  safetensors::save(d.file("dtype.safetensors"), {{"0.weight", cast(randn({8, 8}, g), DType::f16)}, {"0.bias", randn({8}, g)},
                                                  {"2.weight", randn({8, 8}, g)}, {"2.bias", randn({8}, g)}});
  safetensors::save(d.file("data.safetensors"), {{"x", randn({10, 8}, g)}, {"y", randn({10, 5}, g)}});
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--init-weights " + d.file("trunc.safetensors"), "truncated"},
      {"--init-weights " + d.file("corrupt.safetensors"), "corrupt"},
      {"--init-weights " + d.file("shape.safetensors"), "'0.weight' has shape [8, 7], expected [8, 8]"},
      {"--init-weights " + d.file("names.safetensors"), "layer0.weight"},
      {"--init-weights " + d.file("dtype.safetensors"), "dtype float16, expected float32"},
      {"--init-weights " + d.file("missing.safetensors"), "cannot open"},
      {"--data " + d.file("data.safetensors"), "'y' has shape [10, 5], expected [N, 8]"}};
  for (const auto& [args, needle] : cases) {
    const RunResult r = run(kSmall + args + " --metrics " + d.file("m.jsonl"));
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(needle), std::string::npos) << args << " -> " << r.out;
    EXPECT_FALSE(fs::exists(d.file("m.jsonl"))) << "no output file from a failed run";
  }
}

// --model mtl trains TorchJD's example by Jacobian descent on 1, 2 and 4 ranks, in fp32, fp16 with
// dynamic scaling and bf16: the metrics carry each task's loss and the aggregator's weights, every
// rank count gives the same losses (the Jacobian is averaged over ranks), and the loss falls.
TEST(Cli, MultiTaskJacobianDescentOnOneTwoAndFourRanks) {
  TempDir d;
  const std::string args = " --model mtl --tasks 2 --steps 40 --lr 0.05 --log-every 0 --threads 1 ";
  for (const char* amp : {"off", "fp16", "bf16"}) {
    std::vector<std::vector<nlohmann::ordered_json>> runs;
    for (int np : {1, 2, 4}) {
      const std::string m = d.file(std::string("m_") + amp + std::to_string(np) + ".jsonl");
      const int per_rank = 32 / np;
      const RunResult r = run(args + "--amp " + amp + (std::string(amp) == "fp16" ? " --init-scale 1024" : "") +
                                  " --batch-size " + std::to_string(per_rank) +
                                  " --metrics " + m,
                              np == 1 ? "" : std::string(kMpirun).replace(std::string(kMpirun).find("-np 2"), 5, "-np " + std::to_string(np)));
      ASSERT_EQ(r.code, 0) << amp << " np " << np << "\n" << r.out;
      runs.push_back(read_jsonl(m));
    }
    const auto& one = runs[0];
    ASSERT_EQ(one.size(), 41u);
    EXPECT_EQ(one[0]["task_losses"].size(), 2u);
    EXPECT_EQ(one[0]["weights"].size(), 2u);
    EXPECT_NEAR(one[0]["loss"].get<double>(),
                one[0]["task_losses"][0].get<double>() + one[0]["task_losses"][1].get<double>(), 1e-5);
    const double tol = std::string(amp) == "off" ? 1e-4 : 2e-2;
    for (size_t k = 1; k < runs.size(); ++k)
      for (size_t i = 0; i < 40; ++i) {
        if (one[i]["loss"].is_null()) continue;
        EXPECT_NEAR(runs[k][i]["loss"].get<double>(), one[i]["loss"].get<double>(), tol * one[i]["loss"].get<double>())
            << amp << " step " << i + 1 << " with " << (k == 1 ? 2 : 4) << " ranks";
      }
    double first = 0, last = 0;
    for (size_t i = 0; i < 5; ++i) first += one[i]["loss"].is_null() ? 0.0 : one[i]["loss"].get<double>();
    for (size_t i = 35; i < 40; ++i) last += one[i]["loss"].get<double>();
    EXPECT_LT(last, first) << amp << ": the loss falls";
  }
}

TEST(Cli, MultiTaskDataFromAFile) {
  TempDir d;
  Generator g(3);
  const Tensor x = randn({40, 4}, g);
  safetensors::save(d.file("tasks.safetensors"), {{"x", x}, {"y1", randn({40, 1}, g)}, {"y2", randn({40, 1}, g)},
                                                   {"y3", randn({40, 1}, g)}});
  const std::string base = " --model mtl --steps 3 --batch-size 8 --log-every 0 --threads 1 --data " + d.file("tasks.safetensors");
  RunResult r = run(base + " --tasks 3 --in-features 4 --aggregator dualproj");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run(base + " --tasks 4 --in-features 4");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("no tensor 'y4'"), std::string::npos) << r.out;
  r = run(base + " --tasks 3 --in-features 5");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("'x' has shape [40, 4], expected [N, 5]"), std::string::npos) << r.out;
  // One task: "y1", not "y1 ... y1".
  r = run(base + " --tasks 1 --in-features 4");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("(expected x [N, 4] and y1 [N, 1], float32"), std::string::npos) << r.out;
}

TEST(Cli, DataFromAFileTrains) {
  TempDir d;
  Generator g(2);
  const Tensor x = randn({20, 8}, g);
  safetensors::save(d.file("data.safetensors"), {{"x", x}, {"y", mul(x, 0.5)}});
  const RunResult r = run("--width 8 --layers 2 --batch-size 4 --log-every 0 --threads 1 --steps 30 --lr 0.1 --data " + d.file("data.safetensors") + " --metrics " + d.file("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  EXPECT_LT(recs[29]["loss"].get<double>(), recs[0]["loss"].get<double>());
}

// Under bf16 the weight gradients are the GEMMs' fp32 sums; the flag rounds them to bf16 first, as
// PyTorch does: other weights at the end, the same training to a bf16 rounding.
TEST(Cli, Bf16RoundedWeightGradsIsPyTorchsRounding) {
  std::vector<nlohmann::json> ends;
  for (const char* extra : {"", " --bf16-rounded-weight-grads"}) {
    TempDir d;
    const RunResult r = run("--width 32 --layers 3 --batch-size 16 --log-every 0 --threads 1 --steps 10 --lr 0.05 "
                            "--momentum 0.9 --amp bf16 --metrics " + d.file("m.jsonl") + extra);
    ASSERT_EQ(r.code, 0) << r.out;
    const auto recs = read_jsonl(d.file("m.jsonl"));
    ASSERT_EQ(recs.size(), 11u);
    ends.push_back(recs[9]);
    ends.back()["param_checksum"] = recs.back()["param_checksum"];
  }
  EXPECT_NE(ends[0]["param_checksum"], ends[1]["param_checksum"]) << "the flag changed nothing";
  EXPECT_NEAR(ends[0]["loss"].get<double>(), ends[1]["loss"].get<double>(), 1e-2 * ends[1]["loss"].get<double>());
  for (const char* amp : {"off", "fp16"}) {  // nothing to round: a usage error, not a silent no-op
    const RunResult r = run(kNoSteps + "--amp " + amp + " --bf16-rounded-weight-grads");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("--bf16-rounded-weight-grads: only --amp bf16"), std::string::npos) << r.out;
  }
  const RunResult mtl = run(kNoSteps + "--model mtl --amp bf16 --bf16-rounded-weight-grads");
  EXPECT_EQ(mtl.code, 2) << mtl.out;
  EXPECT_NE(mtl.out.find("--model mtl takes its gradients by Jacobian descent"), std::string::npos) << mtl.out;
}

TEST(Cli, EveryTrainingFeatureRunsEndToEnd) {
  // Penalty, clipping, accumulation, AdamW, bf16 and a constant loss scale: finite losses that fall.
  TempDir d;
  const RunResult r = run("--width 16 --layers 3 --batch-size 8 --log-every 0 --threads 1 --steps 40 --lr 0.01 "
                          "--optimizer adamw --weight-decay 0.01 --grad-penalty 0.1 --clip-grad-norm 1.0 "
                          "--clip-grad-value 0.5 --micro-batches 2 --amp bf16 --loss-scale 1024 --metrics " +
                          d.file("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  ASSERT_EQ(recs.size(), 41u);
  for (size_t i = 0; i < 40; ++i) {
    EXPECT_TRUE(recs[i]["loss"].is_number()) << i;
    EXPECT_EQ(recs[i]["scale"], 1024.0) << "a constant scale";
  }
  EXPECT_LT(recs[39]["loss"].get<double>(), recs[0]["loss"].get<double>());
  // The penalty is each micro-batch's: said where the split changes it, and only there.
  EXPECT_NE(r.out.find("notice: --grad-penalty is taken per micro-batch: the step adds the mean of LAMBDA * "
                       "||grad loss_m|| over its 2 micro-batches"),
            std::string::npos)
      << r.out;
  const RunResult one = run("--width 16 --layers 1 --batch-size 8 --threads 1 --steps 1 --grad-penalty 0.1");
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_EQ(one.out.find("--grad-penalty is taken"), std::string::npos) << one.out;
}

TEST(Cli, DeviceCudaWithoutAGpuFailsCleanly) {
  const RunResult r = run(kSmall + "--device cuda");
  const RunResult a = run(kSmall + "--device auto");
  EXPECT_EQ(a.code, 0) << a.out;
  std::string reason;
  if (cuda_usable(&reason)) {  // a GPU machine, or the emulated GPU: both train on it
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(a.out.find("cuda:0"), std::string::npos) << "--device auto did not pick the GPU: " << a.out;
    return;
  }
  EXPECT_EQ(r.code, 2) << "found before any step: " << r.out;
  EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CUDA"), std::string::npos) << r.out;
  EXPECT_NE(a.out.find("cpu"), std::string::npos) << a.out;
}

// Under mpirun a bad input file stops every rank with exit code 2 before any collective: the ranks
// agree on the setup's outcome instead of leaving one another inside a broadcast.
TEST(Cli, BadInputUnderMpirunStopsEveryRankCleanly) {
  const auto t0 = std::chrono::steady_clock::now();
  const RunResult r = run(kSmall + "--init-weights /nonexistent/w.safetensors --comm-timeout 30",
                          kMpirun);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_LT(secs, 20.0) << "no rank waited out a timeout";
  // Both ranks met the same error: it is printed once, naming both.
  const std::string says = "error (ranks 0, 1): /nonexistent/w.safetensors: cannot open";
  const size_t at = r.out.find(says);
  EXPECT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("/nonexistent/w.safetensors", at + says.size()), std::string::npos) << "printed twice: " << r.out;
}

// Every rank reads the data rank 0 reads: a rank given a file of the same size with other bytes (a
// node whose own copy differs; here mpirun's MPMD form gives each rank its own --data) stops the job
// at the set-up with exit 2 naming it, where each rank used to train on its own samples, silently.
TEST(Cli, ARankWhoseDataDiffersFromRank0sIsNamedAtTheSetup) {
  TempDir d;
  const std::string a = d.file("a.txt"), b = d.file("b.txt");
  fs::copy_file(test::generated_text_file("cli_rank_data", 3000), a);
  std::string bytes = [&] {
    std::ifstream in(a, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  bytes[10] = static_cast<char>(bytes[10] ^ 1);
  std::ofstream(b, std::ios::binary) << bytes;
  const std::string gpt = "--model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --steps 2 "
                          "--threads 1 --comm-timeout 30 --data ";
  const std::string one_rank = std::string(kMpirun).replace(std::string(kMpirun).find("-np 2"), 5, "-np 1");
  const RunResult same = run(gpt + a + " : -np 1 " + AMP_TRAIN_BIN + " " + gpt + a, one_rank);
  EXPECT_EQ(same.code, 0) << same.out;
  const RunResult other = run(gpt + a + " : -np 1 " + AMP_TRAIN_BIN + " " + gpt + b, one_rank);
  EXPECT_EQ(other.code, 2) << other.out;
  EXPECT_NE(other.out.find("error (rank 1): --data " + b + " (or --val-data) is not what rank 0 reads"), std::string::npos)
      << other.out;
  // Token data whose --val-data differs on rank 1: its validation loss would have been another set's.
  const std::string train = "'" + test::generated_token_shards("cli_rank_train", 2, 300) + "'";
  const std::string val_a = "'" + test::generated_token_shards("cli_rank_val_a", 1, 200) + "'";
  const std::string val_b = "'" + test::generated_token_shards("cli_rank_val_b", 1, 201) + "'";
  const std::string tok = "--model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --steps 2 "
                          "--threads 1 --comm-timeout 30 --vocab-size 300 --eval-every 1 --data " + train + " --val-data ";
  const RunResult val = run(tok + val_a + " : -np 1 " + AMP_TRAIN_BIN + " " + tok + val_b, one_rank);
  EXPECT_EQ(val.code, 2) << val.out;
  EXPECT_NE(val.out.find("error (rank 1): --data"), std::string::npos) << val.out;
  // A safetensors file (the MLP's, the multi-task model's) of the same shape with one other value.
  Generator g(3);
  const Tensor x = randn({16, 8}, g);
  safetensors::save(d.file("a.safetensors"), {{"x", x}, {"y", mul(x, 0.5)}});
  safetensors::save(d.file("b.safetensors"), {{"x", x}, {"y", mul(x, 0.25)}});
  const std::string mlp = "--width 8 --layers 2 --batch-size 4 --steps 2 --threads 1 --comm-timeout 30 --data ";
  const RunResult xy = run(mlp + d.file("a.safetensors") + " : -np 1 " + AMP_TRAIN_BIN + " " + mlp +
                           d.file("b.safetensors"), one_rank);
  EXPECT_EQ(xy.code, 2) << xy.out;
  EXPECT_NE(xy.out.find("error (rank 1): --data " + d.file("b.safetensors") + " (or --val-data) is not what rank 0 reads"),
            std::string::npos)
      << xy.out;
}

// A multi-task model of one task records that task's loss, as the README's metrics say it does (it
// recorded none: one loss was taken for the ordinary model's).
TEST(Cli, AMultiTaskModelOfOneTaskRecordsItsTaskLoss) {
  TempDir d;
  const RunResult r = run("--model mtl --tasks 1 --steps 2 --batch-size 4 --threads 1 --log-every 0 --metrics " +
                          d.file("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto records = read_jsonl(d.file("m.jsonl"));
  ASSERT_GE(records.size(), 2u);
  ASSERT_TRUE(records[0].contains("task_losses")) << records[0].dump();
  ASSERT_EQ(records[0]["task_losses"].size(), 1u);
  EXPECT_EQ(records[0]["task_losses"][0], records[0]["loss"]);
}

// A --config key that changes nothing in this run (a file shared by runs of several kinds) is a
// notice; the same flag on the command line is refused (EveryFlagIsValidated).
TEST(Cli, AConfigKeyThatChangesNothingIsANotice) {
  TempDir d;
  std::ofstream(d.file("shared.cfg")) << "momentum = 0.9\nwarmup-steps = 3\n";
  const RunResult r = run(kSmall + "--optimizer adamw --config " + d.file("shared.cfg"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("notice: --config " + d.file("shared.cfg") + ": --momentum: only --optimizer sgd uses it; ignored"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("--warmup-steps: only --lr-schedule cosine uses it; ignored"), std::string::npos) << r.out;
  // The model's own: the GPT's sampling flags in a config shared with runs that sample.
  std::ofstream(d.file("gpt.cfg")) << "temperature = 0.5\nprompt = Hello\n";
  const RunResult gpt = run(" --model gpt --data " + test::generated_text_file("cli_flags", 4000) +
                            " --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --steps 2 --threads 1"
                            " --log-every 0 --config " + d.file("gpt.cfg"));
  EXPECT_EQ(gpt.code, 0) << gpt.out;
  EXPECT_NE(gpt.out.find("notice: --config " + d.file("gpt.cfg") + ": --temperature: only a sample uses it, and "
                         "--sample-tokens is 0 (none is drawn); ignored in this run"),
            std::string::npos)
      << gpt.out;
  EXPECT_NE(gpt.out.find("--prompt: only a sample uses it"), std::string::npos) << gpt.out;
  // Another model's keys, and keys whose feature is off (they were refused, exit 2).
  std::ofstream(d.file("models.cfg")) << "tasks = 3\naggregator = mean\nkeep-checkpoints = 2\neval-batches = 3\n";
  const RunResult mlp = run(kSmall + "--config " + d.file("models.cfg"));
  EXPECT_EQ(mlp.code, 0) << mlp.out;
  for (const char* why : {"--tasks: only --model mtl uses it (this run is --model mlp); ignored",
                          "--aggregator: only --model mtl uses it", "--keep-checkpoints: only --checkpoint-dir DIR uses it",
                          "--eval-batches: only --eval-every N"})
    EXPECT_NE(mlp.out.find(why), std::string::npos) << why << "\n" << mlp.out;
}

// Every rank runs rank 0's flags: a rank given another seed trained on another teacher's data, in
// silence (exit 0), and one given --zero 1 or another --steps failed later inside MPI (exit 1, with
// MPI_ERR_TRUNCATE). Both stop at the set-up, exit 2, naming the rank and the flags.
TEST(Cli, ARankRunningOtherFlagsThanRank0sIsNamedAtTheSetup) {
  const std::string mlp = "--width 16 --layers 2 --batch-size 4 --log-every 0 --comm-timeout 30 ";
  const std::string one_rank = std::string(kMpirun).replace(std::string(kMpirun).find("-np 2"), 5, "-np 1");
  auto mpmd = [&](const std::string& rank0, const std::string& rank1) {
    return run(mlp + rank0 + " : -np 1 " + AMP_TRAIN_BIN + " " + mlp + rank1, one_rank);
  };
  // --threads may differ, numbers are values, and a flag given its default is the flag not given.
  const RunResult same = mpmd("--steps 3 --seed 1 --lr 0.1 --threads 1 --optimizer sgd --amp off",
                              "--steps 03 --seed 1 --lr 0.10 --threads 2 --momentum 0");

  EXPECT_EQ(same.code, 0) << same.out;
  // Nor is a switch set to false, the optimizer's own weight decay, or a --config key that only earned
  // a notice (momentum with AdamW) a difference.
  TempDir d;
  std::ofstream(d.file("node0.cfg")) << "no-overlap = false\nmomentum = 0.9\n";
  const RunResult defaults = mpmd("--steps 2 --optimizer adamw --config " + d.file("node0.cfg"),
                                  "--steps 2 --optimizer adamw --weight-decay 0.01");
  EXPECT_EQ(defaults.code, 0) << defaults.out;
  const RunResult seed = mpmd("--steps 3 --seed 1", "--steps 3 --seed 2");
  EXPECT_EQ(seed.code, 2) << seed.out;
  EXPECT_NE(seed.out.find("error (rank 1): this rank's flags are not rank 0's: --seed 2 (rank 0: --seed 1)"),
            std::string::npos)
      << seed.out;
  const RunResult zero = mpmd("--steps 3", "--zero 1 --steps 4");
  EXPECT_EQ(zero.code, 2) << zero.out;
  EXPECT_NE(zero.out.find("--steps 4 (rank 0: --steps 3); --zero 1 (rank 0: not given)"), std::string::npos) << zero.out;
}

// A rank that stops answering during the set-up: the others time out there, naming the set-up,
// and the job ends with exit 1 (it used to escape every handler: SIGABRT, exit 134, a backtrace).
TEST(Cli, ASetupCollectiveThatTimesOutIsReportedAndEndsTheJob) {
  const auto t0 = std::chrono::steady_clock::now();
  const RunResult r = run(kSmall + "--comm-timeout 1", std::string("AMP_DEBUG_STALL=1:0 ") + kMpirun);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_LT(secs, 60.0);
  EXPECT_NE(r.out.find("did not complete within 1 s at the set-up"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// Sizes that cannot fit in memory are usage errors naming the flag, not std::bad_alloc.
// --model gpt as users run it: tokens/s on the progress line, the validation loss before training,
// every N steps and after the last (also in the metrics), sampled text at the end; and its text
// file refused by name when it is missing, a directory, or too short for the block size.
TEST(Cli, GptReportsValidationLossTokensPerSecondAndSamples) {
  TempDir d;
  const std::string text = test::generated_text_file("cli_gpt", 20000);
  const std::string gpt = " --model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --threads 1 ";
  const RunResult r = run(gpt + "--data " + text + " --steps 3 --log-every 1 --eval-every 2 --eval-batches 2 "
                          "--sample-tokens 10 --prompt And --metrics " + d.file("m.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokens/s"), std::string::npos) << r.out;
  for (const char* line : {"step 0: validation loss", "step 2: validation loss", "step 3: validation loss",
                           "--- 10 bytes sampled"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  std::vector<int64_t> evals;
  for (const auto& rec : read_jsonl(d.file("m.jsonl")))
    if (rec.value("event", "") == "eval") {
      evals.push_back(rec["step"].get<int64_t>());
      EXPECT_GT(rec["val_loss"].get<double>(), 0.0);
    }
  EXPECT_EQ(evals, (std::vector<int64_t>{0, 2, 3}));
  // A temperature so small that logit / temperature overflowed drew garbage (1e-310); it draws the
  // largest logit every time, as 1e-6 does.
  std::string greedy[2];
  for (int i = 0; i < 2; ++i) {
    const RunResult s = run(gpt + "--data " + text + " --steps 3 --log-every 0 --sample-tokens 20 --top-k 256 --prompt And "
                            "--temperature " + (i == 0 ? "1e-310" : "1e-6"));
    ASSERT_EQ(s.code, 0) << s.out;
    greedy[i] = s.out.substr(s.out.find("--- 20 bytes sampled"));
    greedy[i] = greedy[i].substr(greedy[i].find('\n'));
  }
  EXPECT_EQ(greedy[0], greedy[1]);
  std::ofstream(d.file("short.txt")) << "too short";
  for (const auto& [data, want] : std::vector<std::pair<std::string, std::string>>{
           {d.file("missing.txt"), "no such file"},
           {d.file("short.txt") + "/x.txt", "short.txt' is not a directory"},
           {d.path.string(), "is a directory"},
           {d.file("short.txt"), "fewer than --block-size + 2"}}) {
    const RunResult bad = run(gpt + "--data " + data + " --steps 1");
    EXPECT_EQ(bad.code, 2) << bad.out;
    EXPECT_NE(bad.out.find(data), std::string::npos) << bad.out;
    EXPECT_NE(bad.out.find(want), std::string::npos) << bad.out;
  }
  EXPECT_EQ(run(kSmall + "--eval-every 2").code, 2);  // no validation text for the MLP
  EXPECT_EQ(run(gpt + "--steps 1").code, 2);          // --data synthetic: a GPT needs text
}

TEST(Cli, ImpossibleSizesAreRefusedByFlag) {
  for (const auto& [args, flag] : std::vector<std::pair<std::string, std::string>>{
           {"--width 2000000 --steps 1", "--width"},
           {"--batch-size 4000000000000000000 --steps 1", "--batch-size"},
           {"--batch-size 100000000 --width 1024 --steps 1", "--batch-size"},
           {"--model gpt --data x.txt --n-embd 65536 --n-layer 48 --n-head 64 --steps 1", "--n-embd"},
           {"--model gpt --data x.txt --block-size 100000000 --steps 1", "--block-size"},
           {"--model gpt --data x.txt --batch-size 100000 --block-size 4096 --steps 1", "--batch-size"}}) {
    const RunResult r = run(args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.out;
    EXPECT_NE(r.out.find(flag), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("GiB"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("bad_alloc"), std::string::npos) << r.out;
  }
}

// SIGTERM (or Ctrl-C) stops the run after the step in flight, on every rank at the same step,
// saves the weights, closes the metrics with an end record, and exits non-zero. The control: a
// run of exactly that many steps ends with the same parameters. After 5 steps: on a GPU (the
// emulated one in the cuda-emu suite) the step is then a CUDA graph's replay (from step 4), which
// reads the stop flag as one of its inputs.
TEST(Cli, SigtermFinishesTheStepSavesAndExitsNonZero) {
  for (const std::string& launcher : {std::string(""), std::string("mpirun -np 2 --oversubscribe ")}) {
    TempDir d;
    const std::string args = kNoSteps + "--metrics m.jsonl --save-weights w.safetensors";
    const std::string out = shell(launcher + "$AMP " + args + " --steps 100000000 & p=$!; "
                                  "while [ $(wc -l < m.jsonl 2>/dev/null || echo 0) -lt 5 ]; do sleep 0.1; done; "
                                  "kill -TERM $p; wait $p; echo exit=$?", d);
    EXPECT_EQ(out.find("exit=0"), std::string::npos) << launcher << out;
    if (launcher.empty()) {
      EXPECT_NE(out.find("exit=143"), std::string::npos) << out;
    }
    EXPECT_NE(out.find("interrupted by SIGTERM"), std::string::npos) << launcher << out;
    if (emulated_device_counters() && cuda_usable(nullptr)) {  // --device auto trains on the emulated GPU
      EXPECT_NE(out.find("captured in a CUDA graph"), std::string::npos) << launcher << out;
    }
    const auto recs = read_jsonl(d.file("m.jsonl"));
    ASSERT_GE(recs.size(), 4u) << out;
    const auto& end = recs.back();
    ASSERT_EQ(end["event"], "end") << out;
    EXPECT_EQ(end["interrupted_by"], "SIGTERM");
    const int64_t steps = end["steps"];
    EXPECT_EQ(static_cast<int64_t>(recs.size()) - 1, steps) << "one record per step trained";
    ASSERT_TRUE(fs::exists(d.file("w.safetensors"))) << out;
    EXPECT_EQ(safetensors::load(d.file("w.safetensors")).size(), 4u);

    const std::string control =
        shell(launcher + "$AMP " + kNoSteps + "--metrics c.jsonl --steps " + std::to_string(steps), d);
    const auto crecs = read_jsonl(d.file("c.jsonl"));
    ASSERT_FALSE(crecs.empty()) << control;
    EXPECT_EQ(crecs.back()["param_checksum"], end["param_checksum"]) << "the saved state is not step " << steps;
  }
}

// A save killed halfway leaves NAME.tmp.PID; the next run removes it (and only temporaries of
// processes that are gone), and says so.
TEST(Cli, StaleTemporariesOfAKilledSaveAreRemoved) {
  TempDir d;
  const pid_t child = gone_pid();
  const std::string stale = d.file("w.safetensors.tmp." + std::to_string(child));
  const std::string live = d.file("w.safetensors.tmp." + std::to_string(::getpid()));
  const std::string other = d.file("w.safetensors.tmp.notapid");
  for (const std::string& f : {stale, live, other}) std::ofstream(f) << "partial";
  const RunResult r = run(kSmall + "--save-weights " + d.file("w.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(fs::exists(stale)) << r.out;
  EXPECT_NE(r.out.find("removed '" + stale + "'"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(live)) << "the temporary of a live process was removed";
  EXPECT_TRUE(fs::exists(other));
}

// The progress line says "nan" as PyTorch does, never the C library's "-nan".
TEST(Cli, ProgressLinePrintsNanPlainly) {
  TempDir d;  // data whose inputs are NaN (weights that are would be refused at load)
  safetensors::save(d.file("nan.safetensors"),
                    {{"x", full({16, 8}, std::numeric_limits<double>::quiet_NaN())}, {"y", zeros({16, 8})}});
  const RunResult r = run("--width 8 --layers 2 --batch-size 4 --threads 1 --steps 2 --log-every 1 --amp fp16 "
                          "--data " + d.file("nan.safetensors"));
  EXPECT_EQ(r.code, 1) << "every step was skipped: " << r.out;
  EXPECT_NE(r.out.find("loss nan"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("-nan"), std::string::npos) << r.out;
}

TEST(Cli, AStalledRankMakesTheOthersExitWithinTheTimeout) {
  const auto t0 = std::chrono::steady_clock::now();
  const RunResult r = run("--width 8 --layers 2 --batch-size 4 --log-every 0 --threads 1 --steps 5 --comm-timeout 3",
                    std::string("AMP_DEBUG_STALL=1:3 ") + kMpirun);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "mpirun hung until the outer timeout";
  EXPECT_LT(secs, 60.0);
  EXPECT_NE(r.out.find("did not complete within 3 s at step 3"), std::string::npos) << r.out;
}

// Over MPI's own transport (TCP, no shared memory), as over NCCL, the gradients' ordered sum is an
// all-to-all then an all-gather: a rank that stops answering ends the job within the timeout, naming
// the stage.
TEST(Cli, AStalledRankInTheOrderedSumsAllToAllIsNamed) {
  const RunResult r = run("--width 8 --layers 2 --batch-size 4 --log-every 0 --threads 1 --steps 5 --comm-timeout 3",
                          std::string("AMP_DEBUG_STALL=1:3 ") + kMpirun +
                              " --mca btl self,tcp --mca btl_tcp_if_include lo -x AMP_COMM_SHM=0");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "mpirun hung until the outer timeout";
  EXPECT_NE(r.out.find("ordered_sum/all_to_all("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did not complete within 3 s at step 3"), std::string::npos) << r.out;
}

// Metrics are written as training goes, a whole line per step, to the file itself: a run stopped
// halfway (here: killed while rank 0 stalls at step 4) leaves its finished steps readable.
TEST(Cli, MetricsAreWrittenAsTrainingGoes) {
  TempDir d;
  // SIGKILL: a SIGTERM would ask the stalled run to stop after its step, which it never finishes.
  const RunResult r = run(kNoSteps + "--steps 10 --metrics " + d.file("m.jsonl"), "AMP_DEBUG_STALL=0:4 timeout -s KILL 8");
  EXPECT_EQ(r.code, 128 + 9) << "the stalled run was not the one killed: " << r.out;
  const auto recs = read_jsonl(d.file("m.jsonl"));
  // Steps 1-3 on the CPU; on a GPU a step's figures are read one step late, so steps 1-2.
  ASSERT_GE(recs.size(), 2u) << r.out;
  ASSERT_LE(recs.size(), 3u) << r.out;
  for (size_t i = 0; i < recs.size(); ++i) EXPECT_EQ(recs[i]["step"], static_cast<int>(i) + 1);
  int files = 0;  // the metrics, and the lock a killed run leaves (free: the next run takes it)
  for (auto& e : fs::directory_iterator(d.path)) files += e.is_regular_file() && e.path().filename() != ".m.jsonl.lock";
  EXPECT_EQ(files, 1) << "a temporary file was left";
}

// A loss that goes non-finite with no scaler to skip the step stops the run, naming the step,
// instead of training on NaN and exiting 0.
TEST(Cli, ANonFiniteLossStopsTheRun) {
  const RunResult r = run(kNoSteps + "--steps 20 --lr 1e30 --amp off");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.code, 128) << "a clean exit, not a crash: " << r.out;
  EXPECT_NE(r.out.find("the loss is"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no loss scaler skipped the step"), std::string::npos) << r.out;
}

TEST(Cli, ARunWhoseEveryStepWasSkippedFails) {
  const RunResult r = run(kNoSteps + "--steps 2 --amp fp16 --inject-nonfinite 1 --inject-nonfinite 2");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(r.code, 128) << r.out;
  EXPECT_NE(r.out.find("every one of the 2 steps was skipped"), std::string::npos) << r.out;
}

TEST(Cli, InjectingNonFiniteGradientsNeedsAScaler) {
  for (const std::string amp : {"--amp off", "--amp bf16", "--amp fp16 --loss-scale off"}) {
    const RunResult r = run(kSmall + amp + " --inject-nonfinite 1");
    EXPECT_EQ(r.code, 2) << amp << ": " << r.out;
    EXPECT_NE(r.out.find("--inject-nonfinite"), std::string::npos) << r.out;
  }
}

// Output paths are checked before the first step: exit 2 at once, naming the flag, instead of a
// failure after the whole run.
TEST(Cli, BadOutputPathsAreRefusedBeforeTraining) {
  TempDir d;
  std::ofstream(d.file("afile")) << "a file, not a directory";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"--metrics " + d.file("afile") + "/m.jsonl", "--metrics: '" + d.file("afile/m.jsonl") + "': '" + d.file("afile") +
                                                        "' is not a directory"},
      {"--save-weights " + d.file("afile") + "/w.safetensors", "' is not a directory"},
      // An empty path (an unset variable in a script) would have turned the output off, silently.
      {"--metrics ''", "--metrics: an empty path"},
      {"--save-weights ''", "--save-weights: an empty path"},
      {"--checkpoint-dir ''", "--checkpoint-dir: an empty path"},
      {"--save-weights /nonexistent_dir/w.safetensors", "--save-weights"},
      {"--save-weights " + d.path.string(), "--save-weights"},
      {"--save-weights /dev/null", "--save-weights"},
      {"--metrics /nonexistent_dir/m.jsonl", "--metrics"},
      {"--metrics " + d.path.string(), "--metrics"},
  };
  for (const auto& [args, flag] : bad) {
    const auto t0 = std::chrono::steady_clock::now();
    const RunResult r = run(kNoSteps + "--steps 100000 " + args);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(r.code, 2) << args << ": " << r.out;
    EXPECT_NE(r.out.find(flag), std::string::npos) << r.out;
    EXPECT_LT(secs, 20.0) << args << ": the run trained before failing";
  }
}

// Saving through a symbolic link replaces the file it names and keeps the link.
TEST(Cli, SavingThroughASymlinkKeepsTheLink) {
  TempDir d;
  fs::create_directories(d.path / "real");
  const fs::path target = d.path / "real" / "w.safetensors", link = d.path / "link.safetensors";
  { std::ofstream(target) << "old"; }
  fs::create_symlink(target, link);
  const RunResult r = run(kSmall + "--save-weights " + link.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::is_symlink(link)) << "the link was replaced by a file";
  EXPECT_GT(fs::file_size(target), 100u) << "the linked file was not written";
  int files = 0;
  for (auto& e : fs::directory_iterator(d.path / "real")) files += e.is_regular_file();
  EXPECT_EQ(files, 1) << "a temporary file was left";
  // A dangling link, as open(2) takes it: the file it names is created, and the link stays (it was
  // replaced by a file beside it, exit 0). A link into a directory that does not exist (a shared
  // filesystem not mounted) is refused naming that directory, before the first step.
  const fs::path dangling = d.path / "dangling.safetensors", later = d.path / "real" / "later.safetensors";
  fs::create_symlink(later, dangling);
  const RunResult dr = run(kSmall + "--save-weights " + dangling.string());
  ASSERT_EQ(dr.code, 0) << dr.out;
  EXPECT_TRUE(fs::is_symlink(dangling)) << "the dangling link was replaced by a file";
  EXPECT_TRUE(fs::is_regular_file(later)) << "the file the link names was not written";
  const fs::path into_nowhere = d.path / "nowhere.safetensors";
  fs::create_symlink(d.path / "unmounted" / "w.safetensors", into_nowhere);
  const RunResult nr = run(kSmall + "--save-weights " + into_nowhere.string());
  EXPECT_EQ(nr.code, 2) << nr.out;
  EXPECT_NE(nr.out.find("unmounted' does not exist"), std::string::npos) << nr.out;
  EXPECT_TRUE(fs::is_symlink(into_nowhere));
  // A loop of links names nothing: refused, the links kept (one would have been replaced by a file).
  fs::create_symlink(d.path / "loop_b", d.path / "loop_a");
  fs::create_symlink(d.path / "loop_a", d.path / "loop_b");
  const RunResult lr = run(kSmall + "--save-weights " + (d.path / "loop_a").string());
  EXPECT_EQ(lr.code, 2) << lr.out;
  EXPECT_NE(lr.out.find("is a symbolic link that does not resolve"), std::string::npos) << lr.out;
  EXPECT_TRUE(fs::is_symlink(d.path / "loop_a") && fs::is_symlink(d.path / "loop_b"));
}

// A --config this user may not read (its directory not searchable) says so, where it said "no such
// file". As root, the run drops to nobody (root reads everything).
TEST(Cli, AConfigThatCannotBeReadSaysWhy) {
  TempDir d;
  fs::create_directories(d.path / "locked");
  std::ofstream(d.file("locked/run.cfg")) << "steps = 1\n";
  fs::permissions(d.path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                              fs::perms::others_read | fs::perms::others_exec);
  fs::permissions(d.path / "locked", fs::perms::none);
  const bool root = ::geteuid() == 0;
  if (root && std::system("command -v setpriv > /dev/null") != 0) GTEST_SKIP() << "root, and no setpriv to drop to nobody";
  const std::string as_user = root ? "setpriv --reuid 65534 --regid 65534 --clear-groups" : "";
  const RunResult r = run(kSmall + "--config " + d.file("locked/run.cfg"), as_user);
  fs::permissions(d.path / "locked", fs::perms::owner_all);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--config: '" + d.file("locked/run.cfg") + "': cannot be read: Permission denied"), std::string::npos)
      << r.out;
}

// Abbreviated flags, stray words, and config files that are not files or that hide bad values.
TEST(Cli, AbbreviationsStrayWordsAndBadConfigsAreUsageErrors) {
  TempDir d;
  const std::string fifo = d.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  { std::ofstream(d.file("bad_value.cfg")) << "lr = abc\n"; }
  { std::ofstream(d.file("twice.cfg")) << "lr = 0.1\nlr = 0.2\n"; }
  { std::ofstream(d.file("huge.cfg")) << "lr = " << std::string(1 << 20, '7') << "x\n"; }  // echoed whole
  { std::ofstream(d.file("unset.cfg")) << "resume =\ncheckpoint-dir = ck\n"; }  // resume = $RESUME, unset: it resumed
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"--wid 16", "--wid"},
      {"--amp fp16 bf16", "unexpected argument 'bf16'"},
      {"steps=5", "unexpected argument 'steps=5'"},
      {"--config " + d.path.string(), "' is a directory"},
      {"--config " + d.file("missing.cfg"), "missing.cfg': no such file"},
      {"--config " + d.file("twice.cfg") + "/", "twice.cfg' is not a directory"},  // it said "no such file"
      {"--config /dev/zero", "not a regular file"},
      {"--config " + fifo, "not a regular file"},
      {"--config " + d.file("bad_value.cfg") + " --lr 0.1", "--config"},
      {"--config " + d.file("twice.cfg"), "--config"},
      {"--config " + d.file("huge.cfg"), "characters ...]"},
      {"--lr " + std::string(100000, '7') + "x", "characters ...]"},  // the command line's too
      {"--config " + d.file("unset.cfg"), "unset.cfg: 'resume =' has no value (an unset variable?)"},
      {"--config ''", "--config: an empty path (an unset variable?)"},
  };
  for (const auto& [args, says] : bad) {
    const auto t0 = std::chrono::steady_clock::now();
    const RunResult r = run(kSmall + args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.out;
    EXPECT_NE(r.out.find(says), std::string::npos) << args << ": " << r.out;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0) << args;
  }
}

// A directory or a device where a weights or data file belongs: exit 2 naming it (it used to be
// read as a file of absurd size: std::bad_alloc, and no name).
TEST(Cli, ADirectoryOrDeviceGivenAsAnInputFileIsNamed) {
  TempDir d;
  for (const std::string flag : {"--init-weights", "--data"})
    for (const std::string& path : {d.path.string(), std::string("/dev/zero")}) {
      const RunResult r = run(kSmall + flag + " " + path);
      EXPECT_EQ(r.code, 2) << flag << " " << path << ": " << r.out;
      EXPECT_NE(r.out.find(path), std::string::npos) << r.out;
      EXPECT_EQ(r.out.find("bad_alloc"), std::string::npos) << r.out;
    }
}

// A Hugging Face file that gives a parameter twice (with and without the "transformer." prefix) is
// refused naming both (the first one used to win, silently); one whose c_attn weight is in our
// layout under the hub's name is refused naming that tensor and both shapes (it used to name a bias
// the file rightly held, as "unexpected").
TEST(Cli, AHuggingFaceFileWithAParameterTwiceOrATransposedWeightIsNamed) {
  TempDir d;
  const std::string gpt = " --model gpt --data " + test::generated_text_file("cli_hf", 4000) +
                          " --n-layer 2 --n-head 2 --n-embd 16 --block-size 8 --batch-size 2 --threads 1 --log-every 0 ";
  ASSERT_EQ(run(gpt + "--steps 1 --save-weights " + d.file("hf.safetensors") + " --save-weights-format hf").code, 0);
  safetensors::NamedTensors twice = safetensors::load(d.file("hf.safetensors"));
  twice.emplace_back("transformer.h.0.ln_1.weight", full({16}, 5.0));
  safetensors::save(d.file("twice.safetensors"), twice);
  const RunResult r = run(gpt + "--steps 1 --init-weights " + d.file("twice.safetensors"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("holds both 'h.0.ln_1.weight' and 'transformer.h.0.ln_1.weight': one parameter given twice"),
            std::string::npos) << r.out;
  safetensors::NamedTensors ours = safetensors::load(d.file("hf.safetensors"));
  for (auto& [name, t] : ours)
    if (name == "h.0.attn.c_attn.weight") t = transpose(t, 0, 1);
  safetensors::save(d.file("ours.safetensors"), ours);
  const RunResult o = run(gpt + "--steps 1 --init-weights " + d.file("ours.safetensors"));
  EXPECT_EQ(o.code, 2) << o.out;
  // In the file's terms: it holds [48, 16] where the hub's layout has [16, 48] (it said the opposite:
  // the shapes after our transpose).
  EXPECT_NE(o.out.find("tensor 'h.0.attn.c_attn.weight' has shape [48, 16], expected [16, 48]"), std::string::npos)
      << o.out;
}

// A FIFO where a data or vocabulary file belongs (alone, in a glob, as --val-data), and a directory
// given as --vocab-file: exit 2 naming it, at once. Each FIFO used to wait in open() for a writer that
// never came, and the directory aborted the run (an uncaught std::ios_base::failure).
TEST(Cli, AFifoOrDirectoryGivenAsDataOrVocabularyIsNamedAtOnce) {
  TempDir d;
  fs::create_directories(d.file("glob"));
  for (const char* f : {"fifo.txt", "fifo.bin", "glob/b.bin"}) ASSERT_EQ(::mkfifo(d.file(f).c_str(), 0600), 0) << f;
  std::vector<uint16_t> tokens(300);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);
  test::write_llmc_shard(d.file("glob/a.bin"), tokens);
  const std::string shards = "'" + test::generated_token_shards("cli_fifo", 2, 300) + "' --vocab-size 300 ";
  const std::string gpt = "--model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 2 --steps 1 "
                          "--threads 1 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {gpt + "--data " + d.file("fifo.txt"), "--data: " + d.file("fifo.txt") + ": is not a regular file"},
      {gpt + "--data " + d.file("fifo.bin") + " --vocab-size 300", d.file("fifo.bin")},
      {gpt + "--data " + d.file("fifo.bin") + " --vocab-size 300 --data-format u16",
       "--data: " + d.file("fifo.bin") + ": is not a regular file (a device, FIFO or socket)"},
      {gpt + "--data '" + d.file("glob") + "/*.bin' --vocab-size 300",
       "--data: " + d.file("glob/b.bin") + ": is not a regular file"},
      {gpt + "--data " + shards + "--eval-every 1 --val-data " + d.file("fifo.bin"),
       "--val-data: " + d.file("fifo.bin") + ": is not a regular file"},
      {"--steps 1 --width 8 --data " + d.file("fifo.bin"), d.file("fifo.bin")},
      {gpt + "--data " + shards + "--sample-tokens 2 --prompt-tokens 1 --vocab-file " + d.file("fifo.txt"),
       "--vocab-file " + d.file("fifo.txt") + ": is not a regular file"},
      {gpt + "--data " + shards + "--sample-tokens 2 --prompt-tokens 1 --vocab-file " + d.file("glob"),
       "--vocab-file " + d.file("glob") + ": is a directory"},
  };
  for (const auto& [args, says] : cases) {
    const RunResult r = run(args, "timeout 60");
    EXPECT_EQ(r.code, 2) << args << ": " << r.out;
    EXPECT_NE(r.out.find(says), std::string::npos) << args << ": " << r.out;
  }
}

// Weights that hold inf or NaN (a diverged run's, or a damaged file's) are refused at load, naming
// the file and the tensor (exit 2): they trained to NaN, or under fp16 skipped every step until the
// scale collapsed, and the message named neither.
TEST(Cli, InitWeightsThatHoldInfOrNanAreRefusedNamingTheTensor) {
  TempDir d;
  const std::string gpt = " --model gpt --data " + test::generated_text_file("cli_nan", 4000) +
                          " --n-layer 1 --n-head 2 --n-embd 16 --block-size 8 --batch-size 2 --threads 1 --log-every 0 ";
  ASSERT_EQ(run(gpt + "--steps 1 --save-weights " + d.file("w.safetensors")).code, 0);
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    safetensors::NamedTensors w = safetensors::load(d.file("w.safetensors"));
    for (auto& [name, t] : w)
      if (name == "transformer.ln_f.bias") {
        std::vector<double> v = t.to_vector();
        v[3] = bad;
        t = from_vector(v, t.shape(), t.dtype());
      }
    safetensors::save(d.file("bad.safetensors"), w);
    const RunResult r = run(gpt + "--steps 3 --amp fp16 --init-weights " + d.file("bad.safetensors"));
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("--init-weights " + d.file("bad.safetensors") + ": transformer.ln_f.bias holds inf or NaN"),
              std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << "trained before refusing:\n" << r.out;
  }
}

}  // namespace
}  // namespace amp
