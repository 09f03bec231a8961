#include "core/modular_kernel.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/cancellation.h"
#include "core/status_macros.h"

namespace moeserve {
namespace {

using Clock = std::chrono::steady_clock;
double MicrosBetweenTimes(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}
double MicrosSince(Clock::time_point from) { return MicrosBetweenTimes(from, Clock::now()); }

}  // namespace

absl::string_view ActivationFormatName(ActivationFormat format) {
  return format == ActivationFormat::kStandard ? "Standard" : "BatchedExperts";
}

absl::StatusOr<PrepareAndFinalize::Receiver> PrepareAndFinalize::PrepareNoReceive(
    const PrepareArgs&) {
  return absl::UnimplementedError(absl::StrCat(name(), " has no PrepareNoReceive"));
}

absl::StatusOr<bool> PrepareAndFinalize::StageInputs(const PrepareArgs&, int64_t, int64_t) {
  return absl::UnimplementedError(absl::StrCat(name(), " has no graph path"));
}
absl::Status PrepareAndFinalize::PrepareStaged(const PrepareArgs&, int64_t, PreparedActivations*) {
  return absl::UnimplementedError(absl::StrCat(name(), " has no graph path"));
}
absl::Status PrepareAndFinalize::FinalizeStaged(DType, Device, const TensorView&,
                                                const PreparedActivations&,
                                                const TopKWeightAndReduce&) {
  return absl::UnimplementedError(absl::StrCat(name(), " has no graph path"));
}
absl::Status PrepareAndFinalize::CollectOutput(const TensorView&, StageTimer*) {
  return absl::UnimplementedError(absl::StrCat(name(), " has no graph path"));
}

std::vector<int64_t> DefaultGraphSizes(int64_t max_tokens) {
  std::vector<int64_t> sizes;
  for (int64_t s = 1; s <= max_tokens;) {
    sizes.push_back(s);
    if (s < 8) {
      s *= 2;
    } else {
      int64_t pow2 = 8;
      while (pow2 * 2 <= s) pow2 *= 2;
      s += pow2 / 4;
    }
  }
  if (max_tokens > 0 && (sizes.empty() || sizes.back() != max_tokens)) sizes.push_back(max_tokens);
  return sizes;
}

absl::StatusOr<std::vector<int64_t>> PrepareAndFinalize::PlanChunks(const PrepareArgs& args) {
  return std::vector<int64_t>{0, args.hidden_states.rank() >= 1 ? args.hidden_states.dim(0) : 0};
}

absl::Status BadTopkIdError(int64_t value, int64_t route, int64_t topk, int64_t num_experts) {
  return absl::InvalidArgumentError(absl::StrCat("topk_ids: value ", value, " at [", route / topk,
                                                 ", ", route % topk, "] is outside [0, ",
                                                 num_experts, ") (num_experts)"));
}

absl::Status BadTopkWeightError(float value, int64_t route, int64_t topk) {
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat("topk_weights: value ", value, " at [",
                                                   route / topk, ", ", route % topk,
                                                   "] is not finite; expected finite router "
                                                   "weights"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("topk_weights: value ", value, " at [", route / topk, ", ", route % topk,
                   "] is outside [-", kMaxAbsTopkWeight, ", ", kMaxAbsTopkWeight,
                   "]; expected router weights (probabilities, possibly scaled)"));
}

absl::Status CheckPrepareArgsLayout(absl::string_view who, const PrepareArgs& args) {
  const TensorView& x = args.hidden_states;
  if (x.rank() != 2 || args.topk_ids.rank() != 2 || args.topk_ids.dim(0) != x.dim(0) ||
      args.topk_weights.shape() != args.topk_ids.shape() ||
      args.topk_ids.dtype() != DType::kINT32 || args.topk_weights.dtype() != DType::kFP32 ||
      !args.topk_ids.is_contiguous() || !args.topk_weights.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who,
        ": expected hidden_states [M, K], topk_ids INT32 [M, topk], topk_weights FP32 "
        "[M, topk]; got ",
        x.DebugString(), ", ", args.topk_ids.DebugString(), ", ", args.topk_weights.DebugString()));
  }
  return absl::OkStatus();
}

