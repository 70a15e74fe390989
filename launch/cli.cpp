#include "launch/cli.h"

#include "comm/mpi_session.h"
#include "launch/training/train_config.h"
#include "models/model_spec.h"
#include "runtime/ops/ops.h"
#include "runtime/core/file_kind.h"
#include "runtime/core/number_format.h"
#include "runtime/core/parse_number.h"

#include <fcntl.h>
#include <climits>
#include <sys/resource.h>
#include <unistd.h>

#include <boost/program_options.hpp>
#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

namespace po = boost::program_options;

namespace amp::launch {

// --- typed validators: Boost calls these for options of these types. Errors list the valid values.

[[noreturn]] void invalid_value(const std::string& value, const std::string& valid) {
  // Boost fills in the option's name when the error passes through store().
  po::error_with_option_name e("invalid value '%value%' for option '%canonical_option%' (valid: " + valid + ")");
  e.set_substitute("value", value);
  throw e;
}

// The value named s in a table of choices; the error lists the table, so the two cannot drift apart.
template <class E>
E choose(const std::string& s, std::initializer_list<std::pair<const char*, E>> choices) {
  std::string valid;
  for (const auto& [name, value] : choices) {
    if (s == name) return value;
    valid += (valid.empty() ? "" : ", ") + std::string(name);
  }
  invalid_value(s, valid);
}

void validate(boost::any& v, const std::vector<std::string>& values, AmpMode*, int) {
  v = choose<AmpMode>(po::validators::get_single_string(values),
                      {{"off", AmpMode::off}, {"fp16", AmpMode::fp16}, {"bf16", AmpMode::bf16}});
}

void validate(boost::any& v, const std::vector<std::string>& values, OptimizerKind*, int) {
  v = choose<OptimizerKind>(po::validators::get_single_string(values),
                            {{"sgd", OptimizerKind::sgd}, {"adamw", OptimizerKind::adamw}});
}

void validate(boost::any& v, const std::vector<std::string>& values, LrSchedule*, int) {
  v = choose<LrSchedule>(po::validators::get_single_string(values),
                         {{"constant", LrSchedule::constant}, {"cosine", LrSchedule::cosine}});
}

void validate(boost::any& v, const std::vector<std::string>& values, CudaGraphs*, int) {
  v = choose<CudaGraphs>(po::validators::get_single_string(values),
                         {{"auto", CudaGraphs::auto_}, {"on", CudaGraphs::on}, {"off", CudaGraphs::off}});
}

void validate(boost::any& v, const std::vector<std::string>& values, DeviceKind*, int) {
  v = choose<DeviceKind>(po::validators::get_single_string(values),
                         {{"auto", DeviceKind::auto_}, {"cpu", DeviceKind::cpu}, {"cuda", DeviceKind::cuda}});
}

void validate(boost::any& v, const std::vector<std::string>& values, LossScale*, int) {
  const std::string& s = po::validators::get_single_string(values);
  LossScale ls;
  if (s == "auto") ls.kind = LossScale::Kind::auto_;
  else if (s == "dynamic") ls.kind = LossScale::Kind::dynamic;
  else if (s == "off") ls.kind = LossScale::Kind::off;
  else {
    // Parsed as a double (a float would refuse its subnormals as out of range): the bounds, which
    // depend on --amp, are check_ranges()'s, the same as --init-scale's.
    const ParsedReal p = parse_real(s);
    const double d = p.value;
    if (p.error != NumberError::none || !(d > 0.0))
      invalid_value(s, "auto, dynamic, off, or a positive number");
    ls.kind = LossScale::Kind::constant;
    ls.value = static_cast<float>(d);
    ls.given = d;
  }
  v = ls;
}

void validate(boost::any& v, const std::vector<std::string>& values, Injection*, int) {
  const std::string& s = po::validators::get_single_string(values);
  Injection inj{0, 0};
  const size_t colon = s.find(':');
  const ParsedInteger step = parse_integer(s.substr(0, colon));
  const ParsedInteger rank = colon == std::string::npos ? ParsedInteger{0, NumberError::none} : parse_integer(s.substr(colon + 1));
  if (step.error != NumberError::none || rank.error != NumberError::none || rank.value < INT_MIN || rank.value > INT_MAX)
    invalid_value(s, "STEP or STEP:RANK, whole numbers");
  inj.step = step.value;
  inj.rank = static_cast<int>(rank.value);
  v = inj;
}

namespace {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Boost's message quotes the value given: a value of megabytes (a binary file given as the config, a
// generated argument) is not echoed whole.
std::string clipped(const std::string& what) {
  if (what.size() <= 400) return what;
  return what.substr(0, 240) + " [... " + std::to_string(what.size() - 360) + " characters ...] " +
         what.substr(what.size() - 120);
}

// Values as a person writes them: 0.9, not 0.90000000000000002.
template <class T>
std::string printable(const T& v) {
  if constexpr (std::is_floating_point_v<T>) {
    return float_repr(static_cast<double>(v));
  } else {
    std::ostringstream os;
    os << v;
    return os.str();
  }
}

// An option whose --help shows its default as printable() writes it.
template <class T>
po::typed_value<T>* with_default(T* v) {
  return po::value(v)->default_value(*v, printable(*v));
}

template <class T>
void require(bool ok, const char* flag, const T& value, const std::string& rule) {
  if (ok) return;
  std::ostringstream os;
  os << flag << " " << rule << ", got " << printable(value);
  throw UsageError(os.str());
}

// The model's own flags and checks are its kind's (models/model_spec.h): sizes that cannot fit in
// this machine's physical memory are refused there, naming the flag, rather than as a bad_alloc later.
void check_model(const TrainConfig& c) {
  std::shared_ptr<const models::ModelSpec> spec;
  try {
    spec = models::configure_model(c.model, c.model_flags);
    // The host's memory, for a run on the host: shared by the node's ranks (launchers name the count).
    // A GPU run keeps its model and activations in device memory, which this does not measure.
    long double ram = c.device == DeviceKind::cuda
                          ? 0.0L
                          : static_cast<long double>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGESIZE);
    std::optional<comm::NodePlace> place;
    try {
      place = comm::node_place_from_launcher();
    } catch (const std::invalid_argument&) {  // a launcher's variables that are not counts: said at GPU selection
    }
    if (place && place->local_size > 1) ram /= place->local_size;
    spec->check(run_shape(c), ram > 0 ? ram : 0.0L);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (c.save_weights_format != "native") {
    const auto formats = spec->weight_formats();
    if (std::find(formats.begin(), formats.end(), c.save_weights_format) == formats.end())
      throw UsageError("--save-weights-format " + c.save_weights_format + ": --model " + c.model + " writes " +
                       (formats.empty() ? std::string("only its own layout (native)") : "native or " + formats[0]));
    if (c.save_weights.empty())
      throw UsageError("--save-weights-format " + c.save_weights_format + ": no --save-weights FILE to write");
  }
  if (c.grad_penalty > 0.0 && !spec->double_backward())
    throw UsageError("--grad-penalty: not available with --model " + c.model);
  if (c.zero == 1 && spec->aggregator(0) != nullptr)
    throw UsageError("--zero 1: --model " + c.model + " trains by Jacobian descent, whose trunk Jacobian is summed "
                     "and aggregated whole on every rank: there is no gradient shard to step; use --zero 0");
  if (c.bf16_rounded_weight_grads && spec->aggregator(0) != nullptr)
    throw UsageError("--bf16-rounded-weight-grads: --model " + c.model + " takes its gradients by Jacobian descent "
                     "(grad()), which rounds them as PyTorch does already");
}

// A loss scale (--init-scale, --loss-scale N) that can train: a normal float32 (a subnormal's inverse
// overflows near 2.9e-39, and every step would be skipped), and under fp16 at least 2^-24, fp16's
// smallest subnormal: below it the scaled gradient of anything smaller than 1 is flushed to zero,
// and the run would step with zero gradients, training nothing, without a single skip to say so.
void check_scale(const char* flag, double scale, AmpMode amp) {
  require(scale > 0.0 && std::isfinite(static_cast<float>(scale)), flag, scale, "must be a positive number within float32's range");
  require(static_cast<float>(scale) >= std::numeric_limits<float>::min(), flag, scale,
          "must be at least 1.18e-38, float32's smallest normal number (gradients are unscaled by its inverse, "
          "which must be finite in float32)");
  if (amp == AmpMode::fp16)
    require(scale >= 0x1p-24, flag, scale,
            "must be at least 2^-24 = 5.96e-08 with --amp fp16: below it every scaled fp16 gradient smaller than 1 "
            "underflows to zero, and nothing would train (scales below 1 shrink the gradients; above 1 they are kept)");
}

// Each rank's threads: at most kMaxThreads, and what the process may create (RLIMIT_NPROC counts
// threads, and libgomp fails, or crashes, past it).
constexpr int kMaxThreads = 1024;
int max_threads() {
  long limit = kMaxThreads;
  rlimit r{};
  if (::getrlimit(RLIMIT_NPROC, &r) == 0 && r.rlim_cur != RLIM_INFINITY)
    limit = std::min<long>(limit, static_cast<long>(r.rlim_cur) - 1);
  std::ifstream threads_max("/proc/sys/kernel/threads-max");
  long system = 0;
  if (threads_max >> system && system > 0) limit = std::min(limit, system - 1);
  return static_cast<int>(std::max(1L, limit));
}

void check_ranges(const TrainConfig& c, int world_size) {
  require(c.eval_every >= 0, "--eval-every", c.eval_every, "must be >= 0 (0: never)");
  require(c.eval_batches >= 1, "--eval-batches", c.eval_batches, "must be >= 1");
  require(c.checkpoint_every >= 0, "--checkpoint-every", c.checkpoint_every, "must be >= 0 (0: at the end only)");
  require(c.keep_checkpoints >= 1, "--keep-checkpoints", c.keep_checkpoints, "must be >= 1");
  if ((c.checkpoint_every > 0 || c.resume) && c.checkpoint_dir.empty())
    throw UsageError("--checkpoint-every and --resume need --checkpoint-dir DIR");
  // --resume with --init-weights is one command line for a job that is requeued: the weights to start
  // from while there is no checkpoint yet, the checkpoint's after. --resume-from names a checkpoint.
  if (c.resume && !c.resume_from.empty())  // --resume-from won, silently
    throw UsageError("--resume and --resume-from: give one (--resume takes the newest checkpoint in --checkpoint-dir, "
                     "--resume-from the one it names)");
  if (!c.init_weights.empty() && !c.resume_from.empty())
    throw UsageError("--init-weights: a run resumed from a named checkpoint takes its weights from it; give one or the other");
  require(c.steps >= 1, "--steps", c.steps, "must be >= 1");
  require(c.batch_size >= 1, "--batch-size", c.batch_size, "must be >= 1");
  require(c.micro_batches >= 1, "--micro-batches", c.micro_batches, "must be >= 1");
  // A stop request (SIGINT, SIGTERM, SIGUSR1, SIGUSR2) is honoured between steps: a step of a billion micro-batches
  // would never reach one. More than 65536 is no accumulation a run needs (a larger --batch-size is).
  require(c.micro_batches <= 65536, "--micro-batches", c.micro_batches,
          "must be at most 65536 (a stop request waits for the step in flight: use a larger --batch-size)");

  require(c.lr >= 0.0 && std::isfinite(c.lr), "--lr", c.lr, "must be a finite number >= 0");
  require(c.momentum >= 0.0 && c.momentum < 1.0, "--momentum", c.momentum, "must be in [0, 1)");
  if (c.weight_decay)
    require(*c.weight_decay >= 0.0 && std::isfinite(*c.weight_decay), "--weight-decay", *c.weight_decay,
            "must be a finite number >= 0");
  require(c.beta1 >= 0.0 && c.beta1 < 1.0, "--beta1", c.beta1, "must be in [0, 1)");
  require(c.beta2 >= 0.0 && c.beta2 < 1.0, "--beta2", c.beta2, "must be in [0, 1)");
  require(c.warmup_steps >= 0, "--warmup-steps", c.warmup_steps, "must be >= 0");
  require(c.decay_steps >= 0, "--decay-steps", c.decay_steps, "must be >= 0 (0: --steps)");
  require(c.min_lr >= 0.0 && c.min_lr <= c.lr, "--min-lr", c.min_lr, "must lie in [0, --lr]");
  if (c.lr_schedule == LrSchedule::cosine) {
    const int64_t decay = c.decay_steps > 0 ? c.decay_steps : c.steps;
    require(decay > c.warmup_steps, "--warmup-steps", c.warmup_steps,
            "must be below --decay-steps (or --steps): the cosine needs at least one step");
  }
  require(c.clip_grad_norm >= 0.0 && std::isfinite(c.clip_grad_norm), "--clip-grad-norm", c.clip_grad_norm,
          "must be a finite number >= 0 (0 turns clipping off)");
  require(c.clip_grad_value >= 0.0 && std::isfinite(c.clip_grad_value), "--clip-grad-value", c.clip_grad_value,
          "must be a finite number >= 0 (0 turns clipping off)");
  require(c.grad_penalty >= 0.0 && std::isfinite(c.grad_penalty), "--grad-penalty", c.grad_penalty,
          "must be a finite number >= 0");
  check_scale("--init-scale", c.init_scale, c.amp);
  if (c.loss_scale.kind == LossScale::Kind::constant) check_scale("--loss-scale", c.loss_scale.given, c.amp);
  // The scaler multiplies in float32: a factor beyond its range is inf there (the scale never grew),
  // one below its smallest normal number 0 or a subnormal (the first backoff collapsed the scale).
  require(c.growth_factor > 1.0 && std::isfinite(static_cast<float>(c.growth_factor)), "--growth-factor", c.growth_factor,
          "must be a number > 1 within float32's range (an infinite factor never grows the scale)");
  require(c.backoff_factor >= std::numeric_limits<float>::min() && c.backoff_factor < 1.0, "--backoff-factor",
          c.backoff_factor, "must be in (0, 1), at least float32's smallest normal number 1.2e-38");
  require(c.growth_interval >= 1, "--growth-interval", c.growth_interval, "must be >= 1");
  require(c.hysteresis >= 1, "--hysteresis", c.hysteresis, "must be >= 1");
  require(c.min_scale >= 0.0f && std::isfinite(c.min_scale), "--min-scale", c.min_scale, "must be a finite number >= 0");
  require(c.max_scale >= c.min_scale, "--max-scale", c.max_scale, "must be >= --min-scale");
  require(c.init_scale >= c.min_scale && c.init_scale <= c.max_scale, "--init-scale", c.init_scale,
          "must lie in [--min-scale, --max-scale], here [" + printable(c.min_scale) + ", " + printable(c.max_scale) +
              "] (its default is " + printable(TrainConfig{}.init_scale) + ")");
  require(c.threads >= 0, "--threads", c.threads, "must be >= 0 (0: cores / local ranks)");
  require(c.threads <= max_threads(), "--threads", c.threads,
          "must be at most " + std::to_string(max_threads()) + " (" + std::to_string(kMaxThreads) +
              ", or fewer where ulimit -u or the kernel's threads-max allow fewer; this machine has " +
              std::to_string(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN))) + " cores)");
  require(c.comm_timeout > 0.0 && std::isfinite(c.comm_timeout), "--comm-timeout", c.comm_timeout,
          "must be a finite number of seconds > 0");
  require(c.check_every >= 0, "--check-every", c.check_every, "must be >= 0");
  require(c.profile_step >= 0 && c.profile_step <= c.steps, "--profile-step", c.profile_step,
          "must be a step of the run: in [0, --steps] (0: none)");
  require(c.log_every >= 0, "--log-every", c.log_every, "must be >= 0");
  require(c.bucket_mb > 0.0 && c.bucket_mb <= 65536.0, "--bucket-mb", c.bucket_mb, "must be in (0, 65536]");
  require(c.zero == 0 || c.zero == 1, "--zero", c.zero, "must be 0 (every rank holds the optimizer's state) or 1 "
          "(ZeRO-1: each rank holds its shard of it)");
  if (!c.inject_nonfinite.empty() && !scaler_options(c).enabled)
    throw UsageError("--inject-nonfinite: without a loss scaler nothing skips the poisoned step, and the run would "
                   "stop at its non-finite loss; use it with --amp fp16 or --loss-scale dynamic|<number>");
  if (c.bf16_rounded_weight_grads && c.amp != AmpMode::bf16)
    throw UsageError("--bf16-rounded-weight-grads: only --amp bf16 has bf16 weight gradients to round (fp16 keeps "
                     "PyTorch's rounding always)");
  check_model(c);
  // Sample indices are int64: step i reads [(i - 1) E, i E), E = batch x micro-batches x ranks, a
  // checkpoint records --steps x E, and an evaluation reads --eval-batches x E. After the memory
  // check, which bounds --batch-size: what overflows is the count of steps or micro-batches.
  // Before MPI_Init the world's size is not known (amp_train's early parse passes INT_MAX): one rank.
  const int64_t ranks = world_size == std::numeric_limits<int>::max() ? 1 : world_size;
  int64_t per_step = 0, total = 0, evaluated = 0;
  const bool fits = c.steps < std::numeric_limits<int64_t>::max() &&
                    !__builtin_mul_overflow(c.batch_size, c.micro_batches, &per_step) &&
                    !__builtin_mul_overflow(per_step, ranks, &per_step) &&
                    !__builtin_mul_overflow(per_step, c.steps + 1, &total);
  const bool steps_larger = c.steps > c.micro_batches;
  require(fits, steps_larger ? "--steps" : "--micro-batches", steps_larger ? c.steps : c.micro_batches,
          "is too large: --batch-size " + std::to_string(c.batch_size) + " x --micro-batches x " +
              std::to_string(ranks) + " rank(s) x (--steps + 1) samples must count in 64 bits");
  require(!__builtin_mul_overflow(per_step, c.eval_batches, &evaluated), "--eval-batches", c.eval_batches,
          "is too large: --eval-batches x --batch-size x --micro-batches x ranks samples must count in 64 bits");
  for (const Injection& inj : c.inject_nonfinite) {
    require(inj.step >= 1 && inj.step <= c.steps, "--inject-nonfinite", inj.step,
            "step must be in [1, --steps=" + std::to_string(c.steps) + "]");
    require(inj.rank >= 0 && inj.rank < world_size, "--inject-nonfinite", inj.rank,
            "rank must be in [0, " + std::to_string(world_size) + ")");
  }
}

