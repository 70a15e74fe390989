#include "runtime/optim/sgd.h"

#include <stdexcept>

#include "runtime/core/number_format.h"

namespace amp::optim {

namespace {
void validate(const SgdOptions& o) {
  if (!(o.lr >= 0.0)) throw std::invalid_argument("Invalid learning rate: " + float_repr(o.lr));
  if (!(o.momentum >= 0.0)) throw std::invalid_argument("Invalid momentum value: " + float_repr(o.momentum));
  if (!(o.weight_decay >= 0.0)) throw std::invalid_argument("Invalid weight_decay value: " + float_repr(o.weight_decay));
  if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0))
    throw std::invalid_argument("Nesterov momentum requires a momentum and zero dampening");
}
}  // namespace

SGD::SGD(const std::vector<ParamGroup<SgdOptions>>& groups) : Optimizer(params_of(groups), lrs_of(groups)) {
  std::vector<bool> with_momentum;
  for (const auto& g : groups) {
    validate(g.options);
    options_.push_back(g.options);
    with_momentum.push_back(g.options.momentum != 0.0);
  }
  add_state("momentum_buffer", with_momentum);
}

void SGD::step_group(size_t group, const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                     const Tensor& grad_scale, const NormClip& clip) {
  const SgdOptions& o = options_[group];
  std::vector<Tensor> grads;
  for (size_t i : index) grads.push_back(params_[i].grad());
  const bool momentum = o.momentum != 0.0;
  const std::vector<Tensor> bufs = momentum ? select(state_.at("momentum_buffer"), index) : std::vector<Tensor>();
  const SgdHyper h{lr(group), o.momentum, o.dampening, o.weight_decay, o.nesterov, o.maximize, keep_unscaled_grads()};
  backend_for(params_[0].device()).sgd_step(select(params_, index), grads, bufs, steps, h, found_inf, grad_scale,
                                                  copies_of(index), lr_tensor(group), clip);
}

nlohmann::json SGD::group_hyper(size_t group) const {
  const SgdOptions& o = options_[group];
  return {{"lr", lr(group)},
          {"momentum", o.momentum},
          {"dampening", o.dampening},
          {"weight_decay", o.weight_decay},
          {"nesterov", o.nesterov},
          {"maximize", o.maximize}};
}

void SGD::load_group_hyper(size_t group, const nlohmann::json& h) {
  SgdOptions o = options_[group];
  require_group_keys("SGD", group, h, {"lr", "momentum", "dampening", "weight_decay", "nesterov"});
  try {
    o.lr = h.at("lr").get<double>();
    o.momentum = h.at("momentum").get<double>();
    o.dampening = h.at("dampening").get<double>();
    o.weight_decay = h.at("weight_decay").get<double>();
    o.nesterov = h.at("nesterov").get<bool>();
    o.maximize = h.value("maximize", false);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument("SGD state_dict, parameter group " + std::to_string(group) + ": " + e.what());
  }
  validate(o);
  if ((o.momentum != 0.0) != (options_[group].momentum != 0.0))
    throw std::invalid_argument("SGD state_dict, parameter group " + std::to_string(group) +
                                ": momentum on/off differs from this optimizer's");
  options_[group] = o;
  set_lr(o.lr, group);
}

}  // namespace amp::optim
