// Checkpoints of a run: what a resume must match, restoring one, writing one (collective), and the
// check that nothing non-finite is ever saved.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "comm/coalesced.h"
#include "launch/training/figures.h"
#include "launch/training/interrupt.h"
#include "launch/training/trainer.h"
#include "runtime/kernels/backend.h"
#include "runtime/nn/state_dict.h"
#include "runtime/ops/ops.h"

namespace amp::launch {

namespace fs = std::filesystem;

namespace {
// The fields of a schedule that change its rates: a constant schedule has no warmup, floor or decay.
nlohmann::json schedule_of(nlohmann::json schedule) {
  if (schedule.is_object() && schedule.value("lr_schedule", "") == "constant")
    for (const char* unused : {"warmup_steps", "min_lr", "decay_steps"}) schedule.erase(unused);
  return schedule;
}

// The data's content against the checksums a checkpoint recorded (none in checkpoints written before
// they were). Names and sizes already match (must_match), so a difference is other bytes under the
// same names: shards made again from other documents or by another tokenizer, a text file edited.
void check_same_data(const nlohmann::json& then, const nlohmann::json& now, const nlohmann::json& shard_names,
                     const std::string& data, const std::string& meta_file) {
  if (then.is_null() || then == now) return;
  const std::string after =
      ": a resumed run must read the data its checkpoint trained on (its numbers, and a resume on any "
      "number of ranks, depend on it); give it those files, or start a new run in another --checkpoint-dir";
  if (then.is_string() && now.is_string())
    throw std::invalid_argument("--data " + data + ": its bytes are not those of the file the checkpoint " + meta_file +
                                " trained on (the same size; checksum " + now.get<std::string>() + ", the checkpoint's " +
                                then.get<std::string>() + ")" + after);
  if (then.is_array() && now.is_array() && then.size() == now.size())
    for (size_t i = 0; i < now.size(); ++i)
      if (then[i] != now[i])
        throw std::invalid_argument(
            "--data " + data + ": shard " + std::to_string(i + 1) + " of " + std::to_string(now.size()) + ", " +
            (shard_names.is_array() && i < shard_names.size() ? shard_names[i].get<std::string>() : "?") +
            ", holds other tokens than the checkpoint " + meta_file + " trained on (checksum " + now[i].dump() +
            ", the checkpoint's " + then[i].dump() + ")" + after);
  throw std::invalid_argument(meta_file + ": corrupt: data_checksums " + then.dump() + " is not of this data's kind");
}
}  // namespace

nlohmann::json Trainer::checkpoint_meta(int64_t step) const {
  // The model's identity ({"model": {...}, "dropout": ...}), then what every run must match.
  nlohmann::json must_match = spec_->checkpoint_identity();
  const int64_t E = samples_per_step();
  must_match.update({{"effective_batch", E},
                     {"optimizer", cfg_.optimizer == OptimizerKind::sgd ? "sgd" : "adamw"},
                     {"amp", cfg_.amp == AmpMode::off ? "off" : cfg_.amp == AmpMode::fp16 ? "fp16" : "bf16"},
                     {"loss_scaling", scaler_->is_enabled()},
                     {"seed", cfg_.seed}});
  // The data's size (and a token dataset's shards by name), not its path: a moved file resumes.
  must_match.update(data_->resume_identity());
  return {{"format", kCheckpointFormat},
          {"must_match", must_match},
          {"data", cfg_.data},
          // Of the data's bytes: checked by a resume, outside must_match so that older checkpoints resume.
          {"data_checksums", data_->content_checksums()},
          {"batch_layout", {{"ranks", comm_.size()}, {"batch_size", cfg_.batch_size}, {"micro_batches", cfg_.micro_batches}}},
          // Samples of the stream consumed: step i uses [(i - 1) E, i E).
          {"data_position", {{"next_sample", step * E}}},
          // Dropout draws counters of the data stream's sample index from the seed's stream, and
          // sampling has its own stream: the seed and the step are the whole RNG state.
          {"rng", {{"seed", cfg_.seed}, {"kind", "counter-based (splitmix64), indexed by sample"}}},
          {"scaler", scaler_->state_dict()},
          // Skipped since step 1, so that a resumed run's count (and its all-skipped rule) is the
          // uninterrupted run's.
          {"skipped_steps", position_.skipped_steps},
          // Seeded aggregators draw by call count (multi-task models).
          {"aggregator_calls", aggregator_ ? aggregator_->calls() : 0},
          {"aggregator", spec_->aggregator_spec()},  // "" for an ordinary model; not required to match
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
  if (!cfg_.init_weights.empty() && comm_.rank() == 0)
    std::printf("amp_train: --resume: the weights are %s's; --init-weights %s is for a start with no checkpoint\n",
                ck->path.c_str(), cfg_.init_weights.c_str());
  const std::string meta_file = ck->path + "/trainer.json";
  // Every read below names the file; the JSON library's own errors (a value of another type) too.
  try {
    const nlohmann::json now = checkpoint_meta(ck->step);
    // (A missing one was read as empty: the first key then "did not match the checkpoint's nothing".)
    if (!ck->meta.contains("must_match") || !ck->meta["must_match"].is_object())
      throw std::invalid_argument(meta_file + ": corrupt: no must_match object (what a resume must match)");
    const nlohmann::json& then = ck->meta["must_match"];
    // The micro-batch size B and the samples per step E are what make a resumed run the same
    // training, bit for bit, on any number of ranks R (README, "The same training on any number of
    // ranks"): another B sums other numbers. What may change is R and K = E / (B R).
    const nlohmann::json layout_then = ck->meta.value("batch_layout", nlohmann::json());
    if (!layout_then.is_null() && !layout_then.is_object())
      throw std::invalid_argument(meta_file + ": corrupt: batch_layout " + layout_then.dump() + " is not an object");
    for (const char* key : {"ranks", "batch_size", "micro_batches"})
      if (layout_then.is_object() && layout_then.contains(key) &&
          !(layout_then[key].is_number_unsigned() && layout_then[key].get<uint64_t>() >= 1 &&
            layout_then[key].get<uint64_t>() <= uint64_t{1} << 31))
        throw std::invalid_argument(meta_file + ": corrupt: batch_layout." + key + " " + layout_then[key].dump() +
                                    " is not a count (a whole number from 1)");
    const int64_t R = comm_.size();
    if (layout_then.is_object() && layout_then.contains("batch_size") && layout_then["batch_size"] != cfg_.batch_size)
      throw std::invalid_argument(meta_file + ": this run's --batch-size " + std::to_string(cfg_.batch_size) +
                                  " does not match the checkpoint's " + layout_then["batch_size"].dump() +
                                  ": a resumed run keeps the micro-batch size and the samples per step; the ranks and "
                                  "--micro-batches may change");
    for (const auto& [key, value] : now["must_match"].items()) {
      if (then.contains(key) && then[key] == value) continue;
      if (key == "data_samples" && then.contains(key) && then[key] == 0) continue;  // a --data file's, unrecorded before
      const std::string was = then.contains(key) ? then[key].dump() : "nothing";
      std::string hint;
      if (key == "effective_batch") {
        hint =
            " (ranks x --batch-size x --micro-batches must give the same samples per step; the checkpoint's layout "
            "was " +
            layout_then.dump();
        if (then.contains(key) && then[key].is_number_integer() && then[key].get<int64_t>() % cfg_.batch_size == 0) {
          const int64_t M = then[key].get<int64_t>() / cfg_.batch_size;  // micro-batches of a step, over all ranks
          hint += M % R == 0
                      ? ": on " + std::to_string(R) + " ranks, --micro-batches " + std::to_string(M / R)
                      : ": its " + std::to_string(M) + " micro-batches of " + std::to_string(cfg_.batch_size) +
                            " a step cannot be split over " + std::to_string(R) + " ranks (--micro-batches " +
                            "must be a whole number): run on a number of ranks that divides " + std::to_string(M);
        }
        hint += ")";
      }
      if (value.is_object() && then.contains(key) && then[key].is_object()) {
        // The model's shape: each field that differs, by its flag (--tasks 2, not the whole object).
        std::string fields;
        // Another kind of model (--model mtl on an mlp checkpoint): that alone, not each other's fields.
        const bool other_kind = value.contains("model") && then[key].contains("model") && value["model"] != then[key]["model"];
        nlohmann::json both = other_kind ? nlohmann::json{{"model", value["model"]}} : value;
        if (!other_kind) both.update(then[key]);
        for (const auto& [field, unused] : both.items()) {
          if (value.value(field, nlohmann::json()) == then[key].value(field, nlohmann::json())) continue;
          std::string flag = field;
          std::replace(flag.begin(), flag.end(), '_', '-');
          auto shown = [](const nlohmann::json& v) {
            return v.is_null() ? std::string("the default") : v.is_string() ? v.get<std::string>() : v.dump();
          };
          fields += (fields.empty() ? "" : ", ") + ("--" + flag) + " " + shown(value.value(field, nlohmann::json())) +
                    " (the checkpoint's: " + shown(then[key].value(field, nlohmann::json())) + ")";
        }
        throw std::invalid_argument(meta_file + ": this run's " + key + " does not match the checkpoint's: " + fields);
      }
      throw std::invalid_argument(meta_file + ": this run's " + key + " " + value.dump() + " does not match the checkpoint's " +
                                  was + hint);
    }
    check_same_data(ck->meta.value("data_checksums", nlohmann::json()), now["data_checksums"],
                    now["must_match"].value("data_shards", nlohmann::json()), cfg_.data, meta_file);
    // A requeued job reruns its command after the run ended: at --steps there is nothing left to
    // train (run() writes what that run's outputs may lack). Beyond it, the flags ask for another run.
    if (ck->step > cfg_.steps)
      throw std::invalid_argument(meta_file + ": the checkpoint is at step " + std::to_string(ck->step) +
                                  ", past --steps " + std::to_string(cfg_.steps) + " (--steps is the total)");
    if (ck->step == cfg_.steps) position_.nothing_left = ck->path;
    // A run that resumes into a directory holding checkpoints newer than the one it resumes from
    // (--resume-from an older one) would interleave its checkpoints with theirs, and keeping the last
    // K would delete its own: refused, naming them.
    if (!cfg_.checkpoint_dir.empty()) {
      // By their steps: the checkpoint resumed from may be named otherwise (a copy, "step-N/").
      for (const std::string& other : list_checkpoints(cfg_.checkpoint_dir))
        if (checkpoint_step_of(fs::path(other).filename().string()) > ck->step)
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
    // Under ZeRO-1, this rank's pieces of the unsharded state: a checkpoint of either kind, from any
    // number of ranks, resumes either way.
    const optim::OptimizerStateDict full = with_padding(ck->optimizer);
    optim::OptimizerStateDict state = zero_ ? zero_->shard_state_dict(full, *opt_) : full;
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
        // What this program wrote: whole counts, the tracker below the interval (PyTorch's
        // load_state_dict, and ours, take more).
        auto whole_in = [&scaler_state](const char* key, double lo, double hi) {
          const auto it = scaler_state.find(key);
          if (it == scaler_state.end()) return;  // load_state_dict names a missing key
          const double v = it->second;
          if (!(v >= lo && v <= hi) || v != std::floor(v))
            throw std::invalid_argument(std::string("scaler.") + key + " must be a whole number in [" +
                                        std::to_string(static_cast<long long>(lo)) + ", " +
                                        std::to_string(static_cast<long long>(hi)) + "], got " + number_str(v));
        };
        constexpr double kIntMax = 2147483647.0;
        whole_in("growth_interval", 1.0, kIntMax);
        const auto interval = scaler_state.find("growth_interval");
        whole_in("_growth_tracker", 0.0, interval == scaler_state.end() ? kIntMax : interval->second - 1.0);
        whole_in("_hysteresis_left", 0.0, kIntMax);
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
      if (scale != scaler_state.end() &&
          (!(scale->second > 0.0) || !scale_collapse(scale->second, cfg_.amp == AmpMode::fp16).empty()))
        throw std::invalid_argument(meta_file + ": corrupt: scaler.scale " + number_str(scale->second) +
                                    " is not a usable loss scale (positive, with an inverse finite in float32, and "
                                    "at least 2^-24 under fp16)");
      try {
        scaler_->load_state_dict(scaler_state);
      } catch (const std::exception& e) {
        throw std::invalid_argument(meta_file + ": corrupt: " + e.what());
      }
      if (!changed.empty() && comm_.rank() == 0)
        std::printf("amp_train: note: the loss scaler's %s: the steps from here use this run's flags\n", changed.c_str());
    }
    // Written by this version (format 2): the data position and the skipped steps, checked.
    if (ck->meta.value("format", 0) >= 2) {  // formats above kCheckpointFormat were refused by load_checkpoint
      const int64_t E = now["must_match"]["effective_batch"].get<int64_t>();
      const nlohmann::json& position = ck->meta.value("data_position", nlohmann::json()).is_object()
                                           ? ck->meta["data_position"] : nlohmann::json::object();
      if (!position.contains("next_sample") || !ck->meta.contains("skipped_steps"))
        throw std::invalid_argument(meta_file + ": corrupt: no " +
                                    (position.contains("next_sample") ? "skipped_steps" : "data_position.next_sample") +
                                    " (format " + ck->meta["format"].dump() + " records where the data stream stands)");
      const nlohmann::json pos = position["next_sample"];
      if (!pos.is_number_integer() || pos.get<int64_t>() != ck->step * E)
        throw std::invalid_argument(meta_file + ": corrupt: data_position.next_sample " + pos.dump() + " is not step " +
                                    std::to_string(ck->step) + " x " + std::to_string(E) + " samples");
      const nlohmann::json skipped = ck->meta.at("skipped_steps");
      if (!skipped.is_number_integer() || skipped.get<int64_t>() < 0 || skipped.get<int64_t>() > ck->step)
        throw std::invalid_argument(meta_file + ": corrupt: skipped_steps " + skipped.dump() + " is not a count in [0, " +
                                    std::to_string(ck->step) + "]");
      position_.skipped_steps = skipped.get<int64_t>();
    }
    if (aggregator_) {
      const nlohmann::json calls = ck->meta.value("aggregator_calls", nlohmann::json(0));
      if (!calls.is_number_unsigned())
        throw std::invalid_argument(meta_file + ": corrupt: aggregator_calls is not a count");
      aggregator_->set_calls(calls.get<uint64_t>());
    }
    position_.start_step = ck->step;
    position_.resumed_from = ck->path;
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
      // Bit for bit the uninterrupted run only when both splits of a step's micro-batches follow the
      // sum tree's subtrees (comm/sum_tree.h): otherwise the steps before and after the resume sum in
      // different orders, and the run is neither layout's.
      const int64_t ranks_then = layout.value("ranks", int64_t{0}), micro_then = layout.value("micro_batches", int64_t{0});
      if (layout != mine && ranks_then > 0 && micro_then > 0 &&
          (!comm::split_is_subtrees(ranks_then, micro_then) || !comm::split_is_subtrees(comm_.size(), cfg_.micro_batches)))
        std::printf("amp_train: note: %lld ranks x %lld micro-batches (the checkpoint's) and %d x %lld (this run's) sum a "
                    "step's micro-batches in different orders (a count of micro-batches that is not a power of two): the "
                    "resumed run is not bit for bit either layout's uninterrupted run; resume on the checkpoint's layout "
                    "for that\n",
                    static_cast<long long>(ranks_then), static_cast<long long>(micro_then), comm_.size(),
                    static_cast<long long>(cfg_.micro_batches));
      if (const nlohmann::json was = ck->meta.value("aggregator", nlohmann::json());
          was.is_string() && was.get<std::string>() != now["aggregator"].get<std::string>())
        std::printf("amp_train: note: --aggregator %s differs from the checkpoint's run (%s): the steps from here "
                    "aggregate with it\n", now["aggregator"].get<std::string>().c_str(), was.get<std::string>().c_str());
      if (schedule_of(ck->meta.value("schedule", nlohmann::json())) != schedule_of(now["schedule"]))
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

optim::OptimizerStateDict Trainer::without_padding(optim::OptimizerStateDict s) const {
  for (const auto& [id, pad] : padded_state_) {
    const auto it = s.state.find(id);
    if (it == s.state.end()) continue;
    for (auto& [key, t] : it->second)
      if (t.shape() == pad.shape) t = nn::first_rows(t, pad.rows);  // a view: no copy
  }
  return s;
}

optim::OptimizerStateDict Trainer::with_padding(optim::OptimizerStateDict s) const {
  for (const auto& [id, pad] : padded_state_) {
    const auto it = s.state.find(id);
    if (it == s.state.end()) continue;
    for (auto& [key, t] : it->second)
      if (t.dim() == static_cast<int64_t>(pad.shape.size()) && t.size(0) == pad.rows && t.shape() != pad.shape)
        t = nn::zero_padded_rows(t, pad.shape);  // other shapes: load_state_dict names them
  }
  return s;
}

bool Trainer::save_checkpoint_at(int64_t step) {
  if (listeners_.before_checkpoint) listeners_.before_checkpoint(step);
  require_finite_parameters(step);
  // A skipped step can back the scale off past what trains (figures.h): such a state is never saved
  // (a resume would refuse it, and pruning would have deleted the last good checkpoint). The scale
  // is the same on every rank; 0 is the emulated GPU's dry run, whose read-backs are zeros.
  if (const double scale = scaler_->is_enabled() ? scaler_->get_scale() : 1.0; scale > 0.0)
    if (const std::string why = scale_collapse(scale, cfg_.amp == AmpMode::fp16); !why.empty())
      throw JobError("after step " + std::to_string(step) + ": the loss scale has collapsed to " + number_str(scale) +
                     ", " + why + ": nothing more can be trained from this state, and it is not saved");
  comm_.set_context("writing the checkpoint of step " + std::to_string(step));
  std::string error, path;
  // Under ZeRO-1 the optimizer's state is gathered from every rank (a collective) into the file an
  // unsharded run writes.
  std::optional<optim::OptimizerStateDict> gathered;
  if (zero_) gathered = zero_->full_state_dict(*opt_, comm_.rank() == 0);
  if (comm_.rank() == 0) {
    try {
      path = save_checkpoint(cfg_.checkpoint_dir, step, nn::state_dict(model()),
                             without_padding(gathered ? *gathered : opt_->state_dict()),
                             checkpoint_meta(step), cfg_.keep_checkpoints);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank learns the outcome from rank 0: a failed write stops the job everywhere, with the
  // previous checkpoints intact. And whether a stop was asked for meanwhile, on any rank: a write
  // takes seconds, and the step after it would take more before the stop (and write its own).
  Tensor failed = full({1}, error.empty() ? 0.0 : 1.0, DType::f32, device_);
  Tensor stop = full({1}, interrupt_signal() != 0 ? 1.0 : 0.0, DType::f32, device_);
  comm::all_reduce_scalars(comm_, {failed, stop}, comm::ReduceOp::sum);
  if (failed.item() != 0.0)
    throw JobError("checkpoint of step " + std::to_string(step) + " failed" + (error.empty() ? " on rank 0" : ": " + error));
  if (comm_.rank() == 0) {
    std::printf("amp_train: checkpoint of step %lld written to %s\n", static_cast<long long>(step), path.c_str());
    std::fflush(stdout);
  }
  return stop.item() != 0.0;
}

}  // namespace amp::launch
