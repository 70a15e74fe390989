#include "runtime/nn/state_dict.h"

#include <map>
#include <set>
#include <stdexcept>

#include "runtime/ops/ops.h"

namespace amp::nn {

safetensors::NamedTensors state_dict(const Module& m) {
  safetensors::NamedTensors out;
  for (auto& [name, t] : m.named_parameters()) out.emplace_back(name, t.detach());
  return out;
}

void load_state_dict(Module& m, const safetensors::NamedTensors& tensors, const std::string& source) {
  const auto params = m.named_parameters();
  std::set<std::string> expected;
  for (const auto& [name, p] : params) expected.insert(name);
  const auto tied = m.tied_aliases();
  const std::map<std::string, std::string> aliases(tied.begin(), tied.end());
  for (const auto& [name, t] : tensors) {
    if (expected.count(name)) continue;
    const auto alias = aliases.find(name);
    if (alias == aliases.end())
      throw std::invalid_argument(source + ": unexpected tensor '" + name + "' (the model has no such parameter)");
    // A tied weight stored twice (PyTorch's state_dict of a tied model holds both): it must be the same.
    const Tensor& target = safetensors::find(tensors, alias->second, source);
    if (t.shape() != target.shape() || t.dtype() != target.dtype() || t.to_vector() != target.to_vector())
      throw std::invalid_argument(source + ": tensor '" + name + "' differs from '" + alias->second +
                                  "', and this model ties them (one weight)");
  }
  for (const auto& [name, p] : params) {
    const Tensor& t = safetensors::find(tensors, name, source);
    if (t.shape() != p.shape())
      throw std::invalid_argument(source + ": tensor '" + name + "' has shape " + shape_str(t.shape()) +
                                  ", expected " + shape_str(p.shape()));
    if (t.dtype() != p.dtype())
      throw std::invalid_argument(source + ": tensor '" + name + "' has dtype " + dtype_name(t.dtype()) +
                                  ", expected " + dtype_name(p.dtype()));
  }
  for (const auto& [name, p] : params) {
    Tensor dst = p.detach();
    copy_(dst, safetensors::find(tensors, name, source).to(p.device()));
  }
}

}  // namespace amp::nn
