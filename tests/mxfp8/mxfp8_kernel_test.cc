// MXFP8 numerics (kernels/cpu/mxfp8.h): E4M3 codec, E8M0 scale rule, block quantize/dequantize.
//
// Round-trip bound tested here. For a block with scale s = 2^(c - 127) and an element x, let
// y = x / s (exact). The scale rule makes amax / s <= 448, so no finite element saturates, and,
// when c > 0, amax / s > 224. E4M3 rounds to nearest, so
//   - |y| >= 2^-6 (E4M3 normal): |y - E4M3(y)| <= half an ulp = 2^(floor(log2|y|) - 4), hence
//       |x - deq(q(x))| <= 2^(floor(log2|x|) - 4)          (<= 2^-4 |x|, relative to x's binade)
//   - |y| <  2^-6 (E4M3 subnormal, spacing 2^-9): |x - deq(q(x))| <= 2^-10 * s
//       (< amax * 2^-10 / 224 ~ 4.4e-6 amax when c > 0: elements 2^17 below the block's amax
//        may flush to zero).
// The block's amax itself is always in the normal range, and amax = 448 * 2^j is exact.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"
#include "tests/mxfp8/uniform_error.h"

namespace moeserve::kernels {
namespace {

using testing_mxfp8::UniformRelativeL2;

// Independent decode: straight from the OCP definition, in double.
double RefE4M3(uint8_t code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (code & 0x80) ? -v : v;
}

// Independent encode: the nearest finite E4M3 value by exhaustive search, ties to the even code
// (adjacent codes differ in their last bit), |x| > 448 saturating.
uint8_t BruteE4M3(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(a - RefE4M3(static_cast<uint8_t>(c)));
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  return sign | static_cast<uint8_t>(best);
}

// Smallest e with amax <= 448 * 2^e (= ceil(log2(amax / 448))), by exact double arithmetic.
int RefScaleCode(float amax) {
  if (amax == 0.0f) return 0;
  int e = -300;
  while (static_cast<double>(amax) > std::ldexp(448.0, e)) ++e;
  return std::clamp(e + 127, 0, 254);
}

std::mt19937_64 FreshRng() {
  const uint64_t seed = std::random_device{}();
  std::cout << "[ rng seed ] " << seed << "\n";
  return std::mt19937_64(seed);
}

// A float with random sign and mantissa in binade [2^e, 2^(e+1)).
float RandomInBinade(std::mt19937_64& rng, int e) {
  const float m = std::uniform_real_distribution<float>(1.0f, 2.0f)(rng);
  return (rng() & 1 ? -1.0f : 1.0f) * std::ldexp(m, e);
}

TEST(E4M3, DecodesEveryCodeExactly) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(E4M3ToFloat(code))) << c;
      continue;
    }
    EXPECT_EQ(static_cast<double>(E4M3ToFloat(code)), RefE4M3(code)) << c;
    EXPECT_EQ(std::signbit(E4M3ToFloat(code)), (c & 0x80) != 0) << c;
  }
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(E4M3ToFloat(0x08), 0.015625f);     // smallest normal 2^-6
  EXPECT_EQ(E4M3ToFloat(0x01), 0.001953125f);  // smallest subnormal 2^-9
}

TEST(E4M3, EncodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const uint8_t code = static_cast<uint8_t>(c);
    EXPECT_EQ(FloatToE4M3(E4M3ToFloat(code)), code) << c;
    EXPECT_EQ(DoubleToE4M3(RefE4M3(code)), code) << c;
  }
}

TEST(E4M3, EncodeMatchesExhaustiveNearestOnRandomValues) {
  std::mt19937_64 rng = FreshRng();
  for (int i = 0; i < 200000; ++i) {
    const int e = std::uniform_int_distribution<int>(-14, 10)(rng);
    const float x = RandomInBinade(rng, e);
    ASSERT_EQ(FloatToE4M3(x), BruteE4M3(x)) << x;
    ASSERT_EQ(DoubleToE4M3(x), BruteE4M3(x)) << x;
  }
}

