// fp32 <-> fp16 / bf16 conversions: PyTorch's bit patterns, hand-computed edge cases, and every
// fp16 value round-tripping through fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "runtime/kernels/backend.h"
#include "runtime/core/half.h"
#include "runtime/ops/ops.h"
#include "test_util.h"

namespace amp {
namespace {

std::vector<uint16_t> u16_of(const safetensors::RawEntry& e) {
  std::vector<uint16_t> v(e.bytes.size() / 2);
  std::memcpy(v.data(), e.bytes.data(), e.bytes.size());
  return v;
}

struct CastFixture {
  std::vector<float> f32;
  std::vector<uint16_t> f16, bf16;
};

CastFixture load_casts() {
  CastFixture c;
  for (const auto& e : safetensors::load_raw(test::data_path("casts.safetensors"))) {
    if (e.name == "f32") {
      c.f32.resize(e.bytes.size() / 4);
      std::memcpy(c.f32.data(), e.bytes.data(), e.bytes.size());
    } else if (e.name == "f16_bits") {
      c.f16 = u16_of(e);
    } else if (e.name == "bf16_bits") {
      c.bf16 = u16_of(e);
    }
  }
  return c;
}

TEST(Casts, MatchPyTorchBitPatterns) {
  const CastFixture c = load_casts();
  ASSERT_EQ(c.f32.size(), 223u);
  ASSERT_EQ(c.f16.size(), c.f32.size());
  for (size_t i = 0; i < c.f32.size(); ++i) {
    const float x = c.f32[i];
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(f16_bits_to_f32(f32_to_f16_bits(x))));
      EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(x))));
      continue;
    }
    EXPECT_EQ(f32_to_f16_bits(x), c.f16[i]) << "fp16 of " << x << " (index " << i << ")";
    EXPECT_EQ(f32_to_bf16_bits(x), c.bf16[i]) << "bf16 of " << x << " (index " << i << ")";
  }
}

TEST(Casts, HandComputedEdgeCases) {
  // fp16: max finite, overflow threshold, subnormals and ties, worked out from the format's definition.
  EXPECT_EQ(f32_to_f16_bits(65504.0f), 0x7bffu);
  EXPECT_EQ(f32_to_f16_bits(65519.99f), 0x7bffu);       // just below the threshold rounds down
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00u);        // halfway to 2^16 rounds to inf
  EXPECT_EQ(f32_to_f16_bits(-1e6f), 0xfc00u);
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001u);        // smallest subnormal
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000u);        // half of it: tie to even (0)
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(3.0f, -26)), 0x0001u);        // three quarters: up
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(3.0f, -25)), 0x0002u);        // 1.5 ulp: tie to even (2)
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -14)), 0x0400u);        // smallest normal
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1023.0f, -24)), 0x03ffu);     // largest subnormal
  EXPECT_EQ(f32_to_f16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00u); // tie: stays at even 1.0
  EXPECT_EQ(f32_to_f16_bits(1.0f + std::ldexp(3.0f, -11)), 0x3c02u); // tie: up to even
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000u);
  EXPECT_EQ(f32_to_f16_bits(INFINITY), 0x7c00u);
  EXPECT_EQ(f16_bits_to_f32(0x0001u), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_bits_to_f32(0x7bffu), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_bits_to_f32(0xfc00u)) && f16_bits_to_f32(0xfc00u) < 0);
  // bf16: ties at 1 + 2^-8 and 1 + 3*2^-8, overflow near fp32's max.
  EXPECT_EQ(f32_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80u);
  EXPECT_EQ(f32_to_bf16_bits(1.0f + std::ldexp(3.0f, -8)), 0x3f82u);
  EXPECT_EQ(f32_to_bf16_bits(3.4028235e38f), 0x7f80u);  // rounds up into inf
  EXPECT_EQ(f32_to_bf16_bits(-INFINITY), 0xff80u);
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(NAN))));
}

TEST(Casts, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const float f = f16_bits_to_f32(h);
    if (std::isnan(f)) {
      EXPECT_EQ(h & 0x7c00u, 0x7c00u);
      continue;
    }
    ASSERT_EQ(f32_to_f16_bits(f), h) << "pattern " << b;
    ASSERT_EQ(f32_to_bf16_bits(bf16_bits_to_f32(h)), h) << "bf16 pattern " << b;
  }
}

TEST(Casts, TensorCastUsesTheSameRounding) {
  const CastFixture c = load_casts();
  std::vector<double> vals(c.f32.begin(), c.f32.end());
  const Tensor x = from_vector(vals, {static_cast<int64_t>(vals.size())});
  const Tensor h = cast(x, DType::f16), b = cast(x, DType::bf16);
  for (size_t i = 0; i < vals.size(); ++i) {
    if (std::isnan(c.f32[i])) continue;
    EXPECT_EQ(h.data<Half>()[i].bits, c.f16[i]) << i;
    EXPECT_EQ(b.data<BFloat16>()[i].bits, c.bf16[i]) << i;
  }
}

}  // namespace
}  // namespace amp
