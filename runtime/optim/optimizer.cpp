#include "runtime/optim/optimizer.h"

#include <stdexcept>

#include "runtime/ops.h"

namespace amp::optim {

Optimizer::Optimizer(std::vector<Tensor> params) : params_(std::move(params)) {
  if (params_.empty()) throw std::invalid_argument("optimizer got an empty parameter list");
  for (const Tensor& p : params_)
    if (!p.is_leaf() || !p.requires_grad())
      throw std::invalid_argument("optimizer can only optimize leaf tensors that require grad");
  step_count_ = zeros({1}, DType::f32, params_[0].device());
}

void Optimizer::zero_grad(bool set_to_none) {
  for (Tensor& p : params_) {
    if (set_to_none) {
      p.set_grad(Tensor());
    } else if (p.grad().defined()) {
      Tensor g = p.grad();
      fill_(g, 0.0);
    }
  }
}

std::vector<Tensor> Optimizer::grads() const {
  std::vector<Tensor> out;
  for (const Tensor& p : params_)
    if (p.grad().defined()) out.push_back(p.grad());
  return out;
}

int64_t Optimizer::step_count() const { return static_cast<int64_t>(step_count_.item()); }

std::vector<Tensor>& Optimizer::add_state(const std::string& name) {
  std::vector<Tensor>& v = state_[name];
  for (const Tensor& p : params_) v.push_back(zeros_like(p));
  return v;
}

void Optimizer::params_with_grad(std::vector<Tensor>* params, std::vector<Tensor>* grads,
                                 const std::vector<Tensor>* state, std::vector<std::vector<Tensor>>* state_out) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (g.shape() != params_[i].shape())
      throw std::logic_error("gradient shape " + shape_str(g.shape()) + " differs from parameter " +
                             shape_str(params_[i].shape()));
    params->push_back(params_[i]);
    grads->push_back(g);
    if (state)
      for (size_t s = 0; s < state_out->size(); ++s) (*state_out)[s].push_back(state[s][i]);
  }
}

std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  out["step"] = step_count_;
  for (const auto& [name, tensors] : state_)
    for (size_t i = 0; i < tensors.size(); ++i) out[name + "." + std::to_string(i)] = tensors[i];
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, Tensor>& state) {
  const auto expected = state_dict();
  for (const auto& [name, t] : expected) {
    auto it = state.find(name);
    if (it == state.end()) throw std::invalid_argument("optimizer state_dict is missing '" + name + "'");
    if (it->second.shape() != t.shape())
      throw std::invalid_argument("optimizer state '" + name + "' has shape " + shape_str(it->second.shape()) +
                                  ", expected " + shape_str(t.shape()));
  }
  for (const auto& [name, t] : expected) {
    Tensor dst = t;
    copy_(dst, state.at(name).to(dst.device()));
  }
}

}  // namespace amp::optim
