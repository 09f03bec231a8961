#include "kernels/cpu/dtype_convert.h"

namespace moeserve::kernels {

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u);
  } else {
    u = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint16_t FloatToFp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: Inf
  if (abs < 0x38800000u) {                        // below the smallest normal, 2^-14
    if (abs < 0x33000000u) return sign;           // below half the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    const uint32_t halfway = 1u << (shift - 1);
    const uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t q = mant >> shift;
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  // Normal: rebias exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebased = abs - (112u << 23);
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

void ConvertBf16ToFp32Ref(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}
void ConvertFp32ToBf16Ref(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(in[i]);
}
void ConvertFp16ToFp32Ref(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Fp16ToFloat(in[i]);
}
void ConvertFp32ToFp16Ref(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToFp16(in[i]);
}

}  // namespace moeserve::kernels
