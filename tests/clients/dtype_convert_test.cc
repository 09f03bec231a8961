#include "clients/cpp/dtype_convert.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace moeserve::client {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(ClientBf16, ExactValues) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(kInf), 0x7f80);
  EXPECT_EQ(FloatToBf16(-kInf), 0xff80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0x4049), 3.140625f);
  EXPECT_TRUE(std::signbit(Bf16ToFloat(0x8000)));
}

TEST(ClientBf16, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 is halfway between 0x3f80 (even) and 0x3f81: ties go to even.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000u)), 0x3f80);
  // Halfway between 0x3f81 (odd) and 0x3f82: ties go up to even.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000u)), 0x3f82);
  // Just above / below the tie.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBf16(FromBits(0x3f807fffu)), 0x3f80);
  // Negative ties mirror positive ones.
  EXPECT_EQ(FloatToBf16(FromBits(0xbf808000u)), 0xbf80);
  EXPECT_EQ(FloatToBf16(FromBits(0xbf818000u)), 0xbf82);
  // The largest float rounds past the largest finite BF16 to Inf.
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7fffffu)), 0x7f80);
  // ...but the largest finite BF16 itself stays.
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7f0000u)), 0x7f7f);
  // Subnormals round like anything else.
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)), 0x0002);
  EXPECT_EQ(FloatToBf16(FromBits(0x00008000u)), 0x0000);
}

TEST(ClientBf16, NanStaysNan) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload lives only in the low 16 bits must not become Inf.
  const uint16_t b = FloatToBf16(FromBits(0x7f800001u));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(b)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0xff800001u)))));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7fc0)));
}

TEST(ClientBf16, EveryPatternRoundTrips) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(f))));
    } else {
      EXPECT_EQ(FloatToBf16(f), b) << std::hex << b;
    }
  }
}

TEST(ClientFp16, ExactValues) {
  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(0.5f), 0x3800);
  EXPECT_EQ(FloatToFp16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(Fp16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(Fp16ToFloat(0x7c00), kInf);
  EXPECT_EQ(Fp16ToFloat(0xfc00), -kInf);
  EXPECT_TRUE(std::signbit(Fp16ToFloat(0x8000)));
}

TEST(ClientFp16, RoundsToNearestTiesToEven) {
  // 1 + 2^-11: halfway between 0x3c00 (even) and 0x3c01.
  EXPECT_EQ(FloatToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11: halfway between 0x3c01 and 0x3c02 (even).
  EXPECT_EQ(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToFp16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Mantissa carry into the exponent: just under 2 rounds to 2.
  EXPECT_EQ(FloatToFp16(std::nextafter(2.0f, 0.0f)), 0x4000);
  // Overflow: 65519 still rounds down, the tie 65520 rounds to Inf (65504's mantissa is odd).
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-65520.0f), 0xfc00);
  EXPECT_EQ(FloatToFp16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToFp16(kInf), 0x7c00);
  EXPECT_EQ(FloatToFp16(-kInf), 0xfc00);
  // Subnormal ties: 2^-25 is halfway between 0 and 2^-24 -> 0; 3 * 2^-25 between 1 and 2 ulps -> 2.
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToFp16(std::ldexp(-1.0f, -25)), 0x8000);
  EXPECT_EQ(FloatToFp16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToFp16(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToFp16(5 * std::ldexp(1.0f, -25)), 0x0002);
  // Largest subnormal + half an ulp ties up to the smallest normal (even mantissa 0).
  EXPECT_EQ(FloatToFp16(std::ldexp(1023.5f, -24)), 0x0400);
  EXPECT_EQ(FloatToFp16(1e-30f), 0x0000);
}

TEST(ClientFp16, NanStaysNan) {
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(FromBits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(FromBits(0xffc00000u)))));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(0x7c01)));
}

TEST(ClientFp16, EveryPatternRoundTrips) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f))));
    } else {
      EXPECT_EQ(FloatToFp16(f), h) << std::hex << h;
    }
  }
}

// For random finite floats in range, the result is the nearest representable value, with ties
// going to the even pattern: checked against both neighbours in double precision.
template <typename Encode, typename Decode>
void CheckNearest(Encode encode, Decode decode, float max_abs, uint64_t seed) {
  std::mt19937 rng(seed);
  for (int i = 0; i < 200000; ++i) {
    const float f = FromBits(rng());
    if (!std::isfinite(f) || std::fabs(f) >= max_abs) continue;
    const uint16_t b = encode(f);
    const double err = std::fabs(static_cast<double>(decode(b)) - f);
    for (int step : {-1, 1}) {
      const uint16_t n = static_cast<uint16_t>(b + step);
      const float nf = decode(n);
      if (!std::isfinite(nf) || std::signbit(nf) != std::signbit(decode(b))) continue;
      const double nerr = std::fabs(static_cast<double>(nf) - f);
      ASSERT_LE(err, nerr) << f;
      if (err == nerr) {
        ASSERT_EQ(b & 1, 0) << "tie not to even for " << f;
      }
    }
  }
}

TEST(ClientBf16, NearestOnRandomFloats) {
  CheckNearest(FloatToBf16, Bf16ToFloat, FromBits(0x7f7f0000u), 1);
}

TEST(ClientFp16, NearestOnRandomFloats) { CheckNearest(FloatToFp16, Fp16ToFloat, 65504.0f, 2); }

TEST(ClientEncodeDecode, RoundTripsThroughTensors) {
  const float values[] = {1.0f, -0.5f, 3.0f, 1.0f + std::ldexp(1.0f, -8)};
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32}) {
    auto bytes = EncodeFloats(values, 4, dtype);
    ASSERT_TRUE(bytes.ok());
    EXPECT_EQ(static_cast<int64_t>(bytes->size()), 4 * DTypeSize(dtype));
    v1::Tensor t;
    t.set_dtype(dtype);
    t.add_shape(2);
    t.add_shape(2);
    t.set_data(*bytes);
    auto back = DecodeFloats(t);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ((*back)[0], 1.0f);
    EXPECT_EQ((*back)[1], -0.5f);
    EXPECT_EQ((*back)[2], 3.0f);
    EXPECT_EQ((*back)[3], dtype == v1::DTYPE_BF16 ? 1.0f : values[3]);
  }
}

TEST(ClientEncodeDecode, RejectsBadTensors) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.add_shape(3);
  t.set_data(std::string(4, '\0'));  // 3 BF16 need 6 bytes
  EXPECT_EQ(DecodeFloats(t).status().code(), absl::StatusCode::kInvalidArgument);
  t.set_dtype(v1::DTYPE_INT32);
  t.set_data(std::string(12, '\0'));
  EXPECT_EQ(DecodeFloats(t).status().code(), absl::StatusCode::kInvalidArgument);
  const float one = 1.0f;
  EXPECT_FALSE(EncodeFloats(&one, 1, v1::DTYPE_INT64).ok());
}

TEST(ClientDTypes, ParseAndName) {
  EXPECT_EQ(*ParseFloatDType("bf16"), v1::DTYPE_BF16);
  EXPECT_EQ(*ParseFloatDType("FP16"), v1::DTYPE_FP16);
  EXPECT_EQ(*ParseFloatDType("float32"), v1::DTYPE_FP32);
  EXPECT_FALSE(ParseFloatDType("int8").ok());
  EXPECT_EQ(DTypeName(v1::DTYPE_BF16), "bf16");
  EXPECT_EQ(DTypeSize(v1::DTYPE_INT64), 8);
  EXPECT_EQ(DTypeSize(v1::DTYPE_UNSPECIFIED), 0);
}

}  // namespace
}  // namespace moeserve::client
