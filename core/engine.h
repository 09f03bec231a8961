// The engine: owns the expert weights, the modular kernel(s) and the ranks, and runs one MoE
// layer forward at a time. This is the API the server (and any other frontend) drives.
#ifndef MOESERVE_CORE_ENGINE_H_
#define MOESERVE_CORE_ENGINE_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/comm/in_process_communicator.h"
#include "core/comm/rank_threads.h"
#include "core/model_config.h"
#include "core/modular_kernel.h"
#include "core/placement.h"
#include "core/tensor.h"
#include "core/weight_loader.h"
#include "core/weights.h"

namespace moeserve {

class NcclCommGroup;

struct EngineOptions {
  ModelConfig model;
  // "cpu" | "cuda" (one GPU per rank; FAILED_PRECONDITION without a GPU or a CUDA build) |
  // "auto" (cuda where a GPU exists, hidden % 8 == 0 and the experts are not the reference
  // ones, else cpu).
  std::string backend = "cpu";
  // "reference" | "blas" (Standard format) | "batched_reference" | "batched_blas"
  // (BatchedExperts format); class names are accepted too. With backend cuda the format picks
  // CudaExperts (Standard) or CudaBatchedExperts; "cuda" / "cuda_batched" name them directly.
  std::string experts = "blas";
  // "auto" (no_ep for one rank, all2all_contiguous for more) | "no_ep" (one rank only) |
  // "all2all_contiguous" | "all2all_batched"; class names are accepted too.
  std::string prepare_finalize = "auto";
  WeightFormat weight_format = WeightFormat::kBF16;
  std::string checkpoint_dir;  // empty: synthetic weights from `seed`
  // Expert-parallel ranks (CPU: one worker thread each; CUDA: one GPU each, ranks 0..N-1 on
  // devices 0..N-1, NCCL between them); must divide num_experts. 0: every visible GPU with
  // backend cuda, 1 with cpu.
  int num_ranks = 1;
  std::string placement = "contiguous";  // "contiguous" | "round_robin"
  // Explicit placement (global expert ids per rank, each expert exactly once), e.g. from a load
  // balancer; overrides `placement` when not empty. Its size must equal num_ranks.
  std::vector<std::vector<int>> rank_experts;
  uint64_t seed = 0;
  int num_threads = 0;  // 0: all hardware threads, shared by the ranks
  int64_t max_tokens_per_request = 8192;
  // Tokens one rank submits to one dispatch round (the batched format's capacity is this times
  // num_ranks rows per local expert). 0: ceil(max_tokens_per_request / num_ranks), at most 128
  // for all2all_batched. Larger batches run in several rounds, never truncated.
  int64_t max_tokens_per_rank = 0;
  // "per_rank": the all-to-all types send a token once per destination rank; "per_route": once
  // per route, as without deduplication (only to measure what deduplication saves).
  std::string dispatch = "per_rank";
  // How long a rank waits for its peers in one collective before the forward fails with
  // DEADLINE_EXCEEDED.
  // On GPUs a collective that does not complete in time aborts the NCCL communicators; the
  // engine then reports not healthy (see Engine::health()).
  int64_t collective_timeout_ms = 60000;
  int64_t memory_budget_bytes = 0;  // 0: what the machine has available
  // Multi-process (multi-node) expert parallelism, backend cuda only. world_size ranks in all,
  // num_ranks of them (one per local GPU) in this process, as global ranks
  // node_rank * num_ranks + i; every process has the same num_ranks. 0: single process
  // (world_size = num_ranks). Node 0 is the leader: only its Forward is called; the others run
  // RunFollower(). Every process must get the same model, weights and engine options.
  int world_size = 0;
  int node_rank = 0;
  // The NCCL unique id's bytes, from NewCollectiveId() on the leader, handed to every process
  // by the frontend (core has no network code). Required when world_size > num_ranks.
  std::string collective_id;
  // Leader: an idle leader sends the followers a no-op command this often (must be well under
  // collective_timeout_ms: a follower's wait for the next command is bounded by it), which also
  // finds a dead follower without a Forward. 0: off.
  int64_t heartbeat_ms = 1000;
  // Tests only: called on each rank's thread at the start of every forward; a non-OK status
  // fails that rank there (an injected fault), and a hook may also sleep (a late rank).
  std::function<absl::Status(int rank)> fault_injection_for_testing;
};

// One layer call. Views are read-only and must stay valid for the call.
struct ForwardInput {
  int layer = 0;
  TensorView hidden_states;  // [M, hidden] BF16, FP16 or FP32
  TensorView topk_ids;       // [M, topk] INT32 or INT64, each in [0, num_experts)
  TensorView topk_weights;   // [M, topk] FP32, finite
};

struct ForwardTimings {
  double queue_us = 0;
  // Stage times: the slowest rank's per stage; num_chunks: the most rounds; transfer: bytes
  // summed over ranks (each rank's bytes to/from other ranks).
  StageTimings stages;
  std::vector<StageTimings> rank_stages;  // per rank
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
};

// Checks a forward against the model: INVALID_ARGUMENT naming the field, what came and what
// was expected; RESOURCE_EXHAUSTED when M exceeds max_tokens. Reads ids and weights (host).
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

