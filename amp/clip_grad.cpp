#include "amp/clip_grad.h"

#include <cmath>
#include <stdexcept>

#include "runtime/backend.h"
#include "runtime/ops.h"

namespace amp {

namespace {
std::vector<Tensor> grads_of(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params)
    if (p.grad().defined()) out.push_back(p.grad());
  return out;
}
}  // namespace

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  if (!(max_norm >= 0.0)) throw std::invalid_argument("clip_grad_norm_: max_norm must be >= 0, got " + std::to_string(max_norm));
  if (!(norm_type > 0.0)) throw std::invalid_argument("clip_grad_norm_: norm_type must be > 0");
  const std::vector<Tensor> grads = grads_of(params);
  if (grads.empty()) return scalar_tensor(0.0);
  Backend& b = backend_for(grads[0].device());
  Tensor acc = zeros({1}, DType::f32, grads[0].device());
  b.norm_accumulate(grads, norm_type, acc);
  Tensor total = std::isinf(norm_type) ? acc : pow(acc, 1.0 / norm_type);
  if (error_if_nonfinite && !std::isfinite(total.item()))
    throw std::runtime_error("The total norm of order " + std::to_string(norm_type) +
                             " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable "
                             "this error and scale the gradients by the non-finite norm anyway, set "
                             "`error_if_nonfinite=false`");
  b.clip_by_norm(grads, total, max_norm);
  return total.reshape({});
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  if (!(clip_value >= 0.0)) throw std::invalid_argument("clip_grad_value_: clip_value must be >= 0");
  const std::vector<Tensor> grads = grads_of(params);
  if (grads.empty()) return;
  backend_for(grads[0].device()).clamp(grads, -clip_value, clip_value);
}

}  // namespace amp
