// Host-memory collectives over one NcclCommunicator, for the small control traffic of
// multi-process serving (the leader's command header, the followers' token slices and their
// output slices). Each call copies the host bytes to grow-only device staging buffers on the
// communicator's stream, runs the NCCL collective and copies the result back, then waits
// (NcclCommunicator::Synchronize: bounded by the group's timeout, same errors).
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
  absl::Status Reserve(void** buf, size_t* cap, size_t bytes);
  std::shared_ptr<NcclCommunicator> comm_;
  void* send_ = nullptr;
  size_t send_cap_ = 0;
  void* recv_ = nullptr;
  size_t recv_cap_ = 0;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_COMM_NCCL_HOST_TRANSFER_H_
