#include "kernels/cpu/mxfp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/dtype_convert.h"

namespace moeserve::kernels {
namespace {

constexpr float Pow2(int e) {
  float v = 1.0f;
  for (; e > 0; --e) v *= 2.0f;
  for (; e < 0; ++e) v *= 0.5f;  // exact down to 2^-149
  return v;
}

constexpr std::array<float, 256> MakeE4M3Table() {
  std::array<float, 256> t{};
  for (int code = 0; code < 256; ++code) {
    const int exp = (code >> 3) & 0xf, mant = code & 0x7;
    float v;
    if (exp == 0xf && mant == 0x7) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (exp == 0) {
      v = static_cast<float>(mant) * Pow2(-9);  // subnormal: mant/8 * 2^-6
    } else {
      v = static_cast<float>(8 + mant) * Pow2(exp - 10);  // (1 + mant/8) * 2^(exp-7)
    }
    t[code] = (code & 0x80) ? -v : v;
  }
  return t;
}

constexpr std::array<float, 256> MakeE8M0Table() {
  std::array<float, 256> t{};
  for (int code = 0; code < 255; ++code) t[code] = Pow2(code - kE8M0Bias);
  t[255] = std::numeric_limits<float>::quiet_NaN();
  return t;
}

constexpr std::array<float, 256> kE4M3Table = MakeE4M3Table();
constexpr std::array<float, 256> kE8M0Table = MakeE8M0Table();

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline bool IsFiniteBits(uint32_t u) { return (u & 0x7f800000u) != 0x7f800000u; }

// Rounds t >= 0 to the nearest integer, ties to even, independent of the FP rounding mode.
inline int RoundHalfEven(double t) {
  const double fl = std::floor(t);
  const double r = t - fl;  // exact
  int q = static_cast<int>(fl);
  if (r > 0.5 || (r == 0.5 && (q & 1))) ++q;
  return q;
}

inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// E4M3 code of a finite y with |y| <= 448, round to nearest even, without branches (so loops
// over it vectorize). Relies on the default FP rounding mode (to nearest) for the subnormal
// range, as all of this library does.
inline uint8_t EncodeE4M3InRange(float y) {
  const uint32_t u = FloatBits(y);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal (|y| >= 2^-6): round FP32's mantissa to 3 bits (ties to even) by adding just under
  // half an E4M3 ulp plus the kept bit's parity; a carry moves into the exponent, as it should.
  // Then rebias the exponent from 127 to 7: code = (bits >> 20) - (120 << 3).
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // Subnormal (|y| < 2^-6, spacing 2^-9): |y| * 2^9 < 8 (exact), rounded to an integer by
  // adding 2^23 in FP32; 8 becomes 0x08, the smallest normal.
  const uint32_t sub = FloatBits(BitsFloat(a) * 512.0f + 8388608.0f) - 0x4b000000u;
  return static_cast<uint8_t>(sign | (a >= 0x3c800000u ? normal : sub));
}

template <typename Load>
Mxfp8Status QuantizeRows(Load load, int64_t rows, int64_t k, uint8_t* q, uint8_t* scales,
                         int64_t* bad_index) {
  if (rows < 0 || k < 0) return Mxfp8Status::kInvalidShape;
  const int64_t blocks = Mxfp8ScaleBlocks(k);
  float v[kMxfp8BlockSize];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * kMxfp8BlockSize;
      const int64_t n = std::min(kMxfp8BlockSize, k - c0);
      const int64_t base = r * k + c0;
      // |v| compares as its bit pattern for finite values, and NaN / Inf patterns are the
      // largest: one integer max gives both amax and whether the block is finite.
      uint32_t amax_bits = 0;
      for (int64_t i = 0; i < n; ++i) {
        v[i] = load(base + i);
        amax_bits = std::max(amax_bits, FloatBits(v[i]) & 0x7fffffffu);
      }
      if (!IsFiniteBits(amax_bits)) {
        for (int64_t i = 0; i < n; ++i) {
          if (!IsFiniteBits(FloatBits(v[i]))) {
            if (bad_index != nullptr) *bad_index = base + i;
            break;
          }
        }
        return Mxfp8Status::kNonFinite;
      }
      const uint8_t code = Mxfp8ScaleCode(BitsFloat(amax_bits));
      scales[r * blocks + b] = code;
      // x / 2^(code - 127) = x * 2^(127 - code) = x * E8M0(254 - code): exact, except below
      // FP32's normal range (< 2^-126) where E4M3 rounds to zero either way. The scale rule
      // makes every |x| * 2^(127 - code) <= 448.
      const float inv_scale = kE8M0Table[kE8M0MaxCode - code];
      uint8_t* qb = q + base;
      for (int64_t i = 0; i < n; ++i) qb[i] = EncodeE4M3InRange(v[i] * inv_scale);
    }
  }
  return Mxfp8Status::kOk;
}

}  // namespace

