#include "core/modular_kernel.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/cancellation.h"
#include "core/status_macros.h"

namespace moeserve {

absl::string_view ActivationFormatName(ActivationFormat format) {
  return format == ActivationFormat::kStandard ? "Standard" : "BatchedExperts";
}

absl::StatusOr<PrepareAndFinalize::Receiver> PrepareAndFinalize::PrepareNoReceive(
    const PrepareArgs&) {
  return absl::UnimplementedError(absl::StrCat(name(), " has no PrepareNoReceive"));
}

absl::StatusOr<std::vector<int64_t>> PrepareAndFinalize::PlanChunks(const PrepareArgs& args) {
  return std::vector<int64_t>{0, args.hidden_states.rank() >= 1 ? args.hidden_states.dim(0) : 0};
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
  if (!args.hidden_states.device().is_host() && !device_io) {
    return absl::InvalidArgumentError(absl::StrCat(prepare_finalize_->name(),
                                                   " reads host hidden_states only, got ",
                                                   args.hidden_states.DebugString()));
  }
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
  if (timer) {
    timer->Reset();
    MOESERVE_RETURN_IF_ERROR(timer->Mark(StageTimer::kPrepare));
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
  MOESERVE_RETURN_IF_ERROR(RunRounds(args, answer, bounds, timer));
  if (convert) MOESERVE_RETURN_IF_ERROR(ConvertTensor(answer, output));
  if (timer) {
    MOESERVE_RETURN_IF_ERROR(timer->Stop());
    MOESERVE_ASSIGN_OR_RETURN(const auto us, timer->ElapsedUs());
    *timings = StageTimings();
    timings->prepare_us = us[StageTimer::kPrepare];
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
    if (prepared.a1q.device() != allocator_->device()) {
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
