#include "kernels/cpu/dtype_convert.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace moeserve::kernels {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Bf16Test, ExactValuesRoundTrip) {
  // Values with at most 8 significant bits are exact in bf16.
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 65536.0f, 255.0f, std::ldexp(1.0f, -126),
                  std::ldexp(1.0f, -133), std::ldexp(-1.5f, 127)}) {
    EXPECT_EQ(Bits(Bf16ToFloat(FloatToBf16(f))), Bits(f)) << f;
  }
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
}

TEST(Bf16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000u)), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000u)), 0x3f82);
  // Just above halfway rounds up.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001u)), 0x3f81);
}

TEST(Bf16Test, SpecialValues) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low bits must not become Inf.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0x7f800001u)))));
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // The largest finite float rounds to Inf in bf16.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(Bf16Test, RandomRelativeErrorWithinHalfUlp) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  for (int i = 0; i < 100000; ++i) {
    const float f = dist(rng);
    const float r = Bf16ToFloat(FloatToBf16(f));
    EXPECT_LE(std::fabs(r - f), std::ldexp(std::fabs(f), -8) * 1.0001f) << f;
  }
}

TEST(Fp16Test, ExhaustiveDecodeEncodeRoundTrip) {
  // Every finite fp16 value decodes to a float that encodes back to the same bits.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = Fp16ToFloat(bits);
    if ((bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu) != 0) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f))));
      continue;
    }
    EXPECT_EQ(FloatToFp16(f), bits) << std::hex << h;
  }
}

TEST(Fp16Test, KnownValuesAndRounding) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);  // halfway to 65536 rounds to even -> Inf
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000);         // halfway: ties to even (0)
  EXPECT_EQ(FloatToFp16(std::ldexp(1.5f, -25)), 0x0001);         // above halfway
  EXPECT_EQ(FloatToFp16(std::ldexp(3.0f, -25)), 0x0002);         // 1.5 ulp: ties to even (2)
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  EXPECT_EQ(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_FLOAT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_FLOAT_EQ(Fp16ToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_TRUE(std::isinf(Fp16ToFloat(0xfc00)) && Fp16ToFloat(0xfc00) < 0);
}

TEST(BulkConvertTest, MatchesScalar) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> in(1001), back(1001);
  for (float& f : in) f = dist(rng);
  std::vector<uint16_t> b(1001), h(1001);
  ConvertFp32ToBf16Ref(in.data(), b.data(), 1001);
  ConvertFp32ToFp16Ref(in.data(), h.data(), 1001);
  for (int i = 0; i < 1001; ++i) {
    EXPECT_EQ(b[i], FloatToBf16(in[i]));
    EXPECT_EQ(h[i], FloatToFp16(in[i]));
  }
  ConvertBf16ToFp32Ref(b.data(), back.data(), 1001);
  for (int i = 0; i < 1001; ++i) EXPECT_EQ(back[i], Bf16ToFloat(b[i]));
  ConvertFp16ToFp32Ref(h.data(), back.data(), 1001);
  for (int i = 0; i < 1001; ++i) EXPECT_EQ(back[i], Fp16ToFloat(h[i]));
}

}  // namespace
}  // namespace moeserve::kernels