// The model's flags that a --config gives and that would change nothing in this run (models/
// model_spec.h: inert): a notice (a config shared by runs of several kinds sets them all), and
// dropped once their values are checked. The command line's are refused by configure_model.
// ignored: gets their names (a notice-only key is no difference between ranks).
void drop_inert_model_flags(TrainConfig& c, const std::set<std::string>& on_command_line, std::vector<std::string>* notices,
                            std::set<std::string>* ignored) {
  // A trainer's flag decides this one (an empty value is the model's to refuse, as an empty path).
  if (const auto v = c.model_flags.find("val-data"); c.eval_every == 0 && v != c.model_flags.end() && !v->second.empty()) {
    const std::string why = "--val-data: only the validation loss uses it, and --eval-every is 0 (none is taken)";
    if (on_command_line.count("val-data")) throw UsageError(why);
    notices->push_back("notice: --config " + c.config_file + ": " + why + "; ignored in this run");
    c.model_flags.erase("val-data");
    ignored->insert("val-data");
  }
  try {
    std::vector<models::InertFlag> from_config;
    for (const models::InertFlag& f : models::inert_model_flags(c.model, c.model_flags))
      if (!on_command_line.count(f.flag)) from_config.push_back(f);
    if (from_config.empty()) return;
    (void)models::model_kind(c.model).configure(c.model_flags);  // every value checked, even one dropped
    for (const models::InertFlag& f : from_config) {
      notices->push_back("notice: --config " + c.config_file + ": --" + f.flag + ": " + f.why + "; ignored in this run");
      c.model_flags.erase(f.flag);
      ignored->insert(f.flag);
    }
  } catch (const std::invalid_argument& e) {  // a value that does not parse: named by it
    throw UsageError(e.what());
  }
}

