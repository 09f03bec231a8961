// The CUDA providers: the no-EP copy to the GPU and the NCCL all-to-all PrepareAndFinalize
// (each in the Standard and the BatchedExperts format), and the CUDA Experts.
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_rank_group.h"
#include "core/cuda/nccl_all_to_all.h"
#include "core/provider_registry.h"

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
  p.create = [format](const EnginePlan&,
                      const RankResources& rank) -> absl::StatusOr<std::unique_ptr<Experts>> {
    return CreateCudaExperts(rank.cuda, rank.device_weights, format);
  };
  return p;
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
}

}  // namespace moeserve
