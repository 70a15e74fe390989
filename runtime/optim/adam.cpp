#include "runtime/optim/adam.h"

#include <stdexcept>

namespace amp::optim {

Adam::Adam(std::vector<Tensor> params, AdamOptions o, bool decoupled)
    : Optimizer(std::move(params)), options_(o), decoupled_(decoupled) {
  if (o.lr < 0.0) throw std::invalid_argument("Invalid learning rate: " + std::to_string(o.lr));
  if (o.eps < 0.0) throw std::invalid_argument("Invalid epsilon value: " + std::to_string(o.eps));
  if (o.beta1 < 0.0 || o.beta1 >= 1.0) throw std::invalid_argument("Invalid beta parameter at index 0: " + std::to_string(o.beta1));
  if (o.beta2 < 0.0 || o.beta2 >= 1.0) throw std::invalid_argument("Invalid beta parameter at index 1: " + std::to_string(o.beta2));
  if (o.weight_decay < 0.0) throw std::invalid_argument("Invalid weight_decay value: " + std::to_string(o.weight_decay));
  lr_ = o.lr;
  add_state("exp_avg");
  add_state("exp_avg_sq");
  if (o.amsgrad) add_state("max_exp_avg_sq");
}

void Adam::step_group(const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                      const Tensor& grad_scale) {
  std::vector<Tensor> grads;
  for (size_t i : index) grads.push_back(params_[i].grad());
  const AdamHyper h{lr_, options_.beta1, options_.beta2, options_.eps, options_.weight_decay, decoupled_,
                    options_.amsgrad};
  backend_for(params_[0].device())
      .adam_step(select(params_, index), grads, select(state_.at("exp_avg"), index), select(state_.at("exp_avg_sq"), index),
                 options_.amsgrad ? select(state_.at("max_exp_avg_sq"), index) : std::vector<Tensor>(), steps, h,
                 found_inf, grad_scale);
}

}  // namespace amp::optim