// The chosen model's flags become its values; a flag of another model is a mistake, not a default
// to ignore (a --config key of another model: a notice, as a shared file sets them all).
// collect: take the chosen model's values; else: refuse another model's flags (on_command_line,
// notices and ignored as check_flags_apply's).
void take_model_flags(const po::variables_map& vm, TrainConfig& c, bool collect,
                      const std::set<std::string>& on_command_line = {}, std::vector<std::string>* notices = nullptr,
                      std::set<std::string>* ignored = nullptr) {
  auto given = [&vm](const std::string& flag) { return vm.count(flag) && !vm[flag].defaulted(); };
  try {
    models::model_kind(c.model);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  for (const models::ModelKind& kind : models::model_kinds())
    for (const models::ModelFlag& f : kind.flags) {
      if (!given(f.name)) continue;
      if (kind.name == c.model) {
        if (collect) c.model_flags[f.name] = vm[f.name].as<std::string>();
        continue;
      }
      if (collect) continue;
      bool also_mine = false;  // two kinds may share a flag's name
      for (const models::ModelFlag& g : models::model_kind(c.model).flags) also_mine = also_mine || g.name == f.name;
      if (also_mine) continue;
      const std::string why = "--" + f.name + ": only --model " + kind.name + " uses it (this run is --model " + c.model + ")";
      if (on_command_line.count(f.name) || notices == nullptr) throw UsageError(why);
      notices->push_back("notice: --config " + c.config_file + ": " + why + "; ignored in this run");
      ignored->insert(f.name);
    }
}

// Digits only: a number type would read -1 as 2^64 - 1.
uint64_t parse_seed(const std::string& text) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos || ec != std::errc() || ptr != end)
    throw UsageError("--seed must be a whole number from 0 to 18446744073709551615, got '" + text + "'");
  return v;
}

