#include "runtime/optim/sgd.h"

#include <stdexcept>

namespace amp::optim {

SGD::SGD(std::vector<Tensor> params, SgdOptions o) : Optimizer(std::move(params)), options_(o) {
  if (o.lr < 0.0) throw std::invalid_argument("Invalid learning rate: " + std::to_string(o.lr));
  if (o.momentum < 0.0) throw std::invalid_argument("Invalid momentum value: " + std::to_string(o.momentum));
  if (o.weight_decay < 0.0) throw std::invalid_argument("Invalid weight_decay value: " + std::to_string(o.weight_decay));
  if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0))
    throw std::invalid_argument("Nesterov momentum requires a momentum and zero dampening");
  lr_ = o.lr;
  if (o.momentum != 0.0) add_state("momentum_buffer");
}

void SGD::step_group(const std::vector<size_t>& index, Tensor& steps, const Tensor& found_inf,
                     const Tensor& grad_scale) {
  std::vector<Tensor> grads;
  for (size_t i : index) grads.push_back(params_[i].grad());
  const bool momentum = options_.momentum != 0.0;
  const std::vector<Tensor> bufs = momentum ? select(state_.at("momentum_buffer"), index) : std::vector<Tensor>();
  const SgdHyper h{lr_, options_.momentum, options_.dampening, options_.weight_decay, options_.nesterov};
  backend_for(params_[0].device()).sgd_step(select(params_, index), grads, bufs, steps, h, found_inf, grad_scale);
}

}  // namespace amp::optim