TopKWeightAndReduce::Kind ResolveWeightAndReduce(TopKWeightAndReduce::Kind kind,
                                                 ActivationFormat format) {
  if (kind != TopKWeightAndReduce::Kind::kDelegate) return kind;
  return format == ActivationFormat::kStandard ? TopKWeightAndReduce::Kind::kContiguous
                                               : TopKWeightAndReduce::Kind::kNaiveBatched;
}

absl::Status CheckCompatible(const PrepareAndFinalize& pf, const Experts& experts) {
  const ActivationFormats formats = experts.activation_formats();
  if (formats.input != pf.activation_format()) {
    return absl::InvalidArgumentError(absl::StrCat(
        pf.name(), " produces ", ActivationFormatName(pf.activation_format()), " activations but ",
        experts.name(), " expects ", ActivationFormatName(formats.input)));
  }
  if (pf.num_dispatchers() > 1 && !experts.supports_expert_map()) {
    return absl::InvalidArgumentError(
        absl::StrCat(experts.name(), " does not support an expert map, which ", pf.name(),
                     " needs with ", pf.num_dispatchers(), " ranks"));
  }
  if (pf.quant_config().activation_dtype != experts.activation_dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        pf.name(), " quantizes activations to ", DTypeName(pf.quant_config().activation_dtype),
        " but ", experts.name(), " computes on ", DTypeName(experts.activation_dtype())));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModularKernel>> ModularKernel::Create(
    std::unique_ptr<PrepareAndFinalize> prepare_finalize, std::unique_ptr<Experts> experts,
    std::unique_ptr<WorkspaceAllocator> allocator) {
  if (prepare_finalize == nullptr || experts == nullptr) {
    return absl::InvalidArgumentError("ModularKernel needs a PrepareAndFinalize and an Experts");
  }
  MOESERVE_RETURN_IF_ERROR(CheckCompatible(*prepare_finalize, *experts));
  if (allocator == nullptr) allocator = MakeHostWorkspaceAllocator();
  return std::unique_ptr<ModularKernel>(
      new ModularKernel(std::move(prepare_finalize), std::move(experts), std::move(allocator)));
}

