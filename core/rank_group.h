// The ranks of one process: each a modular kernel over its experts' weights, with the
// communicators between them. A backend (CPU threads, one GPU per rank) builds them from an
// EnginePlan and the provider registry; Engine and MultiProcessDriver drive them.
#ifndef MOESERVE_CORE_RANK_GROUP_H_
#define MOESERVE_CORE_RANK_GROUP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/comm/rank_threads.h"
#include "core/engine_plan.h"
#include "core/modular_kernel.h"
#include "core/tensor.h"
#include "core/weights.h"

namespace moeserve {

class StopLatch;  // core/cancellation.h

// One forward over every rank, in host memory. Views stay valid for the call.
struct ForwardStep {
  int layer = 0;
  int lane = 0;              // which of the plan's lanes runs it (see EnginePlan::lanes)
  bool timed = true;         // collect stage timings (RankGroup::timings)
  TensorView hidden_states;  // [M, hidden] BF16, FP16 or FP32
  TensorView topk_ids;       // [M, topk] INT32, validated
  TensorView topk_weights;   // [M, topk] FP32
  TensorView output;  // [M, hidden] the request's dtype, written on the leader (global rank 0)
  // world_size + 1 entries: global rank r is the source of tokens [bounds[r], bounds[r+1]).
  std::vector<int64_t> bounds;
  // Checked by every rank between stages (the caller gave up: see core/cancellation.h); null:
  // run to the end. Single process only (followers do not see the caller).
  StopLatch* stop = nullptr;
};

// A step failure every rank agreed on (a refusal found in a collective, e.g. NCCL PlanChunks):
// the communicators are intact and the next step may run. The payload URL is the one
// core/cuda/nccl_all_to_all.cc sets; RunOnEveryRank keeps it on the root cause.
inline bool IsAgreedStepFailure(const absl::Status& status) {
  return !status.ok() && status.GetPayload("moeserve/agreed_failure").has_value();
}
// `status` marked as a failure every rank agreed on (e.g. a StopLatch verdict).
inline absl::Status MarkAgreedStepFailure(absl::Status status) {
  if (!status.ok()) status.SetPayload("moeserve/agreed_failure", absl::Cord("1"));
  return status;
}

// Host-memory collectives with the ranks of every process (multi-process: commands, token and
// output slices). One per local rank; called from that rank's thread only.
class HostTransfer {
 public:
  virtual ~HostTransfer() = default;
  // `bytes` bytes at `host` on global rank `root` overwrite `host` on every rank.
  virtual absl::Status Broadcast(void* host, int64_t bytes, int root) = 0;
  // Communicator::AllToAllV semantics (counts/displacements in bytes, world_size entries).
  virtual absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                                 absl::Span<const int64_t> send_displs, void* recv,
                                 absl::Span<const int64_t> recv_counts,
                                 absl::Span<const int64_t> recv_displs) = 0;
};

// Thread-safety: Run/RunOnEveryRank/Recover one at a time (the Engine serializes them), except
// that Runs on different lanes may overlap (plan().lanes > 1: one local rank, no collectives);
// health/MarkUnhealthy/Abort from any thread.
class RankGroup {
 public:
  virtual ~RankGroup() = default;

  virtual int num_local_ranks() const = 0;
  int first_rank() const { return plan_.first_rank; }  // global rank of local rank 0
  const EnginePlan& plan() const { return plan_; }
  int num_lanes() const { return plan_.lanes; }

  // Single process: every rank runs its slice of `step` through its modular kernel (the
  // collectives between ranks included) and the leader's `step.output` receives every slice.
  // Blocks until all ranks return. Returns OK or the root cause (see RunOnEveryRank).
  absl::Status Run(const ForwardStep& step);

  // Runs fn(local_rank) on every local rank at once (a rank's own thread where there are
  // several). A failing rank aborts its peers' collectives at once, unless the failure is one
  // every rank agreed on (IsAgreedStepFailure: no collective is left waiting). Returns OK or the
  // root cause: a failure other than a peer's ABORTED echo where there is one, as "rank <global>:
  // <message>" (with the cause's payloads) when there is more than one rank. After a failure the
  // group is ready for the next step, or unhealthy (health()).
  absl::Status RunOnEveryRank(const std::function<absl::Status(int local)>& fn);

  // The local rank's modular kernel over one slice: host views, `out` [rows, hidden] FP32.
  // Runs the kernel's collectives: every rank must call it in the same step.
  // timed: collect stage timings (device timers record events; skipped when nobody reads them).
  // `lane`: whose kernel (buffers, stream) runs it.
  // stop: checked between stages (null: none); every rank of the step must get the same one.
  absl::Status ForwardSlice(int local, int layer, const TensorView& hidden_states,
                            const TensorView& topk_ids, const TensorView& topk_weights,
                            const TensorView& out, bool timed = true, int lane = 0,
                            StopLatch* stop = nullptr);
  // Graph counters summed over every local rank and lane; graph_max_tokens() is what the
  // kernels replay (0: graphs off, no_graphs_reason() says why when they were wanted).
  GraphStats graph_stats() const;
  int64_t graph_max_tokens() const;
  const std::string& no_graphs_reason() const { return no_graphs_reason_; }
  // The stage times of the local rank's last timed ForwardSlice on `lane`.
  const StageTimings& timings(int local, int lane = 0) const { return ranks_[local].timings[lane]; }
  const ExpertWeightStore& weights(int local) const { return *ranks_[local].weights; }
  // A per-rank buffer for an output slice that is sent on, reused across steps.
  TensorView OutputBuffer(int local, int64_t rows, DType dtype);

  // Multi-process: the local rank's host channel to every process; null otherwise.
  virtual HostTransfer* host_transfer(int local) { return nullptr; }

  // OK while the ranks can serve; otherwise why not (e.g. aborted NCCL communicators).
  absl::Status health() const;
  void MarkUnhealthy(absl::Status cause);
  // Rebuilds what a failure broke (waits for nothing: call between steps); healthy on success.
  virtual absl::Status Recover();
  // Makes collectives in flight and later ones fail with ABORTED. Any thread.
  virtual void Abort(const absl::Status& cause) {}

 protected:
  struct Rank {
    std::unique_ptr<ExpertWeightStore> weights;
    // One modular kernel per lane (plan_.lanes), over the same weights.
    std::vector<std::unique_ptr<ModularKernel>> kernels;
    std::vector<int32_t> expert_map;    // global -> local on this rank
    std::vector<StageTimings> timings;  // per lane
    HostBuffer out;
  };

  explicit RankGroup(const EnginePlan& plan) : plan_(plan) {}
  // After the ranks are built.
  void StartThreads();

  // One rank's part of Run. Default: the slice written in place (ranks sharing the process's
  // output, e.g. GPUs copying their answer to the host).
  virtual absl::Status RunRank(int local, const ForwardStep& step);
  // A rank failed: unblock its peers (called on the failing rank's thread).
  virtual void AbortPeers(const absl::Status& cause) {}
  // Every rank returned and `cause` is the step's root cause.
  virtual void AfterFailedStep(const absl::Status& cause) {}

  const EnginePlan plan_;
  std::vector<Rank> ranks_;
  std::string no_graphs_reason_;  // set by a backend's Build when graphs were wanted but refused

 private:
  std::unique_ptr<RankThreads> threads_;  // null with one local rank
  mutable std::mutex health_mu_;
  absl::Status health_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_RANK_GROUP_H_
