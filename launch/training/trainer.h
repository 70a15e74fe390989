// The data-parallel training loop of docs/DESIGN.md §7: micro-batches under autocast, a scaled backward,
// bucketed gradient averaging on the last micro-batch, unscale, a found_inf every rank agrees on,
// optional clipping, then step-or-skip and a scale update that is identical on every rank.
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "comm/communicator.h"
#include "comm/reducer.h"
#include "comm/replica_check.h"
#include "comm/sum_tree.h"
#include "comm/zero_shards.h"
#include "jd/aggregator.h"
#include "launch/training/checkpoint.h"
#include "launch/training/metrics.h"
#include "launch/training/step_observer.h"
#include "launch/training/train_config.h"
#include "models/data/dataset.h"
#include "models/model_spec.h"
#include "models/training_model.h"
#include "runtime/kernels/backend.h"
#include "runtime/kernels/cuda/cuda_support.h"
#include "runtime/nn/layers.h"
#include "runtime/optim/lr_scheduler.h"
#include "runtime/optim/optimizer.h"

namespace amp::launch {

// A failure that every rank meets at the same point with the same message (a non-finite loss, a
// replica mismatch, every step skipped): no peer is left inside a collective, so the job can end
// cleanly, and rank 0 alone needs to report it.
class JobError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TrainResult {
  std::vector<StepRecord> records;  // every step's record (rank 0's view)
  int64_t steps_done = 0;           // cfg.steps, or fewer when interrupted
  int interrupted_by = 0;           // the signal that stopped the run early (this rank's, else SIGTERM), or 0
  int64_t skipped_steps = 0;
  double final_scale = 1.0;
  std::string param_checksum;
  bool replicas_consistent = true;
  // The device memory this rank held at most beyond its context, as the driver counts it
  // (DeviceMemory::device_peak_bytes); 0 on the CPU.
  size_t device_memory_bytes = 0;
  // Outputs that could not be saved (the weights, the final checkpoint, the metrics), each naming
  // its flag and cause: the run trained, and the job exits 1. Rank 0's, and every rank's for a
  // checkpoint.
  std::vector<std::string> errors;
};

// What a training run reports while it runs (rank 0 only).
class ProgressSink {
 public:
  virtual ~ProgressSink() = default;
  // Step r's figures; skipped: the steps skipped so far (from step 1); elapsed: seconds since this
  // run's first step started; stopping: the run stops after this step (interrupted).
  virtual void step(const StepRecord& r, int64_t skipped, double elapsed, bool stopping) = 0;
  virtual void validation(int64_t step, double loss) = 0;
  // After the last step, on a device that counts it: rank 0's TrainResult::device_memory_bytes.
  virtual void device_memory(size_t /*bytes*/) {}
};

class Trainer {
 public:
  // Builds the model (seeded, or from --init-weights), the data, the optimizer and the scaler.
  // Only local work, no collective: a rank whose files are bad throws std::invalid_argument here,
  // and the ranks can agree on that before any of them enters a collective.
  Trainer(const TrainConfig& config, comm::Communicator& comm, Device device);
  ~Trainer();
  // Collective from here on: broadcasts rank 0's weights, sets up the reducer, trains.
  TrainResult run();
  nn::Module& model() { return model_->module(); }
  const models::ModelSpec& spec() const { return *spec_; }
  const models::Dataset& data() const { return *data_; }
  const optim::Optimizer& optimizer() const { return *opt_; }
  bool scaling() const { return scaler_->is_enabled(); }
  int64_t start_step() const { return position_.start_step; }
  // Samples per step over every rank: --batch-size x --micro-batches x ranks.
  int64_t samples_per_step() const { return cfg_.batch_size * cfg_.micro_batches * comm_.size(); }  // the step a resumed run continues from (0: fresh)
  const comm::GradientReducer& reducer() const { return *reducer_; }  // after run()
  // A hook called at the start of every step, before any work (fault tests make a rank stall there).
  void set_before_step(std::function<void(int64_t step)> hook) { listeners_.before_step = std::move(hook); }
  // Under --zero 1, called in each step just before the parameters' all-gather (fault tests).
  void set_before_gather(std::function<void(int64_t step)> hook) { listeners_.before_gather = std::move(hook); }
  // Called on every rank as a checkpoint begins, before it is gathered or written (fault tests).
  void set_before_checkpoint(std::function<void(int64_t step)> hook) { listeners_.before_checkpoint = std::move(hook); }
  // Where rank 0 reports each step's figures and each validation loss as they reach the host (the
  // amp_train program prints a progress line: launch/progress.h). None: the run reports nothing but
  // its metrics, messages and result.
  void set_progress(std::shared_ptr<ProgressSink> sink) { listeners_.progress = std::move(sink); }

