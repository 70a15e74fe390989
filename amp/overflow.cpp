#include "amp/overflow.h"

#include <cmath>

#include "runtime/kernels/backend.h"
#include "runtime/ops/ops.h"

namespace amp {

std::vector<std::string> nonfinite_gradients(const std::vector<nn::NamedTensor>& named_params) {
  std::vector<std::string> out;
  for (const auto& [name, p] : named_params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    // The inf-norm is inf or NaN exactly when some element is.
    Tensor m = zeros({1}, DType::f32, g.device());
    backend_for(g.device()).norm_accumulate({g}, INFINITY, m);
    if (!std::isfinite(m.item())) out.push_back(name);
  }
  return out;
}

}  // namespace amp
