// e^x for a float x, evaluated in double by a polynomial so that a loop of it vectorises (libm's
// expf is a call per element: a sixth of the GPT's softmax). The double value is within about 1e-14
// (relative) of e^x, so its one rounding to float is e^x correctly rounded unless e^x lies that close
// to a rounding boundary: none of the 23 million arguments tests/test_rounding.cpp tries. glibc's
// expf is within 0.502 ulp, and differs from it (by 1 ulp) on about 1 argument in 13,000.
// Underflow to subnormals and 0, overflow to inf, and NaN are those of expf.
#pragma once
#include <cstdint>
#include <cstring>

namespace amp::cpu {

[[gnu::always_inline]] inline float exp_float(float xf) {
  const double x = static_cast<double>(xf);
  // e^-104 rounds to 0 in float and e^89 to inf: clamping there keeps 2^n a normal double. NaN
  // (which no comparison passes) becomes 0 here and NaN again at the end.
  // Every comparison only picks a value: with -fno-trapping-math (CMakeLists.txt) the loop is
  // branch-free and vectorises.
  const bool low = x < -104.0, high = x > 89.0, nan = x != x;
  double xc = low ? -104.0 : x;
  xc = high ? 89.0 : xc;
  xc = nan ? 0.0 : xc;
  // n = round(x / ln 2) by the 1.5 * 2^52 shift (n lands in the low mantissa bits), r = x - n ln 2
  // with ln 2 in two parts (n * kLn2Hi is exact), |r| <= ln 2 / 2.
  constexpr double kShift = 6755399441055744.0, kInvLn2 = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
  const double t = xc * kInvLn2 + kShift;
  const double n = t - kShift;
  const double r = (xc - n * kLn2Hi) - n * kLn2Lo;
  // e^r by its Taylor series to r^11: the remainder is below 7e-15 for |r| <= ln 2 / 2.
  double p = 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // 2^n from n's bits: n in [-151, 129], so n + 1023 is a normal double's biased exponent.
  uint64_t tb, sb;
  std::memcpy(&tb, &t, 8);
  std::memcpy(&sb, &kShift, 8);
  const uint64_t scale_bits = (tb - sb + 1023u) << 52;
  double scale;
  std::memcpy(&scale, &scale_bits, 8);
  const float y = static_cast<float>(p * scale);
  return nan ? xf : y;
}

}  // namespace amp::cpu
