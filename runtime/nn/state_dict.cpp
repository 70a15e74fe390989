#include "runtime/nn/state_dict.h"

#include <map>
#include <set>
#include <stdexcept>

#include "runtime/ops/ops.h"

namespace amp::nn {

Tensor first_rows(const Tensor& t, int64_t rows) {
  if (t.dim() < 1 || rows < 0 || rows > t.size(0))
    throw std::invalid_argument("first_rows: " + std::to_string(rows) + " rows of a tensor of shape " + shape_str(t.shape()));
  Shape s = t.shape();
  s[0] = rows;
  return t.view(0, s);
}

Tensor zero_padded_rows(const Tensor& saved, const Shape& full) {
  Tensor out = zeros(full, saved.dtype(), saved.device());
  Tensor head = first_rows(out, saved.dim() < 1 ? 0 : saved.size(0));
  if (head.shape() != saved.shape())
    throw std::invalid_argument("zero_padded_rows: a tensor of shape " + shape_str(saved.shape()) +
                                " is not the first rows of shape " + shape_str(full));
  copy_(head, saved);
  return out;
}

namespace {
std::map<std::string, int64_t> rows_saved(const Module& m) {
  const auto v = m.saved_rows();
  return {v.begin(), v.end()};
}
}  // namespace

safetensors::NamedTensors state_dict(const Module& m) {
  const auto rows = rows_saved(m);
  safetensors::NamedTensors out;
  for (auto& [name, t] : m.named_parameters()) {
    const auto r = rows.find(name);
    out.emplace_back(name, r == rows.end() ? t.detach() : first_rows(t, r->second));
  }
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
  const auto rows = rows_saved(m);
  auto saved_shape = [&](const std::string& name, const Tensor& p) {
    const auto r = rows.find(name);
    return r == rows.end() ? p.shape() : first_rows(p, r->second).shape();
  };
  for (const auto& [name, p] : params) {
    const Tensor& t = safetensors::find(tensors, name, source);
    if (t.shape() != saved_shape(name, p))
      throw std::invalid_argument(source + ": tensor '" + name + "' has shape " + shape_str(t.shape()) +
                                  ", expected " + shape_str(saved_shape(name, p)));
    if (t.dtype() != p.dtype())
      throw std::invalid_argument(source + ": tensor '" + name + "' has dtype " + dtype_name(t.dtype()) +
                                  ", expected " + dtype_name(p.dtype()));
  }
  for (const auto& [name, p] : params) {
    Tensor dst = p.detach();
    const Tensor& t = safetensors::find(tensors, name, source);
    if (t.shape() == p.shape()) copy_(dst, t.to(p.device()));
    else copy_(dst, zero_padded_rows(t.to(p.device()), p.shape()));  // the padding rows zeroed
  }
}

}  // namespace amp::nn
