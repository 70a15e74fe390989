#include "amp/overflow.h"

#include <cmath>

#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

std::vector<std::string> nonfinite_gradients(const std::vector<nn::NamedTensor>& named_params) {
  std::vector<std::string> names;
  std::vector<Tensor> grads;
  for (const auto& [name, p] : named_params) {
    if (!p.grad().defined()) continue;
    names.push_back(name);
    grads.push_back(p.grad());
  }
  std::vector<std::string> out;
  if (grads.empty()) return out;
  // The inf-norm is inf or NaN exactly when some element is: one pass and one read-back for all.
  const Device device = grads[0].device();
  bool one_device = true;
  for (const Tensor& g : grads) one_device = one_device && g.device() == device;
  std::vector<double> norms;
  if (one_device) {
    Tensor m = zeros({static_cast<int64_t>(grads.size())}, DType::f32, device);
    backend_for(device).norm_accumulate_each(grads, INFINITY, m);
    norms = m.to_vector();
  } else {
    for (const Tensor& g : grads) {
      Tensor m = zeros({1}, DType::f32, g.device());
      backend_for(g.device()).norm_accumulate({g}, INFINITY, m);
      norms.push_back(m.item());
    }
  }
  for (size_t i = 0; i < grads.size(); ++i)
    if (!std::isfinite(norms[i])) out.push_back(names[i]);
  return out;
}

}  // namespace amp
