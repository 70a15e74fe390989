// Every product in the shared per-element math is rounded before it is added: no a*b+c is fused
// into one FMA, neither inline (this file's own compilation) nor in the CPU backend's library
// code. nvcc builds the device code with --fmad=false; a compiler that contracted on the host would
// make the CPU and the GPU round differently (GCC contracts C++ by default: the build passes
// -ffp-contract=off).
//
// The inputs are chosen so that the fused and the unfused results differ: with lr = d = 1 + 2^-12,
// lr * d = 1 + 2^-11 + 2^-24 rounds (a tie, to even) to 1 + 2^-11, so p - lr * d with p = 1 is
// -2^-11 unfused and -2^-11 - 2^-24 fused. The reference rounds through volatile temporaries,
// which no compiler may contract.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "runtime/kernels/backend.h"
#include "runtime/kernels/cpu/exp_float.h"
#include "runtime/kernels/optim_math.h"
#include "runtime/core/tensor.h"

namespace amp {
namespace {

constexpr float kOnePlus = 1.0f + 0x1p-12f;

// Hides a value from the optimiser, so that the code under test is compiled, not constant-folded.
float opaque(float v) {
  volatile float x = v;
  return x;
}

float two_roundings_sub(float p, float a, float b) {
  volatile float prod = a * b;
  volatile float r = p - prod;
  return r;
}

TEST(Rounding, TheChosenInputsTellFusedFromUnfused) {
  const float fused = std::fma(-kOnePlus, kOnePlus, 1.0f);
  EXPECT_NE(fused, two_roundings_sub(1.0f, kOnePlus, kOnePlus));
  EXPECT_EQ(two_roundings_sub(1.0f, kOnePlus, kOnePlus), -0x1p-11f);
}

TEST(Rounding, InlineSgdUpdateRoundsTheProductFirst) {
  math::SgdCoef c{opaque(kOnePlus), 0.0f, 1.0f, 0.0f, false, false};
  float p = opaque(1.0f);
  math::sgd_update(&p, opaque(kOnePlus), nullptr, true, c);
  EXPECT_EQ(p, two_roundings_sub(1.0f, kOnePlus, kOnePlus));
}

TEST(Rounding, CpuBackendSgdStepRoundsTheProductFirst) {
  Tensor p = from_vector({1.0}, {1});
  Tensor g = from_vector({static_cast<double>(kOnePlus)}, {1});
  Tensor steps = zeros({1});
  const SgdHyper h{static_cast<double>(kOnePlus), 0.0, 0.0, 0.0, false, false};
  backend_for(kCPU).sgd_step({p}, {g}, {}, steps, h, Tensor(), Tensor(), {});
  EXPECT_EQ(static_cast<float>(p.item()), two_roundings_sub(1.0f, kOnePlus, kOnePlus));
}

TEST(Rounding, InlineAdamMomentRoundsEachProductFirst) {
  // m = lerp(m, g, w) = m + w * (g - m) for |w| < 0.5: the product rounded, then the sum. With
  // w = (1 + 2^-12) / 4, m = -1 and g = 3 + 2^-10, g - m = 4 (1 + 2^-12) exactly and w (g - m) is
  // (1 + 2^-12)^2, whose 2^-24 survives only in a fused result.
  math::AdamCoef c{};
  c.beta1 = 0.5f;
  c.one_minus_beta1 = opaque(kOnePlus / 4.0f);
  c.beta2 = 0.5f;
  c.one_minus_beta2 = 0.5f;
  c.eps = 1.0f;
  c.decay = 1.0f;
  c.neg_step_size = 0.0f;
  c.bc2_sqrt = 1.0f;
  float p = 0.0f, m = opaque(-1.0f), v = 0.0f, vmax = 0.0f;
  const float g = opaque(3.0f + 1.0f / 1024.0f);
  math::adam_update(&p, g, &m, &v, &vmax, c);
  volatile float prod = (kOnePlus / 4.0f) * (g - -1.0f);
  volatile float want = -1.0f + prod;
  EXPECT_EQ(m, want);
  EXPECT_NE(m, std::fma(kOnePlus / 4.0f, g + 1.0f, -1.0f)) << "the inputs do not tell fused from unfused";
}

// Adam's update is PyTorch 2.x's param.addcdiv_(exp_avg, denom, value=-step_size): (value * m) / denom,
// not value * (m / denom). With beta1 = beta2 = 0 (m = g, v = g^2), these inputs (found by a search
// over float32) round the two orders apart.
TEST(Rounding, AdamUpdateMultipliesByTheStepBeforeDividing) {
  const float g = 0x1.d4a706p-1f, step = -0x1.4095b6p-9f, eps = 0x1.f22442p-1f;
  math::AdamCoef c{};
  c.one_minus_beta1 = 1.0f;  // lerp(m, g, 1) = g
  c.one_minus_beta2 = 1.0f;  // v = g * g
  c.eps = opaque(eps);
  c.decay = 1.0f;
  c.neg_step_size = opaque(step);
  c.bc2_sqrt = 1.0f;
  float p = 0.0f, m = 0.0f, v = 0.0f, vmax = 0.0f;
  math::adam_update(&p, opaque(g), &m, &v, &vmax, c);
  volatile float vv = g * g;
  volatile float denom = std::sqrt(vv) + eps;
  volatile float num = step * g;
  volatile float torch_order = num / denom;
  volatile float quotient = g / denom;
  volatile float other_order = step * quotient;
  ASSERT_NE(torch_order, other_order) << "the inputs do not tell the orders apart";
  EXPECT_EQ(p, torch_order);
}

// AMSGrad keeps the running maximum with torch.maximum, which propagates NaN (std::fmax would drop
// it, and the parameter would go on as if nothing happened).
TEST(Rounding, AmsgradMaximumKeepsNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(math::nan_maximum(nan, 1.0f)));
  EXPECT_TRUE(std::isnan(math::nan_maximum(1.0f, nan)));
  EXPECT_EQ(math::nan_maximum(1.0f, 2.0f), 2.0f);
  EXPECT_FALSE(std::isnan(std::fmax(nan, 1.0f)));  // the function this replaced
  math::AdamCoef c{};
  c.one_minus_beta1 = 0.1f;
  c.beta2 = 0.999f;
  c.one_minus_beta2 = 0.001f;
  c.eps = 1e-8f;
  c.decay = 1.0f;
  c.neg_step_size = -0.01f;
  c.bc2_sqrt = 1.0f;
  c.amsgrad = true;
  float p = 1.0f, m = 0.0f, v = 0.0f, vmax = opaque(nan);
  math::adam_update(&p, 0.5f, &m, &v, &vmax, c);
  EXPECT_TRUE(std::isnan(vmax));
  EXPECT_TRUE(std::isnan(p));
}

}  // namespace
}  // namespace amp

