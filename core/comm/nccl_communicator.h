// NCCL transport between the GPU ranks of one process (one rank per GPU, one thread per rank).
//
// An NcclCommGroup owns one NCCL communicator per local GPU, created together (non-blocking
// NCCL communicators, ncclCommInitRankConfig in one group), each bound to the CUDA stream its
// rank computes on. NcclCommunicator is rank r's endpoint and implements Communicator on
// *device* buffers:
//  - AllToAllV: one NCCL group of ncclSend/ncclRecv per peer; the rank's own share is a
//    cudaMemcpyAsync. Counts and displacements are host values (bytes).
//  - AllGather: ncclAllGather of bytes.  Barrier: a one-int ncclAllReduce, then Synchronize().
// Collectives are stream-ordered: they return once enqueued on the rank's stream (send buffers
// may be reused, receive buffers read, by later work on that stream). Synchronize() waits for
// the stream with the group's timeout and is where failures surface:
//   DEADLINE_EXCEEDED  the stream did not drain within the timeout (a peer never joined): the
//                      whole group is aborted (ncclCommAbort on every rank);
//   INTERNAL           NCCL or CUDA reported an error (ncclCommGetAsyncError, ncclGetLastError);
//   ABORTED            another rank aborted the group (the message carries its cause).
// Enqueueing itself is bounded too: with non-blocking communicators, a call that stays
// ncclInProgress past the timeout aborts the group. After a failure the group stays failed
// (healthy() false) until Reinit() builds fresh communicators; no call hangs.
//
// Thread-safety: as Communicator (one thread per rank; Abort/status/healthy from any thread).
// The header has no CUDA or NCCL types; the implementation needs MOESERVE_HAVE_NCCL.
#ifndef MOESERVE_CORE_COMM_NCCL_COMMUNICATOR_H_
#define MOESERVE_CORE_COMM_NCCL_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/comm/communicator.h"

namespace moeserve {

class NcclCommunicator;

// One AllToAllV's buffers (see Communicator::AllToAllV), for several exchanges in one group.
struct AllToAllVTransfer {
  const void* send = nullptr;
  const int64_t* send_counts = nullptr;  // [world] bytes
  const int64_t* send_displs = nullptr;
  void* recv = nullptr;
  const int64_t* recv_counts = nullptr;
  const int64_t* recv_displs = nullptr;
};

class NcclCommGroup : public std::enable_shared_from_this<NcclCommGroup> {
 public:
  // Rank r runs on CUDA device devices[r], its collectives on streams[r] (a cudaStream_t).
  // Blocks until every communicator is ready, at most `timeout`.
  static absl::StatusOr<std::shared_ptr<NcclCommGroup>> Create(std::vector<int> devices,
                                                               std::vector<void*> streams,
                                                               absl::Duration timeout);
  // Multi-process: this process's part of a group of `world_size` ranks spread over several
  // processes (or hosts). Local endpoint i is global rank first_rank + i, on devices[i] /
  // streams[i]. `unique_id` is the ncclUniqueId's bytes (NewUniqueId() on one process, handed
  // to the others out of band). Every process must call this with the same id and world_size;
  // blocks until the whole group is ready, at most `formation_timeout` (each process joins when
  // its own start-up work, e.g. its weight load, is done, so this covers the slowest one's lag;
  // DEADLINE_EXCEEDED when a process never joins; this process's communicators are then
  // aborted). Collectives then wait at most `timeout`.
  static absl::StatusOr<std::shared_ptr<NcclCommGroup>> CreateMultiProcess(
      std::vector<int> devices, std::vector<void*> streams, int world_size, int first_rank,
      const std::string& unique_id, absl::Duration timeout, absl::Duration formation_timeout);
  // A fresh ncclUniqueId as bytes (NCCL_UNIQUE_ID_BYTES long).
  static absl::StatusOr<std::string> NewUniqueId();
  ~NcclCommGroup();

