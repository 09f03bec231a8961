#include "core/cuda/answer_copy.h"

#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda/dtype_convert.cuh"

namespace moeserve {

bool IsPinnedHostPointer(const void* p) {
  cudaPointerAttributes a;
  if (p == nullptr || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

absl::Status ConvertAnswerOnDevice(const float* d_answer, DType dtype, void* d_out, int64_t n,
                                   void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  auto* half = static_cast<uint16_t*>(d_out);
  if (dtype == DType::kBF16) {
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchConvertFp32ToBf16(d_answer, half, n, s));
  } else if (dtype == DType::kFP16) {
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchConvertFp32ToFp16(d_answer, half, n, s));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("the answer can be fp32, bf16 or fp16, got ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

absl::Status AnswerCopy::Enqueue(const float* d_answer, const TensorView& output, void* stream) {
  pending_bytes_ = 0;
  if (output.dtype() == DType::kFP32 || output.numel() == 0) {
    return EnqueueInOutputDtype(d_answer, output, stream);
  }
  MOESERVE_ASSIGN_OR_RETURN(void* d, converted_.Get(output.nbytes()));
  MOESERVE_RETURN_IF_ERROR(
      ConvertAnswerOnDevice(d_answer, output.dtype(), d, output.numel(), stream));
  return EnqueueInOutputDtype(d, output, stream);
}

absl::Status AnswerCopy::EnqueueInOutputDtype(const void* d_answer, const TensorView& output,
                                              void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  pending_bytes_ = 0;
  if (!output.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the answer must go to contiguous memory, got ", output.DebugString()));
  }
  const size_t bytes = output.nbytes();
  if (bytes == 0) return absl::OkStatus();
  if (output.device().space == MemorySpace::kCuda) {
    // A client's CUDA region: device to device (peer copy if it is another GPU).
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(output.raw_data(), d_answer, bytes, cudaMemcpyDefault, s));
    return absl::OkStatus();
  }
  if (output.device().space == MemorySpace::kPinnedHost || IsPinnedHostPointer(output.raw_data())) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(output.raw_data(), d_answer, bytes, cudaMemcpyDeviceToHost, s));
    return absl::OkStatus();
  }
  MOESERVE_ASSIGN_OR_RETURN(void* pin, staging_.Get(bytes));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pin, d_answer, bytes, cudaMemcpyDeviceToHost, s));
  pending_dst_ = output.raw_data();
  pending_src_ = pin;
  pending_bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status AnswerCopy::Reserve(const TensorView& output) {
  const size_t bytes = output.nbytes();
  if (bytes == 0) return absl::OkStatus();
  if (output.dtype() != DType::kFP32) {
    MOESERVE_RETURN_IF_ERROR(converted_.Get(bytes).status());
  }
  if (output.is_contiguous() && output.device().space == MemorySpace::kHost &&
      !IsPinnedHostPointer(output.raw_data())) {
    MOESERVE_RETURN_IF_ERROR(staging_.Get(bytes).status());
  }
  return absl::OkStatus();
}

void AnswerCopy::ReleaseSuperseded() {
  converted_.ReleaseSuperseded();
  staging_.ReleaseSuperseded();
}

void AnswerCopy::Finish() {
  if (pending_bytes_ > 0) copier_->Copy(pending_dst_, pending_src_, pending_bytes_);
  pending_bytes_ = 0;
}

}  // namespace moeserve
