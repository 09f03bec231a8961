// The CPU providers: three PrepareAndFinalize and four Experts types (core/cpu/*.h).
#include "absl/strings/str_cat.h"
#include "core/cpu/all_to_all_prepare_finalize.h"
#include "core/cpu/batched_experts.h"
#include "core/cpu/cpu_experts.h"
#include "core/cpu/cpu_rank_group.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/provider_registry.h"

namespace moeserve {
namespace {

absl::Status PositiveCapacity(const EnginePlan& plan) {
  if (plan.max_tokens_per_rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_num_tokens_per_rank must be > 0, got ", plan.max_tokens_per_rank));
  }
  return absl::OkStatus();
}

// The all-to-all types' shared checks and options.
absl::StatusOr<AllToAllOptions> AllToAllConfig(absl::string_view name, const EnginePlan& plan,
                                               const RankResources& rank) {
  if (rank.comm == nullptr || plan.placement == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, " needs a communicator and a placement"));
  }
  if (plan.placement->num_ranks() != rank.comm->world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": placement has ", plan.placement->num_ranks(),
                     " ranks, the communicator ", rank.comm->world_size()));
  }
  AllToAllOptions options;
  options.max_num_tokens_per_rank = plan.max_tokens_per_rank;
  options.dispatch = plan.dispatch;
  options.max_rounds = plan.max_tokens_per_request;  // > 0 (ResolveEngineConfig)
  return options;
}

template <typename T>
std::function<absl::StatusOr<std::unique_ptr<PrepareAndFinalize>>(const EnginePlan&,
                                                                  const RankResources&)>
AllToAllFactory() {
  return [](const EnginePlan& plan,
            const RankResources& rank) -> absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> {
    absl::StatusOr<AllToAllOptions> options = AllToAllConfig(T::kName, plan, rank);
    if (!options.ok()) return options.status();
    return std::make_unique<T>(rank.comm, plan.placement, *options);
  };
}

}  // namespace

void RegisterCpuProviders(ProviderRegistry& registry) {
  PrepareFinalizeProvider no_ep;
  no_ep.name = std::string(NoEpPrepareAndFinalize::kName);
  no_ep.aliases = {"no_ep"};
  no_ep.format = ActivationFormat::kStandard;
  no_ep.supports_ep = false;
  no_ep.supports = PositiveCapacity;
  no_ep.create = [](const EnginePlan& plan,
                    const RankResources&) -> absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> {
    return std::make_unique<NoEpPrepareAndFinalize>(plan.max_tokens_per_rank);
  };
  (void)registry.Register(std::move(no_ep));

  PrepareFinalizeProvider contiguous;
  contiguous.name = std::string(AllToAllContiguousPrepareAndFinalize::kName);
  contiguous.aliases = {"all2all_contiguous"};
  contiguous.format = ActivationFormat::kStandard;
  contiguous.supports_ep = true;
  contiguous.supports = PositiveCapacity;
  contiguous.create = AllToAllFactory<AllToAllContiguousPrepareAndFinalize>();
  (void)registry.Register(std::move(contiguous));

  PrepareFinalizeProvider batched;
  batched.name = std::string(AllToAllBatchedPrepareAndFinalize::kName);
  batched.aliases = {"all2all_batched"};
  batched.format = ActivationFormat::kBatchedExperts;
  batched.supports_ep = true;
  batched.supports = PositiveCapacity;
  batched.create = AllToAllFactory<AllToAllBatchedPrepareAndFinalize>();
  (void)registry.Register(std::move(batched));

  ExpertsProvider reference;
  reference.name = std::string(ReferenceExperts::kName);
  reference.aliases = {"reference"};
  reference.format = ActivationFormat::kStandard;
  reference.supports_ep = true;
  reference.reference = true;
  reference.create = [](const EnginePlan&,
                        const RankResources&) -> absl::StatusOr<std::unique_ptr<Experts>> {
    return std::make_unique<ReferenceExperts>();
  };
  (void)registry.Register(std::move(reference));

  ExpertsProvider blas;
  blas.name = std::string(BlasExperts::kName);
  blas.aliases = {"blas"};
  blas.format = ActivationFormat::kStandard;
  blas.supports_ep = true;
  blas.create = [](const EnginePlan& plan,
                   const RankResources&) -> absl::StatusOr<std::unique_ptr<Experts>> {
    return std::make_unique<BlasExperts>(plan.threads_per_rank);
  };
  (void)registry.Register(std::move(blas));

  ExpertsProvider batched_reference;
  batched_reference.name = std::string(BatchedReferenceExperts::kName);
  batched_reference.aliases = {"batched_reference"};
  batched_reference.format = ActivationFormat::kBatchedExperts;
  batched_reference.supports_ep = true;
  batched_reference.reference = true;
  batched_reference.create = [](const EnginePlan&,
                                const RankResources&) -> absl::StatusOr<std::unique_ptr<Experts>> {
    return std::make_unique<BatchedReferenceExperts>();
  };
  (void)registry.Register(std::move(batched_reference));

  ExpertsProvider batched_blas;
  batched_blas.name = std::string(BatchedBlasExperts::kName);
  batched_blas.aliases = {"batched_blas"};
  batched_blas.format = ActivationFormat::kBatchedExperts;
  batched_blas.supports_ep = true;
  batched_blas.create = [](const EnginePlan& plan,
                           const RankResources&) -> absl::StatusOr<std::unique_ptr<Experts>> {
    return std::make_unique<BatchedBlasExperts>(plan.threads_per_rank);
  };
  (void)registry.Register(std::move(batched_blas));
}

}  // namespace moeserve
