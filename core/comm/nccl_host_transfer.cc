#include "core/comm/nccl_host_transfer.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

NcclHostTransfer::~NcclHostTransfer() {
  if (send_ == nullptr && recv_ == nullptr) return;
  cudaSetDevice(comm_->device());
  if (send_ != nullptr) cudaFree(send_);
  if (recv_ != nullptr) cudaFree(recv_);
}

absl::Status NcclHostTransfer::Reserve(void** buf, size_t* cap, size_t bytes) {
  if (bytes <= *cap) return absl::OkStatus();
  if (*buf != nullptr) cudaFree(*buf);
  *buf = nullptr;
  *cap = 0;
  const size_t want = std::max<size_t>(bytes + bytes / 4, 4096);
  if (cudaError_t e = cudaMalloc(buf, want); e != cudaSuccess) {
    *buf = nullptr;
    cudaGetLastError();  // returned as the Status: not left to fail this thread's next launch
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc(", want, ") for host staging: ", cudaGetErrorString(e)));
  }
  *cap = want;
  return absl::OkStatus();
}

absl::Status NcclHostTransfer::Broadcast(void* host, int64_t bytes, int root) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  MOESERVE_RETURN_IF_ERROR(Reserve(&send_, &send_cap_, static_cast<size_t>(bytes)));
  cudaStream_t stream = static_cast<cudaStream_t>(comm_->stream());
  if (comm_->rank() == root) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(send_, host, bytes, cudaMemcpyHostToDevice, stream));
  }
  MOESERVE_RETURN_IF_ERROR(comm_->Broadcast(send_, bytes, root));
  MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
  if (comm_->rank() != root) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, send_, bytes, cudaMemcpyDeviceToHost, stream));
    MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
  }
  return absl::OkStatus();
}

absl::Status NcclHostTransfer::AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                                         absl::Span<const int64_t> send_displs, void* recv,
                                         absl::Span<const int64_t> recv_counts,
                                         absl::Span<const int64_t> recv_displs) {
  const size_t world = static_cast<size_t>(comm_->world_size());
  if (send_counts.size() != world || send_displs.size() != world || recv_counts.size() != world ||
      recv_displs.size() != world) {
    return absl::InvalidArgumentError("NcclHostTransfer::AllToAllV: spans need world entries");
  }
  int64_t send_end = 0, recv_end = 0;
  for (size_t p = 0; p < world; ++p) {
    if (send_counts[p] > 0) send_end = std::max(send_end, send_displs[p] + send_counts[p]);
    if (recv_counts[p] > 0) recv_end = std::max(recv_end, recv_displs[p] + recv_counts[p]);
  }
  if (send_end == 0 && recv_end == 0) return absl::OkStatus();  // no traffic for this rank
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  MOESERVE_RETURN_IF_ERROR(Reserve(&send_, &send_cap_, static_cast<size_t>(send_end)));
  MOESERVE_RETURN_IF_ERROR(Reserve(&recv_, &recv_cap_, static_cast<size_t>(recv_end)));
  cudaStream_t stream = static_cast<cudaStream_t>(comm_->stream());
  if (send_end > 0) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(send_, send, send_end, cudaMemcpyHostToDevice, stream));
  }
  MOESERVE_RETURN_IF_ERROR(
      comm_->AllToAllV(send_, send_counts, send_displs, recv_, recv_counts, recv_displs));
  // Wait (bounded) before the copies back: a copy into pageable memory would block the host
  // on the collective without a timeout.
  MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
  if (recv_end == 0) return absl::OkStatus();
  for (size_t p = 0; p < world; ++p) {
    if (recv_counts[p] <= 0) continue;
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(recv) + recv_displs[p],
                                                  static_cast<char*>(recv_) + recv_displs[p],
                                                  recv_counts[p], cudaMemcpyDeviceToHost, stream));
  }
  return comm_->Synchronize();
}

}  // namespace moeserve
