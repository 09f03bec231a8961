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

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_DTYPE_CONVERT_CUH_
