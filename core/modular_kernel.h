// The MoE modular kernel, after vLLM's FusedMoEModularKernel.
//
// One MoE forward = PrepareAndFinalize::Prepare (quantize + dispatch)
//                 -> Experts::Apply (permute, W13 GEMM, SiLU-and-mul, W2 GEMM, unpermute,
//                                    optionally the top-k weight-and-reduce)
//                 -> PrepareAndFinalize::Finalize (combine + the TopKWeightAndReduce that
//                                                  Experts::FinalizeWeightAndReduceImpl() names).
//
// Conventions for every interface here:
//  - Shapes use num_tokens (M), topk, hidden (K), intermediate (N), num_local_experts (E).
//  - Expert ids reaching Experts are *local* indices in [0, E), or -1 for a route whose expert
//    lives on another rank (PrepareAndFinalize maps global ids through the expert map).
//  - Floating-point results between stages are FP32.
//  - Every TensorView says where its memory lives (TensorView::device()). Prepare puts a1q on
//    the device Experts compute on; ModularKernel allocates the workspaces and the fused expert
//    output on that device through its WorkspaceAllocator (core/workspace.h) and hands them to
//    Apply and Finalize. The caller's inputs and output are host (or pinned host) memory.
//  - Objects are not thread-safe: one ModularKernel per rank, used by one thread at a time.
//  - CPU implementations are synchronous. Device implementations run on the stream given at
//    construction and document when they synchronize.
#ifndef MOESERVE_CORE_MODULAR_KERNEL_H_
#define MOESERVE_CORE_MODULAR_KERNEL_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "core/weights.h"
#include "core/workspace.h"

namespace moeserve {

// Largest |router weight| accepted. Router weights are probabilities, at most scaled by a
// routed scaling factor (DeepSeek-V3: 2.5); a finite weight like 3e38 only serves to overflow
// the weighted sums to Inf, so it is refused like NaN and Inf are.
inline constexpr float kMaxAbsTopkWeight = 1e4f;

class StopLatch;  // core/cancellation.h

enum class ActivationFormat {
  kStandard,        // contiguous [M, K] + topk_ids/topk_weights [M, topk]
  kBatchedExperts,  // [E, max_tokens, K] + expert_num_tokens [E]
};
absl::string_view ActivationFormatName(ActivationFormat format);

// The sizes one forward runs at on one rank, after dispatch.
struct MoeProblem {
  int64_t num_tokens = 0;    // Standard: tokens received (M_recv)
  int64_t hidden = 0;        // K
  int64_t intermediate = 0;  // N
  int64_t topk = 0;
  int64_t num_experts = 0;        // global
  int64_t num_local_experts = 0;  // E
  int64_t max_num_tokens = 0;     // Batched: rows per local expert
};

// Per-round state a PrepareAndFinalize hands from Prepare to its own Finalize (DeepEP's
// "handle": for expert parallelism, the dispatch plan's layout); null for implementations that
// need none.
struct DispatchHandle {
  virtual ~DispatchHandle() = default;
};

// What Prepare hands to Experts::Apply. Views point into the PrepareAndFinalize's buffers and
// stay valid until its next Prepare.
struct PreparedActivations {
  ActivationFormat format = ActivationFormat::kStandard;
  // Standard: [M_recv, K]; Batched: [E, max_tokens, K]. dtype = the quantization dtype.
  TensorView a1q;
  // Scales when a1q is in a scaled format; empty otherwise.
  TensorView a1q_scale;
  // Standard: [M_recv, topk] INT32 local expert index or -1, and FP32 weights.
  // Batched: may be empty (rows are already grouped by expert).
  TensorView topk_ids;
  TensorView topk_weights;
  // Batched: [E] INT32, valid rows per local expert. Empty for Standard.
  TensorView expert_num_tokens;
  MoeProblem problem;
  // Read by the same PrepareAndFinalize's Finalize; opaque to everyone else.
  std::shared_ptr<const DispatchHandle> handle;
};

// Applies router weights to per-route expert outputs and sums over top-k.
class TopKWeightAndReduce {
 public:
  enum class Kind { kNoOp, kContiguous, kNaiveBatched, kDelegate };
  virtual ~TopKWeightAndReduce() = default;
  virtual Kind kind() const = 0;
  absl::string_view name() const;

