#include "amp/clip_grad.h"

#include <algorithm>
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

Tensor tensor_norms(const std::vector<Tensor>& tensors, double p, Device out) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  // The tensors of each device, in one pass there (the common case: one device, one pass).
  std::vector<Device> devices;
  for (const Tensor& t : tensors)
    if (std::find(devices.begin(), devices.end(), t.device()) == devices.end()) devices.push_back(t.device());
  if (devices.size() == 1) {
    Tensor acc = full({n}, norm_init(p), DType::f32, devices[0]);
    backend_for(devices[0]).norm_accumulate_each(tensors, p, acc);
    return norm_root(acc, p).to(out);
  }
  Tensor norms = empty({n}, DType::f32, out);
  for (const Device d : devices) {
    std::vector<Tensor> group;
    std::vector<int64_t> at;
    for (int64_t i = 0; i < n; ++i)
      if (tensors[static_cast<size_t>(i)].device() == d) {
        group.push_back(tensors[static_cast<size_t>(i)]);
        at.push_back(i);
      }
    const Tensor part = tensor_norms(group, p, out);
    for (size_t k = 0; k < at.size(); ++k) {
      Tensor slot = norms.view(at[k], {1});
      copy_(slot, part.view(static_cast<int64_t>(k), {1}));
    }
  }
  return norms;
}

Tensor get_total_norm(const std::vector<Tensor>& tensors, double norm_type, bool error_if_nonfinite) {
  if (tensors.empty()) return scalar_tensor(0.0);
  const Device first = tensors[0].device();
  const Tensor total = vector_norm({tensor_norms(tensors, norm_type, first)}, norm_type, first).reshape({});
  if (error_if_nonfinite && !std::isfinite(total.item()))
    throw std::runtime_error("The total norm of order " + float_repr(norm_type) +
                             " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable "
                             "this error and scale the gradients by the non-finite norm anyway, set "
                             "`error_if_nonfinite=false`");
  return total;
}

namespace {
// The gradients by device, in order of first appearance (PyTorch groups them so too): each group goes
// to its own device's backend (all of them went to the first's).
std::vector<std::pair<Device, std::vector<Tensor>>> by_device(const std::vector<Tensor>& grads) {
  std::vector<std::pair<Device, std::vector<Tensor>>> groups;
  for (const Tensor& g : grads) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == g.device(); });
    if (it == groups.end()) it = groups.insert(groups.end(), {g.device(), {}});
    it->second.push_back(g);
  }
  return groups;
}
}  // namespace

void clip_grads_with_norm_(const std::vector<Tensor>& params, double max_norm, const Tensor& total_norm) {
  const std::vector<Tensor> grads = grads_of(params);
  if (grads.empty()) return;
  if (!total_norm.defined() || total_norm.numel() != 1)
    throw std::invalid_argument("clip_grads_with_norm_: total_norm must be a 1-element tensor");
  for (const auto& [dev, group] : by_device(grads))
    backend_for(dev).clip_by_norm(group, total_norm.to(DType::f32).to(dev), max_norm);
}

Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  const Tensor total = get_total_norm(grads_of(params), norm_type, error_if_nonfinite);
  clip_grads_with_norm_(params, max_norm, total);
  return total;
}

void clip_grad_value_(const std::vector<Tensor>& params, double clip_value) {
  for (const auto& [dev, group] : by_device(grads_of(params))) backend_for(dev).clamp(group, -clip_value, clip_value);
}

}  // namespace amp