 private:
  void connect();  // the collective part of the setup, once
  // The figures a step reads back to the host (step.cpp packs and unpacks them by name).
  struct StepFigures {
    Tensor loss, scale, found_inf, stop;
    Tensor grad_norm;  // undefined: not computed this step (no placeholder travels)
    std::vector<Tensor> task_losses;
    std::vector<Tensor> packed() const;
    static void unpack(const std::vector<double>& v, bool has_grad_norm, StepRecord* r);
  };
  // A step whose work is issued and whose figures are on their way to the host.
  struct PendingStep {
    int64_t step;
    std::chrono::steady_clock::time_point start;
    std::unique_ptr<Readback> figures;  // StepFigures::packed(), on its way to the host
    std::optional<DeviceCounts> counted;  // what the step issued, where a step observer counts
    double lr = 0.0;  // the learning rate this step used
    std::vector<double> weights;  // the aggregator's (multi-task)
    bool grad_norm = false;  // computed this step (clipping or --log-grad-norm): in the figures
    uint64_t comm_bytes = 0;  // what this rank sent in the step's collectives (Communicator::bytes_sent)
    // On a GPU: which gradients were not finite (GradScaler::nonfinite_per_tensor, copied aside for this
    // step), read back only if the step was skipped, and their names.
    Tensor nonfinite_flags;
    std::shared_ptr<const std::vector<std::string>> flag_names;
    Tensor jacobian_row_flags;  // multi-task: J's rows (tasks) that held an inf or NaN, read after a skip
  };

  // --- the set-up (trainer.cpp's constructor; resume.cpp): what the run trains, and with what.
  TrainConfig cfg_;
  comm::Communicator& comm_;
  Device device_;
  std::shared_ptr<const models::ModelSpec> spec_;  // the configured kind of model (registry)
  std::unique_ptr<models::TrainingModel> model_;
  std::unique_ptr<models::Dataset> data_;
  std::unique_ptr<jd::Aggregator> aggregator_;  // multi-task runs: Jacobian descent's aggregator
  std::unique_ptr<optim::Optimizer> opt_;
  std::unique_ptr<optim::LRScheduler> scheduler_;  // null: a constant lr
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<comm::GradientReducer> reducer_;  // made by connect()
  std::unique_ptr<comm::ZeroShards> zero_;          // --zero 1: this rank's pieces, which opt_ steps
  comm::ReducerOptions reducer_options() const;
  bool needs_grad_norm() const { return cfg_.clip_grad_norm > 0.0 || cfg_.log_grad_norm; }
  // Where the run stands (resume.cpp sets it from a checkpoint; run() counts the skipped steps).
  struct Position {
    int64_t start_step = 0;     // the step the run continues from (0: a fresh run)
    std::string resumed_from;   // the checkpoint's directory (a resumed run)
    int64_t skipped_steps = 0;  // skipped since step 1 (a resumed run starts from its checkpoint's count)
    // Resumed from a checkpoint at --steps: nothing to train, and the outputs are left as they are.
    std::string nothing_left;
  } position_;
  // The run's autocast region (disabled with --amp off), for the forward, evaluation and sampling;
  // inside it, provide_casts() gives the optimizer's low-precision copies, when kept, as the casts of
  // the parameters.
  autocast autocast_region() const {
    return autocast(device_.type, amp_dtype(cfg_.amp), cfg_.amp != AmpMode::off, true, CastLists::cuda);
  }
  void provide_casts() const;
  // The multi-task backward (mtl_backward, jac_to_grad) in place of backward and the reducer.
  bool multi_task() const { return aggregator_ != nullptr; }
  // Checkpoints (launch/training/checkpoint.h): the configuration a resume must match, restoring one (in the
  // constructor: local work), and writing one (rank 0 writes, every rank agrees on the outcome).
  nlohmann::json checkpoint_meta(int64_t step) const;
  void resume();
  // True when a stop was asked for, on any rank, while it was written (every rank: the outcome is
  // agreed): the run then stops at this step, whose checkpoint it has, not after one more.
  bool save_checkpoint_at(int64_t step);
  // The optimizer's state of a parameter with padding rows (Module::saved_rows: GPT's vocabulary) is
  // saved without them, as the parameter is, and given them back (zero) on resume: PyTorch's id ->
  // {rows saved, the parameter's shape}.
  struct PaddedState {
    int64_t rows;
    Shape shape;
  };
  std::map<int64_t, PaddedState> padded_state_;
  optim::OptimizerStateDict without_padding(optim::OptimizerStateDict s) const;
  optim::OptimizerStateDict with_padding(optim::OptimizerStateDict s) const;