  // output: [M, K] FP32 (host). fused_expert_output:
  //   NoOp: [M, K] already reduced (copied if it is not `output`);
  //   Contiguous: [M, topk, K], route (t, k) at row t * topk + k;
  //   NaiveBatched: [E, max_tokens, K] where expert e's rows are its routes in (t, k) order.
  // topk_ids [M, topk] INT32 local ids (-1 routes contribute nothing); topk_weights [M, topk].
  // Delegate cannot be applied: PrepareAndFinalize resolves it first.
  virtual absl::Status Apply(const TensorView& output, const TensorView& fused_expert_output,
                             const TensorView& topk_weights, const TensorView& topk_ids) const = 0;
};

std::unique_ptr<TopKWeightAndReduce> MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind kind);
// What kDelegate means for a PrepareAndFinalize of `format`: Contiguous for Standard,
// NaiveBatched for BatchedExperts. Other kinds are returned as they are.
TopKWeightAndReduce::Kind ResolveWeightAndReduce(TopKWeightAndReduce::Kind kind,
                                                 ActivationFormat format);

struct PrepareArgs {
  TensorView hidden_states;  // [M, K] BF16/FP16/FP32, this rank's source tokens
  TensorView topk_ids;       // [M, topk] INT32 global expert ids in [0, num_experts)
  TensorView topk_weights;   // [M, topk] FP32
  // (Both host memory, or device memory where accepts_device_routing.)
  int64_t num_experts = 0;
  int64_t num_local_experts = 0;
  int64_t intermediate = 0;
  // [num_experts] INT32 global -> local index on this rank, or -1. Empty: identity.
  TensorView expert_map;
};

// The refusals of a bad route, worded alike wherever it is found (the engine's host scan, or a
// PrepareAndFinalize checking device routing): INVALID_ARGUMENT naming the value, [token, k]
// of `route` and what was expected.
absl::Status BadTopkIdError(int64_t value, int64_t route, int64_t topk, int64_t num_experts);
absl::Status BadTopkWeightError(float value, int64_t route, int64_t topk);

// The layout every PrepareAndFinalize::Prepare needs: hidden_states [M, K], topk_ids contiguous
// INT32 [M, topk], topk_weights contiguous FP32 [M, topk]. INVALID_ARGUMENT starting with `who`.
absl::Status CheckPrepareArgsLayout(absl::string_view who, const PrepareArgs& args);

// The problem a PrepareAndFinalize without expert parallelism hands to the experts:
// `num_tokens` rows (the call's, or padded to a captured size) of `hidden`, all on this rank.
inline MoeProblem NoEpProblem(const PrepareArgs& args, int64_t num_tokens, int64_t hidden,
                              int64_t topk) {
  return MoeProblem{.num_tokens = num_tokens,
                    .hidden = hidden,
                    .intermediate = args.intermediate,
                    .topk = topk,
                    .num_experts = args.num_experts,
                    .num_local_experts = args.num_local_experts,
                    .max_num_tokens = num_tokens};
}

// Quantization applied by Prepare before dispatch ("the quantization hook").
struct QuantConfig {
  DType activation_dtype = DType::kFP32;  // what Experts receive in a1q
};

// Bytes a PrepareAndFinalize moved to and from *other* ranks (its own share, copied locally,
// is not counted).
struct TransferStats {
  int64_t dispatch_bytes_sent = 0;
  int64_t dispatch_bytes_received = 0;
  int64_t combine_bytes_sent = 0;
  int64_t combine_bytes_received = 0;
};

class PrepareAndFinalize {
 public:
  virtual ~PrepareAndFinalize() = default;
  virtual absl::string_view name() const = 0;
  virtual ActivationFormat activation_format() const = 0;
  // Required dtype of topk ids, if the dispatch kernel is strict about it.
  virtual std::optional<DType> topk_indices_dtype() const { return std::nullopt; }
  // Most tokens one rank submits to one dispatch.
  virtual int64_t max_num_tokens_per_rank() const = 0;
  // Ranks taking part in a dispatch.
  virtual int num_dispatchers() const = 0;
  virtual const QuantConfig& quant_config() const = 0;

  // Splits this rank's source tokens into the rounds ("chunks") of prepare -> apply -> finalize
  // one forward needs, so that no round exceeds a fixed capacity (nothing is ever truncated).
  // Returns ascending boundaries {0, b1, ..., M}: round i covers tokens [b[i], b[i+1]).
  // Implementations with peers return the same number of rounds on every rank (a rank with
  // fewer tokens gets empty rounds) and may run a collective to agree. Default: one round.
  virtual absl::StatusOr<std::vector<int64_t>> PlanChunks(const PrepareArgs& args);

