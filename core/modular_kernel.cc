#include "core/modular_kernel.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
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
    std::unique_ptr<PrepareAndFinalize> prepare_finalize, std::unique_ptr<Experts> experts) {
  if (prepare_finalize == nullptr || experts == nullptr) {
    return absl::InvalidArgumentError("ModularKernel needs a PrepareAndFinalize and an Experts");
  }
  MOESERVE_RETURN_IF_ERROR(CheckCompatible(*prepare_finalize, *experts));
  return std::unique_ptr<ModularKernel>(
      new ModularKernel(std::move(prepare_finalize), std::move(experts)));
}

absl::Status ModularKernel::Forward(const ModularKernelArgs& args, const TensorView& output,
                                    StageTimings* timings) {
  if (args.weights == nullptr) return absl::InvalidArgumentError("ModularKernel: no weights");
  if (!experts_->supports_weight_format(args.weights->format)) {
    return absl::InvalidArgumentError(absl::StrCat(experts_->name(), " does not support ",
                                                   WeightFormatName(args.weights->format),
                                                   " weights"));
  }
  using Clock = std::chrono::steady_clock;
  auto us_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  };

  PrepareArgs pargs;
  pargs.hidden_states = args.hidden_states;
  pargs.topk_ids = args.topk_ids;
  pargs.topk_weights = args.topk_weights;
  pargs.num_experts = args.num_experts;
  pargs.num_local_experts = args.weights->num_local_experts;
  pargs.intermediate = args.weights->intermediate;
  pargs.expert_map = args.expert_map;
  const TransferStats stats0 = prepare_finalize_->transfer_stats();
  auto t0 = Clock::now();
  MOESERVE_ASSIGN_OR_RETURN(const std::vector<int64_t> bounds,
                            prepare_finalize_->PlanChunks(pargs));
  if (timings) {
    *timings = StageTimings();
    timings->prepare_us += us_since(t0);
  }
  const int64_t m = args.hidden_states.rank() >= 1 ? args.hidden_states.dim(0) : 0;
  if (bounds.size() < 2 || bounds.front() != 0 || bounds.back() != m) {
    return absl::InternalError(
        absl::StrCat(prepare_finalize_->name(), ": PlanChunks must return {0, ..., ", m, "}"));
  }
  const std::unique_ptr<TopKWeightAndReduce> war = experts_->FinalizeWeightAndReduceImpl();
  for (size_t c = 0; c + 1 < bounds.size(); ++c) {
    const int64_t begin = bounds[c], end = bounds[c + 1];
    if (begin > end) return absl::InternalError("PlanChunks: boundaries must ascend");
    pargs.hidden_states = args.hidden_states.Slice(begin, end);
    pargs.topk_ids = args.topk_ids.Slice(begin, end);
    pargs.topk_weights = args.topk_weights.Slice(begin, end);

    t0 = Clock::now();
    PreparedActivations prepared;
    MOESERVE_RETURN_IF_ERROR(prepare_finalize_->Prepare(pargs, &prepared));
    if (timings) timings->prepare_us += us_since(t0);

    t0 = Clock::now();
    const WorkspaceShapes shapes = experts_->GetWorkspaceShapes(prepared.problem);
    ExpertsApplyArgs aargs;
    aargs.prepared = &prepared;
    aargs.weights = args.weights;
    aargs.workspace13 = workspace13_.Get(shapes.workspace_dtype, shapes.workspace13);
    aargs.workspace2 = workspace2_.Get(shapes.workspace_dtype, shapes.workspace2);
    aargs.output = fused_output_.Get(DType::kFP32, shapes.output);
    MOESERVE_RETURN_IF_ERROR(experts_->Apply(aargs));
    if (timings) timings->experts_us += us_since(t0);

    t0 = Clock::now();
    MOESERVE_RETURN_IF_ERROR(
        prepare_finalize_->Finalize(output.Slice(begin, end), aargs.output, prepared, *war));
    if (timings) timings->finalize_us += us_since(t0);
  }
  if (timings) {
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

}  // namespace moeserve