  // --- the step (step.cpp). A step is its inputs, written eagerly before its device work (so that a
  // CUDA graph's replay reads this step's), then the device work, which reads nothing else from the
  // host: the micro-batches, the stop flag and an injected overflow are tensors here, the learning
  // rate the optimizer's device scalar (Optimizer::write_lr).
  PendingStep train_step(int64_t step);
  void stage_inputs(int64_t step);
  StepFigures device_step();
  // The names of opt_'s parameters that have a gradient, in opt_->grads()' order (ZeRO-1's pieces by
  // their parameters' names).
  std::shared_ptr<const std::vector<std::string>> gradient_names();
  int64_t first_sample(int64_t step) const;  // this rank's first sample of a step (1-based)
  StepRecord finish(PendingStep& p, std::chrono::steady_clock::time_point next_start);
  // The multi-task backward of a micro-batch: its trunk Jacobian and heads' gradients, packed
  // (jd/packed_jacobians.h), join the step's tree (comm/sum_tree.h), summed over ranks in the same
  // order by aggregate_jacobians().
  void multi_task_backward(const models::Losses& L);
  std::vector<double> aggregate_jacobians();  // sums over micro-batches and ranks, aggregates; the weights
  // CUDA graphs (--cuda-graphs): the step is captured once, after kGraphWarmupSteps eager steps (NCCL
  // connects, the allocator's cache and every lazily made buffer are ready), and replayed from then on.
  static constexpr int64_t kGraphWarmupSteps = 3;
  static_assert(kGraphWarmupSteps >= 1, "the capture reads the micro-batch tensors an eager step made");
  std::string graph_blocker() const;  // why this run's step cannot be captured ("" when it can)
  using JacobianTree = comm::SumTree<Tensor, void (*)(Tensor&, const Tensor&)>;
  struct StepState {
    std::vector<models::Batch> batches;  // this step's micro-batches (kept, as the graph's inputs, with graphs)
    Tensor stop_flag;    // [1] f32: 1 when this rank was asked to stop (a stop signal, interrupt.h)
    Tensor inject_flag;  // [1] f32: +inf on a step and rank of --inject-nonfinite, else 0 (defined with one)
    std::vector<double> jd_weights;  // the aggregator's weights of the last step (multi-task)
    bool use_graphs = false;
    std::unique_ptr<DeviceGraph> graph;
    std::unique_ptr<StepFigures> graph_figures;  // the captured step's outputs, rewritten by every replay
    uint64_t graph_comm_bytes = 0;  // what the captured step's collectives send: each replay sends it again
    std::unique_ptr<JacobianTree> jacobian_tree;  // this step's micro-batches, flat [J | heads' grads]
    int64_t jacobian_rows = 0;
    // Multi-task: 1 where this step's summed J holds an inf or NaN (added to found_inf), and which rows.
    Tensor jacobian_found, jacobian_row_flags;
    std::vector<std::string> nonfinite;  // --zero 1 on the CPU: this rank's pieces with non-finite gradients
    int64_t number = 0;  // the step being issued (for the listeners)
    // On a GPU: the scaler's per-gradient flags of the step device_step issued (the same tensor in every
    // replay of a CUDA graph), the names of those gradients, and two copies that alternate between steps,
    // so that a step's flags outlive the next step until its figures are read.
    Tensor flags;
    std::shared_ptr<const std::vector<std::string>> flag_names;
    Tensor flag_copies[2];
  } step_;

  // --- what the loop (trainer.cpp's run) checks and reports besides the metrics and checkpoints.
  // The validation loss over cfg_.eval_batches batches (collective: every rank, same step), or none
  // when a stop was asked for (a stop signal on any rank): the ranks agree after each batch.
  std::optional<double> evaluate();
  // What the model prints after training, under the run's autocast (this rank alone; no collective);
  // it stops at the next token when a stop is asked for.
  std::string after_training();
  // run() for a requeued command whose run trained every step (--resume at --steps): nothing is
  // trained; the outputs that run may not have written (a full disk, a kill while saving) are written
  // from the checkpoint: --save-weights again (the same bytes), the metrics' end record where missing.
  TrainResult finish_a_finished_run();
  // The run's end, shared by run() and finish_a_finished_run(): --save-weights (rank 0; a failure
  // goes into result.errors), and the metrics' last record (the end record, or a failed one naming
  // the first error) then their close.
  void save_weights(TrainResult& result);
  static void end_metrics(MetricsWriter& metrics, TrainResult& result, const std::string& interrupted_by);
  // Hashes and gathers the parameters (collective); records the result.
  comm::ReplicaReport check_replicas(TrainResult* result);
  static void require_consistent(const comm::ReplicaReport& rep, int64_t step);  // throws, naming the ranks
  // Throws JobError naming the parameters that hold inf or NaN (every rank reaches the same verdict).
  void require_finite_parameters(int64_t step);
  // Who hears of each step, besides the metrics.
  struct Listeners {
    std::function<void(int64_t)> before_step;  // set_before_step
    std::function<void(int64_t)> before_gather;  // set_before_gather
    std::function<void(int64_t)> before_checkpoint;  // set_before_checkpoint
    std::shared_ptr<ProgressSink> progress;    // set_progress
    std::unique_ptr<StepObserver> observer;    // what a stand-in device counts per step (step_observer.h), or null
  } listeners_;
};


}  // namespace amp::launch
