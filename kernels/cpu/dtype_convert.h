// Scalar and bulk conversions between BF16, FP16 and FP32 (CPU).
//
// 16-bit values are carried as uint16_t bit patterns. Narrowing rounds to nearest, ties to even;
// NaN stays NaN (quiet), infinities and signed zeros are preserved, FP16 overflow becomes Inf.
#ifndef MOESERVE_KERNELS_CPU_DTYPE_CONVERT_H_
#define MOESERVE_KERNELS_CPU_DTYPE_CONVERT_H_

#include <cstdint>
#include <cstring>

namespace moeserve::kernels {

inline float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  const uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

float Fp16ToFloat(uint16_t bits);
uint16_t FloatToFp16(float f);

// Bulk conversions of n contiguous elements. in and out must not overlap.
void ConvertBf16ToFp32Ref(const uint16_t* in, float* out, int64_t n);
void ConvertFp32ToBf16Ref(const float* in, uint16_t* out, int64_t n);
void ConvertFp16ToFp32Ref(const uint16_t* in, float* out, int64_t n);
void ConvertFp32ToFp16Ref(const float* in, uint16_t* out, int64_t n);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CPU_DTYPE_CONVERT_H_
