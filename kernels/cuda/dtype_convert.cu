#include <cuda_bf16.h>

#include "kernels/cuda/dtype_convert.cuh"

namespace moeserve::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void Bf16ToFp32Kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                 int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

__global__ void Fp32ToBf16Kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                 int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  }
}

// The same integer rounding as kernels/cpu FloatToFp16 (nearest even, canonical NaN 0x7e00),
// so device and host answers are bit-identical.
__device__ __forceinline__ uint16_t FloatToFp16Bits(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;
  if (abs >= 0x477ff000u) return sign | 0x7c00u;
  if (abs < 0x38800000u) {
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;
    const uint32_t halfway = 1u << (shift - 1);
    const uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t q = mant >> shift;
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  const uint32_t rebased = abs - (112u << 23);
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

__global__ void Fp32ToFp16Kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                 int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = FloatToFp16Bits(in[i]);
  }
}

int NumBlocks(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65535 ? blocks : 65535);
}

}  // namespace

cudaError_t LaunchConvertBf16ToFp32(const uint16_t* in, float* out, int64_t n,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Bf16ToFp32Kernel<<<NumBlocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchConvertFp32ToBf16(const float* in, uint16_t* out, int64_t n,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Fp32ToBf16Kernel<<<NumBlocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t LaunchConvertFp32ToFp16(const float* in, uint16_t* out, int64_t n,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  Fp32ToFp16Kernel<<<NumBlocks(n), kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

}  // namespace moeserve::kernels