// A flag given where it changes nothing is a mistake (a schedule's warmup on a constant lr, a scaler's
// knobs without a scaler), not a value to ignore; so is an empty path (an unset variable in a
// script), which would turn an output off.
// on_command_line: the flags the command line gave; a --config key that changes nothing is a notice
// (a config shared by runs of several kinds sets them all; ignored gets its name), the same flag on the
// command line an error.
void check_flags_apply(const po::variables_map& vm, const TrainConfig& c, const std::set<std::string>& on_command_line,
                       std::vector<std::string>* notices, std::set<std::string>* ignored) {
  auto given = [&vm](const char* flag) { return vm.count(flag) && !vm[flag].defaulted(); };
  auto only = [&](std::initializer_list<const char*> flags, bool applies, const std::string& who) {
    for (const char* flag : flags)
      if (given(flag) && !applies) {
        const std::string why = std::string("--") + flag + ": only " + who + " uses it";
        if (on_command_line.count(flag)) throw UsageError(why);
        notices->push_back("notice: --config " + c.config_file + ": " + why + "; ignored in this run");
        ignored->insert(flag);
      }
  };
  only({"keep-checkpoints"}, !c.checkpoint_dir.empty(), "--checkpoint-dir DIR");
  only({"eval-batches"}, c.eval_every > 0, "--eval-every N (a model whose data has a validation split)");
  only({"momentum"}, c.optimizer == OptimizerKind::sgd, "--optimizer sgd");
  only({"beta1", "beta2"}, c.optimizer == OptimizerKind::adamw, "--optimizer adamw");
  only({"warmup-steps", "min-lr", "decay-steps"}, c.lr_schedule == LrSchedule::cosine, "--lr-schedule cosine");
  const GradScalerOptions scaler = scaler_options(c);
  only({"init-scale", "growth-factor", "backoff-factor", "growth-interval", "hysteresis", "min-scale", "max-scale"},
       scaler.enabled && scaler.dynamic,
       "a dynamic loss scale (--amp fp16, or --loss-scale dynamic; this run's scale is " +
           std::string(!scaler.enabled ? "off" : "the constant --loss-scale") + ")");
  for (const char* flag : {"metrics", "save-weights", "checkpoint-dir", "init-weights", "resume-from", "data", "config"})
    if (given(flag) && vm[flag].as<std::string>().empty())
      throw UsageError(std::string("--") + flag + ": an empty path (an unset variable?): give one, or leave the flag out");
}

}  // namespace