TEST(E4M3, MidpointsRoundToEven) {
  // Every midpoint between two adjacent finite codes goes to the one with an even mantissa.
  for (int c = 0; c < 0x7e; ++c) {
    const double lo = RefE4M3(static_cast<uint8_t>(c)), hi = RefE4M3(static_cast<uint8_t>(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: few significant bits
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    const uint8_t even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(FloatToE4M3(mid), even) << mid;
    EXPECT_EQ(FloatToE4M3(-mid), 0x80 | even) << -mid;
    EXPECT_EQ(DoubleToE4M3(mid), even) << mid;
    // Just off the midpoint rounds to the nearer side.
    EXPECT_EQ(FloatToE4M3(std::nextafter(mid, 0.0f)), c) << mid;
    EXPECT_EQ(FloatToE4M3(std::nextafter(mid, 1000.0f)), c + 1) << mid;
  }
  EXPECT_EQ(FloatToE4M3(1.0625f), 0x38);   // 1 + 1/16: between 1.0 (m=0) and 1.125 (m=1)
  EXPECT_EQ(FloatToE4M3(1.1875f), 0x3a);   // between 1.125 (m=1) and 1.25 (m=2)
  EXPECT_EQ(FloatToE4M3(0x1p-10f), 0x00);  // half the smallest subnormal -> +0
  EXPECT_EQ(FloatToE4M3(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(FloatToE4M3(15 * 0x1p-10f), 0x08);  // 7.5 * 2^-9 -> smallest normal
}

TEST(E4M3, Subnormals) {
  for (int m = 1; m < 8; ++m) {
    const float v = std::ldexp(static_cast<float>(m), -9);
    EXPECT_EQ(FloatToE4M3(v), m);
    EXPECT_EQ(FloatToE4M3(-v), 0x80 | m);
    EXPECT_EQ(E4M3ToFloat(static_cast<uint8_t>(m)), v);
  }
  EXPECT_EQ(FloatToE4M3(0x1p-11f), 0x00);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(FloatToE4M3(-std::numeric_limits<float>::denorm_min()), 0x80);  // -0 keeps sign
  EXPECT_EQ(FloatToE4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
}

TEST(E4M3, SaturatesAndKeepsNan) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e6f, 3e38f, inf}) {
    EXPECT_EQ(FloatToE4M3(x), 0x7e) << x;
    EXPECT_EQ(FloatToE4M3(-x), 0xfe) << -x;
    EXPECT_EQ(DoubleToE4M3(x), 0x7e) << x;
  }
  EXPECT_EQ(FloatToE4M3(std::nanf("")), 0x7f);
  EXPECT_EQ(FloatToE4M3(-std::nanf("")), 0xff);
  EXPECT_EQ(DoubleToE4M3(std::nan("")), 0x7f);
}

TEST(E8M0, ScaleRule) {
  EXPECT_EQ(Mxfp8ScaleCode(0.0f), 0);
  EXPECT_EQ(E8M0ToFloat(127), 1.0f);
  EXPECT_EQ(E8M0ToFloat(0), 0x1p-127f);
  EXPECT_EQ(E8M0ToFloat(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(E8M0ToFloat(255)));
  // amax = 448 * 2^j -> 127 + j exactly (a float log2 may land on either side of the integer).
  for (int j = -126; j <= 119; ++j) {
    const float amax = std::ldexp(448.0f, j);
    EXPECT_EQ(Mxfp8ScaleCode(amax), 127 + j) << j;
    EXPECT_EQ(Mxfp8ScaleCode(std::nextafter(amax, 0.0f)), 127 + j) << j;
    EXPECT_EQ(Mxfp8ScaleCode(std::nextafter(amax, 1e38f * 10)), 128 + j) << j;
    // Powers of two too: 2^j / 448 = 2^(j-9) * 8/7 -> ceil = j - 8.
    EXPECT_EQ(Mxfp8ScaleCode(std::ldexp(1.0f, j)), std::clamp(127 + j - 8, 0, 254)) << j;
  }
  EXPECT_EQ(Mxfp8ScaleCode(std::numeric_limits<float>::denorm_min()), 0);  // clamped
  EXPECT_EQ(Mxfp8ScaleCode(std::numeric_limits<float>::max()), 247);
  std::mt19937_64 rng = FreshRng();
  for (int i = 0; i < 100000; ++i) {
    const float amax =
        std::fabs(RandomInBinade(rng, std::uniform_int_distribution<int>(-149, 127)(rng)));
    ASSERT_EQ(Mxfp8ScaleCode(amax), RefScaleCode(amax)) << amax;
  }
}

// Checks q/scales of in [rows, k] against the scale rule and the round-trip bound (header).
void ExpectBlockRule(const std::vector<float>& in, int64_t rows, int64_t k,
                     const std::vector<uint8_t>& q, const std::vector<uint8_t>& scales) {
  const int64_t blocks = Mxfp8ScaleBlocks(k);
  std::vector<float> deq(in.size());
  DequantizeMxfp8RowsRef(q.data(), scales.data(), rows, k, deq.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * 32, c1 = std::min<int64_t>(c0 + 32, k);
      float amax = 0;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(in[r * k + c]));
      const int code = scales[r * blocks + b];
      ASSERT_EQ(code, RefScaleCode(amax)) << "row " << r << " block " << b << " amax " << amax;
      const double s = std::ldexp(1.0, code - 127);
      if (amax > 0 && code > 0) {
        EXPECT_GT(amax / s, 224.0);
        EXPECT_LE(amax / s, 448.0);
      }
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t i = r * k + c;
        const double x = in[i];
        // Dequantization is exact: code value times 2^(c-127), in double.
        ASSERT_EQ(static_cast<double>(deq[i]), RefE4M3(q[i]) * s) << i;
        const double err = std::fabs(x - deq[i]);
        const double bound =
            std::fabs(x) / s >= 0x1p-6 ? std::ldexp(1.0, std::ilogb(x) - 4) : std::ldexp(s, -10);
        ASSERT_LE(err, bound) << "x=" << x << " deq=" << deq[i] << " s=" << s;
        if (x != 0 && std::fabs(x) / s >= 0x1p-6) {
          ASSERT_LE(err, std::fabs(x) / 16) << x;
        }
      }
    }
  }
}

