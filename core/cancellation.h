// Stopping a forward early when its caller has given up (deadline passed, call cancelled).
//
// A running forward checks between its stages (prepare -> experts -> finalize, every round).
// With several ranks exchanging tokens, every rank must take the same decision at the same
// point, or one would wait in a collective for a peer that left: a StopLatch evaluates the
// caller's check once per checkpoint (the first rank to get there) and gives every rank that
// verdict for it. Ranks pass the checkpoints in the same order (the same rounds and stages).
#ifndef MOESERVE_CORE_CANCELLATION_H_
#define MOESERVE_CORE_CANCELLATION_H_

#include <cstdint>
#include <functional>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moeserve {

// OK to go on; otherwise why to stop (DEADLINE_EXCEEDED or CANCELLED, with a message). Called
// from the ranks' threads, one at a time.
using StopCheck = std::function<absl::Status()>;

// Thread-safe.
class StopLatch {
 public:
  explicit StopLatch(StopCheck check) : check_(std::move(check)) {}

  // OK to pass checkpoint `point` (numbered in the order every rank passes them, from 0), or the
  // reason to stop there, "<reason> (stopped before <where>)". Once a point stops, every later
  // point does too. The status carries the payload IsAgreedStepFailure() looks for: every rank
  // stops at the same point, so no collective is left half done and the communicators stay
  // usable.
  absl::Status Check(int64_t point, absl::string_view where);

  // The reason the forward stopped (without the payload), OK if it did not.
  absl::Status stopped() const;

 private:
  mutable std::mutex mu_;
  StopCheck check_;
  int64_t evaluated_ = -1;       // the last point whose verdict was taken
  int64_t stop_at_ = INT64_MAX;  // the first point that stopped
  absl::Status reason_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CANCELLATION_H_
