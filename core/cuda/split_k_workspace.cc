#include "core/cuda/split_k_workspace.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/moe_gemm.cuh"

namespace moeserve {

absl::StatusOr<std::unique_ptr<SplitKWorkspace>> SplitKWorkspace::Create(int device) {
  std::unique_ptr<SplitKWorkspace> ws(new SplitKWorkspace());
  if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("split-K workspace: cudaSetDevice(", device,
                                            ") failed: ", cudaGetErrorString(err)));
  }
  absl::StatusOr<void*> data = ws->buffer_.Get(kernels::kMoeGemmSplitWorkspaceBytes);
  if (!data.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("split-K workspace on GPU ", device, ": ", data.status().message()));
  }
  ws->data_ = *data;
  cudaError_t err = cudaMemset(ws->data_, 0, sizeof(int32_t) * kernels::kMoeGemmSplitCounters);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("split-K workspace: zeroing failed: ", cudaGetErrorString(err)));
  }
  return ws;
}

}  // namespace moeserve
