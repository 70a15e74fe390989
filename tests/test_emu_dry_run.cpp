// amp_train --device cuda in the emulated GPU's dry run (AMP_EMU_DRY_RUN=1) with its launch log
// (AMP_EMU_LAUNCH_LOG), one rank: a small GPT in bf16 with AdamW and an MLP in fp16 with dynamic loss
// scaling train to the end on read-backs of zeros, with 0 host synchronisations; every kernel's cost
// is declared at its launch site; and the log of each step is the log of the same run with
// everything executed (poisoning off, as in the dry run): what the host launches does not depend on
// device values.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_util.h"

namespace {

namespace fs = std::filesystem;

struct Step {
  std::vector<nlohmann::json> ops;
  int64_t peak_bytes = -1;
};

struct Run {
  int code = -1;
  std::string out;
  std::vector<Step> steps;
  std::vector<std::string> marks;  // the log's step and profiler marks, in order
};

Run train(bool dry, const std::string& args, const std::string& env = "") {
  const fs::path dir = fs::temp_directory_path() / ("amp_emu_dry_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string text = (dir / "text").string(), log = (dir / "log.jsonl").string();
  {
    std::ofstream t(text);
    for (int i = 0; i < 2000; ++i) t << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  const std::string cmd = std::string("env -i PATH=\"$PATH\" HOME=\"$HOME\" ASAN_OPTIONS=detect_leaks=0 ") +
                          (dry ? "AMP_EMU_DRY_RUN=1 " : "AMP_CUDA_POISON_FREED=0 ") + env + "AMP_EMU_LAUNCH_LOG=" + log +
                          " timeout 300 " + AMP_TRAIN_BIN + " --device cuda --threads 1 --steps 3 --log-every 1 " +
                          args + (args.find("gpt") != std::string::npos ? " --data " + text : "") + " 2>&1";
  Run r;
  int status = 0;
  r.out = amp::cli::capture(cmd, &status);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream in(log);
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    const std::string op = j["op"].get<std::string>();
    if (op == "step_begin" || op == "step" || op.starts_with("profiler_")) r.marks.push_back(op);
    if (j["op"] == "step_begin") {
      r.steps.emplace_back();
      inside = true;
    } else if (j["op"] == "step") {
      r.steps.back().peak_bytes = j["peak_bytes"].get<int64_t>();
      inside = false;
    } else if (inside) {
      r.steps.back().ops.push_back(j);
    }
  }
  fs::remove_all(dir);
  return r;
}

void check(const std::string& args) {
  const Run dry = train(true, args), real = train(false, args);
  ASSERT_EQ(dry.code, 0) << dry.out;
  ASSERT_EQ(real.code, 0) << real.out;
  EXPECT_NE(dry.out.find("emulated GPU: 0 host syncs"), std::string::npos) << dry.out;
  ASSERT_EQ(dry.steps.size(), 3u) << dry.out;
  ASSERT_EQ(real.steps.size(), 3u) << real.out;
  for (size_t s = 0; s < dry.steps.size(); ++s) {
    EXPECT_GT(dry.steps[s].peak_bytes, 0);
    EXPECT_EQ(dry.steps[s].peak_bytes, real.steps[s].peak_bytes) << "step " << s + 1;
    ASSERT_EQ(dry.steps[s].ops.size(), real.steps[s].ops.size()) << "step " << s + 1;
    for (size_t i = 0; i < dry.steps[s].ops.size(); ++i) {
      const nlohmann::json& op = dry.steps[s].ops[i];
      EXPECT_EQ(op, real.steps[s].ops[i]) << "step " << s + 1 << ", operation " << i;
      if (op["op"] == "kernel") {
        EXPECT_TRUE(op["declared"].get<bool>()) << op.dump();
      }
      if (op["op"] == "gemm") {
        EXPECT_GT(op["flops"].get<int64_t>(), 0) << op.dump();
      }
    }
  }
}

TEST(EmuDryRun, GptBf16AdamW) {
  check("--model gpt --n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 4 --amp bf16 --optimizer adamw "
        "--dropout 0.1 --eval-every 0 --sample-tokens 0");
}

// Without dropout the GPT takes fused attention, ours or cuDNN's (auto's choice where the library
// runs, as the emulated GPU's stand-in kernels do): their costs are declared (the stand-in's FLOPs,
// which the cost model prices at cuDNN's rates), dry and executed alike.
TEST(EmuDryRun, GptBf16FusedAttention) {
  for (const char* kernels : {"fused", "auto"}) {
    check(std::string("--model gpt --n-layer 2 --n-head 2 --n-embd 64 --block-size 16 --batch-size 4 --amp bf16 "
                      "--optimizer adamw --eval-every 0 --sample-tokens 0 --attention ") + kernels);
    const auto r = train(true, std::string("--model gpt --n-layer 2 --n-head 2 --n-embd 64 --block-size 16 --batch-size 4 "
                                           "--amp bf16 --eval-every 0 --sample-tokens 0 --attention ") + kernels);
    ASSERT_EQ(r.code, 0) << r.out;
    int cudnn = 0, ours = 0, dq_from_ds = 0;
    for (const nlohmann::json& op : r.steps.back().ops) {
      if (op["op"] != "kernel") continue;
      const std::string name = op["name"].get<std::string>();
      if (name.starts_with("cudnn_reference_forward")) {
        ++cudnn;
        EXPECT_GT(op["flops"].get<int64_t>(), 0) << op.dump();
      }
      ours += name.starts_with("attention_");  // the prefix the cost model prices our kernels' FLOPs by
      dq_from_ds += name.starts_with("attention_dq_kept_kernel");
    }
    EXPECT_EQ(cudnn, std::string(kernels) == "auto" ? 2 : 0) << kernels << ": a forward a layer";
    // Ours: the forward, then delta, dk/dv and dq (from the dS dk/dv kept) a layer, each named so.
    EXPECT_EQ(ours, std::string(kernels) == "fused" ? 8 : 0) << kernels;
    EXPECT_EQ(dq_from_ds, std::string(kernels) == "fused" ? 2 : 0) << kernels;
  }
}

// cuDNN's deterministic backward keeps dS in its workspace (batch x heads x block^2 x 2 bytes), asked
// for at the step's peak. On an emulated GPU of 80 MiB, a GPT at block 1024 has room for everything
// but that (16 MiB): --attention auto says so once and trains to the end on our kernels (the last
// step's attention is ours: a forward, delta, dk/dv and dq a layer); --attention cudnn stops with a
// message that names the workspace and the flag that needs none.
TEST(EmuDryRun, GptAutoAttentionFallsBackWhereCudnnsWorkspaceFindsNoRoom) {
  const std::string args = "--model gpt --n-layer 2 --n-head 2 --n-embd 64 --block-size 1024 --batch-size 4 --amp bf16 "
                           "--eval-every 0 --sample-tokens 0 --attention ";
  const auto fallback = train(true, args + "auto", "AMP_EMU_MEMORY_MB=80 ");
  ASSERT_EQ(fallback.code, 0) << fallback.out;
  EXPECT_NE(fallback.out.find("notice: attention: not cuDNN's fused attention (CUDA out of memory"), std::string::npos)
      << fallback.out;
  ASSERT_EQ(fallback.steps.size(), 3u) << fallback.out;
  int cudnn = 0, ours = 0;
  for (const nlohmann::json& op : fallback.steps.back().ops) {
    if (op["op"] != "kernel") continue;
    const std::string name = op["name"].get<std::string>();
    cudnn += name.starts_with("cudnn_reference_");
    ours += name.starts_with("attention_");
  }
  EXPECT_EQ(cudnn, 0);
  EXPECT_EQ(ours, 8);
  const auto asked = train(true, args + "cudnn", "AMP_EMU_MEMORY_MB=80 ");
  EXPECT_NE(asked.code, 0) << asked.out;
  EXPECT_NE(asked.out.find("it was cuDNN's attention backward's workspace, 16 MiB for batch 4 x block 1024 x 2 heads"),
            std::string::npos) << asked.out;
  EXPECT_NE(asked.out.find("--attention fused needs no such workspace"), std::string::npos) << asked.out;
}

// GPT-2's GELU (--gelu tanh) in the GEMMs: a layer's MLP forward is one cuBLASLt matmul with the
// GELU_AUX_BIAS epilogue, its backward one with DGELU (the erf GELU keeps its own passes: none).
TEST(EmuDryRun, GptTanhGeluInTheGemmsEpilogues) {
  const std::string gpt = "--model gpt --n-layer 2 --n-head 2 --n-embd 64 --block-size 16 --batch-size 4 --amp bf16 "
                          "--optimizer adamw --eval-every 0 --sample-tokens 0 --gelu ";
  check(gpt + "tanh");
  for (const char* form : {"tanh", "erf"}) {
    const auto r = train(true, gpt + form);
    ASSERT_EQ(r.code, 0) << r.out;
    int forward = 0, backward = 0;
    for (const nlohmann::json& op : r.steps.back().ops) {
      forward += op["op"] == "gemm" && op.value("epilogue", "") == "gelu_aux_bias";
      backward += op["op"] == "gemm" && op.value("epilogue", "") == "dgelu";
    }
    const int want = std::string(form) == "tanh" ? 2 : 0;
    EXPECT_EQ(forward, want) << form << ": one a layer";
    EXPECT_EQ(backward, want) << form << ": one a layer";
  }
}

// The residual stream's gradient reaches each branch in its dtype from LayerNorm's backward, which
// writes that cast beside the sum: no pass casts the fp32 [B, T, C] gradient to bf16 (four, one per
// residual add, before).
TEST(EmuDryRun, GptBranchesTakeTheirGradientsCastByLayerNorm) {
  const auto r = train(true, "--model gpt --n-layer 2 --n-head 2 --n-embd 64 --block-size 16 --batch-size 4 --amp bf16 "
                             "--optimizer adamw --eval-every 0 --sample-tokens 0");
  ASSERT_EQ(r.code, 0) << r.out;
  int residual_casts = 0;
  for (const nlohmann::json& op : r.steps.back().ops)
    residual_casts += op["op"] == "kernel" && op["name"].get<std::string>().starts_with("cast_packed_kernel") &&
                      op.value("params", "").starts_with("(float const*, BFloat16*") && op["read"] == 4 * 16 * 64 * 4;
  EXPECT_EQ(residual_casts, 0) << "a cast of the fp32 residual gradient [4, 16, 64]";
}

// --profile-step 2: cudaProfilerStart just before step 2 begins, cudaProfilerStop once it has ended.
TEST(EmuDryRun, ProfileStepBracketsThatStep) {
  const auto r = train(false, "--width 64 --layers 2 --batch-size 16 --profile-step 2");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<std::string> want = {"step_begin", "step",          "profiler_start", "step_begin",
                                         "step",       "profiler_stop", "step_begin",     "step"};
  EXPECT_EQ(r.marks, want);
}

TEST(EmuDryRun, MlpFp16DynamicScaling) {
  check("--width 64 --layers 3 --batch-size 16 --amp fp16 --loss-scale dynamic --momentum 0.9 --clip-grad-norm 1.0");
}

// fp16 with clipping by the norm: the gradients are checked read-only, their norm reads them
// unscaled and the optimizer's pass unscales them as it reads them, so no pass writes them back
// unscaled (no UnscaleOp kernel in the step). The clamp, which reads them itself, still unscales
// them first: the control, which shows that the count sees the kernel. Same numbers: test_cli.
TEST(EmuDryRun, Fp16ClippingByNormWritesNoUnscaledGradient) {
  const auto unscale_kernels = [](const std::string& extra) {
    const auto r = train(true, "--width 64 --layers 3 --batch-size 16 --amp fp16 --momentum 0.9 --clip-grad-norm 1.0 " + extra);
    EXPECT_EQ(r.code, 0) << r.out;
    int n = 0;
    if (!r.steps.empty())
      for (const nlohmann::json& op : r.steps.back().ops)
        if (op["op"] == "kernel" && op.value("params", "").find("UnscaleOp") != std::string::npos) ++n;
    return n;
  };
  EXPECT_EQ(unscale_kernels(""), 0);
  EXPECT_EQ(unscale_kernels("--log-grad-norm"), 0);
  EXPECT_GT(unscale_kernels("--clip-grad-value 100"), 0);
}

// One rank, one micro-batch, clipping by the norm: no gradient buckets held from one step to the next
// (the norm reads the gradients where they lie, comm/chunked_norm.h), so each step's peak device
// memory is the one of the same run without the norm, which never had buckets, give or take the
// norm's few small blocks. With buckets it was 4 bytes a parameter more (about 0.4 MB here).
TEST(EmuDryRun, ClippingByTheNormHoldsNoGradientBuckets) {
  const std::string gpt = "--model gpt --n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --batch-size 8 --amp bf16 "
                          "--optimizer adamw --eval-every 0 --sample-tokens 0";
  const auto clip = train(true, gpt + " --clip-grad-norm 1");
  const auto plain = train(true, gpt);
  ASSERT_EQ(clip.code, 0) << clip.out;
  ASSERT_EQ(plain.code, 0) << plain.out;
  ASSERT_EQ(clip.steps.size(), plain.steps.size());
  for (size_t s = 0; s < clip.steps.size(); ++s) {
    EXPECT_GE(clip.steps[s].peak_bytes, plain.steps[s].peak_bytes) << "step " << s + 1;
    EXPECT_LE(clip.steps[s].peak_bytes, plain.steps[s].peak_bytes + 8192) << "step " << s + 1;
  }
}

}  // namespace