TEST(Mxfp8Rows, DequantizesEveryCodeAtEveryScaleExactly) {
  // Row r uses scale code r; its 256 columns are every E4M3 code (8 blocks of 32).
  const int64_t rows = 256, k = 256;
  std::vector<uint8_t> q(rows * k), scales(rows * 8);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) q[r * k + c] = static_cast<uint8_t>(c);
    for (int64_t b = 0; b < 8; ++b) scales[r * 8 + b] = static_cast<uint8_t>(r);
  }
  std::vector<float> out(rows * k);
  DequantizeMxfp8RowsRef(q.data(), scales.data(), rows, k, out.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float got = out[r * k + c];
      if (r == 255 || (c & 0x7f) == 0x7f) {
        ASSERT_TRUE(std::isnan(got)) << r << " " << c;  // NaN scale or NaN code
        continue;
      }
      const double want = RefE4M3(static_cast<uint8_t>(c)) * std::ldexp(1.0, r - 127);
      if (std::fabs(want) > std::numeric_limits<float>::max()) {
        ASSERT_TRUE(std::isinf(got)) << r << " " << c;
        continue;
      }
      ASSERT_EQ(static_cast<double>(got), want) << r << " " << c;
      ASSERT_EQ(std::signbit(got), (c & 0x80) != 0) << r << " " << c;
    }
  }
}

TEST(Mxfp8Rows, RoundTripBoundOnManyMagnitudes) {
  std::mt19937_64 rng = FreshRng();
  const int64_t rows = 64, k = 1024;  // 2048 blocks per trial
  for (int trial = 0; trial < 8; ++trial) {
    std::vector<float> in(rows * k);
    for (int64_t blk = 0; blk < rows * k / 32; ++blk) {
      // Each block: a base binade anywhere in FP32's normal range, elements spread over up to
      // 24 binades below it (so some fall into E4M3's subnormals or flush to zero), a few zeros.
      const int base = std::uniform_int_distribution<int>(-100, 110)(rng);
      const int spread = std::uniform_int_distribution<int>(0, 24)(rng);
      for (int j = 0; j < 32; ++j) {
        float v = RandomInBinade(rng, base - std::uniform_int_distribution<int>(0, spread)(rng));
        if (rng() % 17 == 0) v = 0.0f;
        in[blk * 32 + j] = v;
      }
    }
    std::vector<uint8_t> q(rows * k), scales(rows * Mxfp8ScaleBlocks(k));
    ASSERT_EQ(QuantizeMxfp8RowsRef(in.data(), rows, k, q.data(), scales.data()), Mxfp8Status::kOk);
    ExpectBlockRule(in, rows, k, q, scales);
  }
}