  // Validates and runs one forward; output [M, hidden] with hidden_states' dtype (host,
  // caller-owned). Thread-safe: concurrent calls queue and run one at a time.
  // With R ranks the M tokens are split evenly (rank r is the source of its slice), every rank
  // runs the modular kernel (its collectives in the same order) and rank 0, the leader, gathers
  // the output slices. A failure on one rank aborts the collectives of all; the first root
  // cause is returned and the engine stays usable.
  absl::Status Forward(const ForwardInput& input, const TensorView& output,
                       ForwardTimings* timings = nullptr);

  // One expert's weights as computed with, rounded to BF16: w13 [2I, H], w2 [H, I].
  absl::Status GetExpertWeightsBf16(int layer, int expert, uint16_t* w13, uint16_t* w2) const;

  const EngineInfo& info() const { return info_; }

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
  bool is_follower() const { return multi_process_ && first_rank_ != 0; }
  // Follower: runs every command the leader broadcasts (forwards, heartbeats) until the leader
  // shuts the group down (OK) or a collective fails or times out (the error; the process should
  // then exit: a multi-process group is rebuilt by restarting it).
  absl::Status RunFollower();
  // Makes collectives in flight and later ones fail with ABORTED (e.g. RunFollower on SIGTERM).
  // Any thread.
  void AbortCollectives(const absl::Status& cause);

 private:
  struct Rank;
  Engine();
  absl::Status RunRank(int rank, const ForwardInput& input, const TensorView& ids,
                       const TensorView& out32, const std::vector<int64_t>& bounds);
  absl::Status CreateCudaRanks(const WeightSource& source, const std::string& pf_type,
                               ActivationFormat format, int64_t tokens_per_rank);
  void AfterFailedStep(const absl::Status& cause);
  // Multi-process: one command on every local rank (leader: `cmd`; followers: null).
  absl::Status RunStep(const std::vector<int64_t>* cmd, const ForwardInput* input,
                       const TensorView& ids, const TensorView& out32);
  absl::Status MultiStep(int local, const std::vector<int64_t>* cmd, const ForwardInput* input,
                         const TensorView& ids, const TensorView& out32);
  void HeartbeatLoop();
  void StopMultiProcess();

  bool multi_process_ = false;
  bool formed_ = false;  // Create finished: the multi-process group exists
  int first_rank_ = 0;   // global rank of local rank 0
  int world_ = 1;        // ranks in all processes
  WeightSource source_;  // to load an expert another process holds (GetExpertWeightsBf16)
  std::chrono::steady_clock::time_point last_step_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;
  std::thread heartbeat_;

  EngineOptions options_;
  EngineInfo info_;
  std::shared_ptr<const Placement> placement_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::shared_ptr<InProcessCommGroup> group_;  // null with no_ep or on GPUs
  std::shared_ptr<NcclCommGroup> nccl_;        // GPU ranks with an all-to-all
  mutable std::mutex health_mu_;
  absl::Status health_;
  std::unique_ptr<RankThreads> threads_;  // null with one rank
  std::mutex mu_;                         // one forward at a time
  HostBuffer ids32_, out32_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_ENGINE_H_