  // Quantizes args.hidden_states and dispatches tokens to the ranks that own their experts.
  virtual absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) = 0;

  // Prepare without waiting for peers: returns a receiver that completes it. Implementations
  // that cannot split the two return UNIMPLEMENTED (has_prepare_no_receive() == false).
  using Receiver = std::function<absl::Status(PreparedActivations* out)>;
  virtual bool has_prepare_no_receive() const { return false; }
  virtual absl::StatusOr<Receiver> PrepareNoReceive(const PrepareArgs& args);

  // Combines expert outputs back to their source ranks and applies `weight_and_reduce`
  // (resolving kDelegate to this implementation's own). output: [M_src, K] host memory in a
  // dtype for which writes_output_dtype() is true, the source tokens of the matching Prepare.
  // fused_expert_output: what Experts::Apply wrote (WorkspaceShapes::output, FP32, on a1q's
  // device). `prepared` is what that Prepare returned.
  virtual absl::Status Finalize(const TensorView& output, const TensorView& fused_expert_output,
                                const PreparedActivations& prepared,
                                const TopKWeightAndReduce& weight_and_reduce) = 0;
  // Whether Finalize writes `dtype` itself (converting on its device); ModularKernel converts
  // from FP32 on the host for the others.
  virtual bool writes_output_dtype(DType dtype) const { return dtype == DType::kFP32; }
  // Whether Prepare may also read hidden_states, and Finalize write the output, in CUDA device
  // memory (contiguous; any device of this process, e.g. a client's CUDA IPC allocation).
  // Others take host memory only.
  virtual bool accepts_device_tensors() const { return false; }
  // Whether Prepare (and StageInputs) may also read topk_ids (INT32) and topk_weights in CUDA
  // device memory. They are then checked on the device, not by the caller: ids outside
  // [0, num_experts) and weights that are not finite or exceed kMaxAbsTopkWeight in magnitude
  // are neutralized before any kernel indexes with them, and the Finalize (or CollectOutput)
  // that ends the forward returns INVALID_ARGUMENT naming the first one, after its wait.
  virtual bool accepts_device_routing() const { return false; }

  // Bytes exchanged with other ranks since construction (zero for single-rank ones).
  virtual TransferStats transfer_stats() const { return {}; }

  // Graphs (decode). An implementation that supports them splits one forward of M <= P rows,
  // padded to P rows, into host work around device work that reads only fixed buffers, so that
  // ModularKernel can capture the device work once per (layer, P, dtypes) and replay it:
  //   StageInputs (host) -> [PrepareStaged -> Experts::Apply -> FinalizeStaged] (device,
  //   captured) -> CollectOutput (host, waits).
  // Padding routes go nowhere (local id -1, weight 0). Default: no graphs.
  virtual bool supports_graphs() const { return false; }
  // Host: copies this forward's inputs into the fixed staging of P = padded_tokens rows (buffers
  // sized once for `capacity_tokens` rows, so their addresses never change after the first
  // call), or enqueues their copy there when the hidden states are in device or page-locked
  // memory (accepts_device_tensors). Returns false, having done nothing, when these tensors
  // cannot be staged: ModularKernel then runs the forward eagerly. A graph is captured per
  // memory space of hidden_states and of the output (the staged work differs).
  virtual absl::StatusOr<bool> StageInputs(const PrepareArgs& args, int64_t padded_tokens,
                                           int64_t capacity_tokens);
  // Device: Prepare of the staged rows. `args` gives dtypes and sizes only (its data is not
  // read); out->problem.num_tokens == padded_tokens.
  virtual absl::Status PrepareStaged(const PrepareArgs& args, int64_t padded_tokens,
                                     PreparedActivations* out);
  // Device: Finalize of every staged row into fixed output staging in `dtype` (no wait).
  // `output_device`: where CollectOutput's output will be (an implementation may leave the
  // answer on the device for device or page-locked outputs, and copy it straight there).
  virtual absl::Status FinalizeStaged(DType dtype, Device output_device,
                                      const TensorView& fused_expert_output,
                                      const PreparedActivations& prepared,
                                      const TopKWeightAndReduce& weight_and_reduce);
  // Host: waits for the device, then copies the first output.dim(0) staged rows into `output`
  // (host memory, or device memory where accepts_device_tensors). `timer` (null when untimed):
  // an implementation whose device work ends before its wait may Stop() the timer just before
  // waiting, so that timing adds no second wait (host work after the wait is then not timed).
  virtual absl::Status CollectOutput(const TensorView& output, StageTimer* timer);
};

struct ActivationFormats {
  ActivationFormat input;
  ActivationFormat output;
};

