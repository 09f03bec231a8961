#include "core/cuda/split_k_workspace.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/moe_gemm.cuh"

namespace moeserve {

absl::StatusOr<std::unique_ptr<SplitKWorkspace>> SplitKWorkspace::Create(int device) {
  std::unique_ptr<SplitKWorkspace> ws(new SplitKWorkspace());
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaMalloc(&ws->data_, kernels::kMoeGemmSplitWorkspaceBytes);
  if (err != cudaSuccess) {
    ws->data_ = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("split-K workspace: cudaMalloc(", kernels::kMoeGemmSplitWorkspaceBytes,
                     ") on GPU ", device, " failed: ", cudaGetErrorString(err)));
  }
  err = cudaMemset(ws->data_, 0, sizeof(int32_t) * kernels::kMoeGemmSplitCounters);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("split-K workspace: zeroing failed: ", cudaGetErrorString(err)));
  }
  return ws;
}

SplitKWorkspace::~SplitKWorkspace() {
  if (data_ != nullptr) cudaFree(data_);
}

}  // namespace moeserve
