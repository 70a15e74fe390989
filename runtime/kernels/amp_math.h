// Per-element math of the AMP kernels: unscale-and-check and the loss-scale update.
#pragma once
#include <cmath>
#include <cstdint>

#include "runtime/core/half.h"
#include "runtime/core/hd.h"

namespace amp::math {

// The reciprocal is computed in fp64 and rounded once, as PyTorch does, so 1/scale is exact for
// powers of two and correctly rounded otherwise.
AMP_HD float inverse_scale(float scale) { return static_cast<float>(1.0 / static_cast<double>(scale)); }

// inf or NaN: all exponent bits set. A bit test rather than std::isfinite, so that CPU loops vectorise.
AMP_HD bool is_nonfinite(float g) { return (f32_bits(g) & 0x7f800000u) == 0x7f800000u; }
AMP_HD bool is_nonfinite(double g) { return !std::isfinite(g); }  // float64 gradients, checked as such

// One gradient element times inv_scale, in the gradient's compute type (float64 gradients multiply
// by the float32 inverse widened, as PyTorch's kernel does). The value is unscaled even when it is
// non-finite, as in PyTorch; callers OR unscaled_is_nonfinite into found_inf.
template <class C>
AMP_HD C unscale_element(C g, float inv_scale) { return g * static_cast<C>(inv_scale); }

// A gradient as an optimizer step reads it: unscaled (inv_scale 1: it is not scaled), then times the
// clipping factor (clip_coefficient's; 1: no clipping): the numbers of unscale_, then
// clip_grads_with_norm_, then the step, each pass storing float32 (so the same roundings).
AMP_HD float read_gradient(float g, float inv_scale, float clip) { return unscale_element(g, inv_scale) * clip; }

// found_inf's test: the unscaled value, which is what an optimizer step applies. It is non-finite
// whenever the gradient is (inv_scale > 0), and also when a finite gradient times inv_scale is not:
// an inverse that overflowed (a scale below about 2.9e-39) or a product past the float's range.
// PyTorch tests the scaled value only and would apply those infinities; they are skipped here.
template <class C>
AMP_HD bool unscaled_is_nonfinite(C g, float inv_scale) { return is_nonfinite(unscale_element(g, inv_scale)); }

// _amp_update_scale_ plus hysteresis and min/max clamps. With hysteresis 1, min_scale 0 and
// max_scale inf it is exactly PyTorch's algorithm: the factors are doubles and a new scale is
// (float)((double)scale * factor); the growth tracker is an integer. tracker: [growth_tracker,
// hysteresis_left].
AMP_HD void update_scale(float* scale, int64_t* tracker, float found_inf, double growth_factor,
                         double backoff_factor, int growth_interval, int hysteresis, float min_scale,
                         float max_scale) {
  int64_t& growth_tracker = tracker[0];
  int64_t& hysteresis_left = tracker[1];
  if (found_inf != 0.0f) {
    growth_tracker = 0;
    if (hysteresis_left <= 1) {
      *scale = std::fmax(static_cast<float>(static_cast<double>(*scale) * backoff_factor), min_scale);
    } else {
      hysteresis_left -= 1;  // tolerated: keep the scale
    }
    return;
  }
  hysteresis_left = hysteresis;
  const int64_t successful = growth_tracker + 1;
  if (successful == growth_interval) {
    const float grown = std::fmin(static_cast<float>(static_cast<double>(*scale) * growth_factor), max_scale);
    if (std::isfinite(grown)) *scale = grown;  // never grow into inf
    growth_tracker = 0;
  } else {
    growth_tracker = successful;
  }
}

// One element's term of a p-norm, |x|^p, for a finite p (p = 0 counts nonzeros, as
// torch.linalg.vector_norm does). p = 2 and p = 1 (the norms that clipping and the metrics use) skip
// pow: |x| is a float widened to double, so x * x is exact and equals what pow(x, 2) returns, at a
// fraction of its cost.
AMP_HD double norm_term(double abs_x, double p) {
  return p == 2.0 ? abs_x * abs_x : p == 1.0 ? abs_x : p == 0.0 ? (abs_x != 0.0 ? 1.0 : 0.0) : pow(abs_x, p);
}

// torch.nn.utils.clip_grads_with_norm_'s factor: (total_norm + 1e-6).reciprocal() * max_norm, in
// float32 and in that order (Python's `max_norm / tensor`), then clamped to at most 1 (NaN stays NaN).
AMP_HD float clip_coefficient(float total_norm, float max_norm) {
  const float coef = (1.0f / (total_norm + 1e-6f)) * max_norm;
  return 1.0f < coef ? 1.0f : coef;
}

}  // namespace amp::math
