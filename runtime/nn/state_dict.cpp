#include "runtime/nn/state_dict.h"

#include <set>
#include <stdexcept>

#include "runtime/ops.h"

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
  for (const auto& [name, t] : tensors)
    if (!expected.count(name)) throw std::invalid_argument(source + ": unexpected tensor '" + name + "' (the model has no such parameter)");
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
