// The CUDA providers: the no-EP copy to the GPU and the NCCL all-to-all PrepareAndFinalize
// (each in the Standard and the BatchedExperts format), and the CUDA Experts: "cuda" (decode
// kernels, and on Hopper the grouped GEMM above the measured crossover), "cuda_batched", and
// "cuda_grouped_sm90" (the grouped GEMM at every size, Hopper only).
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_grouped_experts.h"
#include "core/cuda/cuda_rank_group.h"
#include "core/cuda/nccl_all_to_all.h"
#include "core/provider_registry.h"
#include "core/status_macros.h"

namespace moeserve {
namespace {

// 16-byte activation rows for the CUDA kernels.
absl::Status HiddenMultipleOf8(absl::string_view name, const EnginePlan& plan) {
  if (plan.model.hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " needs hidden % 8 == 0, got hidden=", plan.model.hidden));
  }
  return absl::OkStatus();
}

PrepareFinalizeProvider NoEp(ActivationFormat format) {
  PrepareFinalizeProvider p;
  p.name = format == ActivationFormat::kStandard ? "CudaNoEpPrepareAndFinalize"
                                                 : "CudaNoEpBatchedPrepareAndFinalize";
  p.backend = Backend::kCuda;
  p.format = format;
  p.supports_ep = false;
  p.device_tensors = true;
  p.device_routing = format == ActivationFormat::kStandard;
  p.create = [format](
                 const EnginePlan& plan,
                 const RankResources& rank) -> absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> {
    return CreateCudaNoEpPrepareAndFinalize(rank.cuda, plan.max_tokens_per_rank, format);
  };
  return p;
}

PrepareFinalizeProvider NcclAllToAll(ActivationFormat format) {
  PrepareFinalizeProvider p;
  p.name = format == ActivationFormat::kStandard ? "NcclAllToAllContiguous" : "NcclAllToAllBatched";
  p.backend = Backend::kCuda;
  p.format = format;
  p.supports_ep = true;
  p.device_tensors = true;
  p.supports = [name = p.name](const EnginePlan&) -> absl::Status {
#ifdef MOESERVE_HAVE_NCCL
    return absl::OkStatus();
#else
    return absl::FailedPreconditionError(
        absl::StrCat("prepare_finalize ", name, " on GPUs needs NCCL, which this build lacks"));
#endif
  };
  p.create = [format](
                 const EnginePlan& plan,
                 const RankResources& rank) -> absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> {
#ifdef MOESERVE_HAVE_NCCL
    NcclAllToAllOptions options;
    options.max_num_tokens_per_rank = plan.max_tokens_per_rank;
    options.format = format;
    options.dispatch = plan.dispatch;
    options.max_rounds = plan.max_tokens_per_request;  // > 0 (ResolveEngineConfig)
    // The CUDA rank group hands every rank its NcclCommunicator.
    return CreateNcclAllToAllPrepareAndFinalize(
        rank.cuda, std::static_pointer_cast<NcclCommunicator>(rank.comm), plan.placement, options);
#else
    return absl::FailedPreconditionError("this build lacks NCCL");
#endif
  };
  return p;
}

ExpertsProvider CudaExperts(ActivationFormat format) {
  ExpertsProvider p;
  const bool standard = format == ActivationFormat::kStandard;
  p.name = standard ? "CudaExperts" : "CudaBatchedExperts";
  p.aliases = {standard ? "cuda" : "cuda_batched"};
  p.backend = Backend::kCuda;
  p.format = format;
  p.supports_ep = true;
  p.supports = [name = p.name](const EnginePlan& plan) { return HiddenMultipleOf8(name, plan); };
  p.create = [format, name = p.name](
                 const EnginePlan&,
                 const RankResources& rank) -> absl::StatusOr<std::unique_ptr<Experts>> {
    // Standard format on a Hopper GPU: the decode kernels below the measured crossover, the
    // grouped GEMM above it (core/cuda/cuda_grouped_experts.h); the same name either way.
    if (format == ActivationFormat::kStandard && rank.cuda != nullptr &&
        CudaGroupedSm90Supported(rank.cuda->device()).ok()) {
      CudaGroupedExpertsOptions options;
      options.path = CudaGroupedExpertsOptions::Path::kCrossover;
      options.name = name;
      return CreateCudaGroupedExperts(rank.cuda, rank.device_weights, options);
    }
    return CreateCudaExperts(rank.cuda, rank.device_weights, format);
  };
  return p;
}

