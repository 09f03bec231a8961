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
      float amax = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        v[i] = load(base + i);
        if (!IsFiniteBits(FloatBits(v[i]))) {
          if (bad_index != nullptr) *bad_index = base + i;
          return Mxfp8Status::kNonFinite;
        }
        amax = std::max(amax, std::fabs(v[i]));
      }
      const uint8_t code = Mxfp8ScaleCode(amax);
      scales[r * blocks + b] = code;
      // x / 2^(code - 127) = x * 2^(127 - code) = x * E8M0(254 - code). Exact unless the product
      // falls below FP32's normal range (< 2^-126), where E4M3 rounds it to zero either way.
      const float inv_scale = kE8M0Table[kE8M0MaxCode - code];
      for (int64_t i = 0; i < n; ++i) q[base + i] = FloatToE4M3(v[i] * inv_scale);
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
  if (a > 0x7f800000u) return sign | kE4M3NanCode;       // NaN
  if (a >= 0x43e00000u) return sign | kE4M3MaxFiniteCode;  // |x| >= 448 (and Inf): saturate
  if (a < 0x3c800000u) {
    // |x| < 2^-6: E4M3 subnormal range, spacing 2^-9. |x| * 2^9 is exact in FP32 (also for FP32
    // subnormals) and lies in [0, 8); rounding it to 8 gives 0x08, the smallest normal.
    return sign | static_cast<uint8_t>(RoundHalfEven(std::fabs(x) * 512.0f));
  }
  // Normal: keep 3 of FP32's 23 mantissa bits, ties to even; a carry into the exponent is
  // correct (it bumps the value to the next binade). |x| < 448 never carries past 448.
  const int exp = static_cast<int>(a >> 23) - 127 + 7;  // biased E4M3 exponent in [1, 15]
  uint32_t mant = (a >> 20) & 0x7;
  const uint32_t rem = a & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (mant & 1))) ++mant;
  const uint32_t code = (static_cast<uint32_t>(exp) << 3) + mant;  // mant 8 carries into exp
  return sign | static_cast<uint8_t>(code);
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
      for (int64_t c = c0; c < c1; ++c) o[c] = kE4M3Table[qr[c]] * s;
    }
  }
}

}  // namespace moeserve::kernels
