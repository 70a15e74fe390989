// Per-element math of the transformer primitives (layer norm, softmax's gradient, dropout), shared by
// the CPU loops and the CUDA kernels. Row statistics (mean, variance, the backward's two row sums)
// are accumulated in double by both backends; these functions apply them to one element.
#pragma once
#include <cmath>
#include <cstdint>

#include "runtime/core/hd.h"
#include "runtime/kernels/rng_math.h"

namespace amp::math {

// Layer norm in the compute type C (float; double for f64 tensors). rstd = 1 / sqrt(var + eps)
// from the row's biased variance (accumulated in double).
template <class C>
AMP_HD C layer_norm_rstd(double var, double eps) { return static_cast<C>(1.0 / std::sqrt(var + eps)); }

// y = (x - mean) * rstd * w + b, in PyTorch's order.
template <class C>
AMP_HD C layer_norm_apply(C x, C mean, C rstd, C w, C b) { return (x - mean) * rstd * w + b; }

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), with dxhat = g * w and
// xhat = (x - mean) * rstd; mean_dxhat and mean_dxhat_xhat are the row's means.
template <class C>
AMP_HD C layer_norm_grad_input(C g, C w, C xhat, C rstd, C mean_dxhat, C mean_dxhat_xhat) {
  return rstd * (g * w - mean_dxhat - xhat * mean_dxhat_xhat);
}

// Softmax's gradient from its output: scale y (g - sum_gy); log-softmax's: g - exp(y) sum_g.
template <class C>
AMP_HD C softmax_grad(C y, C g, C row_sum, C scale) { return scale * y * (g - row_sum); }
template <class C>
AMP_HD C log_softmax_grad(C y, C g, C row_sum) { return g - std::exp(y) * row_sum; }

// The fused classifier's gradient at one logit x of a row whose log-sum-exp is lse: scale (e^(x - lse)
// - 1 at the target, 0 elsewhere), scale = the loss's gradient / N (the mean's). The composite's
// numbers (log-softmax, then nll_loss's and log-softmax's backward) up to rounding.
template <class C>
AMP_HD C cross_entropy_grad(C x, C lse, C scale, bool is_target) {
  return scale * (std::exp(x - lse) - (is_target ? C(1) : C(0)));
}

// Dropout's mask from the counter-based stream: element i is kept (and scaled by 1 / (1 - p)) when
// its uniform draw is at least p. The same counter gives the same decision on any backend, rank or
// thread count.
AMP_HD float dropout_mask(uint64_t seed, uint64_t counter, double p) {
  return uniform01(seed, counter) >= p ? static_cast<float>(1.0 / (1.0 - p)) : 0.0f;
}

}  // namespace amp::math
