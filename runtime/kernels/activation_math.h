// Per-element activation functions and their derivatives, shared by CPU loops and CUDA kernels.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime/core/hd.h"

namespace amp::math {

// NaN passes through, as in PyTorch (x > 0 is false for NaN: the second test keeps it).
template <class T>
AMP_HD T relu(T x) { return x > T(0) || x != x ? x : T(0); }
// PyTorch's threshold_backward(grad, result, 0): zero where the result is <= 0, the gradient
// elsewhere, so it passes where the input was positive or NaN (NaN <= 0 is false).
template <class T>
AMP_HD T relu_backward(T g, T x) { return x <= T(0) ? T(0) : g; }

// GELU, exact form: x * Phi(x), Phi the normal CDF. fp64 computes it with std::erf. fp32 (and the
// 16-bit types, computed in fp32) with the float overloads below, which use arithmetic only: the
// CPU's loops vectorise them (no libm call per element), and the GPU's kernels, whose IEEE operations
// are not contracted into FMAs either (nvcc --fmad=false), round them as the CPU does.
template <class T>
AMP_HD T gelu(T x) { return T(0.5) * x * (T(1) + std::erf(x * T(0.70710678118654752440))); }
// GELU's derivative at x: the factor its backward multiplies the gradient by.
template <class T>
AMP_HD T gelu_slope(T x) {
  const T cdf = T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
  const T pdf = std::exp(T(-0.5) * x * x) * T(0.39894228040143267794);
  return cdf + x * pdf;
}

namespace detail {

// 2^n for n in [-126, 127].
AMP_HD float pow2i(int n) {
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e^a for a in [-87, 88] (no NaN): a = n ln 2 + r, |r| <= ln 2 / 2 (Cody and Waite's two-part ln 2,
// exact products for |n| < 2^12), e^r by its Taylor polynomial to r^7 (relative error < 1e-8), then
// scaled by 2^n. n is rounded to nearest by adding and subtracting 1.5 * 2^23.
AMP_HD float exp_bounded(float a) {
  const float n = (a * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (a - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * pow2i(static_cast<int>(n));
}

// z * z = hi + lo exactly (Veltkamp's split, no FMA), for |z| < 2^60.
AMP_HD void square_exact(float z, float* hi, float* lo) {
  const float c = 4097.0f * z;
  const float zh = c - (c - z), zl = z - zh;
  *hi = z * z;
  *lo = ((zh * zh - *hi) + 2.0f * zh * zl) + zl * zl;
}

// Phi(x) and the normal density phi(x) = e^(-x^2 / 2) / sqrt(2 pi). Phi(x) = erfc(-x / sqrt 2) / 2, with
// erfc(z) for z >= 0.5 from Numerical Recipes' Chebyshev fit (erfcc: t e^(-z^2 + P(t)), t = 1 / (1 + z / 2),
// relative error below 1.2e-7 everywhere) and erf(z) for z < 0.5 from its Taylor series (Phi(0) = 0.5
// exactly). e^(-z^2) = e^(-x^2 / 2) is taken from x itself, x^2 = hi + lo exactly: the rounding of
// x / sqrt 2 would cost 2 z^2 2^-24 of relative error (40 ulps at x = -6). The negative tail is erfc
// itself, not 1 + erf: no cancellation (0.5 (1 + erf) in fp32 is 4 % off at x = -5). Both are 0
// beyond |x| = 13.19, where they leave float's normal range; NaN gives NaN.
AMP_HD void normal_cdf_pdf(float x, float* cdf, float* pdf) {
  const float a = x < 0.0f ? -x : x;
  const float ac = a < 13.19f ? a : 13.19f;  // NaN -> 13.19 here: NaN is returned below
  const float z = ac * 0.70710678118654752440f;
  // erf(z) = 2/sqrt(pi) (z - z^3/3 + z^5/10 - z^7/42 + z^9/216 - z^11/1320), for z < 0.5.
  const float s = z * z;
  float e = -1.0f / 1320.0f;
  e = e * s + 1.0f / 216.0f;
  e = e * s - 1.0f / 42.0f;
  e = e * s + 0.1f;
  e = e * s - 1.0f / 3.0f;
  e = e * s + 1.0f;
  const float erf_small = 1.12837916709551257390f * (e * z);
  const float t = 1.0f / (1.0f + 0.5f * z);
  float q = 0.17087277f;
  q = q * t - 0.82215223f;
  q = q * t + 1.48851587f;
  q = q * t - 1.13520398f;
  q = q * t + 0.27886807f;
  q = q * t - 0.18628806f;
  q = q * t + 0.09678418f;
  q = q * t + 0.37409196f;
  q = q * t + 1.00002368f;
  q = q * t - 1.26551223f;
  float hi, lo;
  square_exact(ac, &hi, &lo);
  const float gauss = a > 13.19f ? 0.0f : exp_bounded(-0.5f * hi) * (1.0f - 0.5f * lo);  // e^(-x^2 / 2)
  const float erfc_z = gauss * (t * exp_bounded(q));  // gauss last: only the result may be subnormal
  const bool small = a < 0.70710678118654752440f;
  const float upper = small ? 0.5f + 0.5f * erf_small : 1.0f - 0.5f * erfc_z;  // Phi(|x|)
  const float lower = small ? 0.5f - 0.5f * erf_small : 0.5f * erfc_z;         // Phi(-|x|)
  *cdf = x != x ? x : x < 0.0f ? lower : upper;
  *pdf = x != x ? x : gauss * 0.39894228040143267794f;
}

}  // namespace detail

AMP_HD float gelu(float x) {
  float cdf, pdf;
  detail::normal_cdf_pdf(x, &cdf, &pdf);
  return x * cdf;
}
AMP_HD float gelu_slope(float x) {
  float cdf, pdf;
  detail::normal_cdf_pdf(x, &cdf, &pdf);
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
