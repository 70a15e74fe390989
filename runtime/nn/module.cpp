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

void Module::replace_parameters(const std::function<bool(const Tensor&)>& changes,
                                const std::function<Tensor(const Tensor&)>& convert) {
  for (auto& [name, t] : params_) {
    if (!changes(t)) continue;
    // Keep the handle identity: swap the storage, so optimizers holding the tensor follow.
    const Tensor c = convert(t.detach());
    t.impl()->storage = c.impl()->storage;
    t.impl()->offset = c.impl()->offset;
    t.impl()->dtype = c.dtype();
    t.set_grad(Tensor());
  }
  for (auto& [name, child] : children_) child->replace_parameters(changes, convert);
}

void Module::to(Device d) {
  replace_parameters([d](const Tensor& t) { return t.device() != d; }, [d](const Tensor& t) { return t.to(d); });
}

void Module::to(DType dtype) {
  replace_parameters([dtype](const Tensor& t) { return t.dtype() != dtype; },
                     [dtype](const Tensor& t) { return t.to(dtype); });
}

}  // namespace amp::nn