absl::Status ModularKernel::Forward(const ModularKernelArgs& args, const TensorView& output,
                                    StageTimings* timings) {
  if (args.weights == nullptr) return absl::InvalidArgumentError("ModularKernel: no weights");
  if (!experts_->supports_weight_format(args.weights->format)) {
    return absl::InvalidArgumentError(absl::StrCat(experts_->name(), " does not support ",
                                                   WeightFormatName(args.weights->format),
                                                   " weights"));
  }
  const int64_t m = args.hidden_states.rank() >= 1 ? args.hidden_states.dim(0) : 0;
  const int64_t k = args.hidden_states.rank() == 2 ? args.hidden_states.dim(1) : 0;
  const DType out_dtype = output.dtype();
  const bool device_io = prepare_finalize_->accepts_device_tensors();
  if ((!output.device().is_host() && !device_io) || output.shape() != Shape{m, k} ||
      !output.is_contiguous() ||
      (out_dtype != DType::kFP32 && out_dtype != DType::kBF16 && out_dtype != DType::kFP16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ModularKernel: output must be a contiguous host [", m, ", ", k,
                     "] tensor of fp32, bf16 or fp16, got ", output.DebugString()));
  }
  if ((!args.topk_ids.device().is_host() || !args.topk_weights.device().is_host()) &&
      !prepare_finalize_->accepts_device_routing()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prepare_finalize_->name(), " reads host topk_ids and topk_weights only, got ",
                     args.topk_ids.DebugString()));
  }
  if (!args.hidden_states.device().is_host() && !device_io) {
    return absl::InvalidArgumentError(absl::StrCat(prepare_finalize_->name(),
                                                   " reads host hidden_states only, got ",
                                                   args.hidden_states.DebugString()));
  }
  // The previous forward's work is done (its Finalize waited for it): what growths replaced
  // then can go now, never in the middle of a step.
  allocator_->ReleaseSuperseded();
  PrepareArgs pargs;
  pargs.hidden_states = args.hidden_states;
  pargs.topk_ids = args.topk_ids;
  pargs.topk_weights = args.topk_weights;
  pargs.num_experts = args.num_experts;
  pargs.num_local_experts = args.weights->num_local_experts;
  pargs.intermediate = args.weights->intermediate;
  pargs.expert_map = args.expert_map;
  const TransferStats stats0 = prepare_finalize_->transfer_stats();
  // Stage marks only when the caller wants timings (device timers record events).
  StageTimer* timer = timings != nullptr ? timer_.get() : nullptr;
  // A step that may replay a graph marks only around the graph (RunGraphed); if it runs
  // eagerly after all, RunRounds marks its stages itself.
  const bool may_graph = graph_options_.max_tokens > 0 && m > 0 && m <= graph_options_.max_tokens;
  if (timer) {
    timer->Reset();
    if (!may_graph) MOESERVE_RETURN_IF_ERROR(timer->Mark(StageTimer::kPrepare));
  }
  MOESERVE_ASSIGN_OR_RETURN(const std::vector<int64_t> bounds,
                            prepare_finalize_->PlanChunks(pargs));
  if (bounds.size() < 2 || bounds.front() != 0 || bounds.back() != m) {
    return absl::InternalError(
        absl::StrCat(prepare_finalize_->name(), ": PlanChunks must return {0, ..., ", m, "}"));
  }
  // A PrepareAndFinalize that writes only FP32 gets an FP32 answer, converted here once.
  const bool convert = !prepare_finalize_->writes_output_dtype(out_dtype);
  if (convert && !output.device().is_host()) {
    return absl::InvalidArgumentError(absl::StrCat(prepare_finalize_->name(), " cannot write ",
                                                   DTypeName(out_dtype), " to device memory"));
  }
  TensorView answer = output;
  if (convert) {
    MOESERVE_ASSIGN_OR_RETURN(answer, output32_.TryGet(DType::kFP32, {m, k}));
  }
  bool graphed = false;
  StageTimings host;  // host clock of a graphed step
  if (may_graph && !convert && bounds.size() == 2 && (output.device().is_host() || device_io)) {
    // One check for the whole replayed step (a graph runs to its end once launched).
    if (args.stop != nullptr) {
      MOESERVE_RETURN_IF_ERROR(args.stop->Check(0, "prepare of round 1/1"));
    }
    MOESERVE_RETURN_IF_ERROR(
        RunGraphed(args, pargs, answer, timer, &graphed, timer != nullptr ? &host : nullptr));
  }
  if (!graphed) {
    if (graph_options_.max_tokens > 0) ++eager_;
    MOESERVE_RETURN_IF_ERROR(RunRounds(args, answer, bounds, timer));
  }
  if (convert) MOESERVE_RETURN_IF_ERROR(ConvertTensor(answer, output));
  if (timer) {
    const Clock::time_point timer_start = Clock::now();
    MOESERVE_RETURN_IF_ERROR(timer->Stop());
    MOESERVE_ASSIGN_OR_RETURN(const auto us, timer->ElapsedUs());
    *timings = StageTimings();
    if (graphed) {
      timings->host_stage_us = host.host_stage_us;
      timings->host_launch_us = host.host_launch_us;
      timings->host_collect_us = host.host_collect_us;
      timings->host_timer_us = MicrosSince(timer_start);
    }
    // A graph without event nodes is timed whole (experts); its prepare is the host staging.
    const bool whole_graph = graphed && !timer->marks_in_graphs();
    timings->prepare_us = whole_graph ? host.host_stage_us : us[StageTimer::kPrepare];
    timings->experts_us = us[StageTimer::kExperts];
    timings->finalize_us = us[StageTimer::kFinalize];
    const TransferStats stats1 = prepare_finalize_->transfer_stats();
    timings->num_chunks = static_cast<int64_t>(bounds.size()) - 1;
    timings->transfer.dispatch_bytes_sent = stats1.dispatch_bytes_sent - stats0.dispatch_bytes_sent;
    timings->transfer.dispatch_bytes_received =
        stats1.dispatch_bytes_received - stats0.dispatch_bytes_received;
    timings->transfer.combine_bytes_sent = stats1.combine_bytes_sent - stats0.combine_bytes_sent;
    timings->transfer.combine_bytes_received =
        stats1.combine_bytes_received - stats0.combine_bytes_received;
  }
  return absl::OkStatus();
}