// Allocated by ModularKernel on a1q's device for every Apply.
struct WorkspaceShapes {
  Shape workspace13;  // scratch, also reused across W1 / W2 stages
  DType workspace13_dtype = DType::kFP32;
  Shape workspace2;
  DType workspace2_dtype = DType::kFP32;
  Shape output;  // fused expert output handed to Finalize, FP32
};

struct ExpertsApplyArgs {
  TensorView output;  // WorkspaceShapes::output, FP32, on a1q's device
  const PreparedActivations* prepared = nullptr;
  int layer = 0;                          // the MoE layer (device weights are keyed by it)
  const LayerWeights* weights = nullptr;  // that layer's host weights
  TensorView workspace13;
  TensorView workspace2;
};

class Experts {
 public:
  virtual ~Experts() = default;
  virtual absl::string_view name() const = 0;
  virtual ActivationFormats activation_formats() const = 0;
  // True if Apply accepts routes to remote experts (-1 ids), i.e. works under expert
  // parallelism.
  virtual bool supports_expert_map() const = 0;
  virtual bool supports_weight_format(WeightFormat format) const = 0;
  // dtype of a1q this implementation computes on.
  virtual DType activation_dtype() const = 0;
  virtual WorkspaceShapes GetWorkspaceShapes(const MoeProblem& problem) const = 0;
  // NoOp if Apply itself applies the top-k weights and reduces.
  virtual std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const = 0;
  virtual absl::Status Apply(const ExpertsApplyArgs& args) = 0;
  // Whether Apply only enqueues device work that reads its inputs' values on the device (no
  // host waits, no allocations, sizes from the problem alone), so it can be captured in a graph.
  virtual bool supports_graphs() const { return false; }
};

// Stage times: host wall clock for host kernels, device time (events) for device ones. A graphed
// step with a timer that marks inside graphs (StageTimer::marks_in_graphs, the CUDA one) is timed
// by event nodes between its stages; with any other timer its whole graph is experts_us,
// prepare_us its host staging (= host_stage_us) and finalize_us 0.
struct StageTimings {
  double prepare_us = 0;
  double experts_us = 0;
  double finalize_us = 0;
  // Host clock of a graphed step (zero for an eager one): StageInputs, the graph's launch (or
  // its first eager run and capture), CollectOutput (the wait for the device and the copy out),
  // and reading the stage timer. What a step costs the host beyond its device time.
  double host_stage_us = 0;
  double host_launch_us = 0;
  double host_collect_us = 0;
  double host_timer_us = 0;
  int64_t num_chunks = 0;  // rounds of prepare -> apply -> finalize (PlanChunks)
  TransferStats transfer;  // bytes this rank exchanged with its peers in this forward
};

struct ModularKernelArgs {
  TensorView hidden_states;  // [M, K] BF16/FP16/FP32
  TensorView topk_ids;       // [M, topk] INT32 global ids, validated
  TensorView topk_weights;   // [M, topk] FP32
  int layer = 0;             // which MoE layer (device-resident weights are keyed by it)
  const LayerWeights* weights = nullptr;  // that layer's host weights
  int64_t num_experts = 0;
  TensorView expert_map;  // optional, see PrepareArgs
  // Checked before every stage of every round (checkpoint 3 * round + stage); a stop verdict
  // ends the forward with it, the output left unspecified. Null: run to the end.
  StopLatch* stop = nullptr;
};

// Graph replay for small forwards (see PrepareAndFinalize::supports_graphs).
struct GraphOptions {
  // Forwards of at most this many tokens (one round) are padded to the next size in `sizes`
  // and replayed from a graph captured on first use; 0 turns graphs off.
  int64_t max_tokens = 0;
  // Ascending padded sizes; empty: DefaultGraphSizes(max_tokens).
  std::vector<int64_t> sizes;
};
// 1, 2, 4, 8, then steps of a quarter of the last power of two (8, 10, 12, 14, 16, 20, ...),
// ending at max_tokens: at most 25% padding above 8 tokens.
std::vector<int64_t> DefaultGraphSizes(int64_t max_tokens);

// Counters of the graph path (one ModularKernel).
struct GraphStats {
  int64_t replays = 0;   // forwards answered by replaying a graph
  int64_t captures = 0;  // graphs captured (a recapture after buffers moved counts again)
  int64_t eager = 0;     // forwards that ran eagerly (too large, several rounds, or unstageable)
  int64_t graphs = 0;    // graphs held now
  // Set when a capture failed and graphs were turned off for this kernel.
  std::string disabled_reason;
};

