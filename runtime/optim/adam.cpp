#include "runtime/optim/adam.h"

#include <stdexcept>

#include "runtime/core/number_format.h"

namespace amp::optim {

namespace {
void validate(const AdamOptions& o) {
  if (!(o.lr >= 0.0)) throw std::invalid_argument("Invalid learning rate: " + float_repr(o.lr));
  if (!(o.eps >= 0.0)) throw std::invalid_argument("Invalid epsilon value: " + float_repr(o.eps));
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0)) throw std::invalid_argument("Invalid beta parameter at index 0: " + float_repr(o.beta1));
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0)) throw std::invalid_argument("Invalid beta parameter at index 1: " + float_repr(o.beta2));
  if (!(o.weight_decay >= 0.0)) throw std::invalid_argument("Invalid weight_decay value: " + float_repr(o.weight_decay));
}
}  // namespace

Adam::Adam(const std::vector<ParamGroup<AdamOptions>>& groups, bool decoupled)
    : Optimizer(params_of(groups), lrs_of(groups)), decoupled_(decoupled) {
  std::vector<bool> amsgrad;
  for (const auto& g : groups) {
    validate(g.options);
    options_.push_back(g.options);
    amsgrad.push_back(g.options.amsgrad);
  }
  add_state("exp_avg");
  add_state("exp_avg_sq");
  add_state("max_exp_avg_sq", amsgrad);
}

void Adam::step_group(size_t group, const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                      const Tensor& grad_scale, const NormClip& clip) {
  const AdamOptions& o = options_[group];
  std::vector<Tensor> grads;
  for (size_t i : index) grads.push_back(params_[i].grad());
  const AdamHyper h{lr(group), o.beta1, o.beta2, o.eps, o.weight_decay, decoupled_, o.amsgrad, o.maximize,
                    keep_unscaled_grads()};
  backend_for(params_[0].device())
      .adam_step(select(params_, index), grads, select(state_.at("exp_avg"), index), select(state_.at("exp_avg_sq"), index),
                 o.amsgrad ? select(state_.at("max_exp_avg_sq"), index) : std::vector<Tensor>(), steps, h, found_inf,
                 grad_scale, copies_of(index), lr_tensor(group), clip);
}

nlohmann::json Adam::group_hyper(size_t group) const {
  const AdamOptions& o = options_[group];
  return {{"lr", lr(group)},          {"betas", {o.beta1, o.beta2}}, {"eps", o.eps},
          {"weight_decay", o.weight_decay}, {"amsgrad", o.amsgrad},  {"maximize", o.maximize}};
}

void Adam::load_group_hyper(size_t group, const nlohmann::json& h) {
  AdamOptions o = options_[group];
  require_group_keys("Adam", group, h, {"lr", "betas", "eps", "weight_decay", "amsgrad"});
  try {
    o.lr = h.at("lr").get<double>();
    const auto& betas = h.at("betas");
    if (!betas.is_array() || betas.size() != 2) throw std::invalid_argument("'betas' must hold two numbers");
    o.beta1 = betas[0].get<double>();
    o.beta2 = betas[1].get<double>();
    o.eps = h.at("eps").get<double>();
    o.weight_decay = h.at("weight_decay").get<double>();
    o.amsgrad = h.at("amsgrad").get<bool>();
    o.maximize = h.value("maximize", false);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument("Adam state_dict, parameter group " + std::to_string(group) + ": " + e.what());
  }
  validate(o);
  if (o.amsgrad != options_[group].amsgrad)
    throw std::invalid_argument("Adam state_dict, parameter group " + std::to_string(group) +
                                ": amsgrad differs from this optimizer's");
  options_[group] = o;
  set_lr(o.lr, group);
}

}  // namespace amp::optim
