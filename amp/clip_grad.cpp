#include "amp/clip_grad.h"

#include <cmath>
#include <stdexcept>

#include "runtime/kernels/backend.h"
#include "runtime/core/number_format.h"
#include "runtime/ops/ops.h"

namespace amp {

namespace {
std::vector<Tensor> grads_of(const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (const Tensor& p : params)
    if (p.grad().defined()) out.push_back(p.grad());
  return out;
}

// What norm_accumulate starts from: 0, or inf for the smallest |x| (p = -inf).
double norm_init(double p) { return std::isinf(p) && p < 0.0 ? INFINITY : 0.0; }

// The norms from norm_accumulate's accumulations, element by element.
Tensor norm_root(const Tensor& acc, double p) {
  if (std::isinf(p) || p == 0.0 || p == 1.0) return acc;  // max, min, count and sum are the norm
  if (p == 2.0) return sqrt(acc);
  return pow(acc, 1.0 / p);
}

// torch.linalg.vector_norm of xs taken as one vector, as a 1-element float32 tensor on `device`.
Tensor vector_norm(const std::vector<Tensor>& xs, double p, Device device) {
  Tensor acc = full({1}, norm_init(p), DType::f32, device);
  backend_for(device).norm_accumulate(xs, p, acc);
  return norm_root(acc, p);
}
}  // namespace

Tensor get_total_norm(const std::vector<Tensor>& tensors, double norm_type, bool error_if_nonfinite) {
  if (tensors.empty()) return scalar_tensor(0.0);
  const Device first = tensors[0].device();
  bool one_device = true;
  for (const Tensor& t : tensors) one_device = one_device && t.device() == first;
  Tensor total;
  if (one_device) {
    // Each tensor's norm (torch._foreach_norm), all in one pass, then the norm of those norms.
    Tensor acc = full({static_cast<int64_t>(tensors.size())}, norm_init(norm_type), DType::f32, first);
    backend_for(first).norm_accumulate_each(tensors, norm_type, acc);
    total = vector_norm({norm_root(acc, norm_type)}, norm_type, first).reshape({});
  } else {
    std::vector<Tensor> norms;
    norms.reserve(tensors.size());
    for (const Tensor& t : tensors) norms.push_back(vector_norm({t}, norm_type, t.device()).to(first));
    total = vector_norm(norms, norm_type, first).reshape({});
  }
  if (error_if_nonfinite && !std::isfinite(total.item()))
    throw std::runtime_error("The total norm of order " + float_repr(norm_type) +
                             " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable "
                             "this error and scale the gradients by the non-finite norm anyway, set "
                             "`error_if_nonfinite=false`");
  return total;
}

void clip_grads_with_norm_(const std::vector<Tensor>& params, double max_norm, const Tensor& total_norm) {
  const std::vector<Tensor> grads = grads_of(params);
  if (grads.empty()) return;
  if (!total_norm.defined() || total_norm.numel() != 1)
    throw std::invalid_argument("clip_grads_with_norm_: total_norm must be a 1-element tensor");
  const Device dev = grads[0].device();
  backend_for(dev).clip_by_norm(grads, total_norm.to(DType::f32).to(dev), max_norm);
}

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  const Tensor total = get_total_norm(grads_of(params), norm_type, error_if_nonfinite);
  clip_grads_with_norm_(params, max_norm, total);
  return total;
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  const std::vector<Tensor> grads = grads_of(params);
  if (grads.empty()) return;
  backend_for(grads[0].device()).clamp(grads, -clip_value, clip_value);
}

}  // namespace amp
