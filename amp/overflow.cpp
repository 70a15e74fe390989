#include "amp/overflow.h"

#include <cmath>

#include "amp/clip_grad.h"
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
  const std::vector<double> norms = tensor_norms(grads, INFINITY, grads[0].device()).to_vector();
  for (size_t i = 0; i < grads.size(); ++i)
    if (!std::isfinite(norms[i])) out.push_back(names[i]);
  return out;
}

}  // namespace amp
