// Builds PrepareAndFinalize and Experts implementations by type name, for the engine, the
// combination suite and the moeserve-mk-check tool.
#ifndef MOESERVE_CORE_CPU_KERNEL_FACTORY_H_
#define MOESERVE_CORE_CPU_KERNEL_FACTORY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/comm/communicator.h"
#include "core/cpu/all_to_all_prepare_finalize.h"
#include "core/modular_kernel.h"
#include "core/placement.h"

namespace moeserve {

// Class names: NoEpPrepareAndFinalize, AllToAllContiguous, AllToAllBatched.
std::vector<std::string> PrepareFinalizeTypes();
// Class names: ReferenceExperts, BlasExperts, BatchedReferenceExperts, BatchedBlasExperts.
std::vector<std::string> ExpertsTypes();

// Accepts a class name or the engine's short name ("no_ep", "all2all_contiguous",
// "all2all_batched"; "reference", "blas", "batched_reference", "batched_blas") and returns the
// class name; INVALID_ARGUMENT listing the choices otherwise.
absl::StatusOr<std::string> CanonicalPrepareFinalizeType(absl::string_view type);
absl::StatusOr<std::string> CanonicalExpertsType(absl::string_view type);

struct PrepareFinalizeConfig {
  // This rank's endpoint (its world size is the number of ranks). Null: a single rank.
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<const Placement> placement;  // required by the all-to-all types
  int64_t max_num_tokens_per_rank = 256;
  QuantConfig quant;
  AllToAllOptions::Dispatch dispatch = AllToAllOptions::Dispatch::kPerRank;
};

absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> MakePrepareAndFinalize(
    absl::string_view type, const PrepareFinalizeConfig& config);
// num_threads: for the BLAS experts (<= 0: all hardware threads).
absl::StatusOr<std::unique_ptr<Experts>> MakeExperts(absl::string_view type, int num_threads);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_KERNEL_FACTORY_H_
