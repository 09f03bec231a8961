#include "core/cuda/grow_only_buffer.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moeserve {

GrowOnlyBuffer::~GrowOnlyBuffer() {
  ReleaseSuperseded();
  if (ptr_ != nullptr) FreeOne(ptr_);
}

void GrowOnlyBuffer::FreeOne(void* ptr) const {
  memory_ == Memory::kDevice ? cudaFree(ptr) : cudaFreeHost(ptr);
}

void GrowOnlyBuffer::ReleaseSuperseded() {
  for (const auto& [ptr, bytes] : superseded_) FreeOne(ptr);
  superseded_.clear();
  superseded_bytes_ = 0;
}

absl::StatusOr<void*> GrowOnlyBuffer::Get(size_t bytes) {
  if (bytes <= capacity_) return ptr_;
  const size_t want = std::max(quarter_slack_ ? bytes + bytes / 4 : bytes, min_bytes_);
  const bool device = memory_ == Memory::kDevice;
  auto allocate = [&](void** p) { return device ? cudaMalloc(p, want) : cudaMallocHost(p, want); };
  void* fresh = nullptr;
  cudaError_t err = allocate(&fresh);
  if (err == cudaErrorMemoryAllocation && (ptr_ != nullptr || !superseded_.empty())) {
    // No room beside the old allocations: free them first (this waits for the device).
    cudaGetLastError();
    ReleaseSuperseded();
    if (ptr_ != nullptr) FreeOne(ptr_);
    ptr_ = nullptr;
    capacity_ = 0;
    err = allocate(&fresh);
  }
  if (err != cudaSuccess) {
    cudaGetLastError();  // returned as the Status: not left to fail this thread's next launch
    return absl::ResourceExhaustedError(absl::StrCat(device ? "cudaMalloc(" : "cudaMallocHost(",
                                                     want, ") failed: ", cudaGetErrorString(err)));
  }
  if (ptr_ != nullptr) {
    superseded_.emplace_back(ptr_, capacity_);
    superseded_bytes_ += capacity_;
  }
  ptr_ = fresh;
  capacity_ = want;
  return ptr_;
}

}  // namespace moeserve
