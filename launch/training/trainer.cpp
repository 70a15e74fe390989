// The trainer: its set-up (model, data, optimizer groups, scaler, resume) and the loop's cadence
// (steps, evaluation, replica checks, checkpoints, progress, outputs). The step is step.cpp.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <stdexcept>

#include "comm/chunked_norm.h"
#include "comm/coalesced.h"
#include "comm/sum_tree.h"
#include "comm/replica_check.h"
#include "launch/training/figures.h"
#include "launch/training/checkpoint.h"
#include "launch/training/interrupt.h"
#include "launch/training/trainer.h"
#include "runtime/core/fnv1a.h"
#include "runtime/core/safetensors.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops/autograd.h"
#include "runtime/ops/autocast_policy.h"
#include "runtime/ops/ops.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/sgd.h"

namespace amp::launch {

namespace fs = std::filesystem;

namespace {

// What stopped the run, for rank 0's line: its own signal, or a peer's (the ranks agree on a stop).
const char* stop_label() {
  return interrupt_signal() != 0 ? signal_label(interrupt_signal()) : "a stop signal to another rank";
}

// Weights that hold inf or NaN train to NaN, or under fp16 skip every step until the loss scale
// collapses: refused at load (exit 2), naming the file and the tensors.
void require_finite_weights(const safetensors::NamedTensors& weights, const std::string& file) {
  std::vector<Tensor> xs;
  std::vector<std::string> names;
  for (const auto& [name, t] : weights)
    if (is_floating(t.dtype()) && t.device().is_cpu()) {
      xs.push_back(t);
      names.push_back(name);
    }
  Tensor found = zeros({1}, DType::f32, kCPU), flags = zeros({static_cast<int64_t>(xs.size())}, DType::f32, kCPU);
  backend_for(kCPU).check_finite(xs, Tensor(), found, flags);
  if (found.item() == 0.0) return;
  std::string bad;
  for (size_t i = 0; i < names.size(); ++i)
    if (flags.data<float>()[i] != 0.0f) bad += (bad.empty() ? "" : ", ") + names[i];
  throw std::invalid_argument("--init-weights " + file + ": " + bad + (bad.find(',') == std::string::npos ? " holds" : " hold") +
                              " inf or NaN: no weights to train from");
}

}  // namespace

Trainer::Trainer(const TrainConfig& config, comm::Communicator& comm, Device device)
    : cfg_(config), comm_(comm), device_(device) {
  Generator gen(cfg_.seed);
  spec_ = models::configure_model(cfg_.model, cfg_.model_flags);
  models::RunShape run = run_shape(cfg_);
  run.device = device_.type;  // chosen by now (--device auto resolved)
  spec_->check(run, 0.0L);
  model_ = spec_->build(gen, device_);
  data_ = spec_->data(cfg_.data, cfg_.seed, device_);
  aggregator_ = spec_->aggregator(cfg_.seed);
  if (cfg_.eval_every > 0 && !data_->has_validation())
    throw std::invalid_argument("--eval-every: --model " + cfg_.model + "'s data (" + data_->describe() +
                                ") has no validation split");
  // --resume with --init-weights: the weights while there is no checkpoint (a requeued job's first
  // start); once there is one they are its, and the file is not read (it may be gone by then).
  if (!cfg_.init_weights.empty() && !(cfg_.resume && !list_checkpoints(cfg_.checkpoint_dir).empty())) {
    safetensors::NamedTensors weights = safetensors::load(cfg_.init_weights);
    require_finite_weights(weights, cfg_.init_weights);  // named as the file names them
    weights = spec_->import_weights(std::move(weights), cfg_.init_weights);
    nn::load_state_dict(model_->module(), weights, cfg_.init_weights);
  }
  // Parameter groups: a model that names its decayed parameters (the GPT: tensors of 2+ dims, as
  // nanoGPT) gets weight decay on those only; otherwise every parameter decays.
  const std::vector<Tensor> decayed = model_->decayed_parameters();
  std::vector<Tensor> not_decayed;
  for (const Tensor& p : model().parameters())
    if (std::none_of(decayed.begin(), decayed.end(), [&](const Tensor& d) { return d.same(p); })) not_decayed.push_back(p);
  std::vector<std::vector<Tensor>> lists = {model().parameters()};
  if (!decayed.empty()) {
    lists = {decayed};
    if (!not_decayed.empty()) lists.push_back(not_decayed);
  }
  {
    const auto saved = model().saved_rows();
    const std::map<std::string, int64_t> rows(saved.begin(), saved.end());
    std::vector<std::pair<Tensor, int64_t>> padded;  // the parameters with padding rows, and their saved rows
    for (const auto& [name, p] : model().named_parameters())
      if (const auto r = rows.find(name); r != rows.end()) padded.emplace_back(p, r->second);
    int64_t id = 0;  // PyTorch's ids: the groups' parameters in order
    for (const auto& list : lists)
      for (const Tensor& p : list) {
        for (const auto& [q, r] : padded)
          if (q.same(p)) padded_state_[id] = {r, p.shape()};
        ++id;
      }
  }
  if (cfg_.zero == 1) {
    if (multi_task()) throw std::invalid_argument("--zero 1: not with Jacobian descent (its trunk Jacobian is summed whole)");
    // ZeRO-1: the optimizer steps this rank's pieces of the parameters (its shard of the buckets,
    // planned now; the reducer that makes them comes with connect()).
    zero_ = std::make_unique<comm::ZeroShards>(comm::plan_buckets(model().parameters(), reducer_options(), comm_.size()),
                                               model().parameters(), lists, comm_);
    lists = zero_->piece_groups();
  }
  auto groups = [&](auto options) {
    using O = decltype(options);
    O off = options;
    off.weight_decay = 0.0;
    std::vector<optim::ParamGroup<O>> g{{lists[0], options}};
    if (lists.size() > 1) g.push_back({lists[1], off});
    return g;
  };
  if (cfg_.optimizer == OptimizerKind::sgd) {
    optim::SgdOptions o;
    o.lr = cfg_.lr;
    o.momentum = cfg_.momentum;
    o.weight_decay = cfg_.weight_decay.value_or(o.weight_decay);
    opt_ = std::make_unique<optim::SGD>(groups(o));
  } else {
    optim::AdamWOptions o;
    o.lr = cfg_.lr;
    o.beta1 = cfg_.beta1;
    o.beta2 = cfg_.beta2;
    o.weight_decay = cfg_.weight_decay.value_or(o.weight_decay);
    opt_ = std::make_unique<optim::AdamW>(groups(o));
  }
  scheduler_ = make_scheduler(cfg_, *opt_);
  scaler_ = std::make_unique<GradScaler>(scaler_options(cfg_));  // found_inf is summed with the step's figures
  // On a GPU, the fused check says which gradients were not finite (read only after a skipped step);
  // on the CPU the gradients are still there to inspect when the step's figures arrive.
  scaler_->set_per_tensor_flags(device_.is_cuda());
  listeners_.observer = make_step_observer(device_);
  // The scaler's state is created by its first scale(), on that output's device: do it here, so that
  // the first counted step launches what every other step does.
  scaler_->scale(zeros({}, DType::f32, device_));
  // --cuda-graphs: on where the step can be captured (auto), refused where it cannot (on).
  const std::string blocker = graph_blocker();
  if (cfg_.cuda_graphs == CudaGraphs::on && !blocker.empty())
    throw std::invalid_argument("--cuda-graphs on: the step cannot be captured: " + blocker +
                                " (--cuda-graphs auto runs it eagerly)");
  step_.use_graphs = cfg_.cuda_graphs != CudaGraphs::off && blocker.empty();
  if (cfg_.resume || !cfg_.resume_from.empty()) {
    resume();
  } else if (!cfg_.checkpoint_dir.empty()) {
    // A fresh run would interleave its checkpoints with another run's, and keeping the last K
    // could delete its own: refuse, and say what to do.
    const std::vector<std::string> existing = list_checkpoints(cfg_.checkpoint_dir);
    if (!existing.empty())
      throw std::invalid_argument("--checkpoint-dir " + cfg_.checkpoint_dir + " already holds checkpoints (" +
                                  existing.back() + "): add --resume to continue that run, or choose another directory");
  }
}

Trainer::~Trainer() = default;

std::string Trainer::graph_blocker() const {
  if (!device_.is_cuda()) return "the device is the CPU (a CUDA graph is a GPU's)";
  if (multi_task())
    return "--model " + cfg_.model + " reads its m x m Gramian on the host every step (as TorchJD does)";
  return "";
}

void Trainer::connect() {
  if (reducer_) return;
  // Every replica starts from rank 0's weights, whatever happened before.
  for (Tensor p : model().parameters()) {
    Tensor d = p.detach();
    comm_.broadcast(d, 0);
  }
  if (!comm::split_is_subtrees(comm_.size(), cfg_.micro_batches) && comm_.rank() == 0) {
    std::printf(
        "amp_train: note: --micro-batches %lld is not a power of two: on %d ranks the sums follow this split, "
        "so the run is not bit for bit the one of another split of its samples per step (it is with a "
        "power of two, or on one rank)\n",
        static_cast<long long>(cfg_.micro_batches), comm_.size());
    std::fflush(stdout);
  }
  if (multi_task()) return;  // Jacobians and head gradients are summed in aggregate_jacobians()
  reducer_ = std::make_unique<comm::GradientReducer>(model().parameters(), comm_, reducer_options());
  if (zero_) zero_->attach(reducer_->buffers());
}

comm::ReducerOptions Trainer::reducer_options() const {
  comm::ReducerOptions ro;
  ro.bucket_bytes = static_cast<size_t>(cfg_.bucket_mb * 1024 * 1024);
  ro.first_bucket_bytes = std::min<size_t>(ro.bucket_bytes, 1u << 20);
  ro.overlap = cfg_.overlap;
  ro.micro_batches = cfg_.micro_batches;
  ro.ordered_sum = true;  // the losses carry B / E: summed in one order, the step is rank-invariant
  ro.shard = cfg_.zero == 1;
  if (ro.shard) ro.shard_align = comm::kNormChunk;  // a norm chunk never straddles two shards
  // One rank and one micro-batch: no buckets (nothing is summed), so no 4 bytes a parameter held
  // from one step to the next; the gradient norm reads the gradients at the slots the buckets would
  // give them (comm/chunked_norm.h), its bits the same. ZeRO-1's shards are pieces of the buckets.
  ro.passthrough = !ro.shard;
  return ro;
}

std::optional<double> Trainer::evaluate() {
  model_->train(false);
  std::vector<Tensor> batch_means;
  bool stopped = false;
  {
    NoGradGuard no_grad;
    autocast ac = autocast_region();
    provide_casts();
    // Batch k is the E = B K R sequences [k E, (k + 1) E) of the validation stream, split as a
    // training step is: rank r's micro-batch j is the (r K + j)-th run of B. Its mean is summed as a
    // step's loss is (each micro-batch's times B / E, in the tree's order), so that it does not
    // depend on the split either.
    const int64_t B = cfg_.batch_size, K = cfg_.micro_batches, R = comm_.size();
    for (int64_t k = 0; k < cfg_.eval_batches; ++k) {
      auto tree = comm::make_sum_tree<Tensor>([](Tensor& into, const Tensor& other) { add_(into, other); });
      for (int64_t j = 0; j < K; ++j) {
        const models::Batch b = data_->validation_rows(((k * R + comm_.rank()) * K + j) * B, B);
        Tensor l = model_->losses(b).per_task.at(0).detach().reshape({1}).to(DType::f32);
        tree.push(K * R > 1 ? div(l, static_cast<double>(K * R)) : l);
      }
      batch_means.push_back(tree.fold());
      // A stop asked for on any rank ends the evaluation after this batch, on every rank (one small
      // collective a batch: evaluation is not the step).
      bool stop = interrupt_signal() != 0;
      if (comm_.size() > 1) {
        Tensor any = full({1}, stop ? 1.0 : 0.0, DType::f32, device_);
        comm::all_reduce_scalars(comm_, {any}, comm::ReduceOp::max);
        stop = any.item() != 0.0;
      }
      if (stop && k + 1 < cfg_.eval_batches) {
        stopped = true;
        break;
      }
    }
  }
  if (stopped) {
    model_->train(true);
    return std::nullopt;
  }
  comm::all_reduce_scalars(comm_, batch_means, comm::ReduceOp::sum);  // in the tree's order
  Tensor total = zeros({1}, DType::f32, device_);
  for (const Tensor& m : batch_means) add_(total, m);
  mul_(total, 1.0 / static_cast<double>(cfg_.eval_batches));
  model_->train(true);
  return total.item();
}

std::string Trainer::after_training() {
  autocast ac = autocast_region();
  provide_casts();
  return spec_->after_training(*model_, cfg_.seed, [] { return interrupt_signal() != 0; });
}

comm::ReplicaReport Trainer::check_replicas(TrainResult* result) {
  const comm::ReplicaReport rep = comm::check_replicas(comm_, model().parameters());
  result->param_checksum = hex64(rep.hash);
  result->replicas_consistent = rep.consistent;
  return rep;
}

void Trainer::require_consistent(const comm::ReplicaReport& rep, int64_t step) {
  if (!rep.consistent) {
    std::string ranks;
    for (int r : rep.differing_ranks) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw JobError("replica check failed after step " + std::to_string(step) + ": the parameters of rank(s) " +
                             ranks + " differ from rank 0's");
  }
}

TrainResult Trainer::finish_a_finished_run() {
  TrainResult done;
  done.steps_done = position_.start_step;
  done.skipped_steps = position_.skipped_steps;
  done.final_scale = scaler_->get_scale();
  comm_.set_context("the replica check of a finished run");
  require_consistent(check_replicas(&done), done.steps_done);
  if (comm_.rank() != 0) return done;
  const bool end_written = cfg_.metrics.empty() || ends_with_end_record(cfg_.metrics, done.steps_done);
  std::printf("amp_train: --resume: %s is at step %lld, which --steps asks for: nothing left to train%s\n",
              position_.nothing_left.c_str(), static_cast<long long>(done.steps_done),
              cfg_.save_weights.empty() && end_written ? "" : "; writing that run's outputs from it");
  std::fflush(stdout);
  save_weights(done);
  if (!end_written) {
    try {
      MetricsWriter metrics(cfg_.metrics, true);
      metrics.write(ResumeRecord{done.steps_done, position_.resumed_from});
      end_metrics(metrics, done, "");  // (no device_memory_bytes: this run trained nothing)
    } catch (const std::invalid_argument& e) {  // the file cannot be opened
      done.errors.push_back(e.what());
    }
  }
  return done;
}

void Trainer::save_weights(TrainResult& result) {
  if (cfg_.save_weights.empty()) return;
  try {
    safetensors::save(cfg_.save_weights, spec_->export_weights(nn::state_dict(model()), cfg_.save_weights_format));
  } catch (const std::exception& e) {
    result.errors.push_back(std::string("--save-weights: ") + e.what());
  }
}

void Trainer::end_metrics(MetricsWriter& metrics, TrainResult& result, const std::string& interrupted_by) {
  if (result.errors.empty())
    metrics.write(EndRecord{result.steps_done, result.skipped_steps, result.final_scale, result.param_checksum,
                            result.replicas_consistent, interrupted_by, static_cast<int64_t>(result.device_memory_bytes)});
  else
    metrics.write(FailedRecord{result.steps_done, result.errors.front()});
  metrics.close();
  if (!metrics.error().empty()) result.errors.push_back(metrics.error());
}

TrainResult Trainer::run() {
  if (!position_.nothing_left.empty()) return finish_a_finished_run();
  connect();
  // Under autocast the forward's casts of the parameters are the optimizer's low-precision copies,
  // which each step rewrites as it updates the parameters (Optimizer::keep_low_precision_copies):
  // made once, here, after the weights were loaded and broadcast, and outside any step's figures.
  // Not under ZeRO-1: this rank's optimizer holds pieces of the parameters, not their casts.
  if (cfg_.amp != AmpMode::off && cfg_.low_precision_copies && !zero_)
    opt_->keep_low_precision_copies(amp_dtype(cfg_.amp));
  if (zero_ && comm_.rank() == 0) {
    std::printf("amp_train: --zero 1: rank 0 steps %lld of the %lld parameter elements, with %zu bytes of optimizer "
                "state (%.1f MiB)\n",
                static_cast<long long>(zero_->piece_elements()), static_cast<long long>(zero_->total_elements()),
                opt_->state_bytes(), static_cast<double>(opt_->state_bytes()) / (1 << 20));
    std::fflush(stdout);
  }
  set_fp32_weight_grads(!cfg_.bf16_rounded_weight_grads);
  // Nothing reads a gradient after the step (the next backward overwrites them): a step that unscales
  // them need not write them back.
  opt_->set_keep_unscaled_grads(false);
  // Synthetic samples are made before the first step, as a file is read before it, so that no step
  // pays for data (nor counts it on the emulated GPU). This rank's rows repeat once the steps have
  // gone around the pool P: after P / gcd(E, P) steps, E the samples of a step.
  if (const int64_t pool = data_->period(); pool > 0) {
    const int64_t per_step = samples_per_step();
    const int64_t cycle = pool / std::gcd(per_step, pool);
    for (int64_t step = position_.start_step + 1; step <= std::min(cfg_.steps, position_.start_step + cycle); ++step)
      data_->prepare(first_sample(step), cfg_.micro_batches * cfg_.batch_size);
  }
  TrainResult result;
  result.skipped_steps = position_.skipped_steps;
  const bool rank0 = comm_.rank() == 0;
  if (rank0 && device_.is_cuda() && cfg_.cuda_graphs == CudaGraphs::auto_ && !step_.use_graphs) {
    std::printf("amp_train: note: each step is launched eagerly, not as a CUDA graph: %s\n", graph_blocker().c_str());
    std::fflush(stdout);
  }
  // A resumed run appends to the metrics, after a record that says so (the steps after the checkpoint
  // that the stopped run wrote appear again, from the resumed run, which supersedes them).
  if (std::error_code ec; rank0 && !cfg_.metrics.empty() && position_.start_step == 0 &&
                          std::filesystem::file_size(cfg_.metrics, ec) > 0 && !ec)
    std::printf("amp_train: notice: --metrics %s: replacing what it holds (a run's records: a resume from a checkpoint appends)\n",
                cfg_.metrics.c_str());
  MetricsWriter metrics = rank0 && !cfg_.metrics.empty() ? MetricsWriter(cfg_.metrics, position_.start_step > 0) : MetricsWriter();
  if (position_.start_step > 0) metrics.write(ResumeRecord{position_.start_step, position_.resumed_from});
  // A metrics file that cannot be written is said at once and at the end (exit 1), and costs
  // nothing else: training goes on, and the weights and checkpoints are saved.
  bool warned = false;
  auto warn_once_about = [&](const MetricsWriter& m) {
    if (m.error().empty() || warned) return;
    warned = true;
    std::fprintf(stderr, "amp_train: warning: %s; no more metrics are written (the file ends with its last whole line), "
                 "training goes on and the run will exit 1\n", m.error().c_str());
    std::fflush(stderr);
  };
  if (cfg_.checkpoint_dir.size() && rank0)
    for (const std::string& t : remove_stale_checkpoint_temporaries(cfg_.checkpoint_dir))
      std::printf("notice: removed '%s', a checkpoint left incomplete by a run that was killed while %s\n", t.c_str(),
                  fs::path(t).filename().string().rfind(".old-", 0) == 0 ? "deleting it (an older one it no longer kept)"
                                                                           : "writing it");
  const auto start = std::chrono::steady_clock::now();
  bool stopping = false;  // every rank sets it at the same step (the flag is in the reduced figures)
  auto emit = [&](const StepRecord& r) {
    // A non-finite loss that no scaler skipped would be trained on, and the weights go NaN
    // quietly: stop, naming the step (the same on every rank: the loss is averaged over ranks).
    if (!std::isfinite(r.loss) && !r.skipped)
      throw JobError("step " + std::to_string(r.step) + ": the loss is " +
                               (std::isnan(r.loss) ? "NaN" : "infinite") +
                               " and no loss scaler skipped the step (non-finite data or weights, or a learning "
                               "rate that diverges); stopping before the weights are corrupted");
    // A scale whose float32 inverse is infinite unscales every gradient to inf or NaN, so the step
    // was skipped, and every step from here would be; under fp16 one below 2^-24 flushes the scaled
    // gradients to zero, so the step trained nothing and was not skipped. (A scale of 0 on a step
    // not skipped is the emulated GPU's dry run, whose read-backs are zeros.) The same figures on
    // every rank, so every rank stops here.
    if (const std::string why = scale_collapse(r.scale, cfg_.amp == AmpMode::fp16);
        scaler_->is_enabled() && (r.skipped || r.scale > 0.0) && !why.empty())
      throw JobError("step " + std::to_string(r.step) + ": the loss scale has collapsed to " + number_str(r.scale) +
                     ", " + why + ": no step from here would train. The gradients overflowed at every scale tried: "
                     "look for non-finite data or weights, or a learning rate that diverges (--min-scale sets a "
                     "floor for the scale)");
    result.records.push_back(r);
    position_.skipped_steps += r.skipped;
    result.skipped_steps = position_.skipped_steps;
    metrics.write(r);
    warn_once_about(metrics);
    if (r.stop_requested && !stopping) {
      stopping = true;
      if (rank0 && !interrupt_announced())  // a stop asked of another rank (this one's said so as it came)
        std::printf("amp_train: interrupted (%s): finishing the step in flight%s; Ctrl-C again "
                    "(after %g s) stops at once\n", stop_label(), cfg_.save_weights.empty() ? "" : ", then saving the weights",
                    kDuplicateWindowSeconds);
    }
    if (rank0 && listeners_.progress) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // A pipe whose reader went: the line fails, not the process, and later ones go to /dev/null.
      print_guarded([&] { listeners_.progress->step(r, result.skipped_steps, elapsed, stopping); });
    }
  };
  // A step's figures are read once the next step's work is issued (one step late), unless they
  // are already on the host (always, on the CPU).
  std::unique_ptr<PendingStep> late;
  int64_t checkpointed = -1;  // the step whose checkpoint the loop wrote as it stopped
  result.steps_done = position_.start_step;
  // The validation loss after `step` (collective), on the progress line and in the metrics.
  // A stop asked for during it ends the run as a stop after a step does (no record of a partial loss).
  auto report_evaluation = [&](int64_t step) {
    const std::optional<double> val = evaluate();
    if (!val) {
      if (!stopping && rank0)
        std::printf("amp_train: interrupted (%s) during the evaluation after step %lld: stopping%s\n", stop_label(),
                    static_cast<long long>(step), cfg_.save_weights.empty() ? "" : ", then saving the weights");
      stopping = true;
      return;
    }
    metrics.write(EvalRecord{step, *val});
    warn_once_about(metrics);
    if (rank0 && listeners_.progress) {
      print_guarded([&] { listeners_.progress->validation(step, *val); });  // as a step's line
    }
  };
  // A step's figures still in flight, emitted now: before an evaluation's or checkpoint's lines.
  auto flush_late = [&] {
    if (late) emit(finish(*late, std::chrono::steady_clock::now()));
    late.reset();
  };
  // A failure that ends the run is the metrics' last record (when they can still be written).
  try {
    if (cfg_.eval_every > 0 && position_.start_step == 0) report_evaluation(0);  // the untrained model's (about ln 256, for bytes)
    for (int64_t step = position_.start_step + 1; step <= cfg_.steps && !stopping; ++step) {
      result.steps_done = step;
      comm_.set_context("step " + std::to_string(step));
      PendingStep cur = train_step(step);
      const auto now = std::chrono::steady_clock::now();
      if (late) {
        emit(finish(*late, cur.start));
        late.reset();
      }
      if (cur.figures->ready()) emit(finish(cur, now));
      else late = std::make_unique<PendingStep>(std::move(cur));
      if (cfg_.check_every > 0 && step % cfg_.check_every == 0 && step != cfg_.steps && !stopping)
        require_consistent(check_replicas(&result), step);
      if (cfg_.eval_every > 0 && (step % cfg_.eval_every == 0 || step == cfg_.steps) && !stopping) {
        flush_late();
        report_evaluation(step);
      }
      if (!cfg_.checkpoint_dir.empty() && cfg_.checkpoint_every > 0 && step % cfg_.checkpoint_every == 0 &&
          step != cfg_.steps && !stopping) {
        flush_late();
        // The flushed figures may ask to stop: that saves after the loop. A stop asked for while the
        // checkpoint was written stops here, at the step it holds.
        if (!stopping && save_checkpoint_at(step)) {
          stopping = true;
          checkpointed = step;
          if (rank0 && !interrupt_announced())
            std::printf("amp_train: interrupted (%s) while the checkpoint of step %lld was written: stopping%s\n",
                        stop_label(), static_cast<long long>(step), cfg_.save_weights.empty() ? "" : ", then saving the weights");
        }
      }
    }
    flush_late();
    // Every step is queued and its memory taken (the caching allocator keeps what it was given).
    result.device_memory_bytes = memory_for(device_).device_peak_bytes();
    if (rank0 && listeners_.progress && result.device_memory_bytes > 0)
      listeners_.progress->device_memory(result.device_memory_bytes);
    if (listeners_.observer) listeners_.observer->run_end(comm_.rank());
    // skipped_steps counts from step 1 (a resumed run starts from its checkpoint's count). A run that
    // was interrupted stops as asked (exit 128 + signal, with its outputs), whatever it skipped.
    if (!stopping && result.skipped_steps == result.steps_done && result.steps_done > position_.start_step)
      throw JobError("every one of the " + std::to_string(result.steps_done) +
                     " steps was skipped for non-finite gradients: nothing was trained (final scale " +
                     number_str(scaler_->get_scale()) + ")");
    comm_.set_context("the end-of-run replica check");
    result.final_scale = scaler_->get_scale();
    // Only a skipped step backs the scale off: after one, the scale it left may have collapsed.
    if (const std::string why = scale_collapse(result.final_scale, cfg_.amp == AmpMode::fp16);
        scaler_->is_enabled() && !result.records.empty() && result.records.back().skipped && !why.empty())
      throw JobError("after step " + std::to_string(result.steps_done) + ": the loss scale has collapsed to " +
                     number_str(result.final_scale) + ", " + why +
                     ": nothing more can be trained from this state, and it is not saved");
    const comm::ReplicaReport rep = check_replicas(&result);
    if (stopping) result.interrupted_by = interrupt_signal() != 0 ? interrupt_signal() : SIGTERM;
    require_consistent(rep, result.steps_done);  // throws, naming the ranks, before anything is saved
    require_finite_parameters(result.steps_done);  // likewise: a NaN model is never saved, nor exits 0
    // The outputs, then the record that says the run finished: one output's failure costs no other.
    // A stop before any step (during the step-0 evaluation) saves no weights: they are the ones the
    // run started from (a file there may be a finished run's).
    const bool trained = result.steps_done > position_.start_step;
    if (rank0 && !cfg_.save_weights.empty() && !trained)
      std::printf("amp_train: stopped before the first step: --save-weights %s is not written\n", cfg_.save_weights.c_str());
    if (rank0 && trained) save_weights(result);
    // The last step's checkpoint: at the end, or where an interruption stopped the run.
    if (!cfg_.checkpoint_dir.empty() && result.steps_done > position_.start_step && result.steps_done != checkpointed) {
      try {
        save_checkpoint_at(result.steps_done);
      } catch (const JobError& e) {  // every rank: the weights above are kept, and the job exits 1
        result.errors.push_back(e.what());
      }
    }
    end_metrics(metrics, result, stopping ? signal_label(result.interrupted_by) : "");
    if (rank0 && !stopping) {
      const std::string text = after_training();  // a language model's sample, say: any bytes, NUL too
      // A requested output lost (/dev/full, a full disk, a reader gone) is a failure, not a silence.
      bool written = false;
      int err = 0;
      print_guarded([&] {
        errno = 0;
        written = !standard_output_gone() && std::fwrite(text.data(), 1, text.size(), stdout) == text.size() &&
                  std::fflush(stdout) == 0;
        err = errno;
      });
      const bool gone = standard_output_gone();
      if (!written)
        result.errors.push_back("the sample (" + std::to_string(text.size()) +
                                " bytes) could not be written to standard output" +
                                (gone ? std::string(": its reader is gone")
                                 : err != 0 ? std::string(": ") + std::strerror(err) : std::string()));
      else if (interrupt_signal() != 0) result.interrupted_by = interrupt_signal();  // the sample was cut short
    }
  } catch (const std::exception& e) {  // a JobError, or this rank's own failure (a timeout, the device)
    metrics.write(FailedRecord{result.steps_done, e.what()});
    throw;
  }
  return result;
}

}  // namespace amp::launch
