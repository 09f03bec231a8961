#include "core/comm/nccl_host_transfer.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

NcclHostTransfer::~NcclHostTransfer() {
  cudaSetDevice(comm_->device());  // for the buffers' frees, which follow
}

absl::Status NcclHostTransfer::Broadcast(void* host, int64_t bytes, int root) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  MOESERVE_ASSIGN_OR_RETURN(void* staging, send_.Get(static_cast<size_t>(bytes)));
  cudaStream_t stream = static_cast<cudaStream_t>(comm_->stream());
  if (comm_->rank() == root) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging, host, bytes, cudaMemcpyHostToDevice, stream));
  }
  MOESERVE_RETURN_IF_ERROR(comm_->Broadcast(staging, bytes, root));
  MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
  if (comm_->rank() != root) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, staging, bytes, cudaMemcpyDeviceToHost, stream));
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
  MOESERVE_ASSIGN_OR_RETURN(void* send_staging, send_.Get(static_cast<size_t>(send_end)));
  MOESERVE_ASSIGN_OR_RETURN(void* recv_staging, recv_.Get(static_cast<size_t>(recv_end)));
  cudaStream_t stream = static_cast<cudaStream_t>(comm_->stream());
  if (send_end > 0) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(send_staging, send, send_end, cudaMemcpyHostToDevice, stream));
  }
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllV(send_staging, send_counts, send_displs, recv_staging,
                                            recv_counts, recv_displs));
  // Wait (bounded) before the copies back: a copy into pageable memory would block the host
  // on the collective without a timeout.
  MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
  if (recv_end == 0) return absl::OkStatus();
  for (size_t p = 0; p < world; ++p) {
    if (recv_counts[p] <= 0) continue;
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(recv) + recv_displs[p],
                                                  static_cast<char*>(recv_staging) + recv_displs[p],
                                                  recv_counts[p], cudaMemcpyDeviceToHost, stream));
  }
  return comm_->Synchronize();
}

}  // namespace moeserve
