// Per-element optimizer updates with PyTorch's exact order of operations.
#pragma once
#include <cmath>

#include "runtime/hd.h"

namespace amp::math {

// torch.optim.SGD. first_step: the momentum buffer does not exist yet and is set to the gradient.
AMP_HD void sgd_update(float* p, float g, float* buf, bool first_step, float lr, float momentum, float dampening,
                       float weight_decay, bool nesterov) {
  float d = g;
  if (weight_decay != 0.0f) d = d + weight_decay * *p;
  if (momentum != 0.0f) {
    const float b = first_step ? d : *buf * momentum + (1.0f - dampening) * d;
    *buf = b;
    d = nesterov ? d + momentum * b : b;
  }
  *p = *p - lr * d;
}

// Step-dependent scalars of Adam, computed in fp64 as PyTorch does on the host.
struct AdamScalars {
  double step_size;
  double bias_correction2_sqrt;
};
AMP_HD AdamScalars adam_scalars(double step, double lr, double beta1, double beta2) {
  const double bc1 = 1.0 - std::pow(beta1, step);
  const double bc2 = 1.0 - std::pow(beta2, step);
  return {lr / bc1, std::sqrt(bc2)};
}

// torch.optim.Adam / AdamW (decoupled weight decay).
AMP_HD void adam_update(float* p, float g, float* m, float* v, float* vmax, float lr, float beta1, float beta2,
                        float eps, float weight_decay, bool decoupled, bool amsgrad, AdamScalars s) {
  if (weight_decay != 0.0f) {
    if (decoupled) {
      *p = *p * (1.0f - lr * weight_decay);
    } else {
      g = g + weight_decay * *p;
    }
  }
  *m = *m + (1.0f - beta1) * (g - *m);  // lerp
  *v = *v * beta2 + (1.0f - beta2) * g * g;
  float denom_base = *v;
  if (amsgrad) {
    *vmax = std::fmax(*vmax, *v);
    denom_base = *vmax;
  }
  const float denom = std::sqrt(denom_base) / static_cast<float>(s.bias_correction2_sqrt) + eps;
  *p = *p + static_cast<float>(-s.step_size) * (*m / denom);
}

}  // namespace amp::math
