#include "kernels/cpu/dtype_convert.h"

#include "kernels/fp16_bits.h"

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
  return Fp32BitsToFp16Bits(u);
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
