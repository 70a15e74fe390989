// Per-element activation functions and their derivatives, shared by CPU loops and CUDA kernels.
#pragma once
#include <cmath>

#include "runtime/core/hd.h"

namespace amp::math {

// NaN passes through, as in PyTorch (x > 0 is false for NaN: the second test keeps it).
template <class T>
AMP_HD T relu(T x) { return x > T(0) || x != x ? x : T(0); }
// PyTorch's threshold_backward(grad, result, 0): zero where the result is <= 0, the gradient
// elsewhere, so it passes where the input was positive or NaN (NaN <= 0 is false).
template <class T>
AMP_HD T relu_backward(T g, T x) { return x <= T(0) ? T(0) : g; }

// GELU, exact form: x * Phi(x).
template <class T>
AMP_HD T gelu(T x) { return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440))); }
// GELU's derivative at x: the factor its backward multiplies the gradient by.
template <class T>
AMP_HD T gelu_slope(T x) {
  const T cdf = T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
  const T pdf = std::exp(T(-0.5) * x * x) * T(0.39894228040143267794);
  return cdf + x * pdf;
}
template <class T>
AMP_HD T gelu_backward(T g, T x) { return g * gelu_slope(x); }

// GELU, tanh approximation.
template <class T>
AMP_HD T gelu_tanh(T x) {
  const T inner = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
  return T(0.5) * x * (T(1) + std::tanh(inner));
}
template <class T>
AMP_HD T gelu_tanh_slope(T x) {
  const T k = T(0.79788456080286535588);
  const T inner = k * (x + T(0.044715) * x * x * x);
  const T t = std::tanh(inner);
  const T dinner = k * (T(1) + T(3) * T(0.044715) * x * x);
  return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * dinner;
}
template <class T>
AMP_HD T gelu_tanh_backward(T g, T x) { return g * gelu_tanh_slope(x); }

}  // namespace amp::math
