// Collectives between the expert-parallel ranks of one engine.
//
// A Communicator is one rank's endpoint of a group of world_size() ranks. Every rank calls the
// same collectives in the same order (as with NCCL or MPI); a collective returns on a rank once
// that rank's part of the exchange is complete.
//
// Thread-safety: one Communicator belongs to one rank and is used by one thread at a time;
// different ranks' Communicators are used concurrently from different threads. Abort() is the
// exception: any thread may call it at any time.
//
// Blocking: every collective blocks until all ranks have joined it (or the group's timeout
// passes, or a rank aborts). Send buffers may be reused and receive buffers read as soon as the
// call returns OK. Errors:
//   DEADLINE_EXCEEDED  a peer did not join within the timeout (the group is then aborted);
//   ABORTED            another rank aborted the group (the message carries its cause);
//   INTERNAL           the ranks disagree (mismatched collective or byte counts).
// After an error the group stays failed until its owner resets it with no collective in
// flight (see InProcessCommGroup::Reset).
#ifndef MOESERVE_CORE_COMM_COMMUNICATOR_H_
#define MOESERVE_CORE_COMM_COMMUNICATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace moeserve {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // All-to-all-v of bytes. To peer p this rank sends send_counts[p] bytes starting at
  // send + send_displs[p]; from peer p it receives recv_counts[p] bytes into
  // recv + recv_displs[p]. recv_counts[p] must equal what p sends here (INTERNAL otherwise; the
  // counts are normally exchanged first with AllGather). Spans have world_size() entries.
  // send and recv must not overlap.
  virtual absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                                 absl::Span<const int64_t> send_displs, void* recv,
                                 absl::Span<const int64_t> recv_counts,
                                 absl::Span<const int64_t> recv_displs) = 0;

  // Every rank contributes `bytes` bytes; recv [world_size() * bytes] receives rank p's at
  // recv + p * bytes. Every rank must pass the same `bytes`.
  virtual absl::Status AllGather(const void* send, int64_t bytes, void* recv) = 0;

  virtual absl::Status Barrier() = 0;

  // Fails the collectives in flight and those that follow, on every rank of the group, with
  // ABORTED carrying `cause`. Safe from any thread. Idempotent (the first cause is kept).
  virtual void Abort(const absl::Status& cause) = 0;
};

// All-gather of one int64 vector per rank: out[p * mine.size() + i] = rank p's mine[i].
absl::Status AllGatherCounts(Communicator& comm, absl::Span<const int64_t> mine,
                             std::vector<int64_t>* out);

// Checks gathered counts (per-peer rows, rounds) before anything is sized from them: every
// entry of `all` (every rank's counts, as AllGatherCounts returns them) in [0, max_rows]. Every
// rank checks the whole gather, so all ranks see the same verdict and fail the forward together (no
// rank left waiting in the next collective). DATA_LOSS names the rank, the entry, the value and the
// bound; `who` prefixes it.
absl::Status CheckGatheredCounts(absl::Span<const int64_t> all, int world_size, int64_t max_rows,
                                 absl::string_view who);

}  // namespace moeserve

#endif  // MOESERVE_CORE_COMM_COMMUNICATOR_H_
