// The engine: resolves its options once (ResolveEngineConfig), has the backend build its ranks
// (a RankGroup: weights, modular kernels, communicators), and runs one MoE layer forward at a
// time: validate, split the tokens over the ranks, run, gather, report timings. Multi-process
// groups run through a MultiProcessDriver. This is the API the server (and any other frontend)
// drives.
#ifndef MOESERVE_CORE_ENGINE_H_
#define MOESERVE_CORE_ENGINE_H_

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/cancellation.h"
#include "core/engine_plan.h"
#include "core/model_config.h"
#include "core/modular_kernel.h"
#include "core/multi_process_driver.h"
#include "core/rank_group.h"
#include "core/router.h"
#include "core/tensor.h"
#include "core/weights.h"

namespace moeserve {

// One layer call. Views are read-only and must stay valid for the call.
struct ForwardInput {
  int layer = 0;
  TensorView hidden_states;  // [M, hidden] BF16, FP16 or FP32
  TensorView topk_ids;       // [M, topk] INT32 or INT64, each in [0, num_experts)
  TensorView topk_weights;   // [M, topk] FP32, finite, |w| <= kMaxAbsTopkWeight
};

struct ForwardTimings {
  double queue_us = 0;
  // Host wall time of the step on the ranks (their stages, waits and host work), so that a
  // caller's total minus this is its own overhead.
  double engine_us = 0;
  // Stage times: the slowest rank's per stage; num_chunks: the most rounds; transfer: bytes
  // summed over ranks (each rank's bytes to/from other ranks).
  StageTimings stages;
  std::vector<StageTimings> rank_stages;  // per rank
  // Whether stages and rank_stages were measured: false (and they are zero) when the step ran
  // without its stage timers (ForwardValidated's time_stages).
  bool stages_timed = false;
};

struct EngineInfo {
  ModelConfig model;
  std::string backend;
  std::string prepare_finalize;
  std::string experts;
  WeightFormat weight_format = WeightFormat::kBF16;
  std::string checkpoint_dir;  // empty: synthetic weights from `seed`
  int num_ranks = 1;
  std::string placement = "contiguous";
  std::vector<std::vector<int>> rank_experts;  // global expert ids per rank
  int64_t max_tokens_per_request = 0;
  int64_t max_tokens_per_rank = 0;  // per dispatch round
  int local_ranks = 1;              // ranks in this process (multi-process: < num_ranks)
  int node_rank = 0;                // this process's index (multi-process)
  int threads_per_rank = 1;         // experts' threads on each rank
  std::vector<DType> hidden_dtypes = {DType::kBF16, DType::kFP16, DType::kFP32};
  std::vector<DType> topk_ids_dtypes = {DType::kINT32, DType::kINT64};
  // Server-side routing (Engine::Route): the router as RouterConfig::Describe() says, or empty
  // when there is none, with the reason in no_router_reason.
  std::string router;
  std::string no_router_reason;
  // Forward takes hidden_states and writes the output in CUDA device memory too (a client's
  // CUDA region, read and written in place): single-process GPU engines.
  bool device_tensors = false;
  // Forward takes topk_ids (INT32) and topk_weights in CUDA device memory too, checked on the
  // device (a bad value is INVALID_ARGUMENT once the step's device work has finished) so that
  // no copy to the host and no wait precede the launch: single-rank GPU engines.
  bool device_routing = false;
  // Steps of at most this many tokens per rank replay CUDA graphs (0: none; then
  // no_graphs_reason says why, when graphs were wanted).
  int64_t graph_max_tokens = 0;
  std::string no_graphs_reason;
};

// Checks a forward against the model: INVALID_ARGUMENT naming the field, what came and what
// was expected; RESOURCE_EXHAUSTED when M exceeds max_tokens. Reads ids and weights where they
// are host memory; in device memory (EngineInfo::device_routing) the engine checks them there.
// NaN/Inf in hidden_states is allowed and propagates to that token's output only.
// Engine::Forward runs it; ValidateForwardShapes is its O(1) part (layer, dtypes, shapes, M),
// enough to size an output buffer before calling Forward.
absl::Status ValidateForwardShapes(const ModelConfig& model, int64_t max_tokens,
                                   const ForwardInput& input);
absl::Status ValidateForwardInput(const ModelConfig& model, int64_t max_tokens,
                                  const ForwardInput& input);

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();