absl::Status ModularKernel::EnableGraphs(const GraphOptions& options) {
  if (options.max_tokens <= 0) {
    graph_options_ = GraphOptions();
    graph_max_tokens_ = 0;
    graphs_.clear();
    held_ = 0;
    return absl::OkStatus();
  }
  if (!prepare_finalize_->supports_graphs()) {
    return absl::FailedPreconditionError(
        absl::StrCat(prepare_finalize_->name(), " cannot split its work for graphs"));
  }
  if (!experts_->supports_graphs()) {
    return absl::FailedPreconditionError(
        absl::StrCat(experts_->name(), " cannot be captured in a graph"));
  }
  if (allocator_->device().is_host()) {
    return absl::FailedPreconditionError("graphs need device workspaces; these are host memory");
  }
  GraphOptions resolved = options;
  if (resolved.sizes.empty()) resolved.sizes = DefaultGraphSizes(options.max_tokens);
  if (!std::is_sorted(resolved.sizes.begin(), resolved.sizes.end()) ||
      resolved.sizes.front() <= 0 || resolved.sizes.back() < resolved.max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "graph sizes must ascend from >= 1 and reach max_tokens=", options.max_tokens));
  }
  graph_options_ = std::move(resolved);
  graph_max_tokens_ = graph_options_.max_tokens;
  graph_workspaces_reserved_ = false;
  graphs_.clear();
  held_ = 0;
  return absl::OkStatus();
}

GraphStats ModularKernel::graph_stats() const {
  GraphStats stats;
  stats.replays = replays_;
  stats.captures = captures_;
  stats.eager = eager_;
  stats.graphs = held_;
  std::lock_guard<std::mutex> lock(graph_mu_);
  stats.disabled_reason = graph_disabled_reason_;
  return stats;
}