  // Local endpoint i (global rank first_rank() + i; keeps the group alive).
  std::shared_ptr<NcclCommunicator> communicator(int rank);
  // Ranks in the whole group (all processes).
  int world_size() const { return world_; }
  // Ranks (endpoints) in this process, and the global rank of the first.
  int local_size() const { return static_cast<int>(devices_.size()); }
  int first_rank() const { return first_rank_; }
  bool multi_process() const { return multi_process_; }
  absl::Duration timeout() const { return timeout_; }

  // Fails every rank's current and later collectives with ABORTED carrying `cause`; each rank
  // aborts its NCCL communicator when it notices (at its next wait). Any thread; idempotent.
  void Abort(const absl::Status& cause);
  // Aborts every rank's NCCL communicator now (ncclCommAbort; NCCL kernels in flight exit).
  // Call with no rank thread inside a collective, e.g. after a failed step has returned.
  void AbortAll();
  // OK, or the first cause of failure.
  absl::Status status() const;
  bool healthy() const { return !failed_.load(std::memory_order_acquire); }
  // Destroys the (aborted) communicators and creates fresh ones with a new unique id. Only with
  // no collective in flight. A multi-process group cannot be rebuilt from one process:
  // FAILED_PRECONDITION (restart the processes).
  absl::Status Reinit();

  // "NCCL x.y.z" of the library loaded at run time.
  static std::string Version();

 private:
  friend class NcclCommunicator;
  NcclCommGroup() = default;
  // Creates the communicators and waits at most `wait` for all of them to be ready.
  absl::Status Init(absl::Duration wait);
  void Fail(const absl::Status& cause);

  static absl::StatusOr<std::shared_ptr<NcclCommGroup>> CreateLocalWithId(
      std::vector<int> devices, std::vector<void*> streams, absl::Duration timeout, int world,
      int first_rank, const std::string& unique_id, absl::Duration formation_timeout);
  std::vector<int> devices_;
  std::vector<void*> streams_;
  int world_ = 0;
  int first_rank_ = 0;
  bool multi_process_ = false;
  std::string unique_id_;     // multi-process: the id every process was given
  std::vector<void*> comms_;  // ncclComm_t
  std::vector<std::unique_ptr<NcclCommunicator>> endpoints_;
  std::unique_ptr<std::atomic<bool>[]> comm_aborted_;
  absl::Duration timeout_;
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  absl::Status failure_;
};

class NcclCommunicator final : public Communicator {
 public:
  int rank() const override { return rank_; }
  int world_size() const override;
  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                         absl::Span<const int64_t> send_displs, void* recv,
                         absl::Span<const int64_t> recv_counts,
                         absl::Span<const int64_t> recv_displs) override;
  // Several all-to-all-v exchanges in one NCCL group (one launch, one latency).
  absl::Status AllToAllVGroup(absl::Span<const AllToAllVTransfer> transfers);
  absl::Status AllGather(const void* send, int64_t bytes, void* recv) override;
  absl::Status Barrier() override;
  // ncclBroadcast of `bytes` bytes of device memory `buf` from global rank `root` to every rank
  // (in place). Stream-ordered like the others.
  absl::Status Broadcast(void* buf, int64_t bytes, int root);
  void Abort(const absl::Status& cause) override;

  // Waits until everything enqueued on this rank's stream has completed (see the file comment
  // for the errors). Spins on cudaStreamQuery: microseconds matter at decode sizes.
  absl::Status Synchronize();
  int device() const;
  void* stream() const;  // cudaStream_t
  NcclCommGroup& group() { return *group_; }

 private:
  friend class NcclCommGroup;
  NcclCommunicator(NcclCommGroup* group, int rank, int local)
      : group_(group), rank_(rank), local_(local) {}

 public:
  ~NcclCommunicator() override;

 private:
  // ncclInProgress -> wait (bounded) for the non-blocking communicator to finish enqueueing.
  absl::Status WaitEnqueued(const char* what);
  absl::Status Check(const char* what);
  NcclCommGroup* group_;     // owns this endpoint; communicator() hands out aliasing shared_ptrs
  int rank_;                 // global rank (NCCL's)
  int local_;                // index into the group's per-process arrays
  void* scratch_ = nullptr;  // device int for Barrier
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_COMM_NCCL_COMMUNICATOR_H_
