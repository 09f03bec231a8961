// Where a rank's expert weights come from: synthetic (seeded) or a checkpoint, in the format
// they are served in.
#ifndef MOESERVE_CORE_WEIGHT_LOADER_H_
#define MOESERVE_CORE_WEIGHT_LOADER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model_config.h"
#include "core/router.h"
#include "core/weights.h"

namespace moeserve {

struct WeightSource {
  // Empty: synthetic weights from `seed`. Otherwise a Hugging Face checkpoint directory.
  std::string checkpoint_dir;
  uint64_t seed = 0;
  WeightFormat format = WeightFormat::kBF16;  // format served (quantized at load if needed)
  int num_threads = 1;
  int64_t memory_budget_bytes = 0;  // <= 0: what the machine has available
};

// The model to serve: `configured` (preset plus overrides) for synthetic weights, or the
// checkpoint's config.json for a checkpoint (then `configured` is ignored).
absl::StatusOr<ModelConfig> ResolveModelConfig(const WeightSource& source,
                                               const ModelConfig& configured);

// Loads the weights of `expert_ids` (global ids, local-index order) for every MoE layer of
// `model`. Each rank calls this for its own experts only.
absl::StatusOr<std::unique_ptr<ExpertWeightStore>> LoadExpertWeights(const WeightSource& source,
                                                                     const ModelConfig& model,
                                                                     std::vector<int> expert_ids);

// The router (gates) of `model` for server-side routing, from the same source: synthetic gates
// from `seed` (CreateSyntheticRouter) or the checkpoint's (checkpoint::LoadCheckpointRouter).
// Sets *router, or leaves it null and sets *no_router_reason when the model has no router
// moeserve implements or the checkpoint has no gates. Errors only for a broken checkpoint
// (gates missing for some layers, wrong shapes or dtypes, non-finite values).
absl::Status LoadRouter(const WeightSource& source, const ModelConfig& model, int num_threads,
                        std::unique_ptr<Router>* router, std::string* no_router_reason);

}  // namespace moeserve

#endif  // MOESERVE_CORE_WEIGHT_LOADER_H_
