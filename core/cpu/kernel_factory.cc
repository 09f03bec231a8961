#include "core/cpu/kernel_factory.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/cpu/batched_experts.h"
#include "core/cpu/cpu_experts.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/status_macros.h"

namespace moeserve {

std::vector<std::string> PrepareFinalizeTypes() {
  return {std::string(NoEpPrepareAndFinalize::kName),
          std::string(AllToAllContiguousPrepareAndFinalize::kName),
          std::string(AllToAllBatchedPrepareAndFinalize::kName)};
}

std::vector<std::string> ExpertsTypes() {
  return {std::string(ReferenceExperts::kName), std::string(BlasExperts::kName),
          std::string(BatchedReferenceExperts::kName), std::string(BatchedBlasExperts::kName)};
}

absl::StatusOr<std::string> CanonicalPrepareFinalizeType(absl::string_view type) {
  if (type == "no_ep" || type == NoEpPrepareAndFinalize::kName) {
    return std::string(NoEpPrepareAndFinalize::kName);
  }
  if (type == "all2all_contiguous" || type == AllToAllContiguousPrepareAndFinalize::kName) {
    return std::string(AllToAllContiguousPrepareAndFinalize::kName);
  }
  if (type == "all2all_batched" || type == AllToAllBatchedPrepareAndFinalize::kName) {
    return std::string(AllToAllBatchedPrepareAndFinalize::kName);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("prepare_finalize: got '", type,
                   "', expected no_ep, all2all_contiguous or all2all_batched (or a class name: ",
                   absl::StrJoin(PrepareFinalizeTypes(), ", "), ")"));
}

absl::StatusOr<std::string> CanonicalExpertsType(absl::string_view type) {
  if (type == "reference" || type == ReferenceExperts::kName) {
    return std::string(ReferenceExperts::kName);
  }
  if (type == "blas" || type == BlasExperts::kName) return std::string(BlasExperts::kName);
  if (type == "batched_reference" || type == BatchedReferenceExperts::kName) {
    return std::string(BatchedReferenceExperts::kName);
  }
  if (type == "batched_blas" || type == BatchedBlasExperts::kName) {
    return std::string(BatchedBlasExperts::kName);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "experts: got '", type,
      "', expected reference, blas, batched_reference or batched_blas (or a class name: ",
      absl::StrJoin(ExpertsTypes(), ", "), ")"));
}

absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> MakePrepareAndFinalize(
    absl::string_view type, const PrepareFinalizeConfig& config) {
  MOESERVE_ASSIGN_OR_RETURN(const std::string name, CanonicalPrepareFinalizeType(type));
  if (config.max_num_tokens_per_rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_num_tokens_per_rank must be > 0, got ", config.max_num_tokens_per_rank));
  }
  const int world = config.comm ? config.comm->world_size() : 1;
  if (name == NoEpPrepareAndFinalize::kName) {
    if (world != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " serves a single rank, but there are ", world,
                       " ranks; use AllToAllContiguous (all2all_contiguous) or AllToAllBatched "
                       "(all2all_batched)"));
    }
    return std::make_unique<NoEpPrepareAndFinalize>(config.max_num_tokens_per_rank, config.quant);
  }
  if (config.comm == nullptr || config.placement == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, " needs a communicator and a placement"));
  }
  if (config.placement->num_ranks() != world) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": placement has ",
                                                   config.placement->num_ranks(),
                                                   " ranks, the communicator ", world));
  }
  AllToAllOptions options;
  options.max_num_tokens_per_rank = config.max_num_tokens_per_rank;
  options.quant = config.quant;
  options.dispatch = config.dispatch;
  if (name == AllToAllContiguousPrepareAndFinalize::kName) {
    return std::make_unique<AllToAllContiguousPrepareAndFinalize>(config.comm, config.placement,
                                                                  options);
  }
  return std::make_unique<AllToAllBatchedPrepareAndFinalize>(config.comm, config.placement,
                                                             options);
}

absl::StatusOr<std::unique_ptr<Experts>> MakeExperts(absl::string_view type, int num_threads) {
  MOESERVE_ASSIGN_OR_RETURN(const std::string name, CanonicalExpertsType(type));
  if (name == ReferenceExperts::kName) return std::make_unique<ReferenceExperts>();
  if (name == BlasExperts::kName) return std::make_unique<BlasExperts>(num_threads);
  if (name == BatchedReferenceExperts::kName) return std::make_unique<BatchedReferenceExperts>();
  return std::make_unique<BatchedBlasExperts>(num_threads);
}

}  // namespace moeserve
