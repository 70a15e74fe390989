#include "runtime/optim/optimizer.h"

#include <stdexcept>

#include "runtime/ops.h"

namespace amp::optim {

Optimizer::Optimizer(std::vector<Tensor> params) : params_(std::move(params)) {
  if (params_.empty()) throw std::invalid_argument("optimizer got an empty parameter list");
  for (const Tensor& p : params_)
    if (!p.is_leaf() || !p.requires_grad())
      throw std::invalid_argument("optimizer can only optimize leaf tensors that require grad");
  cohort_of_.assign(params_.size(), 0);
  cohort_steps_.push_back(zeros({1}, DType::f32, params_[0].device()));
}

void Optimizer::step(const Tensor& found_inf, const Tensor& grad_scale) {
  std::map<size_t, std::vector<size_t>> present;  // cohort -> its parameters that have a gradient
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (g.shape() != params_[i].shape())
      throw std::logic_error("gradient shape " + shape_str(g.shape()) + " differs from parameter " +
                             shape_str(params_[i].shape()));
    present[cohort_of_[i]].push_back(i);
  }
  for (auto& [cohort, index] : present) {
    size_t members = 0;
    for (size_t c : cohort_of_) members += c == cohort;
    size_t target = cohort;
    if (index.size() != members) {
      // Only some members step: they continue from the same count in a cohort of their own.
      target = cohort_steps_.size();
      cohort_steps_.push_back(cohort_steps_[cohort].clone());
      for (size_t i : index) cohort_of_[i] = target;
    }
    step_group(index, cohort_steps_[target], found_inf, grad_scale);
  }
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

int64_t Optimizer::step_count(size_t param) const {
  return static_cast<int64_t>(cohort_steps_.at(cohort_of_.at(param)).item());
}

std::vector<Tensor> Optimizer::select(const std::vector<Tensor>& all, const std::vector<size_t>& index) const {
  std::vector<Tensor> out;
  for (size_t i : index) out.push_back(all.at(i));
  return out;
}

std::vector<Tensor>& Optimizer::add_state(const std::string& name) {
  std::vector<Tensor>& v = state_[name];
  for (const Tensor& p : params_) v.push_back(zeros_like(p));
  return v;
}

std::map<std::string, Tensor> Optimizer::state_dict() const {
  std::map<std::string, Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i) out["step." + std::to_string(i)] = cohort_steps_[cohort_of_[i]];
  for (const auto& [name, tensors] : state_)
    for (size_t i = 0; i < tensors.size(); ++i) out[name + "." + std::to_string(i)] = tensors[i];
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, Tensor>& state) {
  const auto expected = state_dict();
  for (const auto& [name, t] : expected) {
    auto it = state.find(name);
    if (it == state.end()) throw std::invalid_argument("optimizer state_dict is missing '" + name + "'");
    if (it->second.numel() != t.numel())
      throw std::invalid_argument("optimizer state '" + name + "' has shape " + shape_str(it->second.shape()) +
                                  ", expected " + shape_str(t.shape()));
  }
  for (const auto& [name, tensors] : state_)
    for (size_t i = 0; i < tensors.size(); ++i) {
      Tensor dst = tensors[i];
      copy_(dst, state.at(name + "." + std::to_string(i)).to(dst.device()));
    }
  // Parameters with equal step counts share a cohort again (loading is not a hot path).
  std::map<double, size_t> by_count;
  cohort_steps_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    const double n = state.at("step." + std::to_string(i)).item();
    auto it = by_count.find(n);
    if (it == by_count.end()) {
      it = by_count.emplace(n, cohort_steps_.size()).first;
      cohort_steps_.push_back(full({1}, n, DType::f32, params_[0].device()));
    }
    cohort_of_[i] = it->second;
  }
}

}  // namespace amp::optim
