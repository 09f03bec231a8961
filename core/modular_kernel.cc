#include "core/modular_kernel.h"

#include <chrono>

#include "absl/strings/string_view.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

absl::string_view ActivationFormatName(ActivationFormat format) {
  return format == ActivationFormat::kStandard ? "Standard" : "BatchedExperts";
}

absl::StatusOr<PrepareAndFinalize::Receiver> PrepareAndFinalize::PrepareNoReceive(
    const PrepareArgs&) {
  return absl::UnimplementedError(absl::StrCat(name(), " has no PrepareNoReceive"));
}

absl::Status CheckCompatible(const PrepareAndFinalize& pf, const Experts& experts) {
  const ActivationFormats formats = experts.activation_formats();
  if (formats.input != pf.activation_format()) {
    return absl::InvalidArgumentError(absl::StrCat(
        pf.name(), " produces ", ActivationFormatName(pf.activation_format()),
        " activations but ", experts.name(), " expects ", ActivationFormatName(formats.input)));
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

  auto t0 = Clock::now();
  PrepareArgs pargs;
  pargs.hidden_states = args.hidden_states;
  pargs.topk_ids = args.topk_ids;
  pargs.topk_weights = args.topk_weights;
  pargs.num_experts = args.num_experts;
  pargs.num_local_experts = args.weights->num_local_experts;
  pargs.intermediate = args.weights->intermediate;
  pargs.expert_map = args.expert_map;
  PreparedActivations prepared;
  MOESERVE_RETURN_IF_ERROR(prepare_finalize_->Prepare(pargs, &prepared));
  if (timings) timings->prepare_us = us_since(t0);

  t0 = Clock::now();
  const WorkspaceShapes shapes = experts_->GetWorkspaceShapes(prepared.problem);
  ExpertsApplyArgs aargs;
  aargs.prepared = &prepared;
  aargs.weights = args.weights;
  aargs.workspace13 = workspace13_.Get(shapes.workspace_dtype, shapes.workspace13);
  aargs.workspace2 = workspace2_.Get(shapes.workspace_dtype, shapes.workspace2);
  aargs.output = fused_output_.Get(DType::kFP32, shapes.output);
  MOESERVE_RETURN_IF_ERROR(experts_->Apply(aargs));
  if (timings) timings->experts_us = us_since(t0);

  t0 = Clock::now();
  const std::unique_ptr<TopKWeightAndReduce> war = experts_->FinalizeWeightAndReduceImpl();
  MOESERVE_RETURN_IF_ERROR(prepare_finalize_->Finalize(output, aargs.output, prepared, *war));
  if (timings) timings->finalize_us = us_since(t0);
  return absl::OkStatus();
}

}  // namespace moeserve