absl::Status ModularKernel::RunGraphed(const ModularKernelArgs& args, const PrepareArgs& pargs,
                                       const TensorView& output, StageTimer* timer, bool* ran,
                                       StageTimings* host) {
  const int64_t m = pargs.hidden_states.dim(0), k = pargs.hidden_states.dim(1);
  const std::vector<int64_t>& sizes = graph_options_.sizes;
  const int64_t padded = *std::lower_bound(sizes.begin(), sizes.end(), m);
  const Clock::time_point stage_start = Clock::now();
  MOESERVE_ASSIGN_OR_RETURN(*ran, prepare_finalize_->StageInputs(pargs, padded, sizes.back()));
  if (!*ran) return absl::OkStatus();
  if (host) host->host_stage_us = MicrosSince(stage_start);
  MoeProblem problem;
  problem.num_tokens = padded;
  problem.hidden = k;
  problem.intermediate = pargs.intermediate;
  problem.topk = pargs.topk_ids.dim(1);
  problem.num_experts = pargs.num_experts;
  problem.num_local_experts = pargs.num_local_experts;
  problem.max_num_tokens = padded;
  if (!graph_workspaces_reserved_) {
    // Once, for the largest padded size: growing the workspaces size by size would move them
    // under every graph captured before.
    MoeProblem largest = problem;
    largest.num_tokens = largest.max_num_tokens = sizes.back();
    const WorkspaceShapes most = experts_->GetWorkspaceShapes(largest);
    MOESERVE_RETURN_IF_ERROR(
        allocator_->Get(WorkspaceAllocator::kWorkspace13, most.workspace13_dtype, most.workspace13)
            .status());
    MOESERVE_RETURN_IF_ERROR(
        allocator_->Get(WorkspaceAllocator::kWorkspace2, most.workspace2_dtype, most.workspace2)
            .status());
    MOESERVE_RETURN_IF_ERROR(
        allocator_->Get(WorkspaceAllocator::kFusedOutput, DType::kFP32, most.output).status());
    graph_workspaces_reserved_ = true;
  }
  const WorkspaceShapes shapes = experts_->GetWorkspaceShapes(problem);
  ExpertsApplyArgs apply;
  apply.layer = args.layer;
  apply.weights = args.weights;
  MOESERVE_ASSIGN_OR_RETURN(
      apply.workspace13, allocator_->Get(WorkspaceAllocator::kWorkspace13, shapes.workspace13_dtype,
                                         shapes.workspace13));
  MOESERVE_ASSIGN_OR_RETURN(
      apply.workspace2,
      allocator_->Get(WorkspaceAllocator::kWorkspace2, shapes.workspace2_dtype, shapes.workspace2));
  MOESERVE_ASSIGN_OR_RETURN(
      apply.output, allocator_->Get(WorkspaceAllocator::kFusedOutput, DType::kFP32, shapes.output));
  const std::array<void*, 3> addresses = {apply.workspace13.raw_data(), apply.workspace2.raw_data(),
                                          apply.output.raw_data()};
  // A timed step of a timer that marks inside graphs replays a graph with event nodes between
  // its stages (the prepare stage then starts here, before the launch); with any other timer
  // the whole graph is its experts stage.
  const bool marks_in_graph = timer != nullptr && timer->marks_in_graphs();
  if (timer) {
    MOESERVE_RETURN_IF_ERROR(
        timer->Mark(marks_in_graph ? StageTimer::kPrepare : StageTimer::kExperts));
  }
  const std::unique_ptr<TopKWeightAndReduce> weight_and_reduce =
      experts_->FinalizeWeightAndReduceImpl();
  const DType out_dtype = output.dtype();
  bool capturing = false;
  auto mark = [&](StageTimer::Stage stage) -> absl::Status {
    if (!marks_in_graph) return absl::OkStatus();
    return capturing ? timer->MarkInGraph(stage) : timer->Mark(stage);
  };
  // Only enqueues (see PrepareAndFinalize::supports_graphs): run eagerly, or captured.
  auto device_step = [&]() -> absl::Status {
    PreparedActivations prepared;
    MOESERVE_RETURN_IF_ERROR(prepare_finalize_->PrepareStaged(pargs, padded, &prepared));
    MOESERVE_RETURN_IF_ERROR(mark(StageTimer::kExperts));
    ExpertsApplyArgs a = apply;
    a.prepared = &prepared;
    MOESERVE_RETURN_IF_ERROR(experts_->Apply(a));
    MOESERVE_RETURN_IF_ERROR(mark(StageTimer::kFinalize));
    MOESERVE_RETURN_IF_ERROR(prepare_finalize_->FinalizeStaged(out_dtype, output.device(), a.output,
                                                               prepared, *weight_and_reduce));
    if (capturing && marks_in_graph) MOESERVE_RETURN_IF_ERROR(timer->EndMarksInGraph());
    return absl::OkStatus();
  };
  const GraphKey key{args.layer,
                     padded,
                     pargs.hidden_states.dtype(),
                     out_dtype,
                     pargs.hidden_states.device().space,
                     output.device().space,
                     pargs.topk_ids.device().space,
                     marks_in_graph};
  const Clock::time_point launch_start = Clock::now();
  auto it = graphs_.find(key);
  if (it != graphs_.end() && it->second.workspaces == addresses) {
    MOESERVE_RETURN_IF_ERROR(it->second.graph->Launch());
    ++replays_;
    if (marks_in_graph) {
      MOESERVE_RETURN_IF_ERROR(timer->MarkReplayed(StageTimer::kExperts));
      MOESERVE_RETURN_IF_ERROR(timer->MarkReplayed(StageTimer::kFinalize));
    }
  } else {
    // First use (or the workspaces moved): this forward runs eagerly, which also loads every
    // kernel the capture will record, then the same work is captured for the next ones.
    MOESERVE_RETURN_IF_ERROR(device_step());
    capturing = true;
    absl::StatusOr<std::unique_ptr<StepGraph>> graph = allocator_->Capture(device_step);
    capturing = false;
    if (graph.ok()) {
      graphs_[key] = GraphEntry{std::move(*graph), addresses};
      held_ = static_cast<int64_t>(graphs_.size());
      ++captures_;
    } else {
      // This forward's answer is on its way; later ones run eagerly.
      {
        std::lock_guard<std::mutex> lock(graph_mu_);
        graph_disabled_reason_ = absl::StrCat("capturing layer ", args.layer, " at ", padded,
                                              " tokens failed: ", graph.status().ToString());
      }
      graph_options_.max_tokens = 0;
      graph_max_tokens_ = 0;
      graphs_.clear();
      held_ = 0;
    }
  }
  // No mark after the launch: the graph holds the finalize too, and CollectOutput's Stop ends
  // the interval before its wait.
  const Clock::time_point collect_start = Clock::now();
  if (host) host->host_launch_us = MicrosBetweenTimes(launch_start, collect_start);
  MOESERVE_RETURN_IF_ERROR(prepare_finalize_->CollectOutput(output, timer));
  if (host) host->host_collect_us = MicrosSince(collect_start);
  return absl::OkStatus();
}