TEST(Mxfp8Rows, WeightLikeDataRelativeL2) {
  // Values uniform in [-a, a], like the synthetic weights (a = sqrt(3 / fan_in)). With
  // a = t * 2^E, t in [1, 2), the expected relative L2 error (UniformRelativeL2) ranges from
  // 2.36% (t = 1) to 2.88% (t ~ 1.215); fan-in 2048 has t = 1.22, near the worst case.
  EXPECT_NEAR(UniformRelativeL2(1.0), 0.02362, 1e-5);
  double worst = 0;
  for (int i = 0; i < 1000; ++i) worst = std::max(worst, UniformRelativeL2(1.0 + i / 1000.0));
  EXPECT_NEAR(worst, 0.02884, 1e-4);
  std::mt19937_64 rng = FreshRng();
  const int64_t rows = 256, k = 2048;
  for (float a : {0.0625f, 0.04f, 0.038273f /* sqrt(3 / 2048) */, 0.09f, 3.0f}) {
    std::vector<float> in(rows * k);
    std::uniform_real_distribution<float> u(-a, a);
    for (float& v : in) v = u(rng);
    std::vector<uint8_t> q(rows * k), scales(rows * Mxfp8ScaleBlocks(k));
    ASSERT_EQ(QuantizeMxfp8RowsRef(in.data(), rows, k, q.data(), scales.data()), Mxfp8Status::kOk);
    std::vector<float> deq(in.size());
    DequantizeMxfp8RowsRef(q.data(), scales.data(), rows, k, deq.data());
    double num = 0, den = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      num += (in[i] - deq[i]) * static_cast<double>(in[i] - deq[i]);
      den += in[i] * static_cast<double>(in[i]);
    }
    const double rel = std::sqrt(num / den), expected = UniformRelativeL2(a);
    std::cout << "a=" << a << " relative L2 " << rel << ", expected " << expected << "\n";
    // 512K samples: the estimate's own spread is about 0.1% of the value.
    EXPECT_NEAR(rel, expected, 0.01 * expected) << a;
    EXPECT_LE(rel, 0.0290) << a;
  }
}

TEST(Mxfp8Rows, AllZeroBlocksGetCodeZero) {
  const int64_t rows = 3, k = 96;
  std::vector<float> in(rows * k, 0.0f);
  for (int64_t c = 32; c < 64; ++c) in[1 * k + c] = 1.5f;  // one non-zero block in row 1
  in[2 * k + 70] = -0.0f;
  std::vector<uint8_t> q(rows * k, 0xaa), scales(rows * 3, 0xaa);
  ASSERT_EQ(QuantizeMxfp8RowsRef(in.data(), rows, k, q.data(), scales.data()), Mxfp8Status::kOk);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < 3; ++b) {
      // ceil(log2(1.5 / 448)) = ceil(-8.2) = -8 -> 119.
      EXPECT_EQ(scales[r * 3 + b], (r == 1 && b == 1) ? 119 : 0);
    }
  }
  std::vector<float> deq(rows * k, 1.0f);
  DequantizeMxfp8RowsRef(q.data(), scales.data(), rows, k, deq.data());
  for (int64_t i = 0; i < rows * k; ++i) EXPECT_EQ(deq[i], in[i]) << i;
}

TEST(Mxfp8Rows, AmaxAtPowerOfTwoTimes448IsExact) {
  std::mt19937_64 rng = FreshRng();
  for (int j : {-130, -120, -40, -9, -1, 0, 1, 7, 60, 119}) {
    std::vector<float> in(32);
    const float amax = std::ldexp(448.0f, j);
    for (float& v : in) v = amax * std::uniform_real_distribution<float>(-0.99f, 0.99f)(rng);
    in[17] = (j % 2) ? -amax : amax;
    uint8_t q[32], scale;
    ASSERT_EQ(QuantizeMxfp8RowsRef(in.data(), 1, 32, q, &scale), Mxfp8Status::kOk);
    float deq[32];
    DequantizeMxfp8RowsRef(q, &scale, 1, 32, deq);
    if (j >= -127) {
      EXPECT_EQ(scale, 127 + j) << j;
      EXPECT_EQ(q[17], (j % 2) ? 0xfe : 0x7e) << j;
      EXPECT_EQ(deq[17], in[17]) << j;
    } else {
      EXPECT_EQ(scale, 0) << j;  // clamped; amax still representable below 448 * 2^-127
    }
  }
}

