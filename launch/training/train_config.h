// Everything amp_train can be told, with its defaults. The CLI (cli.cpp) fills it; the trainer reads it.
#pragma once
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "models/model_spec.h"
#include "runtime/core/dtype.h"
#include "runtime/optim/lr_scheduler.h"

namespace amp::launch {

enum class AmpMode { off, fp16, bf16 };
// The dtype of an --amp mode's autocast region (fp16 for off, whose region is disabled).
inline DType amp_dtype(AmpMode m) { return m == AmpMode::bf16 ? DType::bf16 : DType::f16; }
enum class OptimizerKind { sgd, adamw };
enum class LrSchedule { constant, cosine };
enum class DeviceKind { auto_, cpu, cuda };
// --cuda-graphs: capture the training step once and replay it (auto: where the step can be captured).
enum class CudaGraphs { auto_, on, off };
// --loss-scale: auto (dynamic for fp16, off otherwise), dynamic, off, or a constant value.
struct LossScale {
  enum class Kind { auto_, dynamic, off, constant } kind = Kind::auto_;
  float value = 0.0f;
  double given = 0.0;  // the number as written (checked against --amp's bounds), for a constant
};

struct Injection {
  int64_t step;  // 1-based
  int rank;
};

struct TrainConfig {
  // Model: a kind of the registry (models/model_spec.h) and the values of its own flags, by name
  // ({"n-layer", "2"}); the flags not given keep the kind's defaults.
  std::string model = models::model_kinds().front().name;
  models::ModelFlagValues model_flags;
  // Evaluation (a model whose data has a validation split): the validation loss over eval_batches
  // batches every eval_every steps and after the last (0: never).
  int64_t eval_every = 0, eval_batches = 8;
  // Checkpoints: every checkpoint_every steps (and at the end, and when interrupted) into
  // checkpoint_dir/step-NNNNNNNN, keeping the last keep_checkpoints; resume from the latest.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int64_t keep_checkpoints = 3;
  bool resume = false;
  std::string resume_from;  // a checkpoint directory to resume from (an older one, by the user's choice)
  // Data and weights
  std::string data = "synthetic";
  std::string init_weights, save_weights;
  std::string save_weights_format = "native";  // or one of the model's weight_formats() (the GPT: hf)
  // Training
  int64_t steps = 100;
  int64_t batch_size = 32;  // per rank, per micro-batch
  int64_t micro_batches = 1;
  OptimizerKind optimizer = OptimizerKind::sgd;
  double lr = 0.01;
  double momentum = 0.0;  // torch.optim.SGD's default
  std::optional<double> weight_decay;  // unset: PyTorch's default for the optimizer (SGD 0, AdamW 0.01)
  double beta1 = 0.9, beta2 = 0.999;   // AdamW
  // Learning-rate schedule: constant, or cosine (linear warmup over warmup_steps, then cosine decay
  // to min_lr at decay_steps, then min_lr). decay_steps 0: --steps.
  LrSchedule lr_schedule = LrSchedule::constant;
  int64_t warmup_steps = 0;
  double min_lr = 0.0;
  int64_t decay_steps = 0;
  uint64_t seed = 0;
  double clip_grad_norm = 0.0;   // 0: off
  bool log_grad_norm = false;    // the 2-norm in the metrics without clipping (one more read of the gradients)
  bool allow_tf32 = false;       // fp32 GEMMs in TF32 on a GPU's tensor cores
  int64_t profile_step = 0;      // on a GPU, this step between cudaProfilerStart and cudaProfilerStop (0: none)
  double clip_grad_value = 0.0;  // 0: off
  double grad_penalty = 0.0;     // 0: off
  // AMP
  AmpMode amp = AmpMode::off;
  LossScale loss_scale;
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int growth_interval = 2000;
  int hysteresis = 1;
  float min_scale = 0.0f;
  float max_scale = std::numeric_limits<float>::infinity();
  std::vector<Injection> inject_nonfinite;
  // Under autocast, the optimizer keeps each parameter's fp16/bf16 copy, rewritten by its step, and the
  // forward reads it instead of casting every parameter every step (the same numbers; false: the
  // control that tests compare against).
  bool low_precision_copies = true;
  // Under bf16, a linear layer's weight gradient is its GEMM's fp32 sums, not rounded to bf16 first as
  // PyTorch's autocast does (set_fp32_weight_grads); true: PyTorch's rounding.
  bool bf16_rounded_weight_grads = false;
  // Runtime and distribution
  DeviceKind device = DeviceKind::auto_;
  int threads = 0;  // 0: cores / ranks on this node
  double comm_timeout = 300.0;
  int64_t check_every = 0;  // 0: replica check at the end only
  double bucket_mb = 25.0;
  bool overlap = true;
  int zero = 0;  // 1: ZeRO-1, the optimizer's state sharded over the ranks (comm/zero_shards.h)
  CudaGraphs cuda_graphs = CudaGraphs::auto_;
  // Output
  std::string metrics;
  std::string config_file;  // --config, an input the outputs must not overwrite
  // The flags given (command line, then --config's keys it did not set), as "name value" in name
  // order: what every rank of a job must share (amp_train compares them over the ranks).
  std::vector<std::string> given_flags;
  int64_t log_every = 10;  // 0: no progress lines
};

// The scaler options that the CLI flags select (disabled for --loss-scale off, or auto without fp16).
GradScalerOptions scaler_options(const TrainConfig& c);
// The --lr-schedule as PyTorch schedulers on opt (null for a constant lr).
std::unique_ptr<optim::LRScheduler> make_scheduler(const TrainConfig& c, optim::Optimizer& opt);

// The run as a model's checks see it (models::RunShape): data, batch, optimizer state, autocast.
models::RunShape run_shape(const TrainConfig& c);

}  // namespace amp::launch