absl::Status ModularKernel::RunRounds(const ModularKernelArgs& args, const TensorView& output,
                                      const std::vector<int64_t>& bounds, StageTimer* timer) {
  auto mark = [timer](StageTimer::Stage stage) {
    return timer ? timer->Mark(stage) : absl::OkStatus();
  };
  PrepareArgs pargs;
  pargs.num_experts = args.num_experts;
  pargs.num_local_experts = args.weights->num_local_experts;
  pargs.intermediate = args.weights->intermediate;
  pargs.expert_map = args.expert_map;
  const std::unique_ptr<TopKWeightAndReduce> weight_and_reduce =
      experts_->FinalizeWeightAndReduceImpl();
  const size_t rounds = bounds.size() - 1;
  // Every rank passes the same checkpoints (the same rounds, PlanChunks), so the verdicts agree.
  auto check = [&](size_t round, StageTimer::Stage stage) {
    if (args.stop == nullptr) return absl::OkStatus();
    static constexpr const char* kStageName[] = {"prepare", "experts", "finalize"};
    return args.stop->Check(static_cast<int64_t>(round) * 3 + stage,
                            absl::StrCat(kStageName[stage], " of round ", round + 1, "/", rounds));
  };
  for (size_t round = 0; round + 1 < bounds.size(); ++round) {
    const int64_t begin = bounds[round], end = bounds[round + 1];
    if (begin > end) return absl::InternalError("PlanChunks: boundaries must ascend");
    pargs.hidden_states = args.hidden_states.Slice(begin, end);
    pargs.topk_ids = args.topk_ids.Slice(begin, end);
    pargs.topk_weights = args.topk_weights.Slice(begin, end);

    MOESERVE_RETURN_IF_ERROR(check(round, StageTimer::kPrepare));
    MOESERVE_RETURN_IF_ERROR(mark(StageTimer::kPrepare));
    PreparedActivations prepared;
    MOESERVE_RETURN_IF_ERROR(prepare_finalize_->Prepare(pargs, &prepared));
    // Page-locked memory is host memory to a host allocator (a merged step's page-locked
    // buffers, passed through as they are by a host PrepareAndFinalize).
    const Device a1q_device = prepared.a1q.device().space == MemorySpace::kPinnedHost
                                  ? Device::Host()
                                  : prepared.a1q.device();
    if (a1q_device != allocator_->device()) {
      return absl::FailedPreconditionError(absl::StrCat(
          prepare_finalize_->name(), " put a1q on ", DeviceName(prepared.a1q.device()),
          " but this ModularKernel allocates its workspaces on ", DeviceName(allocator_->device()),
          "; create it with an allocator for that device"));
    }

    MOESERVE_RETURN_IF_ERROR(check(round, StageTimer::kExperts));
    MOESERVE_RETURN_IF_ERROR(mark(StageTimer::kExperts));
    const WorkspaceShapes shapes = experts_->GetWorkspaceShapes(prepared.problem);
    ExpertsApplyArgs apply;
    apply.prepared = &prepared;
    apply.layer = args.layer;
    apply.weights = args.weights;
    MOESERVE_ASSIGN_OR_RETURN(apply.workspace13,
                              allocator_->Get(WorkspaceAllocator::kWorkspace13,
                                              shapes.workspace13_dtype, shapes.workspace13));
    MOESERVE_ASSIGN_OR_RETURN(
        apply.workspace2, allocator_->Get(WorkspaceAllocator::kWorkspace2, shapes.workspace2_dtype,
                                          shapes.workspace2));
    MOESERVE_ASSIGN_OR_RETURN(apply.output, allocator_->Get(WorkspaceAllocator::kFusedOutput,
                                                            DType::kFP32, shapes.output));
    MOESERVE_RETURN_IF_ERROR(experts_->Apply(apply));

    MOESERVE_RETURN_IF_ERROR(check(round, StageTimer::kFinalize));
    MOESERVE_RETURN_IF_ERROR(mark(StageTimer::kFinalize));
    MOESERVE_RETURN_IF_ERROR(prepare_finalize_->Finalize(output.Slice(begin, end), apply.output,
                                                         prepared, *weight_and_reduce));
  }
  return absl::OkStatus();
}

}  // namespace moeserve