// cpu::exp_float (the CPU softmax's vectorisable e^x) against e^x correctly rounded to float (libm's
// double exp, rounded once) and against libm's expf, over every 97th float in [-110, 95] and the
// special values.
namespace amp {
namespace {
int ulps_apart(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  return std::abs(ia - ib);  // both non-negative here
}
}  // namespace

TEST(Rounding, ExpFloatIsCorrectlyRoundedAlmostAlways) {
  long n = 0, off_exact = 0, off_libm = 0;
  int worst = 0;
  auto from_bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  };
  // Every 97th bit pattern of the magnitudes up to 110, each with both signs (e^x of the negative
  // ones underflows below -103.97, and of the positive ones overflows above 88.72).
  for (uint32_t bits = 0; bits <= 0x42dc0000u /* 110 */; bits += 97)
    for (const float x : {from_bits(bits), -from_bits(bits)}) {
      const float got = cpu::exp_float(opaque(x));
      const float exact = static_cast<float>(std::exp(static_cast<double>(x)));
      ++n;
      if (std::isinf(exact)) {
        ASSERT_TRUE(std::isinf(got) && got > 0) << x;
        continue;
      }
      const int d = ulps_apart(got, exact);
      worst = std::max(worst, d);
      off_exact += d != 0;
      off_libm += got != std::exp(x);
    }
  std::printf("  %ld arguments: %ld not correctly rounded, %ld unlike libm's expf\n", n, off_exact, off_libm);
  EXPECT_GT(n, 1000000);
  EXPECT_LE(worst, 1);
  EXPECT_LE(off_exact, n / 100000) << "of " << n;
  EXPECT_LE(off_libm, n / 1000) << "of " << n;
  EXPECT_EQ(cpu::exp_float(opaque(0.0f)), 1.0f);
  EXPECT_EQ(cpu::exp_float(opaque(-std::numeric_limits<float>::infinity())), 0.0f);
  EXPECT_EQ(cpu::exp_float(opaque(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(cpu::exp_float(opaque(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(cpu::exp_float(opaque(-103.0f)), std::exp(-103.0f));  // a subnormal
  EXPECT_EQ(cpu::exp_float(opaque(88.72f)), std::exp(88.72f));    // near the largest float
}

}  // namespace amp
