#include "amp/grad_scaler.h"

#include <cmath>
#include <limits>
#include <stdexcept>

#include "comm/coalesced.h"
#include "runtime/core/number_format.h"
#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {
// A scale that float32 holds as a positive, finite number whose float32 inverse (what the kernels
// unscale by) is finite too: not past float32's range (inf), nor below 1 / FLT_MAX (about 2.9e-39):
// an inverse of inf unscales every gradient to inf or NaN, every step is skipped, and the backoff
// takes the scale down to 0, where it stays.
bool usable_scale(double v) {
  return v > 0.0 && v <= std::numeric_limits<float>::max() && std::isfinite(static_cast<float>(1.0 / v));
}
}  // namespace

GradScaler::GradScaler(GradScalerOptions o, comm::Communicator* comm) : options_(o), comm_(comm) {
  if (o.enabled) validate();  // a disabled scaler takes any factors, as PyTorch's does
}

void GradScaler::validate() const {
  const GradScalerOptions& o = options_;
  if (!(o.growth_factor > 1.0)) throw std::invalid_argument("The growth factor must be > 1.0. Got " + float_repr(o.growth_factor));
  if (!(o.backoff_factor > 0.0 && o.backoff_factor < 1.0))
    throw std::invalid_argument("The backoff factor must be < 1.0 and > 0. Got " + float_repr(o.backoff_factor));
  if (o.growth_interval < 1) throw std::invalid_argument("growth_interval must be a positive integer. Got " + std::to_string(o.growth_interval));
  if (!usable_scale(o.init_scale))
    throw std::invalid_argument("init_scale must be positive and finite, with a finite inverse, in float32. Got " +
                                float_repr(o.init_scale));
  if (o.hysteresis < 1) throw std::invalid_argument("hysteresis must be >= 1. Got " + std::to_string(o.hysteresis));
  if (o.min_scale < 0.0f || !(o.max_scale >= o.min_scale))
    throw std::invalid_argument("min_scale must be >= 0 and <= max_scale");
  if (o.dynamic && !(o.init_scale >= o.min_scale && o.init_scale <= o.max_scale))  // (it was taken, outside them)
    throw std::invalid_argument("init_scale must lie in [min_scale, max_scale]. Got " + float_repr(o.init_scale) + " in [" +
                                float_repr(o.min_scale) + ", " + float_repr(o.max_scale) + "]");
}

void GradScaler::require_state(const char* funcname) const {
  if (!scale_.defined())
    throw std::runtime_error(std::string("Attempted ") + funcname +
                             " but _scale is None.  This may indicate your script did not use "
                             "scaler.scale(loss or outputs) earlier in the iteration.");
}

void GradScaler::lazy_init(Device device) {
  scale_ = full({}, options_.init_scale, DType::f32, device);
  tracker_ = from_vector({static_cast<double>(init_growth_tracker_), static_cast<double>(hysteresis_left())}, {2},
                         DType::i64, device);
}

Tensor GradScaler::scale(const Tensor& outputs) {
  if (!options_.enabled) return outputs;
  if (!scale_.defined()) lazy_init(outputs.device());
  return mul(outputs, scale_.to(outputs.device()));
}

std::vector<Tensor> GradScaler::checked_grads(optim::Optimizer& opt, PerOptimizer* st) const {
  std::vector<Tensor> grads = opt.grads();
  for (const Tensor& g : grads)
    if (g.dtype() == DType::f16) throw std::invalid_argument("Attempting to unscale FP16 gradients.");
  st->found_inf = grads.empty() ? Tensor() : zeros({1}, DType::f32, grads[0].device());
  st->per_tensor = Tensor();
  if (per_tensor_flags_ && !grads.empty())
    st->per_tensor = zeros({static_cast<int64_t>(grads.size())}, DType::f32, grads[0].device());
  st->agreed = false;
  return grads;
}