  // Validates and runs one forward; output [M, hidden] with hidden_states' dtype (caller-owned;
  // host memory, or CUDA device memory as hidden_states may be where info().device_tensors --
  // elsewhere FAILED_PRECONDITION). topk ids and weights are host memory, or CUDA device memory
  // where info().device_routing (ids INT32; INVALID_ARGUMENT otherwise). Thread-safe:
  // concurrent calls run up to steps_in_flight() at once (each on its own lane: stream, buffers,
  // workspaces), the rest wait. With R ranks the M tokens are split evenly (rank r is the source
  // of its slice), every rank runs the modular kernel (its collectives in the same order) and
  // rank 0, the leader, gathers the output slices. A failure on one rank aborts the collectives
  // of all; the first root cause is returned and the engine stays usable.
  //
  // `stop` (may be null) says whether the caller gave up: it is checked once a lane is free
  // and then between the stages of every round on every rank (in a single process; a
  // multi-process group checks only before the step), and its DEADLINE_EXCEEDED or CANCELLED
  // is returned as it is, naming where it stopped; the output is then unspecified and the
  // engine stays healthy.
  absl::Status Forward(const ForwardInput& input, const TensorView& output,
                       ForwardTimings* timings = nullptr, StopCheck stop = nullptr);
  // Forward for a caller that has already run ValidateForwardInput on `input` (with this
  // engine's model and max_tokens_per_request), e.g. the batcher: the O(M * topk) value scan is
  // not repeated. Shapes and the output are still checked.
  // `time_stages` false skips the stage timers while still filling the host-clock timings
  // (queue_us, engine_us): a GPU rank's timers record device events, about 9 us of a one-token
  // step on an H200 (tests/benchmarks/engine/RESULTS.md, 2026-12-04 14:23).
  absl::Status ForwardValidated(const ForwardInput& input, const TensorView& output,
                                ForwardTimings* timings = nullptr, StopCheck stop = nullptr,
                                bool time_stages = true);

  // Server-side routing: the layer's gate on hidden_states -> topk_ids and topk_weights
  // (core/router.h for the semantics). hidden [M, hidden] BF16/FP16/FP32, topk_ids INT32
  // [M, topk] and topk_weights FP32 [M, topk] written; host memory. FAILED_PRECONDITION when
  // the model has no router (info().no_router_reason); otherwise the refusals of
  // ValidateForwardShapes (layer, hidden_states, M over the limit). Thread-safe and independent
  // of forwards (it runs beside them, on the caller's thread and the router's own threads).
  // Cost: one FP32 GEMM of M x hidden x num_experts on the host, whatever the backend
  // (tests/benchmarks/router/RESULTS.md: DeepSeek-V3's gate about 1-2 ms at M <= 16 on a busy
  // 2-core machine, linear in M beyond).
  absl::Status Route(int layer, const TensorView& hidden_states, const TensorView& topk_ids,
                     const TensorView& topk_weights) const;
  bool has_router() const { return router_ != nullptr; }

  // One expert's weights as computed with, rounded to BF16: w13 [2I, H], w2 [H, I].
  absl::Status GetExpertWeightsBf16(int layer, int expert, uint16_t* w13, uint16_t* w2) const;
  // What GetExpertWeightsBf16 checks first, cheaply (callers check before allocating):
  // INVALID_ARGUMENT unless `layer` has experts and `expert` is in [0, num_experts).
  absl::Status ValidateExpertRef(int layer, int expert) const;

  const EngineInfo& info() const { return info_; }
  // Steps that may run at once (Forward calls beyond it wait for a lane).
  int steps_in_flight() const { return plan_.lanes; }
  // Graph replay counters of this process's ranks (all zero without graphs).
  GraphStats graph_stats() const;

  // OK while the engine can serve; otherwise why not (e.g. the NCCL communicators were aborted
  // after a collective timed out or a rank failed mid-forward). While unhealthy, Forward
  // returns UNAVAILABLE at once. The server should report NOT_SERVING while !healthy().
  // Thread-safe, never blocks on a forward.
  absl::Status health() const;
  bool healthy() const { return health().ok(); }
  // Rebuilds the communicators after a failure (waits for any forward in flight); OK and
  // healthy again on success.
  absl::Status Recover();
  // Tests only: marks the engine unhealthy with `cause`, as a failed collective would.
  void MarkUnhealthyForTesting(absl::Status cause);

  // Multi-process mode (EngineOptions::world_size). A fresh collective id for the leader to
  // hand to the followers; FAILED_PRECONDITION without NCCL.
  static absl::StatusOr<std::string> NewCollectiveId();
  bool is_follower() const { return multi_process_ != nullptr && !multi_process_->is_leader(); }
  // Follower: runs every command the leader broadcasts (forwards, heartbeats) until the leader
  // shuts the group down (OK) or a collective fails or times out (the error; the process should
  // then exit: a multi-process group is rebuilt by restarting it).
  absl::Status RunFollower();
  // Makes collectives in flight and later ones fail with ABORTED (e.g. RunFollower on SIGTERM).
  // Any thread.
  void AbortCollectives(const absl::Status& cause);

 private:
  Engine() = default;
  // A failed step as clients see it (UNAVAILABLE for a collective's timeout or abort).
  static absl::Status ClientStatusForFailedStep(absl::Status cause);

  // Takes a free lane (waiting for one) and holds its mutex until destroyed.
  class LaneLease;
  int AcquireLane();
  void ReleaseLane(int lane);

  EnginePlan plan_;
  EngineInfo info_;
  // Steps run on lanes (plan_.lanes; 1 on the CPU and with collectives): a step holds one
  // lane's mutex while it runs; Recover holds them all; the multi-process driver's heartbeats
  // take lane 0's.
  std::vector<std::unique_ptr<std::mutex>> lane_mu_;
  std::mutex pool_mu_;
  std::condition_variable pool_cv_;
  std::vector<bool> lane_busy_;  // guarded by pool_mu_
  std::unique_ptr<RankGroup> ranks_;
  std::unique_ptr<MultiProcessDriver> multi_process_;  // null in a single process
  std::unique_ptr<Router> router_;                     // null: no server-side routing
  std::vector<HostBuffer> ids32_;                      // per lane
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_ENGINE_H_
