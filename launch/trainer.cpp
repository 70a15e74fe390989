#include "launch/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <thread>
#include <limits>
#include <stdexcept>

#include "amp/autocast.h"
#include "amp/clip_grad.h"
#include "amp/overflow.h"
#include "comm/coalesced.h"
#include "comm/replica_check.h"
#include "comm/sum_tree.h"
#include "launch/interrupt.h"
#include "jd/mtl_backward.h"
#include "runtime/autograd.h"
#include "runtime/backend.h"
#include "runtime/fnv1a.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops.h"
#include "runtime/rng_math.h"
#include "runtime/optim/adam.h"
#include "runtime/optim/sgd.h"
#include "runtime/safetensors.h"

namespace amp::launch {

namespace fs = std::filesystem;

namespace {
// A number for the progress line: "nan" and "inf" as PyTorch prints them, never "-nan".
std::string number_str(double v) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// The figures a step reads back to the host, packed into one read-back and unpacked by name: their
// order lives here only.
struct StepFigures {
  Tensor loss, scale, found_inf, stop;
  Tensor grad_norm;  // undefined: not computed this step (no placeholder travels)
  std::vector<Tensor> task_losses;

  std::vector<Tensor> packed() const {
    std::vector<Tensor> v = {loss, scale, found_inf, stop};
    if (grad_norm.defined()) v.push_back(grad_norm);
    v.insert(v.end(), task_losses.begin(), task_losses.end());
    return v;
  }
  static void unpack(const std::vector<double>& v, bool has_grad_norm, StepRecord* r) {
    size_t i = 0;
    r->loss = v.at(i++);
    r->scale = v.at(i++);
    r->skipped = v.at(i++) != 0.0;
    r->stop_requested = v.at(i++) != 0.0;
    r->grad_norm = has_grad_norm ? v.at(i++) : std::numeric_limits<double>::quiet_NaN();
    r->task_losses.assign(v.begin() + static_cast<long>(i), v.end());
  }
};

// True when the scale's float32 inverse, which unscales the gradients (amp_math.h inverse_scale), is
// not finite: below about 2.9e-39 every gradient unscales to inf or NaN, and every step is skipped.
bool scale_collapsed(double scale) {
  return !std::isfinite(static_cast<float>(1.0 / static_cast<double>(static_cast<float>(scale))));
}
}  // namespace

std::unique_ptr<optim::LRScheduler> make_scheduler(const TrainConfig& c, optim::Optimizer& opt) {
  if (c.lr_schedule == LrSchedule::constant) return nullptr;
  // Cosine: LinearLR from lr / (W + 1) to lr over W steps, then CosineAnnealingLR down to min_lr at
  // the decay step, then min_lr (a LambdaLR), chained by SequentialLR as a PyTorch user writes it.
  const int64_t warmup = c.warmup_steps;
  const int64_t decay = c.decay_steps > 0 ? c.decay_steps : c.steps;
  std::vector<std::unique_ptr<optim::LRScheduler>> parts;
  std::vector<int64_t> milestones;
  if (warmup > 0) {
    parts.push_back(std::make_unique<optim::LinearLR>(opt, 1.0 / static_cast<double>(warmup + 1), 1.0, warmup));
    milestones.push_back(warmup);
  }
  parts.push_back(std::make_unique<optim::CosineAnnealingLR>(opt, decay - warmup, c.min_lr));
  if (decay < c.steps) {
    const double floor = c.lr > 0.0 ? c.min_lr / c.lr : 0.0;
    parts.push_back(std::make_unique<optim::LambdaLR>(opt, [floor](int64_t) { return floor; }));
    milestones.push_back(decay);
  }
  if (parts.size() == 1) return std::move(parts[0]);
  return std::make_unique<optim::SequentialLR>(opt, std::move(parts), std::move(milestones));
}

GradScalerOptions scaler_options(const TrainConfig& c) {
  GradScalerOptions o;
  o.init_scale = c.init_scale;
  o.growth_factor = c.growth_factor;
  o.backoff_factor = c.backoff_factor;
  o.growth_interval = c.growth_interval;
  o.hysteresis = c.hysteresis;
  o.min_scale = c.min_scale;
  o.max_scale = c.max_scale;
  switch (c.loss_scale.kind) {
    case LossScale::Kind::auto_: o.enabled = c.amp == AmpMode::fp16; break;  // bf16 needs no scaling
    case LossScale::Kind::dynamic: o.enabled = true; break;
    case LossScale::Kind::off: o.enabled = false; break;
    case LossScale::Kind::constant:
      o.enabled = true;
      o.dynamic = false;
      o.init_scale = c.loss_scale.value;
      break;
  }
  return o;
}

Trainer::Trainer(const TrainConfig& config, comm::Communicator& comm, Device device)
    : cfg_(config), comm_(comm), device_(device) {
  Generator gen(cfg_.seed);
  spec_ = models::configure_model(cfg_.model, cfg_.model_flags);
  spec_->check({cfg_.data, cfg_.batch_size}, 0.0L);
  model_ = spec_->build(gen, device_);
  data_ = spec_->data(cfg_.data, cfg_.seed, device_);
  aggregator_ = spec_->aggregator(cfg_.seed);
  if (cfg_.eval_every > 0 && !data_->has_validation())
    throw std::invalid_argument("--eval-every: --model " + cfg_.model + "'s data (" + data_->describe() +
                                ") has no validation split");
  if (!cfg_.init_weights.empty()) {
    nn::load_state_dict(model_->module(), safetensors::load(cfg_.init_weights), cfg_.init_weights);
  }
  // Parameter groups: a model that names its decayed parameters (the GPT: tensors of 2+ dims, as
  // nanoGPT) gets weight decay on those only; otherwise every parameter decays.
  const std::vector<Tensor> decayed = model_->decayed_parameters();
  std::vector<Tensor> not_decayed;
  for (const Tensor& p : model().parameters())
    if (std::none_of(decayed.begin(), decayed.end(), [&](const Tensor& d) { return d.same(p); })) not_decayed.push_back(p);
  auto groups = [&](auto options) {
    using O = decltype(options);
    if (decayed.empty()) return optim::one_group(model().parameters(), options);
    O off = options;
    off.weight_decay = 0.0;
    std::vector<optim::ParamGroup<O>> g{{decayed, options}};
    if (!not_decayed.empty()) g.push_back({not_decayed, off});
    return g;
  };
  if (cfg_.optimizer == OptimizerKind::sgd) {
    optim::SgdOptions o;
    o.lr = cfg_.lr;
    o.momentum = cfg_.momentum;
    o.weight_decay = cfg_.weight_decay.value_or(o.weight_decay);
    opt_ = std::make_unique<optim::SGD>(groups(o));
  } else {
    optim::AdamOptions o = optim::AdamWOptions();
    o.lr = cfg_.lr;
    o.beta1 = cfg_.beta1;
    o.beta2 = cfg_.beta2;
    o.weight_decay = cfg_.weight_decay.value_or(o.weight_decay);
    opt_ = std::make_unique<optim::AdamW>(groups(o));
  }
  scheduler_ = make_scheduler(cfg_, *opt_);
  scaler_ = std::make_unique<GradScaler>(scaler_options(cfg_), &comm_);
  // The scaler's state is created by its first scale(), on that output's device: do it here, so that
  // the first counted step launches what every other step does.
  scaler_->scale(zeros({}, DType::f32, device_));
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

nlohmann::json Trainer::checkpoint_meta(int64_t step) const {
  // The model's identity ({"model": {...}, "dropout": ...}), then what every run must match.
  nlohmann::json must_match = spec_->checkpoint_identity();
  const int64_t E = cfg_.batch_size * cfg_.micro_batches * comm_.size();
  must_match.update({{"effective_batch", E},
                     {"optimizer", cfg_.optimizer == OptimizerKind::sgd ? "sgd" : "adamw"},
                     {"amp", cfg_.amp == AmpMode::off ? "off" : cfg_.amp == AmpMode::fp16 ? "fp16" : "bf16"},
                     {"loss_scaling", scaler_->is_enabled()},
                     {"seed", cfg_.seed},
                     // The data's size, not its path: a moved file resumes.
                     {"data_samples", data_->resume_size()}});
  return {{"format", 2},
          {"must_match", must_match},
          {"data", cfg_.data},
          {"batch_layout", {{"ranks", comm_.size()}, {"batch_size", cfg_.batch_size}, {"micro_batches", cfg_.micro_batches}}},
          // Samples of the stream consumed: step i uses [(i - 1) E, i E).
          {"data_position", {{"next_sample", step * E}}},
          // Dropout draws counters of the data stream's sample index from the seed's stream, and
          // sampling has its own stream: the seed and the step are the whole RNG state.
          {"rng", {{"seed", cfg_.seed}, {"kind", "counter-based (splitmix64), indexed by sample"}}},
          {"scaler", scaler_->state_dict()},
          // Skipped since step 1, so that a resumed run's count (and its all-skipped rule) is the
          // uninterrupted run's.
          {"skipped_steps", skipped_steps_},
          // Seeded aggregators draw by call count (multi-task models).
          {"aggregator_calls", aggregator_ ? aggregator_->calls() : 0},
          // Not required to match: a resumed run may train longer, or on another schedule (and says so).
          {"schedule", {{"lr_schedule", cfg_.lr_schedule == LrSchedule::cosine ? "cosine" : "constant"},
                        {"lr", cfg_.lr},
                        {"warmup_steps", cfg_.warmup_steps},
                        {"min_lr", cfg_.min_lr},
                        {"decay_steps", cfg_.decay_steps > 0 ? cfg_.decay_steps : cfg_.steps}}}};
}

void Trainer::resume() {
  std::optional<Checkpoint> ck =
      cfg_.resume_from.empty() ? load_latest_checkpoint(cfg_.checkpoint_dir) : load_checkpoint(cfg_.resume_from);
  if (!ck) {
    if (comm_.rank() == 0)
      std::printf("amp_train: --resume: no checkpoint in %s yet; starting from step 1\n", cfg_.checkpoint_dir.c_str());
    return;
  }
  const std::string meta_file = ck->path + "/trainer.json";
  // Every read below names the file; the JSON library's own errors (a value of another type) too.
  try {
    const nlohmann::json now = checkpoint_meta(ck->step);
    const nlohmann::json then = ck->meta.value("must_match", nlohmann::json::object());
    if (!then.is_object()) throw std::invalid_argument(meta_file + ": corrupt: must_match is not an object");
    // The micro-batch size B and the samples per step E are what make a resumed run the same
    // training, bit for bit, on any number of ranks R (README, "The same training on any number of
    // ranks"): another B sums other numbers. What may change is R and K = E / (B R).
    const nlohmann::json layout_then = ck->meta.value("batch_layout", nlohmann::json());
    const int64_t R = comm_.size();
    if (layout_then.is_object() && layout_then.contains("batch_size") && layout_then["batch_size"] != cfg_.batch_size)
      throw std::invalid_argument(meta_file + ": this run's --batch-size " + std::to_string(cfg_.batch_size) +
                                  " does not match the checkpoint's " + layout_then["batch_size"].dump() +
                                  ": a resumed run keeps the micro-batch size and the samples per step; the ranks and "
                                  "--micro-batches may change");
    for (const auto& [key, value] : now["must_match"].items()) {
      if (then.contains(key) && then[key] == value) continue;
      const std::string was = then.contains(key) ? then[key].dump() : "nothing";
      std::string hint;
      if (key == "effective_batch") {
        hint =
            " (ranks x --batch-size x --micro-batches must give the same samples per step; the checkpoint's layout "
            "was " +
            layout_then.dump();
        if (then[key].is_number_integer() && then[key].get<int64_t>() % cfg_.batch_size == 0) {
          const int64_t M = then[key].get<int64_t>() / cfg_.batch_size;  // micro-batches of a step, over all ranks
          hint += M % R == 0
                      ? ": on " + std::to_string(R) + " ranks, --micro-batches " + std::to_string(M / R)
                      : ": its " + std::to_string(M) + " micro-batches of " + std::to_string(cfg_.batch_size) +
                            " a step cannot be split over " + std::to_string(R) + " ranks (--micro-batches " +
                            "must be a whole number): run on a number of ranks that divides " + std::to_string(M);
        }
        hint += ")";
      }
      throw std::invalid_argument(meta_file + ": this run's " + key + " " + value.dump() + " does not match the checkpoint's " +
                                  was + hint);
    }
    if (ck->step >= cfg_.steps)
      throw std::invalid_argument(meta_file + ": the checkpoint is at step " + std::to_string(ck->step) +
                                  ", and --steps " + std::to_string(cfg_.steps) + " asks for no more (--steps is the total)");
    // A run that resumes into a directory holding checkpoints newer than the one it resumes from
    // (--resume-from an older one) would interleave its checkpoints with theirs, and keeping the last
    // K would delete its own: refused, naming them.
    if (!cfg_.checkpoint_dir.empty()) {
      const std::string mine = fs::path(ck->path).filename().string();
      for (const std::string& other : list_checkpoints(cfg_.checkpoint_dir))
        if (fs::path(other).filename().string() > mine)  // step-NNNNNNNN: the names sort as the steps
          throw std::invalid_argument("--checkpoint-dir " + cfg_.checkpoint_dir + " holds " + other +
                                      ", newer than the checkpoint this run resumes from (" + ck->path +
                                      "): move it away, or write this run's checkpoints to another --checkpoint-dir");
    }
    nn::load_state_dict(model(), ck->model, ck->path + "/model.safetensors");
    // The schedule is a function of the step: replaying it gives the lrs of the uninterrupted run, bit
    // for bit. The optimizer's state (moments, step counts) comes from the checkpoint, its
    // hyperparameters from this run's flags and schedule (as the note below says), not the checkpoint's.
    if (scheduler_)
      for (int64_t i = 0; i < ck->step; ++i) scheduler_->step();
    optim::OptimizerStateDict state = ck->optimizer;
    state.param_groups = opt_->state_dict().param_groups;
    opt_->load_state_dict(state);
    std::map<std::string, double> scaler_state;
    const nlohmann::json saved_scaler = ck->meta.value("scaler", nlohmann::json::object());
    if (!saved_scaler.is_object()) throw std::invalid_argument(meta_file + ": corrupt: scaler is not an object");
    for (const auto& [k, v] : saved_scaler.items()) {
      if (!v.is_number()) throw std::invalid_argument(meta_file + ": corrupt: scaler." + k + " is not a number");
      scaler_state[k] = v.get<double>();
    }
    if (scaler_->is_enabled()) {
      // The scale, the growth tracker and the hysteresis count are the run's state: from the checkpoint.
      // The factors and the interval are hyperparameters: from this run's flags, as the optimizer's are.
      const GradScalerOptions mine = scaler_->options();  // this run's flags (the load below replaces them)
      try {
        scaler_->load_state_dict(scaler_state);  // checks the checkpoint's own state first
      } catch (const std::exception& e) {
        throw std::invalid_argument(meta_file + ": corrupt: " + e.what());
      }
      std::string changed;
      auto take_flag = [&](const char* key, const char* flag, double value) {
        const auto it = scaler_state.find(key);
        if (it != scaler_state.end() && it->second != value)
          changed += std::string(changed.empty() ? "" : ", ") + flag + " " + number_str(value) + " (the checkpoint's run had " +
                     number_str(it->second) + ")";
        scaler_state[key] = value;
      };
      take_flag("growth_factor", "--growth-factor", mine.growth_factor);
      take_flag("backoff_factor", "--backoff-factor", mine.backoff_factor);
      take_flag("growth_interval", "--growth-interval", mine.growth_interval);
      // A shorter interval than the checkpoint's: the successful steps counted so far, at most all but one.
      scaler_state["_growth_tracker"] = std::min(scaler_state["_growth_tracker"], mine.growth_interval - 1.0);
      if (scaler_state.count("_hysteresis_left"))
        scaler_state["_hysteresis_left"] = std::min(scaler_state["_hysteresis_left"], static_cast<double>(mine.hysteresis));
      const auto scale = scaler_state.find("scale");
      if (scale != scaler_state.end() && (!(scale->second > 0.0) || scale_collapsed(scale->second)))
        throw std::invalid_argument(meta_file + ": corrupt: scaler.scale " + number_str(scale->second) +
                                    " is not a usable loss scale (positive, with an inverse finite in float32)");
      try {
        scaler_->load_state_dict(scaler_state);
      } catch (const std::exception& e) {
        throw std::invalid_argument(meta_file + ": corrupt: " + e.what());
      }
      if (!changed.empty() && comm_.rank() == 0)
        std::printf("amp_train: note: the loss scaler's %s: the steps from here use this run's flags\n", changed.c_str());
    }
    // Written by this version (format 2): the data position and the skipped steps, checked.
    if (ck->meta.value("format", 0) >= 2) {
      const int64_t E = now["must_match"]["effective_batch"].get<int64_t>();
      const nlohmann::json pos = ck->meta.at("data_position").at("next_sample");
      if (!pos.is_number_integer() || pos.get<int64_t>() != ck->step * E)
        throw std::invalid_argument(meta_file + ": corrupt: data_position.next_sample " + pos.dump() + " is not step " +
                                    std::to_string(ck->step) + " x " + std::to_string(E) + " samples");
      const nlohmann::json skipped = ck->meta.at("skipped_steps");
      if (!skipped.is_number_integer() || skipped.get<int64_t>() < 0 || skipped.get<int64_t>() > ck->step)
        throw std::invalid_argument(meta_file + ": corrupt: skipped_steps " + skipped.dump() + " is not a count in [0, " +
                                    std::to_string(ck->step) + "]");
      skipped_steps_ = skipped.get<int64_t>();
    }
    if (aggregator_) {
      const nlohmann::json calls = ck->meta.value("aggregator_calls", nlohmann::json(0));
      if (!calls.is_number_unsigned())
        throw std::invalid_argument(meta_file + ": corrupt: aggregator_calls is not a count");
      aggregator_->set_calls(calls.get<uint64_t>());
    }
    start_step_ = ck->step;
    if (comm_.rank() == 0) {
      const nlohmann::json layout = ck->meta.value("batch_layout", nlohmann::json());
      const nlohmann::json mine = now["batch_layout"];
      std::printf("amp_train: resuming from %s (step %lld)", ck->path.c_str(), static_cast<long long>(ck->step));
      if (layout != mine)
        std::printf(" on another layout: %lld ranks x batch %lld x %lld micro-batches, where the checkpoint had %lld x %lld x "
                    "%lld; the same %lld samples per step",
                    static_cast<long long>(comm_.size()), static_cast<long long>(cfg_.batch_size),
                    static_cast<long long>(cfg_.micro_batches), layout.value("ranks", 0LL), layout.value("batch_size", 0LL),
                    layout.value("micro_batches", 0LL), static_cast<long long>(now["must_match"]["effective_batch"].get<int64_t>()));
      std::printf("\n");
      if (ck->meta.value("schedule", nlohmann::json()) != now["schedule"])
        std::printf("amp_train: note: the learning-rate schedule differs from the checkpoint's run (%s, now %s): the "
                    "steps from here follow the new one (with --lr-schedule cosine, --decay-steps defaults to --steps; "
                    "give it to keep the schedule of a run that trains longer)\n",
                    ck->meta.value("schedule", nlohmann::json()).dump().c_str(), now["schedule"].dump().c_str());
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(meta_file + ": corrupt: " + e.what());
  }
}

void Trainer::require_finite_parameters(int64_t step) {
  // Collective: every rank's verdict is summed, so that all of them stop here, or none.
  Tensor found = zeros({1}, DType::f32, device_);
  backend_for(device_).check_finite(model().parameters(), Tensor(), found);
  comm::all_reduce_scalars(comm_, {found}, comm::ReduceOp::sum);
  if (found.item() != 0.0) {
    std::string names;
    for (const auto& [name, p] : model().named_parameters()) {
      Tensor one = zeros({1}, DType::f32, device_);
      backend_for(device_).check_finite({p}, Tensor(), one);
      if (one.item() != 0.0) names += (names.empty() ? "" : ", ") + name;
    }
    throw JobError("after step " + std::to_string(step) + ": the parameters hold inf or NaN (" + names +
                   "): nothing is saved from this state (the checkpoints written before are intact). A step that no "
                   "scaler skipped diverged: lower --lr, or clip with --clip-grad-norm");
  }
}

void Trainer::save_checkpoint_at(int64_t step) {
  require_finite_parameters(step);
  comm_.set_context("writing the checkpoint of step " + std::to_string(step));
  std::string error, path;
  if (comm_.rank() == 0) {
    try {
      path = save_checkpoint(cfg_.checkpoint_dir, step, nn::state_dict(model()), opt_->state_dict(),
                             checkpoint_meta(step), cfg_.keep_checkpoints);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank learns the outcome from rank 0: a failed write stops the job everywhere, with the
  // previous checkpoints intact.
  Tensor failed = full({1}, error.empty() ? 0.0 : 1.0, DType::f32, device_);
  comm::all_reduce_scalars(comm_, {failed}, comm::ReduceOp::sum);
  if (failed.item() != 0.0)
    throw JobError("checkpoint of step " + std::to_string(step) + " failed" + (error.empty() ? " on rank 0" : ": " + error));
  if (comm_.rank() == 0) {
    std::printf("amp_train: checkpoint of step %lld written to %s\n", static_cast<long long>(step), path.c_str());
    std::fflush(stdout);
  }
}

Trainer::~Trainer() = default;

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
  comm::ReducerOptions ro;
  ro.bucket_bytes = static_cast<size_t>(cfg_.bucket_mb * 1024 * 1024);
  ro.first_bucket_bytes = std::min<size_t>(ro.bucket_bytes, 1u << 20);
  ro.overlap = cfg_.overlap;
  ro.micro_batches = cfg_.micro_batches;
  ro.ordered_sum = true;  // the losses carry B / E: summed in one order, the step is rank-invariant
  reducer_ = std::make_unique<comm::GradientReducer>(model().parameters(), comm_, ro);
}

void Trainer::multi_task_backward(const models::Losses& L, bool /*last*/) {
  jd::MtlBackwardOptions o;
  o.shared_params = model_->shared_parameters();
  o.tasks_params = model_->task_parameters();
  jd::mtl_backward(scaler_->scale(L.per_task), L.features, o);
  // This micro-batch's trunk Jacobian and heads' gradients, flat, join the tree of the step's
  // micro-batches (comm/sum_tree.h); aggregate_jacobians() sums them over ranks in the same order.
  const Tensor J = jd::concatenated_jacobian(o.shared_params);
  int64_t n = J.numel();
  for (const auto& task : o.tasks_params)
    for (const Tensor& p : task) n += p.numel();
  Tensor leaf = empty({n}, DType::f32, device_);
  Tensor part = leaf.view(0, {J.numel()});
  copy_(part, J.reshape({J.numel()}));
  int64_t off = J.numel();
  for (const auto& task : o.tasks_params)
    for (Tensor p : task) {
      Tensor dst = leaf.view(off, {p.numel()});
      if (p.grad().defined()) copy_(dst, p.grad().reshape({p.numel()}));
      else fill_(dst, 0.0);
      off += p.numel();
      p.set_grad(Tensor());
    }
  for (Tensor p : o.shared_params) p.set_jac(Tensor());
  if (!jacobian_tree_)
    jacobian_tree_ = std::make_unique<JacobianTree>([](Tensor& into, const Tensor& other) { add_(into, other); });
  jacobian_tree_->push(leaf);
  jacobian_tree_->take_released();
  jacobian_rows_ = J.shape()[0];
}

std::vector<double> Trainer::aggregate_jacobians() {
  const std::vector<Tensor> shared = model_->shared_parameters();
  Tensor sum = jacobian_tree_->fold();
  comm_.ordered_sum(sum);  // every rank's, in the tree's order
  int64_t N = 0;
  for (const Tensor& p : shared) N += p.numel();
  const Tensor J = sum.view(0, {jacobian_rows_, N});
  int64_t off = jacobian_rows_ * N;
  for (const auto& task : model_->task_parameters())
    for (Tensor p : task) {
      p.set_grad(sum.view(off, p.shape()).clone());
      off += p.numel();
    }
  for (Tensor p : shared) p.set_jac(Tensor());
  jd::aggregate_into_grads(shared, J, *aggregator_);
  return aggregator_->last_weights();
}

void Trainer::provide_casts() const {
  if (!opt_->low_precision_copies().empty()) autocast_provide_casts(opt_->params(), opt_->low_precision_copies());
}

double Trainer::evaluate() {
  model_->train(false);
  const DType amp_dtype = cfg_.amp == AmpMode::bf16 ? DType::bf16 : DType::f16;
  std::vector<Tensor> batch_means;
  {
    NoGradGuard no_grad;
    autocast ac(device_.type, amp_dtype, cfg_.amp != AmpMode::off, true, CastLists::cuda);
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
    }
  }
  comm::all_reduce_scalars(comm_, batch_means, comm::ReduceOp::sum);  // in the tree's order
  Tensor total = zeros({1}, DType::f32, device_);
  for (const Tensor& m : batch_means) add_(total, m);
  mul_(total, 1.0 / static_cast<double>(cfg_.eval_batches));
  model_->train(true);
  return total.item();
}

std::string Trainer::after_training() {
  const DType amp_dtype = cfg_.amp == AmpMode::bf16 ? DType::bf16 : DType::f16;
  autocast ac(device_.type, amp_dtype, cfg_.amp != AmpMode::off, true, CastLists::cuda);
  provide_casts();
  return spec_->after_training(*model_, cfg_.seed);
}

int64_t Trainer::first_sample(int64_t step) const {
  const int64_t B = cfg_.batch_size, K = cfg_.micro_batches, R = comm_.size();
  return (step - 1) * B * K * R + comm_.rank() * K * B;
}

Trainer::PendingStep Trainer::train_step(int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  if (before_step_) before_step_(step);
  const int64_t B = cfg_.batch_size, K = cfg_.micro_batches;
  const int64_t first = first_sample(step);
  const std::vector<Tensor> params = model().parameters();
  const bool autocasting = cfg_.amp != AmpMode::off;
  const DType amp_dtype = cfg_.amp == AmpMode::bf16 ? DType::bf16 : DType::f16;
  const std::optional<DeviceCounters> counted_from = emulated_device_counters();
  if (counted_from && device_.is_cuda()) {
    backend_for(device_).reset_peak_bytes();  // the step's own peak, for the launch log
    log_emulated_step_begin(step);
  }
  const Tensor scale_used = scaler_->scale_snapshot(device_);

  opt_->zero_grad();
  // Each task's loss over the micro-batches, summed in the tree's order (comm/sum_tree.h) like the
  // gradients, so that the logged figures are rank-invariant too.
  std::vector<comm::SumTree<Tensor, void (*)(Tensor&, const Tensor&)>> task_trees;
  for (int64_t m = 0; m < K; ++m) {
    if (!multi_task()) reducer_->prepare_for_backward(/*sync=*/m == K - 1);
    const models::Batch batch = data_->rows(first + m * B, B);
    models::Losses L;
    {
      autocast ac(device_.type, amp_dtype, autocasting, true, CastLists::cuda);
      provide_casts();
      L = model_->losses(batch);
      // The mean over the step's samples: B / E, the same factor in every split (no division by
      // the ranks after the sum), so that a micro-batch's gradient does not depend on the split.
      if (const int64_t share = K * comm_.size(); share > 1)
        for (Tensor& l : L.per_task) l = div(l, static_cast<double>(share));
    }
    {
      NoGradGuard ng;
      for (size_t t = task_trees.size(); t < L.per_task.size(); ++t)
        task_trees.emplace_back([](Tensor& into, const Tensor& other) { add_(into, other); });
      for (size_t t = 0; t < L.per_task.size(); ++t)
        task_trees[t].push(L.per_task[t].detach().reshape({1}).to(DType::f32));
    }
    if (multi_task()) {
      // Every head gets its own loss's gradient; the trunk a Jacobian, aggregated after the last one.
      multi_task_backward(L, m == K - 1);
      continue;
    }
    Tensor loss = L.per_task.at(0);
    if (cfg_.grad_penalty > 0.0) {
      // loss + lambda * ||grad loss||_2, the gradient taken through the scaled loss (PyTorch's recipe).
      std::vector<Tensor> g = grad({scaler_->scale(loss)}, params, {}, true, true);
      const Tensor scale = scaler_->scale_snapshot(device_);  // divided on the device: no host read
      Tensor sq = zeros({}, DType::f32, device_);
      for (const Tensor& t : g) sq = add(sq, sum(pow(div(t, scale), 2.0)));
      autocast ac(device_.type, amp_dtype, autocasting, true, CastLists::cuda);
      loss = add(loss, mul(sqrt(sq), cfg_.grad_penalty));
    }
    scaler_->scale(loss).backward();
  }
  std::vector<double> weights;
  if (multi_task()) {
    weights = aggregate_jacobians();  // gradients are now averaged over ranks (still scaled)
  } else {
    reducer_->finish();  // gradients are now averaged over ranks (still scaled)
  }
  std::vector<Tensor> task_sums;  // this rank's, then (after the collective) the step's
  for (auto& tree : task_trees) task_sums.push_back(tree.fold());

  // The stop flag (a rank got SIGINT/SIGTERM) travels with the loss, in the scaler's found_inf
  // collective when there is one: every rank learns it from the same reduced figures, so every rank
  // stops after the same step.
  Tensor stop = full({1}, interrupt_signal() != 0 ? 1.0 : 0.0, DType::f32, device_);
  bool figures_ride = scaler_->sum_with_found_inf(stop);
  for (Tensor& t : task_sums) figures_ride = figures_ride && scaler_->sum_with_found_inf(t);

  for (const Injection& inj : cfg_.inject_nonfinite) {
    if (inj.step != step || inj.rank != comm_.rank()) continue;
    const float inf = std::numeric_limits<float>::infinity();
    backend_for(device_).copy_from_host(params[0].grad().data_ptr(), &inf, sizeof inf);
  }

  scaler_->unscale_(*opt_);
  Tensor grad_norm;
  if (cfg_.clip_grad_norm > 0.0) {
    grad_norm = clip_grad_norm_(params, cfg_.clip_grad_norm);
  } else if (cfg_.log_grad_norm) {  // a read of every gradient that PyTorch's loop does not pay for: asked only
    Tensor acc = zeros({1}, DType::f32, device_);
    backend_for(device_).norm_accumulate(opt_->grads(), 2.0, acc);
    grad_norm = sqrt(acc);
  }  // else: not computed, null in the metrics
  if (cfg_.clip_grad_value > 0.0) clip_grad_value_(params, cfg_.clip_grad_value);
  scaler_->step(*opt_);
  scaler_->update();

  if (!figures_ride) {
    std::vector<Tensor> figures = {stop};
    figures.insert(figures.end(), task_sums.begin(), task_sums.end());
    comm::all_reduce_scalars(comm_, figures, comm::ReduceOp::sum);  // in the tree's order
  }
  // The losses are means already (B / E each): summed over ranks, they are the step's mean.
  Tensor loss_sum = task_sums.at(0);
  for (size_t t = 1; t < task_sums.size(); ++t) loss_sum = add(loss_sum, task_sums[t]);
  if (task_sums.size() < 2) task_sums.clear();  // one loss: it is `loss`
  // The figures travel to the host in the background: nothing here waits for the device.
  const Tensor found = scaler_->is_enabled() ? scaler_->last_found_inf() : zeros({1}, DType::f32, device_);
  const StepFigures figures{loss_sum, scale_used, found, stop, grad_norm, task_sums};
  PendingStep p{step, t0, backend_for(device_).start_readback(figures.packed()), {}, opt_->lr(), weights,
                grad_norm.defined()};
  if (scheduler_) scheduler_->step();  // after the optimizer's step, skipped or not, as PyTorch's loop does
  if (counted_from && device_.is_cuda()) {
    p.counted = *emulated_device_counters() - *counted_from;
    counted_ += *p.counted;
    log_emulated_step(step, backend_for(device_).peak_bytes());
  }
  return p;
}

StepRecord Trainer::finish(PendingStep& p, std::chrono::steady_clock::time_point next_start) {
  StepRecord r;
  r.step = p.step;
  StepFigures::unpack(p.figures->values(), p.grad_norm, &r);
  r.weights = p.weights;
  r.lr = p.lr;
  // From this step's start to the next one's: the step's share of the wall time, whether or not
  // the device ran ahead of the host.
  r.step_ms = std::chrono::duration<double, std::milli>(next_start - p.start).count();
  if (p.counted) {
    r.device_launches = p.counted->launches;
    r.device_host_syncs = p.counted->host_syncs;
    r.device_d2h_copies = p.counted->d2h_copies;
  }
  if (r.skipped && device_.is_cpu()) {
    // On the CPU a step's figures are final at once, so its gradients are still there to inspect.
    std::string names;
    for (const std::string& n : nonfinite_gradients(model().named_parameters())) names += (names.empty() ? "" : ", ") + n;
    if (!names.empty())
      std::fprintf(stderr, "amp_train: rank %d: step %lld skipped: non-finite gradients in %s\n", comm_.rank(),
                   static_cast<long long>(r.step), names.c_str());
  }
  return r;
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

TrainResult Trainer::run() {
  connect();
  // Under autocast the forward's casts of the parameters are the optimizer's low-precision copies,
  // which each step rewrites as it updates the parameters (Optimizer::keep_low_precision_copies):
  // made once, here, after the weights were loaded and broadcast, and outside any step's figures.
  if (cfg_.amp != AmpMode::off && cfg_.low_precision_copies)
    opt_->keep_low_precision_copies(cfg_.amp == AmpMode::bf16 ? DType::bf16 : DType::f16);
  set_fp32_weight_grads(!cfg_.bf16_rounded_weight_grads);
  // Synthetic samples are made before the first step, as a file is read before it, so that no step
  // pays for data (nor counts it on the emulated GPU). This rank's rows repeat once the steps have
  // gone around the pool P: after P / gcd(E, P) steps, E the samples of a step.
  if (const int64_t pool = data_->period(); pool > 0) {
    const int64_t per_step = cfg_.batch_size * cfg_.micro_batches * comm_.size();
    const int64_t cycle = pool / std::gcd(per_step, pool);
    for (int64_t step = start_step_ + 1; step <= std::min(cfg_.steps, start_step_ + cycle); ++step)
      data_->prepare(first_sample(step), cfg_.micro_batches * cfg_.batch_size);
  }
  TrainResult result;
  result.skipped_steps = skipped_steps_;
  const bool rank0 = comm_.rank() == 0;
  // A resumed run appends to the metrics (the steps after the checkpoint that the first run wrote
  // appear again, from the resumed run).
  MetricsWriter metrics = rank0 && !cfg_.metrics.empty() ? MetricsWriter(cfg_.metrics, start_step_ > 0) : MetricsWriter();
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
      std::printf("notice: removed '%s', a checkpoint left incomplete by a run that was killed while %s it\n", t.c_str(),
                  fs::path(t).filename().string().rfind(".old-", 0) == 0 ? "deleting (an older one it no longer kept)"
                                                                           : "writing");
  const auto start = std::chrono::steady_clock::now();
  const int64_t samples_per_step = cfg_.batch_size * cfg_.micro_batches * comm_.size();
  bool stopping = false;  // every rank sets it at the same step (the flag is in the reduced figures)
  auto emit = [&](const StepRecord& r) {
    // A non-finite loss that no scaler skipped would be trained on, and the weights go NaN
    // quietly: stop, naming the step (the same on every rank: the loss is averaged over ranks).
    if (!std::isfinite(r.loss) && !r.skipped)
      throw JobError("step " + std::to_string(r.step) + ": the loss is " +
                               (std::isnan(r.loss) ? "NaN" : "infinite") +
                               " and no loss scaler skipped the step (non-finite data or weights, or a learning "
                               "rate that diverges); stopping before the weights are corrupted");
    // A scale whose float32 inverse is infinite unscales every gradient to inf or NaN: every step
    // from here would be skipped. The same figure on every rank, so every rank stops here.
    // (The emulated GPU's dry run reads back a scale of 0: it runs nothing, so nothing collapsed.)
    if (scaler_->is_enabled() && scale_collapsed(r.scale) && !emulated_dry_run())
      throw JobError("step " + std::to_string(r.step) + ": the loss scale has collapsed to " + number_str(r.scale) +
                     ", whose inverse is not finite in float32: every step from here would be skipped. The "
                     "gradients overflowed at every scale tried: look for non-finite data or weights, or a learning "
                     "rate that diverges (--min-scale sets a floor for the scale)");
    result.records.push_back(r);
    skipped_steps_ += r.skipped;
    result.skipped_steps = skipped_steps_;
    metrics.write(r);
    warn_once_about(metrics);
    if (r.stop_requested && !stopping) {
      stopping = true;
      if (rank0)
        std::printf("amp_train: interrupted (SIGINT or SIGTERM): finishing the step in flight%s; a second signal "
                    "stops at once\n", cfg_.save_weights.empty() ? "" : ", then saving the weights");
    }
    if (rank0 && cfg_.log_every > 0 && (r.step % cfg_.log_every == 0 || r.step == cfg_.steps || stopping)) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // Samples per second, or tokens per second for a language model (block_size tokens a sample).
      const double tokens_per_sample = spec_->tokens_per_sample();
      const int64_t done = r.step - start_step_;
      const double rate = static_cast<double>(done * samples_per_step) * tokens_per_sample / elapsed;
      const double eta = elapsed / static_cast<double>(done) * static_cast<double>(cfg_.steps - r.step);
      std::printf("step %lld/%lld  loss %s  lr %.4g  scale %g  skipped %lld  %.0f %s/s  ETA %.0fs",
                  static_cast<long long>(r.step), static_cast<long long>(cfg_.steps), number_str(r.loss).c_str(), r.lr,
                  r.scale, static_cast<long long>(result.skipped_steps), rate, spec_->unit(), eta);
      if (r.device_launches >= 0)
        std::printf("  [emulated GPU: %lld launches, %lld host syncs, %lld D2H copies]",
                    static_cast<long long>(r.device_launches), static_cast<long long>(r.device_host_syncs),
                    static_cast<long long>(r.device_d2h_copies));
      std::printf("\n");
      std::fflush(stdout);
    }
  };
  // A step's figures are read once the next step's work is issued (one step late), unless they
  // are already on the host (always, on the CPU).
  std::unique_ptr<PendingStep> late;
  result.steps_done = start_step_;
  // The validation loss after `step` (collective), on the progress line and in the metrics.
  auto report_evaluation = [&](int64_t step) {
    const double val = evaluate();
    metrics.write(EvalRecord{step, val});
    warn_once_about(metrics);
    if (rank0) {
      std::printf("step %lld: validation loss %s\n", static_cast<long long>(step), number_str(val).c_str());
      std::fflush(stdout);
    }
  };
  // A step's figures still in flight, emitted now: before an evaluation's or checkpoint's lines.
  auto flush_late = [&] {
    if (late) emit(finish(*late, std::chrono::steady_clock::now()));
    late.reset();
  };
  // A failure that ends the run is the metrics' last record (when they can still be written).
  try {
    if (cfg_.eval_every > 0 && start_step_ == 0) report_evaluation(0);  // the untrained model's (about ln 256, for bytes)
    for (int64_t step = start_step_ + 1; step <= cfg_.steps && !stopping; ++step) {
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
        if (!stopping) save_checkpoint_at(step);  // the flushed figures may ask to stop: that saves after the loop
      }
    }
    flush_late();
    if (emulated_device_counters() && device_.is_cuda()) {
      // Every rank, not only rank 0 (whose figures the metrics hold): a sync on one rank is a sync.
      std::printf("amp_train: rank %d: emulated GPU: %lld host syncs, %lld kernel launches, %lld D2H copies in %lld "
                  "training steps\n",
                  comm_.rank(), static_cast<long long>(counted_.host_syncs), static_cast<long long>(counted_.launches),
                  static_cast<long long>(counted_.d2h_copies), static_cast<long long>(result.steps_done));
      std::fflush(stdout);
    }
    // skipped_steps counts from step 1 (a resumed run starts from its checkpoint's count). A run that
    // was interrupted stops as asked (exit 128 + signal, with its outputs), whatever it skipped.
    if (!stopping && result.skipped_steps == result.steps_done && result.steps_done > start_step_)
      throw JobError("every one of the " + std::to_string(result.steps_done) +
                     " steps was skipped for non-finite gradients: nothing was trained (final scale " +
                     number_str(scaler_->get_scale()) + ")");
    comm_.set_context("the end-of-run replica check");
    result.final_scale = scaler_->get_scale();
    if (scaler_->is_enabled() && scale_collapsed(result.final_scale) && !emulated_dry_run())
      throw JobError("after step " + std::to_string(result.steps_done) + ": the loss scale has collapsed to " +
                     number_str(result.final_scale) + ", whose inverse is not finite in float32: nothing more can be "
                     "trained from this state, and it is not saved");
    const comm::ReplicaReport rep = check_replicas(&result);
    if (stopping) result.interrupted_by = interrupt_signal() != 0 ? interrupt_signal() : SIGTERM;
    require_consistent(rep, result.steps_done);  // throws, naming the ranks, before anything is saved
    require_finite_parameters(result.steps_done);  // likewise: a NaN model is never saved, nor exits 0
    // The outputs, then the record that says the run finished: one output's failure costs no other.
    if (rank0 && !cfg_.save_weights.empty()) {
      try {
        safetensors::save(cfg_.save_weights, nn::state_dict(model()));
      } catch (const std::exception& e) {
        result.errors.push_back(std::string("--save-weights: ") + e.what());
      }
    }
    // The last step's checkpoint: at the end, or where an interruption stopped the run.
    if (!cfg_.checkpoint_dir.empty() && result.steps_done > start_step_) {
      try {
        save_checkpoint_at(result.steps_done);
      } catch (const JobError& e) {  // every rank: the weights above are kept, and the job exits 1
        result.errors.push_back(e.what());
      }
    }
    if (result.errors.empty())
      metrics.write(EndRecord{result.steps_done, result.skipped_steps, result.final_scale, result.param_checksum,
                              result.replicas_consistent, stopping ? signal_label(result.interrupted_by) : ""});
    else
      metrics.write(FailedRecord{result.steps_done, result.errors.front()});
    metrics.close();
    if (!metrics.error().empty()) result.errors.push_back(metrics.error());
    if (rank0 && !stopping) {
      const std::string text = after_training();  // a language model's sample, say
      std::fputs(text.c_str(), stdout);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {  // a JobError, or this rank's own failure (a timeout, the device)
    metrics.write(FailedRecord{result.steps_done, e.what()});
    throw;
  }
  return result;
}

}  // namespace amp::launch
