// Multi-process (multi-node) serving on top of a RankGroup: the leader process (node 0) runs
// every forward and broadcasts a command to the followers, which run their ranks' part of it;
// an idle leader sends a no-op heartbeat so a dead follower is found without a forward.
//
// Protocol, per step: the leader's global rank 0 broadcasts a fixed-size command (int64 words:
// magic, op, layer, M, hidden dtype, world, then the world + 1 token bounds) over the ranks'
// host channels (RankGroup::host_transfer); for a forward, rank 0 sends every remote rank its
// tokens (hidden rows, int32 ids, fp32 weights), every rank runs its kernel, and the remote
// ranks send their output rows back to rank 0. Ranks of the leader's process use the leader's
// buffers directly.
#ifndef MOESERVE_CORE_MULTI_PROCESS_DRIVER_H_
#define MOESERVE_CORE_MULTI_PROCESS_DRIVER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "core/rank_group.h"
#include "core/tensor.h"

namespace moeserve {

class MultiProcessDriver {
 public:
  // `group` (plan().multi_process) and `step_mu` (the owner's one-step-at-a-time lock, which
  // the heartbeat takes with try_lock) outlive the driver.
  MultiProcessDriver(RankGroup* group, std::mutex* step_mu);
  // Stop().
  ~MultiProcessDriver();

  bool is_leader() const { return group_->first_rank() == 0; }

  // Leader: starts the heartbeat thread (plan().heartbeat_ms > 0). Call once the group formed.
  void Start();
  // Leader, with step_mu held: one forward over every process. The followers' results arrive
  // in step.output. Returns the root cause as RankGroup::RunOnEveryRank does.
  absl::Status Forward(const ForwardStep& step);
  // Follower (takes step_mu): runs every command until the leader shuts the group down (OK) or
  // a step fails (the error; a refusal every rank agreed on is not a failure).
  absl::Status RunFollower();
  // Stops the heartbeat; a started leader then tells the followers to leave their loop (bounded
  // by the collective timeout). Idempotent.
  void Stop();

 private:
  // One command on every local rank (leader: `command`; followers: null, received).
  absl::Status RunCommandOnEveryRank(const std::vector<int64_t>* command, const ForwardStep* step);
  absl::Status RunCommandOnRank(int local, const std::vector<int64_t>* command,
                                const ForwardStep* step);
  void HeartbeatLoop();

  RankGroup* const group_;
  std::mutex* const step_mu_;
  const int world_;
  bool started_ = false;
  // Per local rank: the command last received and the packed token slices.
  std::vector<std::vector<int64_t>> command_;
  std::vector<std::vector<char>> slices_;
  std::chrono::steady_clock::time_point last_step_;

  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;
  std::thread heartbeat_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_MULTI_PROCESS_DRIVER_H_
