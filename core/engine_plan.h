// The engine's configuration: EngineOptions (strings, as frontends pass them) resolved once into
// an EnginePlan (enums, provider class names, numbers), by a pure function.
#ifndef MOESERVE_CORE_ENGINE_PLAN_H_
#define MOESERVE_CORE_ENGINE_PLAN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/cpu/all_to_all_prepare_finalize.h"
#include "core/model_config.h"
#include "core/modular_kernel.h"
#include "core/placement.h"
#include "core/weight_loader.h"
#include "core/weights.h"

namespace moeserve {

class ProviderRegistry;

enum class Backend { kCpu, kCuda };
absl::string_view BackendName(Backend backend);  // "cpu" | "cuda"

// The multi-process command carries the token bounds of every rank (MultiProcessDriver).
constexpr int kMaxMultiProcessWorld = 256;
// graph_max_tokens = -1 on a GPU: steps up to 1024 tokens per rank replay graphs. A CUDA-region
// call of 1024 tokens then costs 65-100 us beyond its experts instead of 100-125 eagerly
// (tests/benchmarks/transport/RESULTS.md, 2026-12-02); workspaces are reserved for it once.
inline constexpr int64_t kAutoGraphMaxTokens = 1024;
// Most engine steps in flight at once (EngineOptions::steps_in_flight).
constexpr int kMaxStepsInFlight = 8;

struct EngineOptions {
  ModelConfig model;
  // "cpu" | "cuda" (one GPU per rank; FAILED_PRECONDITION without a GPU or a CUDA build) |
  // "auto" (cuda where a GPU exists and the CUDA providers support the plan, e.g. hidden % 8 == 0,
  // unless the experts asked for are a reference oracle; else cpu).
  std::string backend = "cpu";
  // A name or alias from the provider registry (core/provider_registry.h; `moeserve-mk-check
  // --list` prints them): "reference" | "blas" (Standard format) | "batched_reference" |
  // "batched_blas" (BatchedExperts format) | "cuda" | "cuda_batched" | "cuda_grouped_sm90" |
  // "cuda_w8a8" (MXFP8 weights, FP8 activations; core/cuda/cuda_grouped_experts.h). On another
  // backend than the named provider's, a CPU name picks that backend's Experts of the same
  // activation format.
  std::string experts = "blas";
  // "auto" (no_ep for one rank, all2all_contiguous for more; all2all_batched for the GPU's
  // batched Experts) | "no_ep" (one rank only) | "all2all_contiguous" | "all2all_batched"; class
  // names from the provider registry are accepted too. On the GPU the CPU names pick the GPU
  // provider of the same kind and format.
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
  // Multi-process: how long the GPU ranks' NCCL group may take to form at start. Every process
  // joins after its own weight load, so this covers the slowest load's lag behind the fastest
  // (a checkpoint shard can take minutes); the group's collectives then wait
  // collective_timeout_ms. At least collective_timeout_ms is used.
  int64_t group_formation_timeout_ms = 600000;
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
  // Leader: an idle leader sends the followers a no-op command this often, which also finds a
  // dead follower without a Forward. Multi-process serving needs it in
  // [1, collective_timeout_ms / 3] (a follower's wait for the next command is bounded by the
  // timeout, and idle commands can be two periods apart); unused in one process.
  int64_t heartbeat_ms = 1000;
  // Told how the weight load goes (progress, or a stop request); optional, must outlive
  // Engine::Create.
  WeightLoadObserver* load_observer = nullptr;
  // Engine steps that may run at once, each on its own lane (a stream, its own buffers and
  // workspaces; the weights are shared), so that one step's copies overlap another's experts.
  // 0: auto (2 with backend cuda and a single-rank PrepareAndFinalize, else 1). More than 1 is
  // refused where steps must run one at a time (collectives between ranks, multi-process).
  int steps_in_flight = 0;
  // Graph replay (CUDA graphs) for engine steps of at most this many tokens per rank: each
  // (layer, padded size) is captured on first use and replayed after (core/modular_kernel.h,
  // GraphOptions). -1: auto (kAutoGraphMaxTokens with backend cuda where the PrepareAndFinalize and
  // Experts can be captured, else off); 0: off. A positive value the providers cannot honour is
  // refused.
  int64_t graph_max_tokens = -1;
  // Tests only: called on each rank's thread at the start of every forward; a non-OK status
  // fails that rank there (an injected fault), and a hook may also sleep (a late rank).
  std::function<absl::Status(int rank)> fault_injection_for_testing;
};

// EngineOptions resolved: every string parsed, every default filled in, every provider chosen
// and checked. Immutable once built; Engine, the RankGroups and the MultiProcessDriver read it.
struct EnginePlan {
  ModelConfig model;  // validated
  Backend backend = Backend::kCpu;
  // Provider class names (ProviderRegistry), as the instances' name() reports them.
  std::string prepare_finalize;
  std::string experts;
  ActivationFormat activation_format = ActivationFormat::kStandard;  // between PF and Experts
  AllToAllOptions::Dispatch dispatch = AllToAllOptions::Dispatch::kPerRank;
  // Ranks: `world_size` in all, `local_ranks` in this process as global ranks
  // [first_rank, first_rank + local_ranks); multi_process when world_size > local_ranks.
  int local_ranks = 1;
  int world_size = 1;
  int node_rank = 0;
  int first_rank = 0;
  bool multi_process = false;
  std::string collective_id;                   // multi-process only
  std::shared_ptr<const Placement> placement;  // world_size ranks
  int threads_per_rank = 1;                    // the Experts' threads on each rank
  int64_t max_tokens_per_request = 0;
  // Tokens one rank submits to one dispatch round (no-EP: max_tokens_per_request).
  int64_t max_tokens_per_rank = 0;
  absl::Duration collective_timeout = absl::Seconds(60);
  absl::Duration group_formation_timeout = absl::Seconds(600);  // >= collective_timeout
  int64_t heartbeat_ms = 0;  // leader of a multi-process group; 0: off
  int lanes = 1;             // steps in flight (EngineOptions::steps_in_flight resolved)
  // EngineOptions::graph_max_tokens resolved (0: off); graphs_required: asked for explicitly,
  // so providers that cannot capture fail the build instead of running eagerly.
  int64_t graph_max_tokens = 0;
  bool graphs_required = false;
  WeightSource weights;  // where every rank loads its experts from
  std::function<absl::Status(int rank)> fault_injection_for_testing;
};

// Resolves `options` against `registry` for a machine with `visible_gpus` CUDA devices. Pure (no
// IO; the hardware thread count is the only other input): model resolution from a checkpoint
// happens before. Errors: INVALID_ARGUMENT naming the option, what came and what was expected;
// FAILED_PRECONDITION for what this machine or build cannot do (no GPU, no CUDA backend).
// `options.model` must already be resolved (ResolveModelConfig).
absl::StatusOr<EnginePlan> ResolveEngineConfig(const EngineOptions& options,
                                               const ProviderRegistry& registry, int visible_gpus);

}  // namespace moeserve

#endif  // MOESERVE_CORE_ENGINE_PLAN_H_
