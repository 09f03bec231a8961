// In-process transport between the CPU rank threads of one engine.
//
// Each collective is a real exchange: every rank posts descriptors of its own send buffer in
// its slot of the group, waits at a barrier until all ranks have posted, copies its share out of
// each peer's send buffer into its own receive buffer, and waits at a second barrier so that no
// peer reuses a send buffer that is still being read. Nothing is exchanged through a shared
// tensor, so a device transport (NCCL) can replace this class without changing any algorithm.
#ifndef MOESERVE_CORE_COMM_IN_PROCESS_COMMUNICATOR_H_
#define MOESERVE_CORE_COMM_IN_PROCESS_COMMUNICATOR_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/comm/communicator.h"

namespace moeserve {

class InProcessCommGroup : public std::enable_shared_from_this<InProcessCommGroup> {
 public:
  // world_size >= 1; `timeout` bounds how long one rank waits for its peers at any barrier.
  static absl::StatusOr<std::shared_ptr<InProcessCommGroup>> Create(int world_size,
                                                                    absl::Duration timeout);

  // Rank `rank`'s endpoint; it keeps the group alive.
  std::unique_ptr<Communicator> MakeCommunicator(int rank);

  int world_size() const { return world_size_; }

  // Fails every rank's current and later collectives (see Communicator::Abort).
  void Abort(const absl::Status& cause);
  // OK, or the cause the group was aborted with.
  absl::Status status() const;
  // Clears a failure so the group can be used again. Only call with no collective in flight
  // (e.g. after every rank thread has returned from the failed step).
  void Reset();

 private:
  friend class InProcessCommunicator;
  enum class Op { kNone, kAllToAllV, kAllGather, kBarrier };
  struct Slot {
    Op op = Op::kNone;
    uint64_t seq = 0;
    const std::byte* send = nullptr;
    const int64_t* send_counts = nullptr;  // AllToAllV: [world_size]
    const int64_t* send_displs = nullptr;
    int64_t bytes = 0;  // AllGather: bytes per rank
  };

  InProcessCommGroup(int world_size, absl::Duration timeout)
      : world_size_(world_size), timeout_(timeout), slots_(world_size), next_seq_(world_size, 0) {}
  // Waits until every rank has arrived at this barrier, the timeout passes, or the group fails.
  // `opens_reads`: the barrier publishes the ranks' slots; once it completes, every rank reads
  // its peers' slots and buffers and must call DoneReading() before it returns.
  absl::Status Arrive(int rank, absl::string_view what, bool opens_reads = false);
  // This rank no longer reads its peers' slots; waits until no rank does (reads never block),
  // so that a rank failing early does not free or repost what a slower peer still reads.
  void DoneReading();

  const int world_size_;
  const absl::Duration timeout_;
  std::vector<Slot> slots_;  // slot r is written only by rank r, read by peers between barriers
  std::vector<uint64_t> next_seq_;  // per rank, written only by that rank (and by Reset)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  int readers_ = 0;       // ranks between an opening barrier and DoneReading()
  absl::Status failure_;  // first cause; OK while healthy
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_COMM_IN_PROCESS_COMMUNICATOR_H_
