#include "runtime/nn/module.h"

namespace amp::nn {

Tensor& Module::register_parameter(std::string name, Tensor t) {
  t.set_requires_grad(true);
  params_.emplace_back(std::move(name), std::move(t));
  return params_.back().second;
}

void Module::register_module(std::string name, std::shared_ptr<Module> m) {
  children_.emplace_back(std::move(name), std::move(m));
}

void Module::collect(const std::string& prefix, std::vector<NamedTensor>* out) const {
  for (const auto& [name, t] : params_) out->emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out);
}

std::vector<NamedTensor> Module::named_parameters() const {
  std::vector<NamedTensor> out;
  collect("", &out);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

void Module::zero_grad() {
  for (Tensor& p : parameters()) p.set_grad(Tensor());
}

void Module::to(Device d) {
  for (auto& [name, t] : params_) {
    if (t.device() == d) continue;
    // Keep the handle identity: swap the storage, so optimizers holding the tensor follow.
    Tensor moved = t.to(d);
    t.impl()->storage = moved.impl()->storage;
    t.impl()->offset = moved.impl()->offset;
    t.set_grad(Tensor());
  }
  for (auto& [name, child] : children_) child->to(d);
}

void Module::to(DType dtype) {
  for (auto& [name, t] : params_) {
    if (t.dtype() == dtype) continue;
    Tensor cast = t.detach().to(dtype);
    t.impl()->storage = cast.impl()->storage;
    t.impl()->offset = cast.impl()->offset;
    t.impl()->dtype = dtype;
    t.set_grad(Tensor());
  }
  for (auto& [name, child] : children_) child->to(dtype);
}

}  // namespace amp::nn
