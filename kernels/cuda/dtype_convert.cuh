// BF16 <-> FP32 and FP32 -> FP16 conversion on the device. The CPU twins are ConvertBf16ToFp32Ref,
// ConvertFp32ToBf16Ref and ConvertFp32ToFp16Ref in kernels/cpu/dtype_convert.h; results are
// bit-identical.
#ifndef MOESERVE_KERNELS_CUDA_DTYPE_CONVERT_CUH_
#define MOESERVE_KERNELS_CUDA_DTYPE_CONVERT_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moeserve::kernels {

// Asynchronous on `stream`; in/out are device pointers of n elements.
cudaError_t LaunchConvertBf16ToFp32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchConvertFp32ToBf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
cudaError_t LaunchConvertFp32ToFp16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
// FP16 -> BF16 through FP32 (exact), rounded to nearest even: as the host's ConvertTensor.
cudaError_t LaunchConvertFp16ToBf16(const uint16_t* in, uint16_t* out, int64_t n,
                                    cudaStream_t stream);

// Copies `bytes` from src to dst on the SMs (16 bytes per thread where both pointers and the
// size are 16-byte aligned, else 1). Either side may be page-locked host memory, which the
// kernel reads or writes over PCIe (unified addressing): a small staged copy then needs no
// copy-engine node in a captured graph. The CPU twin is std::memcpy.
cudaError_t LaunchCopyBytes(void* dst, const void* src, size_t bytes, cudaStream_t stream);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_DTYPE_CONVERT_CUH_
