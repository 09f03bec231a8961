#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/fp16_bits.h"

namespace moeserve::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void Bf16ToFp32Kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                 int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

__global__ void Fp32ToBf16Kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                 int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  }
}

__global__ void Fp32ToFp16Kernel(const float* __restrict__ in, uint16_t* __restrict__ out,
                                 int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = Fp32BitsToFp16Bits(__float_as_uint(in[i]));  // as the host twin
  }
}

__global__ void Fp16ToBf16Kernel(const uint16_t* __restrict__ in, uint16_t* __restrict__ out,
                                 int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float f = __half2float(__ushort_as_half(in[i]));
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
}

// T = uint4 (16 bytes a thread) or uint8_t.
template <typename T>
__global__ void CopyKernel(const T* __restrict__ src, T* __restrict__ dst, int64_t n) {
  PdlWait();
  PdlLaunchDependents();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
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
  return LaunchPdl(Bf16ToFp32Kernel, dim3(NumBlocks(n)), dim3(kThreads), 0, stream, in, out, n);
}

cudaError_t LaunchConvertFp32ToBf16(const float* in, uint16_t* out, int64_t n,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return LaunchPdl(Fp32ToBf16Kernel, dim3(NumBlocks(n)), dim3(kThreads), 0, stream, in, out, n);
}

cudaError_t LaunchConvertFp32ToFp16(const float* in, uint16_t* out, int64_t n,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return LaunchPdl(Fp32ToFp16Kernel, dim3(NumBlocks(n)), dim3(kThreads), 0, stream, in, out, n);
}

cudaError_t LaunchConvertFp16ToBf16(const uint16_t* in, uint16_t* out, int64_t n,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return LaunchPdl(Fp16ToBf16Kernel, dim3(NumBlocks(n)), dim3(kThreads), 0, stream, in, out, n);
}

cudaError_t LaunchCopyBytes(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (aligned(dst) && aligned(src) && bytes % 16 == 0) {
    const auto n = static_cast<int64_t>(bytes / 16);
    return LaunchPdl(CopyKernel<uint4>, dim3(NumBlocks(n)), dim3(kThreads), 0, stream,
                     static_cast<const uint4*>(src), static_cast<uint4*>(dst), n);
  }
  const auto n = static_cast<int64_t>(bytes);
  return LaunchPdl(CopyKernel<uint8_t>, dim3(NumBlocks(n)), dim3(kThreads), 0, stream,
                   static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), n);
}

}  // namespace moeserve::kernels
