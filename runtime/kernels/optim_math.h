// Per-element optimizer updates in PyTorch's order of operations (torch.optim 2.x, the single-tensor
// implementations that PyTorch runs on the CPU).
// Hyperparameters are doubles, as in Python; every coefficient the kernels need is derived from
// them in fp64 and rounded once to fp32, exactly where PyTorch passes a Python float to a kernel
// (so 1 - beta2 is (float)(1 - 0.999) = 0.001f, not 1.0f - 0.999f).
#pragma once
#include <cmath>

#include "runtime/core/hd.h"

namespace amp {

// keep_unscaled_grads: when a step is given grad_scale (the gradients still scaled), it writes the
// unscaled gradients back, as PyTorch's fused step does; false skips that write, for a caller that
// reads no gradient after the step (Optimizer::set_keep_unscaled_grads).
struct SgdHyper {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
  bool keep_unscaled_grads = true;
};
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled_weight_decay;  // AdamW
  bool amsgrad, maximize;
  bool keep_unscaled_grads = true;
};

namespace math {

struct SgdCoef {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, maximize;
};
AMP_HD SgdCoef sgd_coef(const SgdHyper& h) {
  return {static_cast<float>(h.lr), static_cast<float>(h.momentum), static_cast<float>(1.0 - h.dampening),
          static_cast<float>(h.weight_decay), h.nesterov, h.maximize};
}

// torch.optim.SGD. first_step: the momentum buffer does not exist yet and is set to the gradient.
AMP_HD void sgd_update(float* p, float g, float* buf, bool first_step, const SgdCoef& c) {
  float d = c.maximize ? -g : g;
  if (c.weight_decay != 0.0f) d = d + c.weight_decay * *p;
  if (c.momentum != 0.0f) {
    const float b = first_step ? d : *buf * c.momentum + c.one_minus_dampening * d;
    *buf = b;
    d = c.nesterov ? d + c.momentum * b : b;
  }
  *p = *p - c.lr * d;
}

struct AdamCoef {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
  float decay;            // AdamW: 1 - lr * weight_decay
  float neg_step_size;    // -lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  bool decoupled, amsgrad, maximize;
};
// step: the step being taken (1 for the first); bias corrections in fp64 as PyTorch does on the host.
AMP_HD AdamCoef adam_coef(const AdamHyper& h, double step) {
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  return {static_cast<float>(h.beta1),        static_cast<float>(1.0 - h.beta1),
          static_cast<float>(h.beta2),        static_cast<float>(1.0 - h.beta2),
          static_cast<float>(h.eps),          static_cast<float>(h.weight_decay),
          static_cast<float>(1.0 - h.lr * h.weight_decay),
          static_cast<float>(-(h.lr / bc1)),  static_cast<float>(std::sqrt(bc2)),
          h.decoupled_weight_decay,           h.amsgrad,
          h.maximize};
}

// torch.lerp(start, end, weight): the form depends on |weight|, so that both ends are exact.
AMP_HD float lerp(float start, float end, float weight) {
  return std::fabs(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

// torch.maximum: a NaN in either argument is the result (std::fmax would drop it).
AMP_HD float nan_maximum(float a, float b) { return a != a || b != b ? a + b : (a > b ? a : b); }

// torch.optim.Adam / AdamW (decoupled weight decay).
AMP_HD void adam_update(float* p, float g, float* m, float* v, float* vmax, const AdamCoef& c) {
  if (c.maximize) g = -g;
  if (c.weight_decay != 0.0f) {
    if (c.decoupled) {
      *p = *p * c.decay;
    } else {
      g = g + c.weight_decay * *p;
    }
  }
  *m = lerp(*m, g, c.one_minus_beta1);  // exp_avg.lerp_(grad, 1 - beta1)
  *v = *v * c.beta2 + c.one_minus_beta2 * g * g;  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
  float denom_base = *v;
  if (c.amsgrad) {
    *vmax = nan_maximum(*vmax, *v);  // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
    denom_base = *vmax;
  }
  const float denom = std::sqrt(denom_base) / c.bc2_sqrt + c.eps;
  *p = *p + c.neg_step_size * *m / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size): (v * m) / d
}

}  // namespace math
}  // namespace amp
