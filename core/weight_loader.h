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

// Told how this process's weight load goes, e.g. to print progress or to stop it. Thread-safe:
// called from the loading threads (one per rank at most).
class WeightLoadObserver {
 public:
  virtual ~WeightLoadObserver() = default;
  // Once, before anything is read: this process will hold `bytes` of expert weights (host
  // memory, served format) in `shards` pieces (one per local rank and MoE layer), with
  // `available_bytes` of host memory free now.
  virtual void OnLoadPlanned(int64_t bytes, int shards, int64_t available_bytes) {}
  // One rank's experts of MoE layer `layer` are resident (`bytes` of them). A non-OK status
  // (e.g. CANCELLED when the process is told to stop) ends the load with that status.
  virtual absl::Status OnShardLoaded(int rank, int layer, int64_t bytes) {
    return absl::OkStatus();
  }
};

struct WeightSource {
  // Empty: synthetic weights from `seed`. Otherwise a Hugging Face checkpoint directory.
  std::string checkpoint_dir;
  uint64_t seed = 0;
  WeightFormat format = WeightFormat::kBF16;  // format served (quantized at load if needed)
  int num_threads = 1;
  int64_t memory_budget_bytes = 0;         // <= 0: what the machine has available
  WeightLoadObserver* observer = nullptr;  // optional; must outlive the load
};

// The model to serve: `configured` (preset plus overrides) for synthetic weights, or the
// checkpoint's config.json for a checkpoint (then `configured` is ignored).
absl::StatusOr<ModelConfig> ResolveModelConfig(const WeightSource& source,
                                               const ModelConfig& configured);

// Loads the weights of `expert_ids` (global ids, local-index order) for every MoE layer of
// `model`. Each rank calls this for its own experts only; `rank` (global) is what the observer
// is told.
absl::StatusOr<std::unique_ptr<ExpertWeightStore>> LoadExpertWeights(const WeightSource& source,
                                                                     const ModelConfig& model,
                                                                     std::vector<int> expert_ids,
                                                                     int rank = 0);

// Host bytes of expert weights this process will hold: every local rank's experts of every
// MoE layer, in `format` (what WeightLoadObserver::OnLoadPlanned is told).
int64_t ExpertWeightBytes(const ModelConfig& model, WeightFormat format,
                          const std::vector<int>& experts_per_local_rank);

// The router (gates) of `model` for server-side routing, from the same source: synthetic gates
// from `seed` (CreateSyntheticRouter) or the checkpoint's (checkpoint::LoadCheckpointRouter).
// Sets *router, or leaves it null and sets *no_router_reason when the model has no router
// moeserve implements or the checkpoint has no gates. Errors only for a broken checkpoint
// (gates missing for some layers, wrong shapes or dtypes, non-finite values).
absl::Status LoadRouter(const WeightSource& source, const ModelConfig& model, int num_threads,
                        std::unique_ptr<Router>* router, std::string* no_router_reason);

}  // namespace moeserve

#endif  // MOESERVE_CORE_WEIGHT_LOADER_H_