TEST(Mxfp8Rows, RefusesNanAndInfWithTheirIndex) {
  const int64_t rows = 4, k = 40;
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> in(rows * k, 0.25f);
    in[2 * k + 37] = bad;
    std::vector<uint8_t> q(rows * k), scales(rows * 2);
    int64_t where = -1;
    EXPECT_EQ(QuantizeMxfp8RowsRef(in.data(), rows, k, q.data(), scales.data(), &where),
              Mxfp8Status::kNonFinite);
    EXPECT_EQ(where, 2 * k + 37);
    EXPECT_EQ(QuantizeMxfp8RowsRef(in.data(), rows, k, q.data(), scales.data()),
              Mxfp8Status::kNonFinite);  // bad_index optional
    std::vector<uint16_t> b16(in.size());
    for (size_t i = 0; i < in.size(); ++i) b16[i] = FloatToBf16(in[i]);
    where = -1;
    EXPECT_EQ(QuantizeMxfp8RowsFromBf16Ref(b16.data(), rows, k, q.data(), scales.data(), &where),
              Mxfp8Status::kNonFinite);
    EXPECT_EQ(where, 2 * k + 37);
  }
  EXPECT_NE(std::string(Mxfp8StatusName(Mxfp8Status::kNonFinite)).find("NaN or Inf"),
            std::string::npos);
  uint8_t q, s;
  EXPECT_EQ(QuantizeMxfp8RowsRef(nullptr, -1, 4, &q, &s), Mxfp8Status::kInvalidShape);
}

TEST(Mxfp8Rows, KNotAMultipleOf32PartialLastBlock) {
  std::mt19937_64 rng = FreshRng();
  for (int64_t k : {1, 7, 31, 33, 63, 70, 200}) {
    const int64_t rows = 5, blocks = Mxfp8ScaleBlocks(k);
    ASSERT_EQ(blocks, (k + 31) / 32);
    std::vector<float> in(rows * k);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        // The last (partial) block is 2^-20 times smaller: its scale must come from its own
        // values, not from the row or a neighbouring block.
        const bool last = c / 32 == blocks - 1 && blocks > 1;
        in[r * k + c] = RandomInBinade(rng, last ? -30 : -10);
      }
    }
    std::vector<uint8_t> q(rows * k), scales(rows * blocks);
    ASSERT_EQ(QuantizeMxfp8RowsRef(in.data(), rows, k, q.data(), scales.data()), Mxfp8Status::kOk);
    ExpectBlockRule(in, rows, k, q, scales);
    if (blocks > 1) {
      EXPECT_LT(scales[blocks - 1], scales[0] - 15) << k;
    }
  }
}

TEST(Mxfp8Rows, Bf16InputMatchesFp32Input) {
  std::mt19937_64 rng = FreshRng();
  const int64_t rows = 16, k = 96;
  std::vector<uint16_t> b16(rows * k);
  std::vector<float> f32(rows * k);
  for (size_t i = 0; i < b16.size(); ++i) {
    b16[i] = FloatToBf16(RandomInBinade(rng, std::uniform_int_distribution<int>(-20, 5)(rng)));
    f32[i] = Bf16ToFloat(b16[i]);
  }
  std::vector<uint8_t> q1(rows * k), s1(rows * 3), q2(rows * k), s2(rows * 3);
  ASSERT_EQ(QuantizeMxfp8RowsRef(f32.data(), rows, k, q1.data(), s1.data()), Mxfp8Status::kOk);
  ASSERT_EQ(QuantizeMxfp8RowsFromBf16Ref(b16.data(), rows, k, q2.data(), s2.data()),
            Mxfp8Status::kOk);
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(s1, s2);
}

}  // namespace
}  // namespace moeserve::kernels
