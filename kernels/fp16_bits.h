// FP32 -> FP16 bit conversion shared by the host (kernels/cpu/dtype_convert.cc) and the device
// (kernels/cuda/dtype_convert.cu), so both round the same way: nearest even, subnormals, overflow
// to Inf, canonical NaN 0x7e00. Integer arithmetic only; no CUDA needed to include it.
#ifndef MOESERVE_KERNELS_FP16_BITS_H_
#define MOESERVE_KERNELS_FP16_BITS_H_

#include <cstdint>

#if defined(__CUDACC__)
#define MOESERVE_HOST_DEVICE __host__ __device__
#else
#define MOESERVE_HOST_DEVICE
#endif

namespace moeserve::kernels {

// `bits`: the FP32 value's bit pattern.
MOESERVE_HOST_DEVICE inline uint16_t Fp32BitsToFp16Bits(uint32_t bits) {
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
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

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_FP16_BITS_H_