namespace {
// grads times 1/scale, found_inf set when any is not finite: one fused pass per dtype (a backend's
// call takes one dtype, as PyTorch's _amp_foreach_non_finite_check_and_unscale_ does).
void unscale_by_dtype(const std::vector<Tensor>& grads, const Tensor& scale, Tensor& found_inf,
                      Tensor* per_tensor = nullptr) {
  std::map<DType, std::vector<Tensor>> by_dtype;
  for (const Tensor& g : grads) {
    if (g.device() != found_inf.device())
      throw std::invalid_argument("unscale_grads_: a gradient on " + g.device().str() + ", found_inf on " +
                                  found_inf.device().str());
    by_dtype[g.dtype()].push_back(g);
  }
  if (grads.empty()) return;
  const Tensor s = scale.to(found_inf.device());
  // Per-tensor flags where one call takes every gradient (one dtype); otherwise none.
  if (per_tensor != nullptr && by_dtype.size() > 1) *per_tensor = Tensor();
  const Tensor flags = per_tensor != nullptr ? *per_tensor : Tensor();
  for (auto& [dt, group] : by_dtype) backend_for(found_inf.device()).unscale_and_check(group, s, found_inf, flags);
}
}  // namespace

void GradScaler::unscale_grads_(optim::Optimizer& opt, const Tensor& scale, Tensor& found_inf, bool allow_fp16) {
  const std::vector<Tensor> grads = opt.grads();
  if (!allow_fp16)
    for (const Tensor& g : grads)
      if (g.dtype() == DType::f16) throw std::invalid_argument("Attempting to unscale FP16 gradients.");
  unscale_by_dtype(grads, scale, found_inf);
}

void GradScaler::unscale_(optim::Optimizer& opt) {
  if (!options_.enabled) return;
  require_state("unscale_");
  PerOptimizer& st = per_optimizer_[&opt];
  if (st.stage == Stage::unscaled)
    throw std::runtime_error("unscale_() has already been called on this optimizer since the last update().");
  if (st.stage == Stage::stepped) throw std::runtime_error("unscale_() is being called after step().");
  const std::vector<Tensor> grads = checked_grads(opt, &st);  // refuses float16, as PyTorch's unscale_
  if (!grads.empty()) unscale_by_dtype(grads, scale_, st.found_inf, &st.per_tensor);
  st.stage = Stage::unscaled;
}

Tensor GradScaler::check_inf_(optim::Optimizer& opt) {
  return check_inf_(opt, nullptr);
}

Tensor GradScaler::check_inf_(optim::Optimizer& opt,
                              const std::function<void(const Tensor& scale, const Tensor& found_inf)>& fused) {
  if (!options_.enabled) return Tensor();
  require_state("check_inf_");
  PerOptimizer& st = per_optimizer_[&opt];
  if (st.stage != Stage::ready)
    throw std::runtime_error("check_inf_() must come before unscale_() and step() in an iteration.");
  // The unscaled values are checked (what the step will apply), without writing them.
  const std::vector<Tensor> grads = checked_grads(opt, &st);
  if (!grads.empty()) {
    Backend& be = backend_for(grads[0].device());
    const Tensor scale = scale_.to(grads[0].device());
    if (!fused) {
      be.check_finite(grads, scale, st.found_inf, st.per_tensor);
    } else {
      fused(scale, st.found_inf);
      if (st.per_tensor.defined()) be.nonfinite_flags_if_found(grads, scale, st.found_inf, st.per_tensor);
    }
  }
  st.stage = Stage::checked;
  return st.found_inf;
}

Tensor GradScaler::nonfinite_per_tensor(const optim::Optimizer& opt) const {
  auto it = per_optimizer_.find(&opt);
  return it == per_optimizer_.end() ? Tensor() : it->second.per_tensor;
}

Tensor GradScaler::found_inf_tensor(const optim::Optimizer& opt) const {
  auto it = per_optimizer_.find(&opt);
  return it == per_optimizer_.end() ? Tensor() : it->second.found_inf;
}

Tensor GradScaler::pending_scale(const optim::Optimizer& opt) const {
  auto it = per_optimizer_.find(&opt);
  if (it == per_optimizer_.end() || it->second.stage != Stage::checked || !it->second.found_inf.defined()) return Tensor();
  return scale_.to(it->second.found_inf.device());
}

