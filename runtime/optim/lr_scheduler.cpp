#include "runtime/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <stdexcept>
#include <string>

#include "runtime/core/number_format.h"

namespace amp::optim {

namespace {

// A state dict's entries, checked: each failure names the key and what it holds.
[[noreturn]] void refuse(const char* key, const std::string& want, const nlohmann::json& got) {
  std::string shown = got.dump();
  if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
  throw std::invalid_argument(std::string("scheduler state dict: '") + key + "' must be " + want + ", got " + shown);
}

const nlohmann::json& entry(const nlohmann::json& state, const char* key) {
  if (!state.contains(key)) throw std::invalid_argument(std::string("scheduler state dict: no '") + key + "'");
  return state.at(key);
}

int64_t integer(const nlohmann::json& state, const char* key, int64_t least) {
  const nlohmann::json& v = entry(state, key);
  if (!v.is_number_integer() || v.get<int64_t>() < least) refuse(key, "an integer >= " + std::to_string(least), v);
  return v.get<int64_t>();
}

double number(const nlohmann::json& state, const char* key, double least, double most) {
  const nlohmann::json& v = entry(state, key);
  if (!v.is_number() || !(v.get<double>() >= least && v.get<double>() <= most))
    refuse(key, "a number in [" + float_repr(least) + ", " + float_repr(most) + "]", v);
  return v.get<double>();
}

std::vector<double> rates(const nlohmann::json& state, const char* key, size_t groups) {
  const nlohmann::json& v = entry(state, key);
  // Any finite number: a schedule may go below 0 (a StepLR's negative gamma, a lambda's factor).
  const std::string want = std::to_string(groups) + " learning rate(s), one a parameter group, each finite";
  if (!v.is_array() || v.size() != groups) refuse(key, want, v);
  std::vector<double> out;
  for (const nlohmann::json& x : v) {
    if (!x.is_number() || !std::isfinite(x.get<double>())) refuse(key, want, v);
    out.push_back(x.get<double>());
  }
  return out;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

LRScheduler::LRScheduler(Optimizer& opt) : opt_(opt) {}

nlohmann::json LRScheduler::state_dict() const {
  nlohmann::json state = own_state();
  state["last_epoch"] = last_epoch_;
  state["_step_count"] = step_count_;
  state["base_lrs"] = base_lrs_;
  state["_last_lr"] = last_lr_;
  return state;
}

void LRScheduler::load_state_dict(const nlohmann::json& state) {
  load(state, false);  // everything checked (the schedulers a SequentialLR holds included) ...
  load(state, true);   // ... before anything is taken
}

void LRScheduler::load(const nlohmann::json& state, bool take) {
  if (!state.is_object()) throw std::invalid_argument("scheduler state dict: not a JSON object");
  const int64_t epoch = integer(state, "last_epoch", -1);
  const int64_t count = integer(state, "_step_count", 0);
  std::vector<double> base = rates(state, "base_lrs", groups());
  std::vector<double> last = rates(state, "_last_lr", groups());
  load_own(state, take);
  if (!take) return;
  last_epoch_ = epoch;
  step_count_ = count;
  base_lrs_ = std::move(base);
  last_lr_ = std::move(last);
}

void LRScheduler::take_base_lrs() {
  if (!base_lrs_.empty()) return;
  for (size_t g = 0; g < opt_.num_param_groups(); ++g) {
    if (!opt_.initial_lr(g)) opt_.set_initial_lr(g, opt_.lr(g));  // group.setdefault("initial_lr", lr)
    base_lrs_.push_back(*opt_.initial_lr(g));
  }
}

void LRScheduler::initial_step() {
  take_base_lrs();
  step_count_ = 0;
  step();
}

void LRScheduler::apply(const std::vector<double>& lrs) {
  for (size_t g = 0; g < lrs.size(); ++g) opt_.set_lr(lrs[g], g);
  last_lr_ = lrs;
}

void LRScheduler::step() {
  ++step_count_;
  ++last_epoch_;
  apply(get_lr());
}

void LRScheduler::step_to(int64_t epoch) {
  ++step_count_;
  last_epoch_ = epoch;
  apply(closed_form_lr());
}

LambdaLR::LambdaLR(Optimizer& opt, Lambda lr_lambda) : LambdaLR(opt, std::vector<Lambda>(opt.num_param_groups(), lr_lambda)) {}

LambdaLR::LambdaLR(Optimizer& opt, std::vector<Lambda> lr_lambdas) : LRScheduler(opt), lambdas_(std::move(lr_lambdas)) {
  if (lambdas_.size() != groups())
    throw std::invalid_argument("Expected " + std::to_string(groups()) + " lr_lambdas, but got " + std::to_string(lambdas_.size()));
  initial_step();
}

std::vector<double> LambdaLR::get_lr() const {
  std::vector<double> out;
  for (size_t g = 0; g < groups(); ++g) out.push_back(base_lrs_[g] * lambdas_[g](last_epoch_));
  return out;
}

nlohmann::json LambdaLR::own_state() const { return {{"lr_lambdas", std::vector<std::nullptr_t>(lambdas_.size(), nullptr)}}; }

void LambdaLR::load_own(const nlohmann::json& state, bool) {
  // The lambdas are this object's (PyTorch saves only callable objects' state, None for functions).
  if (state.contains("lr_lambdas")) {
    const nlohmann::json& v = state.at("lr_lambdas");
    if (!v.is_array() || v.size() != lambdas_.size())
      refuse("lr_lambdas", std::to_string(lambdas_.size()) + " entries, one a parameter group", v);
  }
}

StepLR::StepLR(Optimizer& opt, int64_t step_size, double gamma) : LRScheduler(opt), step_size_(step_size), gamma_(gamma) {
  if (step_size < 1) throw std::invalid_argument("StepLR: step_size must be >= 1, got " + std::to_string(step_size));
  initial_step();
}

std::vector<double> StepLR::get_lr() const {
  std::vector<double> out;
  const bool decay = last_epoch_ != 0 && last_epoch_ % step_size_ == 0;
  for (size_t g = 0; g < groups(); ++g) out.push_back(decay ? group_lr(g) * gamma_ : group_lr(g));
  return out;
}

std::vector<double> StepLR::closed_form_lr() const {
  std::vector<double> out;
  for (double base : base_lrs_) out.push_back(base * std::pow(gamma_, static_cast<double>(last_epoch_ / step_size_)));
  return out;
}

nlohmann::json StepLR::own_state() const { return {{"step_size", step_size_}, {"gamma", gamma_}}; }

void StepLR::load_own(const nlohmann::json& state, bool take) {
  const int64_t step_size = integer(state, "step_size", 1);
  const double gamma = number(state, "gamma", -kInf, kInf);
  if (take) step_size_ = step_size, gamma_ = gamma;
}

LinearLR::LinearLR(Optimizer& opt, double start_factor, double end_factor, int64_t total_iters)
    : LRScheduler(opt), start_(start_factor), end_(end_factor), total_iters_(total_iters) {
  if (!(start_factor > 0.0 && start_factor <= 1.0))
    throw std::invalid_argument("Starting multiplicative factor expected to be greater than 0 and less or equal to 1.");
  if (!(end_factor >= 0.0 && end_factor <= 1.0))
    throw std::invalid_argument("Ending multiplicative factor expected to be between 0 and 1.");
  if (total_iters < 1) throw std::invalid_argument("LinearLR: total_iters must be >= 1, got " + std::to_string(total_iters));
  initial_step();
}

std::vector<double> LinearLR::get_lr() const {
  std::vector<double> out;
  for (size_t g = 0; g < groups(); ++g) {
    if (last_epoch_ == 0) {
      out.push_back(group_lr(g) * start_);
    } else if (last_epoch_ > total_iters_) {
      out.push_back(group_lr(g));
    } else {
      const double t = static_cast<double>(total_iters_), e = static_cast<double>(last_epoch_);
      out.push_back(group_lr(g) * (1.0 + (end_ - start_) / (t * start_ + (e - 1.0) * (end_ - start_))));
    }
  }
  return out;
}

std::vector<double> LinearLR::closed_form_lr() const {
  std::vector<double> out;
  const double progress = static_cast<double>(std::min(total_iters_, last_epoch_)) / static_cast<double>(total_iters_);
  for (double base : base_lrs_) out.push_back(base * (start_ + (end_ - start_) * progress));
  return out;
}

nlohmann::json LinearLR::own_state() const {
  return {{"start_factor", start_}, {"end_factor", end_}, {"total_iters", total_iters_}};
}

void LinearLR::load_own(const nlohmann::json& state, bool take) {
  const double start = number(state, "start_factor", 0.0, 1.0);
  if (start == 0.0) refuse("start_factor", "greater than 0 and at most 1", state.at("start_factor"));
  const double end = number(state, "end_factor", 0.0, 1.0);
  const int64_t total = integer(state, "total_iters", 1);
  if (take) start_ = start, end_ = end, total_iters_ = total;
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, int64_t t_max, double eta_min)
    : LRScheduler(opt), t_max_(t_max), eta_min_(eta_min) {
  if (t_max < 1) throw std::invalid_argument("CosineAnnealingLR: T_max must be >= 1, got " + std::to_string(t_max));
  initial_step();
}

std::vector<double> CosineAnnealingLR::get_lr() const {
  const double pi = std::numbers::pi, t = static_cast<double>(t_max_), e = static_cast<double>(last_epoch_);
  const int64_t period = 2 * t_max_;
  const int64_t phase = ((last_epoch_ - 1 - t_max_) % period + period) % period;  // Python's %
  std::vector<double> out;
  for (size_t g = 0; g < groups(); ++g) {
    const double lr = group_lr(g), base = base_lrs_[g];
    if (last_epoch_ == 0) {
      out.push_back(lr);
    } else if (step_count_ == 1 && last_epoch_ > 0) {
      out.push_back(eta_min_ + (base - eta_min_) * (1.0 + std::cos(e * pi / t)) / 2.0);
    } else if (phase == 0) {
      out.push_back(lr + (base - eta_min_) * (1.0 - std::cos(pi / t)) / 2.0);
    } else {
      out.push_back((1.0 + std::cos(pi * e / t)) / (1.0 + std::cos(pi * (e - 1.0) / t)) * (lr - eta_min_) + eta_min_);
    }
  }
  return out;
}

std::vector<double> CosineAnnealingLR::closed_form_lr() const {
  const double pi = std::numbers::pi, t = static_cast<double>(t_max_), e = static_cast<double>(last_epoch_);
  std::vector<double> out;
  for (double base : base_lrs_) out.push_back(eta_min_ + (base - eta_min_) * (1.0 + std::cos(pi * e / t)) / 2.0);
  return out;
}

nlohmann::json CosineAnnealingLR::own_state() const { return {{"T_max", t_max_}, {"eta_min", eta_min_}}; }

void CosineAnnealingLR::load_own(const nlohmann::json& state, bool take) {
  const int64_t t_max = integer(state, "T_max", 1);
  const double eta_min = number(state, "eta_min", -kInf, kInf);
  if (take) t_max_ = t_max, eta_min_ = eta_min;
}

SequentialLR::SequentialLR(Optimizer& opt, std::vector<std::unique_ptr<LRScheduler>> schedulers,
                           std::vector<int64_t> milestones)
    : LRScheduler(opt), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
  if (schedulers_.empty()) throw std::invalid_argument("SequentialLR expects at least one scheduler");
  for (const auto& s : schedulers_)
    if (s == nullptr || &s->opt_ != &opt)
      throw std::invalid_argument("SequentialLR expects all schedulers to belong to the same optimizer");
  if (milestones_.size() != schedulers_.size() - 1)
    throw std::invalid_argument("Sequential Schedulers expects number of schedulers provided to be one more than the "
                                "number of milestone points, but got number of schedulers " +
                                std::to_string(schedulers_.size()) + " and the number of milestones to be equal to " +
                                std::to_string(milestones_.size()));
  for (size_t i = 1; i < milestones_.size(); ++i)
    if (milestones_[i] <= milestones_[i - 1]) throw std::invalid_argument("SequentialLR: milestones must increase");
  last_epoch_ = 0;
  take_base_lrs();
  // Back to the initial lrs; undo the step each scheduler took when it was built; start the first.
  for (size_t g = 0; g < groups(); ++g) opt_.set_lr(base_lrs_[g], g);
  for (auto& s : schedulers_) s->last_epoch_ -= 1;
  schedulers_[0]->initial_step();
  set_last_lr(schedulers_[0]->get_last_lr());
}

void SequentialLR::step() {
  ++last_epoch_;
  const size_t idx = static_cast<size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), last_epoch_) - milestones_.begin());
  LRScheduler& s = *schedulers_[idx];
  if (idx > 0 && milestones_[idx - 1] == last_epoch_) {
    s.step_to(0);
  } else {
    s.step();
  }
  set_last_lr(s.get_last_lr());
}


nlohmann::json SequentialLR::own_state() const {
  nlohmann::json inner = nlohmann::json::array();
  for (const auto& s : schedulers_) inner.push_back(s->state_dict());
  return {{"_milestones", milestones_}, {"_schedulers", inner}};
}

void SequentialLR::load_own(const nlohmann::json& state, bool take) {
  const nlohmann::json& m = entry(state, "_milestones");
  const std::string want = std::to_string(milestones_.size()) + " increasing integers";
  if (!m.is_array() || m.size() != milestones_.size()) refuse("_milestones", want, m);
  std::vector<int64_t> milestones;
  for (const nlohmann::json& x : m) {
    if (!x.is_number_integer() || (!milestones.empty() && x.get<int64_t>() <= milestones.back())) refuse("_milestones", want, m);
    milestones.push_back(x.get<int64_t>());
  }
  const nlohmann::json& inner = entry(state, "_schedulers");
  if (!inner.is_array() || inner.size() != schedulers_.size())
    refuse("_schedulers", std::to_string(schedulers_.size()) + " schedulers' state dicts", inner);
  for (size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load(inner[i], take);
  if (take) milestones_ = std::move(milestones);
}

}  // namespace amp::optim