float E4M3ToFloat(uint8_t code) { return kE4M3Table[code]; }

float E8M0ToFloat(uint8_t code) { return kE8M0Table[code]; }

uint8_t FloatToE4M3(float x) {
  const uint32_t u = FloatBits(x);
  const uint8_t sign = (u >> 24) & 0x80;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | kE4M3NanCode;         // NaN
  if (a >= 0x43e00000u) return sign | kE4M3MaxFiniteCode;  // |x| >= 448 (and Inf): saturate
  return EncodeE4M3InRange(x);
}

uint8_t DoubleToE4M3(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | kE4M3NanCode;
  const double a = std::fabs(x);
  if (a >= 448.0) return sign | kE4M3MaxFiniteCode;
  if (a < 0.015625) return sign | static_cast<uint8_t>(RoundHalfEven(a * 512.0));
  int ex;
  const double m = std::frexp(a, &ex);  // a = m * 2^ex, m in [0.5, 1)
  int exp = ex - 1 + 7;                 // a = (2m) * 2^(ex-1)
  int mant = RoundHalfEven((2.0 * m - 1.0) * 8.0);
  if (mant == 8) mant = 0, ++exp;
  return sign | static_cast<uint8_t>((exp << 3) | mant);
}

uint8_t Mxfp8ScaleCode(float amax) {
  if (!IsFiniteBits(FloatBits(amax))) return kE8M0NanCode;
  amax = std::fabs(amax);
  if (amax == 0.0f) return 0;
  // amax = m * 2^ex with m in [0.5, 1), and 448 = 0.875 * 2^9, so
  // amax / 448 = (m / 0.875) * 2^(ex - 9) with m / 0.875 in (0.57, 1.15): its ceil(log2) is
  // ex - 9 when m <= 0.875 and ex - 8 otherwise. Exact, unlike a rounded log2.
  int ex;
  const float m = std::frexp(amax, &ex);
  const int e = m <= 0.875f ? ex - 9 : ex - 8;
  return static_cast<uint8_t>(std::clamp(e + kE8M0Bias, 0, static_cast<int>(kE8M0MaxCode)));
}

const char* Mxfp8StatusName(Mxfp8Status status) {
  switch (status) {
    case Mxfp8Status::kOk:
      return "ok";
    case Mxfp8Status::kNonFinite:
      return "non-finite input (NaN or Inf) cannot be quantized to MXFP8";
    case Mxfp8Status::kInvalidShape:
      return "negative rows or k";
  }
  return "unknown";
}

Mxfp8Status QuantizeMxfp8RowsRef(const float* in, int64_t rows, int64_t k, uint8_t* q,
                                 uint8_t* scales, int64_t* bad_index) {
  return QuantizeRows([in](int64_t i) { return in[i]; }, rows, k, q, scales, bad_index);
}

Mxfp8Status QuantizeMxfp8RowsFromBf16Ref(const uint16_t* in, int64_t rows, int64_t k, uint8_t* q,
                                         uint8_t* scales, int64_t* bad_index) {
  return QuantizeRows([in](int64_t i) { return Bf16ToFloat(in[i]); }, rows, k, q, scales,
                      bad_index);
}

void DequantizeMxfp8RowsRef(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t k,
                            float* out) {
  const int64_t blocks = Mxfp8ScaleBlocks(k);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* qr = q + r * k;
    float* o = out + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      const float s = kE8M0Table[scales[r * blocks + b]];
      const int64_t c0 = b * kMxfp8BlockSize;
      const int64_t c1 = std::min(c0 + kMxfp8BlockSize, k);
      // A table lookup and one exact multiply. (Bit arithmetic that vectorizes was measured
      // slower at the baseline x86-64 target this builds for: about 1.5 vs 0.8 ns per value.)
      for (int64_t c = c0; c < c1; ++c) o[c] = kE4M3Table[qr[c]] * s;
    }
  }
}

}  // namespace moeserve::kernels