// Why a pair cannot be combined; OK if it can.
absl::Status CheckCompatible(const PrepareAndFinalize& prepare_finalize, const Experts& experts);

class ModularKernel {
 public:
  // Refuses (INVALID_ARGUMENT, saying why) a pair that CheckCompatible rejects. `allocator`
  // provides the workspaces on the device Prepare puts a1q on (null: host memory).
  static absl::StatusOr<std::unique_ptr<ModularKernel>> Create(
      std::unique_ptr<PrepareAndFinalize> prepare_finalize, std::unique_ptr<Experts> experts,
      std::unique_ptr<WorkspaceAllocator> allocator = nullptr);

  // Runs prepare -> apply -> finalize once per round of PrepareAndFinalize::PlanChunks (stage
  // times are summed over rounds), checking args.stop before each stage. output: [M, K] host
  // memory, FP32, BF16 or FP16. Workspaces come from Experts::GetWorkspaceShapes() through the
  // allocator, reused across calls; FAILED_PRECONDITION if Prepare put a1q on another device than
  // the allocator's. Returns when the output is written. Not thread-safe.
  absl::Status Forward(const ModularKernelArgs& args, const TensorView& output,
                       StageTimings* timings = nullptr);

  PrepareAndFinalize& prepare_finalize() { return *prepare_finalize_; }
  Experts& experts() { return *experts_; }

  // Turns graph replay on for forwards of at most options.max_tokens tokens. FAILED_PRECONDITION
  // naming the component when the PrepareAndFinalize, the Experts or the allocator cannot
  // (CPU ones never can). Graphs are captured lazily, at a forward's first use of a (layer,
  // padded size, input dtype, output dtype), and held until the kernel is destroyed; one
  // captured after its buffers moved (a larger eager forward grew them) is captured again.
  absl::Status EnableGraphs(const GraphOptions& options);
  // Set before forwards start (EnableGraphs is not thread-safe); 0 after a failed capture.
  int64_t graph_max_tokens() const { return graph_max_tokens_.load(); }
  // Thread-safe.
  GraphStats graph_stats() const;

 private:
  ModularKernel(std::unique_ptr<PrepareAndFinalize> pf, std::unique_ptr<Experts> experts,
                std::unique_ptr<WorkspaceAllocator> allocator)
      : prepare_finalize_(std::move(pf)),
        experts_(std::move(experts)),
        allocator_(std::move(allocator)),
        timer_(allocator_->MakeStageTimer()) {}
  absl::Status RunRounds(const ModularKernelArgs& args, const TensorView& output,
                         const std::vector<int64_t>& bounds, StageTimer* timer);
  // One round of m <= graph_options_.max_tokens tokens through a graph. *ran = false (and
  // nothing done) when the inputs cannot be staged.
  // `host` (null when untimed): its host_* times are set when the step ran graphed.
  absl::Status RunGraphed(const ModularKernelArgs& args, const PrepareArgs& pargs,
                          const TensorView& output, StageTimer* timer, bool* ran,
                          StageTimings* host);
  struct GraphKey {
    int layer;
    int64_t tokens;
    DType in, out;
    MemorySpace in_space, out_space, routing_space;
    bool timed;  // with the timer's event nodes between the stages (StageTimer::MarkInGraph)
    bool operator<(const GraphKey& o) const {
      return std::tie(layer, tokens, in, out, in_space, out_space, routing_space, timed) <
             std::tie(o.layer, o.tokens, o.in, o.out, o.in_space, o.out_space, o.routing_space,
                      o.timed);
    }
  };
  struct GraphEntry {
    std::unique_ptr<StepGraph> graph;
    std::array<void*, 3> workspaces{};  // the addresses it was captured with
  };
  std::unique_ptr<PrepareAndFinalize> prepare_finalize_;
  std::unique_ptr<Experts> experts_;
  std::unique_ptr<WorkspaceAllocator> allocator_;
  std::unique_ptr<StageTimer> timer_;
  HostBuffer output32_;  // FP32 answer for a PrepareAndFinalize that writes only FP32
  GraphOptions graph_options_;
  std::atomic<int64_t> graph_max_tokens_{0};
  bool graph_workspaces_reserved_ = false;
  std::map<GraphKey, GraphEntry> graphs_;
  // Counters, read by graph_stats() from other threads (metrics) while forwards run.
  std::atomic<int64_t> replays_{0}, captures_{0}, eager_{0}, held_{0};
  mutable std::mutex graph_mu_;  // guards graph_disabled_reason_
  std::string graph_disabled_reason_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_MODULAR_KERNEL_H_