void GradScaler::agree_on_found_inf() {
  std::vector<Tensor> slots;  // the found_infs still pending
  for (auto& [opt, st] : per_optimizer_)
    if (st.found_inf.defined() && !st.agreed) slots.push_back(st.found_inf);
  // Every rank must take the same decision: a SUM over ranks (non-zero if any rank overflowed), all
  // optimizers in one collective. Without a communicator the caller agreed (or there is one rank).
  if (comm_ != nullptr) comm::all_reduce_scalars(*comm_, slots, comm::ReduceOp::sum);
  for (auto& [opt, st] : per_optimizer_)
    if (st.found_inf.defined()) st.agreed = true;
}

void GradScaler::step(optim::Optimizer& opt, const NormClip& clip) {
  if (!options_.enabled) {
    opt.step(Tensor(), Tensor(), clip);
    return;
  }
  require_state("step");
  PerOptimizer& st = per_optimizer_[&opt];
  if (st.stage == Stage::stepped) throw std::runtime_error("step() has already been called since the last update().");
  // Not unscaled yet: checked read-only (here, or by check_inf_), and the fused step then unscales
  // them (and writes them back) in its own pass: one read pass instead of a separate read-write
  // unscale pass.
  if (st.stage == Stage::ready) check_inf_(opt);
  Tensor grad_scale;
  if (st.stage == Stage::checked && st.found_inf.defined()) grad_scale = scale_.to(st.found_inf.device());
  if (!st.found_inf.defined()) throw std::runtime_error("No inf checks were recorded for this optimizer.");
  agree_on_found_inf();
  opt.step(st.found_inf, grad_scale, clip);
  st.stage = Stage::stepped;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  require_state("update");
  agree_on_found_inf();
  Tensor total;
  for (auto& [opt, st] : per_optimizer_) {
    if (!st.found_inf.defined()) continue;
    if (!total.defined()) {
      total = st.found_inf.to(scale_.device()).clone();
    } else {
      add_(total, st.found_inf.to(scale_.device()));
    }
  }
  if (!total.defined()) throw std::runtime_error("No inf checks were recorded prior to update.");
  last_found_inf_ = total;
  if (options_.error_at_min_scale && options_.min_scale > 0.0f) {
    // Opt-in check: reads device values on the host. As DeepSpeed's, only an overflow that would
    // back off below the minimum is an error: one that hysteresis tolerates keeps the scale.
    const double s = get_scale();
    const bool backs_off = !options_.dynamic || tracker_.to_vector()[1] <= 1.0;
    if (total.item() != 0.0 && s <= options_.min_scale && backs_off) {
      per_optimizer_.clear();  // the iteration is over: a caller that goes on starts a new one
      throw std::runtime_error("Current loss scale already at minimum (" + float_repr(s) +
                               ") and gradients still overflow: training cannot continue");
    }
  }
  if (!options_.dynamic) {
    per_optimizer_.clear();
    return;
  }
  const ScaleUpdateHyper h{options_.growth_factor, options_.backoff_factor, options_.growth_interval,
                           options_.hysteresis, options_.min_scale, options_.max_scale};
  backend_for(scale_.device()).update_scale(scale_, tracker_, total, h);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  require_state("update");
  // PyTorch fills any float; a scale that is not positive and finite in float32 would silently zero
  // or poison every gradient, so it is refused here.
  if (!usable_scale(new_scale))
    throw std::invalid_argument("new_scale must be positive and finite, with a finite inverse, in float32, got " +
                                float_repr(new_scale));
  fill_(scale_, new_scale);
  per_optimizer_.clear();
}

void GradScaler::update(const Tensor& new_scale) {
  if (!options_.enabled) return;
  require_state("update");
  const char* reason = "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False.";
  if (!new_scale.defined() || new_scale.device() != scale_.device() || new_scale.numel() != 1 ||
      new_scale.requires_grad() || !is_floating(new_scale.dtype()))
    throw std::invalid_argument(reason);
  copy_(scale_, new_scale.reshape({}).to(DType::f32));
  per_optimizer_.clear();
}