CliResult parse_cli(int argc, const char* const* argv, int world_size) {
  TrainConfig c;
  std::string config_file, seed_text;
  bool no_overlap = false;

  po::options_description general("General");
  general.add_options()
    ("help,h", "print this help and exit")
    ("config", po::value(&config_file), "read options from FILE (key = value, same names); the command line wins")
    ("device", po::value(&c.device)->default_value(c.device, "auto"), "auto|cpu|cuda (auto: CUDA when present)")
    ("threads", with_default(&c.threads), "CPU threads per rank (0: cores / ranks on the node)")
    ("seed", po::value(&seed_text)->default_value("0"), "seed of the model init and the synthetic data (0 to 2^64 - 1)")
    ("metrics", po::value(&c.metrics), "write per-step metrics as JSON Lines to FILE (rank 0)")
    ("log-every", with_default(&c.log_every), "progress line every N steps on rank 0 (0: off)");
  po::options_description model("Model");
  std::string kinds;
  for (const models::ModelKind& k : models::model_kinds()) kinds += (kinds.empty() ? "" : ", ") + k.name + " (" + k.summary + ")";
  model.add_options()("model", with_default(&c.model), kinds.c_str());
  // Each kind's own flags (models/model_spec.h), as text that the kind parses and checks.
  std::vector<std::string> added;
  std::map<std::string, std::string> model_defaults;  // a model flag's default value, as written (for the ranks' comparison)
  for (const models::ModelKind& k : models::model_kinds())
    for (const models::ModelFlag& f : k.flags) {
      if (std::find(added.begin(), added.end(), f.name) != added.end()) continue;
      added.push_back(f.name);
      model_defaults[f.name] = f.default_value;
      std::string shown = f.default_value;
      for (size_t p = 0; (p = shown.find('\n', p)) != std::string::npos;) shown.replace(p, 1, "\\n");
      model.add_options()(f.name.c_str(), po::value<std::string>()->default_value(f.default_value, shown), f.help.c_str());
    }
  model.add_options()
    ("init-weights", po::value(&c.init_weights), "load parameters from a safetensors FILE (PyTorch names)")
    ("save-weights", po::value(&c.save_weights), "save parameters to a safetensors FILE at the end")
    ("save-weights-format", with_default(&c.save_weights_format),
     "native (the model's own names: PyTorch's, nanoGPT's for the GPT) or hf (gpt: Hugging Face's GPT-2)");
  std::string data_help = "synthetic, or a FILE:";
  for (const models::ModelKind& k : models::model_kinds()) data_help += " " + k.name + ": " + k.data_help + ";";
  data_help.pop_back();
  po::options_description training("Training");
  training.add_options()
    ("data", with_default(&c.data), data_help.c_str())
    ("steps", with_default(&c.steps), "optimizer steps")
    ("batch-size", with_default(&c.batch_size), "samples per rank per micro-batch")
    ("micro-batches", with_default(&c.micro_batches), "micro-batches accumulated per step")
    ("optimizer", po::value(&c.optimizer)->default_value(c.optimizer, "sgd"), "sgd|adamw")
    ("lr", with_default(&c.lr), "learning rate")
    ("momentum", with_default(&c.momentum), "SGD momentum")
    ("weight-decay", po::value<double>()->value_name("arg (=sgd: 0.0, adamw: 0.01)")->notifier([&c](double v) { c.weight_decay = v; }),
     "weight decay (AdamW: decoupled)")
    ("beta1", with_default(&c.beta1), "AdamW beta1")
    ("beta2", with_default(&c.beta2), "AdamW beta2")
    ("lr-schedule", po::value(&c.lr_schedule)->default_value(c.lr_schedule, "constant"),
     "constant|cosine (cosine: linear warmup over --warmup-steps, cosine decay to --min-lr at --decay-steps)")
    ("warmup-steps", with_default(&c.warmup_steps), "steps of linear warmup from lr/(N+1) to lr (cosine)")
    ("min-lr", with_default(&c.min_lr), "the lr the cosine decays to")
    ("decay-steps", with_default(&c.decay_steps), "step at which the cosine reaches --min-lr (0: --steps)")
    ("clip-grad-norm", with_default(&c.clip_grad_norm), "clip the total 2-norm (0: off)")
    ("log-grad-norm", po::bool_switch(&c.log_grad_norm),
     "report the gradients' 2-norm in the metrics without --clip-grad-norm too (one more read of every gradient a step)")
    ("clip-grad-value", with_default(&c.clip_grad_value), "clamp each gradient (0: off)")
    ("grad-penalty", with_default(&c.grad_penalty), "add LAMBDA * ||grad loss||_2 (0: off)");
  po::options_description evals("Evaluation (a model whose data has a validation split)");
  evals.add_options()
    ("eval-every", with_default(&c.eval_every), "validation loss every N steps and after the last (0: never)")
    ("eval-batches", with_default(&c.eval_batches), "validation batches (of --batch-size per rank) per evaluation");
  po::options_description ckpt("Checkpoints");
  ckpt.add_options()
    ("checkpoint-dir", po::value(&c.checkpoint_dir), "write checkpoints under DIR (step-NNNNNNNN/ each)")
    ("checkpoint-every", with_default(&c.checkpoint_every), "checkpoint every N steps (0: at the end only); also on SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, SIGPIPE")
    ("keep-checkpoints", with_default(&c.keep_checkpoints), "keep the last K complete checkpoints")
    ("resume", po::bool_switch(&c.resume), "continue from the latest checkpoint in --checkpoint-dir (none: start afresh)")
    ("resume-from", po::value(&c.resume_from), "continue from this checkpoint directory (an older one, say)");
  po::options_description ampo("AMP");
  ampo.add_options()
    ("amp", po::value(&c.amp)->default_value(c.amp, "off"), "autocast dtype: off|fp16|bf16")
    ("loss-scale", po::value(&c.loss_scale)->default_value(c.loss_scale, "auto"),
     "auto|dynamic|off|<number> (auto: dynamic with fp16, off with bf16 and off)")
    ("init-scale", with_default(&c.init_scale), "initial dynamic loss scale")
    ("growth-factor", with_default(&c.growth_factor), "scale growth factor")
    ("backoff-factor", with_default(&c.backoff_factor), "scale backoff factor")
    ("growth-interval", with_default(&c.growth_interval), "clean steps between growths")
    ("hysteresis", with_default(&c.hysteresis), "consecutive overflows before a backoff")
    ("min-scale", with_default(&c.min_scale), "lower bound of the scale")
    ("max-scale", po::value(&c.max_scale)->default_value(c.max_scale, "inf"), "upper bound of the scale")
    ("inject-nonfinite", po::value(&c.inject_nonfinite)->value_name("STEP[:RANK]"),
     "put an inf into a gradient of RANK (default 0) at STEP; repeatable")
    ("allow-tf32", po::bool_switch(&c.allow_tf32),
     "on a GPU, fp32 matrix products on the tensor cores with their inputs rounded to TF32 (10 mantissa bits), "
     "as torch.backends.cuda.matmul.allow_tf32 (default: off, as PyTorch's)")
    ("bf16-rounded-weight-grads", po::bool_switch(&c.bf16_rounded_weight_grads),
     "under bf16, round each linear layer's weight gradient to bf16 before it becomes the fp32 .grad, as PyTorch does "
     "(default: the GEMM's fp32 sums, one pass less)");
  po::options_description dist("Distributed");
  dist.add_options()
    ("comm-timeout", with_default(&c.comm_timeout), "seconds any collective may take")
    ("profile-step", with_default(&c.profile_step),
     "on a GPU, run step N between cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off` "
     "or `nsys --capture-range=cudaProfilerApi` (0: none)")
    ("check-every", with_default(&c.check_every), "replica check every N steps (0: end only)")
    ("bucket-mb", with_default(&c.bucket_mb), "gradient bucket size in MiB")
    ("no-overlap", po::bool_switch(&no_overlap), "all-reduce after backward instead of during it")
    ("zero", with_default(&c.zero),
     "0|1: 1 is ZeRO-1: each rank keeps its shard of the summed gradients, steps the optimizer on it (AdamW's "
     "moments divided over the ranks) and the parameters are all-gathered; bit for bit the run of --zero 0")
    ("cuda-graphs", po::value(&c.cuda_graphs)->default_value(c.cuda_graphs, "auto"),
     "auto|on|off: on a GPU, run 3 steps eagerly, then capture the step in a CUDA graph and replay it (the same "
     "numbers, one launch a step). auto: where the step can be captured (not the multi-task model, which says why); on: refuse to run where it cannot");

  po::options_description all("amp_train: data-parallel mixed-precision training\n\n"
                              "Usage: mpirun -np N amp_train [options]");  // Boost adds the ':'
  all.add(general).add(model).add(training).add(evals).add(ckpt).add(ampo).add(dist);

  CliResult res;
  try {
    po::variables_map vm;
    // No abbreviations (--wid would become --width, and break when a flag is added), and no words
    // that belong to no flag (--amp fp16 bf16, steps=5): both are usage errors.
    const auto style = po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
    const po::parsed_options parsed = po::command_line_parser(argc, argv).options(all).style(style).run();
    const std::vector<std::string> stray = po::collect_unrecognized(parsed.options, po::include_positional);
    if (!stray.empty()) throw UsageError("unexpected argument '" + stray.front() + "' (every value follows its flag)");
    po::store(parsed, vm);
    std::map<std::string, std::string> given;  // name -> its values as written, the command line's first
    auto record = [&given](const po::parsed_options& p) {
      std::map<std::string, std::string> these;
      for (const po::option& o : p.options) {
        std::string& v = these[o.string_key];
        for (const std::string& part : o.value) v += (v.empty() ? "" : ",") + part;
      }
      for (auto& [k, v] : these) given.emplace(k, v);  // a key already given keeps its value
    };
    record(parsed);
    std::set<std::string> on_command_line;
    for (const po::option& o : parsed.options) on_command_line.insert(o.string_key);
    if (vm.count("help")) {
      std::ostringstream os;
      os << all;
      res.message = os.str();
      return res;
    }
    if (vm.count("config")) {
      const std::string file = vm["config"].as<std::string>();
      c.config_file = file;
      if (file.empty()) throw UsageError("--config: an empty path (an unset variable?): give one, or leave the flag out");
      std::error_code ec;
      const bool there = std::filesystem::exists(file, ec);  // false with ec set: a directory on the way not searchable
      if (ec) throw UsageError("--config: '" + file + "': cannot be read: " + ec.message());
      if (!there) throw UsageError("--config: '" + file + "': " + missing_file(file));
      if (const std::string kind = irregular_file(file); !kind.empty())  // a directory, FIFO or /dev/zero: never read
        throw UsageError("--config: '" + file + "' is " + kind);
      std::ifstream raw(file, std::ios::binary);
      if (!raw) {  // why, from open(2) itself (a stream does not promise errno)
        const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
        const int err = fd < 0 ? errno : 0;
        if (fd >= 0) ::close(fd);
        throw UsageError("--config: cannot open '" + file + "'" + (err ? std::string(": ") + std::strerror(err) : ""));
      }
      std::string text((std::istreambuf_iterator<char>(raw)), std::istreambuf_iterator<char>());
      if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);  // a UTF-8 byte-order mark (Windows' editors)
      std::istringstream in(text);
      try {
        const po::parsed_options from_file = po::parse_config_file(in, all);
        // What only a command line can say: a file does not include another, nor asks for help.
        for (const po::option& o : from_file.options) {
          // An empty value would turn a switch on (resume = $RESUME, the variable unset, resumed).
          const po::option_description* d = all.find_nothrow(o.string_key, false);
          if (d && d->semantic()->max_tokens() == 0 && (o.value.empty() || o.value.front().empty()))
            throw UsageError("--config " + file + ": '" + o.string_key + " =' has no value (an unset variable?): write " +
                             o.string_key + " = true, or false");
          if (o.string_key == "config" || o.string_key == "help")
            throw UsageError("--config " + file + ": '" + o.string_key + "' cannot be set in a config file (" +
                             (o.string_key == "config" ? "config files do not include others" : "give --help on the command line") +
                             ")");
        }
        // Every value of the file is parsed, even one the command line overrides, and a key given
        // twice is an error: a malformed value must not wait for the day the override goes. (Ranges
        // are checked on the values the run takes: an overridden value may well not fit this run.)
        po::variables_map alone;
        po::store(from_file, alone);
        po::store(from_file, vm);  // values already set by the command line win
        record(from_file);
      } catch (const po::error& e) {
        throw UsageError("--config " + file + ": " + clipped(e.what()));
      }
    }
    po::notify(vm);
    // Numbers as their values (--lr 0.10 is --lr 0.1, --seed 07 is --seed 7), for the ranks' comparison.
    auto canonical = [](const std::string& v) {
      char* end = nullptr;
      const double x = v.empty() ? 0.0 : std::strtod(v.c_str(), &end);
      if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(x)) return v;
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", x);
      return std::string(buf);
    };
    c.seed = parse_seed(seed_text);
    c.overlap = !no_overlap;
    std::set<std::string> ignored;  // --config keys that only earned a notice
    take_model_flags(vm, c, true);
    drop_inert_model_flags(c, on_command_line, &res.notices, &ignored);
    check_ranges(c, world_size);
    take_model_flags(vm, c, false, on_command_line, &res.notices, &ignored);
    check_flags_apply(vm, c, on_command_line, &res.notices, &ignored);
    if (c.grad_penalty > 0.0 && c.micro_batches * world_size > 1)
      res.notices.push_back("notice: --grad-penalty is taken per micro-batch: the step adds the mean of LAMBDA * "
                            "||grad loss_m|| over its " + std::to_string(c.micro_batches * world_size) +
                            " micro-batches (all ranks'), as a PyTorch loop that accumulates does; unlike the loss, "
                            "it depends on how the batch is split");
    // A switch's value (--resume, resume = true, resume = 1) as true or false.
    auto is_switch = [&all](const std::string& k) {
      const po::option_description* d = all.find_nothrow(k, false);
      return d && d->semantic()->max_tokens() == 0;
    };
    auto as_bool = [](const std::string& v) {
      return v.empty() || v == "1" || v == "true" || v == "yes" || v == "on" ? std::string("true") : std::string("false");
    };
    // A flag given its default is the flag not given: one node's config spelling out a default is
    // not a difference from another's. The default: a model flag's own value, the optimizer's weight
    // decay, a switch's false, else --help's "(=X)".
    auto default_text = [&](const std::string& k) -> std::optional<std::string> {
      if (const auto it = model_defaults.find(k); it != model_defaults.end()) return it->second;
      if (k == "weight-decay") return std::string(c.optimizer == OptimizerKind::adamw ? "0.01" : "0");
      if (is_switch(k)) return std::string("false");
      const po::option_description* d = all.find_nothrow(k, false);
      const std::string n = d ? d->semantic()->name() : "";  // "arg (=X)" where the option has a default
      const size_t at = n.find(" (=");
      if (at == std::string::npos || n.back() != ')') return std::nullopt;
      return n.substr(at + 3, n.size() - at - 4);
    };
    for (const auto& [k, written] : given) {
      if (ignored.count(k)) continue;
      const std::string v = is_switch(k) ? as_bool(written) : written;
      const std::optional<std::string> fallback = default_text(k);
      if (!fallback || canonical(*fallback) != canonical(v)) c.given_flags.push_back(k + " " + canonical(v));
    }
  } catch (const po::error& e) {
    res.exit_code = 2;
    res.message = "amp_train: error: " + clipped(e.what()) + "\nTry 'amp_train --help' for the options.";
    return res;
  } catch (const UsageError& e) {
    res.exit_code = 2;
    res.message = std::string("amp_train: error: ") + e.what();
    return res;
  }
  res.config = c;
  return res;
}

}  // namespace amp::launch
