// Host-memory collectives over one NcclCommunicator, for the small control traffic of
// multi-process serving (the leader's command header, the followers' token slices and their
// output slices). Each call copies the host bytes to grow-only device staging buffers on the
// communicator's stream, runs the NCCL collective and copies the result back, then waits
// (NcclCommunicator::Synchronize: bounded by the group's timeout, same errors). A buffer that
// grows keeps the allocation it replaces until the transfer goes (GrowOnlyBuffer, never
// ReleaseSuperseded): cudaFree waits for every stream of the device, a step's collectives
// included, without the group's timeout, and stalls every other thread's CUDA calls meanwhile.
//
// Thread-safety: as the communicator (one thread at a time). Header without CUDA/NCCL types;
// the implementation needs MOESERVE_HAVE_NCCL.
#ifndef MOESERVE_CORE_COMM_NCCL_HOST_TRANSFER_H_
#define MOESERVE_CORE_COMM_NCCL_HOST_TRANSFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/comm/nccl_communicator.h"
#include "core/cuda/grow_only_buffer.h"

namespace moeserve {

class NcclHostTransfer {
 public:
  explicit NcclHostTransfer(std::shared_ptr<NcclCommunicator> comm) : comm_(std::move(comm)) {}
  ~NcclHostTransfer();
  NcclHostTransfer(const NcclHostTransfer&) = delete;
  NcclHostTransfer& operator=(const NcclHostTransfer&) = delete;

  // `bytes` bytes at `host` on global rank `root` overwrite `host` on every rank.
  absl::Status Broadcast(void* host, int64_t bytes, int root);
  // Communicator::AllToAllV with host buffers (counts/displacements in bytes, world entries).
  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                         absl::Span<const int64_t> send_displs, void* recv,
                         absl::Span<const int64_t> recv_counts,
                         absl::Span<const int64_t> recv_displs);

  NcclCommunicator& comm() { return *comm_; }

 private:
  static constexpr size_t kMinStagingBytes = 4096;
  std::shared_ptr<NcclCommunicator> comm_;
  GrowOnlyBuffer send_{GrowOnlyBuffer::Memory::kDevice, kMinStagingBytes, /*quarter_slack=*/true};
  GrowOnlyBuffer recv_{GrowOnlyBuffer::Memory::kDevice, kMinStagingBytes, /*quarter_slack=*/true};
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_COMM_NCCL_HOST_TRANSFER_H_