Tensor GradScaler::scale_snapshot(Device device) const {
  if (!options_.enabled) return scalar_tensor(1.0, DType::f32, device);
  return scale_.defined() ? scale_.clone() : full({}, options_.init_scale, DType::f32, device);
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item() : options_.init_scale;
}

int GradScaler::get_growth_tracker() const {
  return static_cast<int>(tracker_.defined() ? tracker_.to_vector()[0] : static_cast<double>(init_growth_tracker_));
}

bool GradScaler::found_inf(const optim::Optimizer& opt) const {
  auto it = per_optimizer_.find(&opt);
  return it != per_optimizer_.end() && it->second.found_inf.defined() && it->second.found_inf.item() != 0.0;
}

void GradScaler::set_growth_factor(double v) {
  const double old = options_.growth_factor;
  options_.growth_factor = v;
  try { validate(); } catch (...) { options_.growth_factor = old; throw; }
}
void GradScaler::set_backoff_factor(double v) {
  const double old = options_.backoff_factor;
  options_.backoff_factor = v;
  try { validate(); } catch (...) { options_.backoff_factor = old; throw; }
}
void GradScaler::set_growth_interval(int v) {
  const int old = options_.growth_interval;
  options_.growth_interval = v;
  try { validate(); } catch (...) { options_.growth_interval = old; throw; }
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  std::map<std::string, double> sd = {{"scale", get_scale()},
                                      {"growth_factor", options_.growth_factor},
                                      {"backoff_factor", options_.backoff_factor},
                                      {"growth_interval", options_.growth_interval},
                                      {"_growth_tracker", get_growth_tracker()}};
  // Our extension (PyTorch has no hysteresis): the overflows still tolerated, so that a resumed run
  // backs off where the uninterrupted one would.
  if (options_.hysteresis > 1)
    sd["_hysteresis_left"] = tracker_.defined() ? tracker_.to_vector()[1] : static_cast<double>(hysteresis_left());
  return sd;
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled) return;
  if (state.empty())
    throw std::runtime_error("The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.");
  for (const char* k : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    if (!state.count(k)) throw std::invalid_argument(std::string("GradScaler state_dict is missing '") + k + "'");
  // PyTorch takes any number here (a tracker at or past the interval never grows the scale again, and
  // a fraction is truncated as its integer tensor's fill_ truncates); only what an integer cannot
  // hold is refused, its cast being undefined. A checkpoint's state is checked strictly by its reader.
  auto count_in = [&state](const char* key, double lo, double hi) {
    const double v = state.at(key);
    if (!(v >= lo && v <= hi))
      throw std::invalid_argument(std::string("GradScaler state_dict: '") + key + "' must be in [" + float_repr(lo) +
                                  ", " + float_repr(hi) + "], got " + float_repr(v));
  };
  constexpr double kIntMax = 2147483647.0;
  count_in("growth_interval", 1.0, kIntMax);
  count_in("_growth_tracker", -kIntMax, kIntMax);
  if (state.count("_hysteresis_left")) count_in("_hysteresis_left", 0.0, kIntMax);
  if (!usable_scale(state.at("scale")))
    throw std::invalid_argument("GradScaler state_dict: 'scale' " + float_repr(state.at("scale")) +
                                " is not a usable loss scale (positive and finite, with a finite inverse, in float32)");
  GradScalerOptions o = options_;
  o.init_scale = state.at("scale");
  o.growth_factor = state.at("growth_factor");
  o.backoff_factor = state.at("backoff_factor");
  o.growth_interval = static_cast<int>(state.at("growth_interval"));
  const GradScalerOptions old = options_;
  options_ = o;
  try { validate(); } catch (...) { options_ = old; throw; }
  init_growth_tracker_ = static_cast<int64_t>(state.at("_growth_tracker"));
  const auto left = state.find("_hysteresis_left");
  init_hysteresis_left_ = left == state.end() ? -1 : static_cast<int64_t>(left->second);
  if (scale_.defined()) {
    fill_(scale_, o.init_scale);
    copy_(tracker_, from_vector({static_cast<double>(init_growth_tracker_), static_cast<double>(hysteresis_left())}, {2},
                                DType::i64, tracker_.device()));
  }
}

}  // namespace amp
