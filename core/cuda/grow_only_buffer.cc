#include "core/cuda/grow_only_buffer.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moeserve {

GrowOnlyBuffer::~GrowOnlyBuffer() { Free(); }

void GrowOnlyBuffer::Free() {
  if (ptr_ != nullptr) memory_ == Memory::kDevice ? cudaFree(ptr_) : cudaFreeHost(ptr_);
  ptr_ = nullptr;
  capacity_ = 0;
}

absl::StatusOr<void*> GrowOnlyBuffer::Get(size_t bytes) {
  if (bytes <= capacity_) return ptr_;
  Free();
  const size_t want = std::max(quarter_slack_ ? bytes + bytes / 4 : bytes, min_bytes_);
  const bool device = memory_ == Memory::kDevice;
  if (cudaError_t err = device ? cudaMalloc(&ptr_, want) : cudaMallocHost(&ptr_, want);
      err != cudaSuccess) {
    ptr_ = nullptr;
    cudaGetLastError();  // returned as the Status: not left to fail this thread's next launch
    return absl::ResourceExhaustedError(absl::StrCat(device ? "cudaMalloc(" : "cudaMallocHost(",
                                                     want, ") failed: ", cudaGetErrorString(err)));
  }
  capacity_ = want;
  return ptr_;
}

}  // namespace moeserve
