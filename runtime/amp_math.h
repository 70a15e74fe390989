// Per-element math of the AMP kernels: unscale-and-check and the loss-scale update.
#pragma once
#include <cmath>

#include "runtime/half.h"
#include "runtime/hd.h"

namespace amp::math {

// The reciprocal is computed in fp64 and rounded once, as PyTorch does, so 1/scale is exact for
// powers of two and correctly rounded otherwise.
AMP_HD float inverse_scale(float scale) { return static_cast<float>(1.0 / static_cast<double>(scale)); }

// inf or NaN: all exponent bits set. A bit test rather than std::isfinite, so that CPU loops vectorise.
AMP_HD bool is_nonfinite(float g) { return (f32_bits(g) & 0x7f800000u) == 0x7f800000u; }

// One gradient element times inv_scale. The value is unscaled even when it is non-finite, as in
// PyTorch; callers OR is_nonfinite(g) of the original value into found_inf.
AMP_HD float unscale_element(float g, float inv_scale) { return g * inv_scale; }

// _amp_update_scale_ plus hysteresis and min/max clamps. With hysteresis 1, min_scale 0 and
// max_scale inf it is exactly PyTorch's algorithm. state: [scale, growth_tracker, hysteresis_left].
AMP_HD void update_scale(float* state, float found_inf, float growth_factor, float backoff_factor,
                         int growth_interval, int hysteresis, float min_scale, float max_scale) {
  float& scale = state[0];
  float& tracker = state[1];
  float& hysteresis_left = state[2];
  if (found_inf != 0.0f) {
    tracker = 0.0f;
    if (hysteresis_left <= 1.0f) {
      scale = std::fmax(scale * backoff_factor, min_scale);
    } else {
      hysteresis_left -= 1.0f;  // tolerated: keep the scale
    }
    return;
  }
  hysteresis_left = static_cast<float>(hysteresis);
  const float successful = tracker + 1.0f;
  if (successful == static_cast<float>(growth_interval)) {
    const float grown = std::fmin(scale * growth_factor, max_scale);
    if (std::isfinite(grown)) scale = grown;  // never grow into inf
    tracker = 0.0f;
  } else {
    tracker = successful;
  }
}

// One element's term of a p-norm, |x|^p, for a finite p > 0. p = 2 and p = 1 (the norms that
// clipping and the metrics use) skip pow: |x| is a float widened to double, so x * x is exact and
// equals what pow(x, 2) returns, at a fraction of its cost.
AMP_HD double norm_term(double abs_x, double p) {
  return p == 2.0 ? abs_x * abs_x : p == 1.0 ? abs_x : pow(abs_x, p);
}

}  // namespace amp::math