// An Experts over CreateCudaGroupedExperts with `options` (its name becomes options.name), on
// compute capability 9.0 GPUs; `mxfp8_only` refuses any other weight format.
ExpertsProvider CudaGroupedProvider(std::string name, std::string alias,
                                    CudaGroupedExpertsOptions options, bool mxfp8_only) {
  ExpertsProvider p;
  p.name = std::move(name);
  p.aliases = {std::move(alias)};
  p.backend = Backend::kCuda;
  p.format = ActivationFormat::kStandard;
  p.supports_ep = true;
  p.supports = [name = p.name, mxfp8_only](const EnginePlan& plan) -> absl::Status {
    MOESERVE_RETURN_IF_ERROR(HiddenMultipleOf8(name, plan));
    if (mxfp8_only && plan.weights.format != WeightFormat::kMXFP8) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " serves MXFP8 weights (W8A8); the weights here are ",
          WeightFormatName(plan.weights.format), " (use --weight_format mxfp8, or experts cuda)"));
    }
    // Every rank's GPU is checked again when its Experts are made; device 0 speaks for them.
    const absl::Status s = CudaGroupedSm90Supported(0);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(name, ": ", s.message()));
    return absl::OkStatus();
  };
  options.name = p.name;
  p.create = [options](const EnginePlan&,
                       const RankResources& rank) -> absl::StatusOr<std::unique_ptr<Experts>> {
    return CreateCudaGroupedExperts(rank.cuda, rank.device_weights, options);
  };
  return p;
}

// The grouped GEMM at every batch size (MXFP8 weights through a BF16 copy dequantized once:
// core/cuda/cuda_grouped_experts.h).
ExpertsProvider CudaGroupedSm90() {
  CudaGroupedExpertsOptions options;
  options.path = CudaGroupedExpertsOptions::Path::kGrouped;
  return CudaGroupedProvider("CudaGroupedSm90Experts", "cuda_grouped_sm90", options,
                             /*mxfp8_only=*/false);
}

// W8A8 for MXFP8 weights (opt-in, not exact against the BF16 path): the FP8 grouped GEMM with
// activations quantized per row per 128 K above the measured crossover, the decode kernels below
// it (core/cuda/cuda_grouped_experts.h).
ExpertsProvider CudaW8A8() {
  CudaGroupedExpertsOptions options;
  options.path = CudaGroupedExpertsOptions::Path::kCrossover;
  options.fp8_activations = true;
  return CudaGroupedProvider("CudaW8A8Experts", "cuda_w8a8", options, /*mxfp8_only=*/true);
}

// core_cuda registers itself: linked whole-archive (moeserve_backends), so this object and its
// initializer are kept although nothing refers to them.
const bool kRegistered = [] {
  RegisterCudaBackend(ProviderRegistry::Global());
  return true;
}();

}  // namespace

void RegisterCudaProviders(ProviderRegistry& registry) {
  (void)registry.Register(NoEp(ActivationFormat::kStandard));
  (void)registry.Register(NoEp(ActivationFormat::kBatchedExperts));
  (void)registry.Register(NcclAllToAll(ActivationFormat::kStandard));
  (void)registry.Register(NcclAllToAll(ActivationFormat::kBatchedExperts));
  (void)registry.Register(CudaExperts(ActivationFormat::kStandard));
  (void)registry.Register(CudaExperts(ActivationFormat::kBatchedExperts));
  (void)registry.Register(CudaGroupedSm90());
  (void)registry.Register(CudaW8A8());
}

}  // namespace moeserve
