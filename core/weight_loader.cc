#include "core/weight_loader.h"

#include "absl/strings/str_cat.h"

namespace moeserve {

absl::StatusOr<ModelConfig> ResolveModelConfig(const WeightSource& source,
                                               const ModelConfig& configured) {
  if (!source.checkpoint_dir.empty()) {
    return absl::UnimplementedError(absl::StrCat("checkpoint loading is not available yet (",
                                                 source.checkpoint_dir, ")"));
  }
  return configured;
}

absl::StatusOr<std::unique_ptr<ExpertWeightStore>> LoadExpertWeights(
    const WeightSource& source, const ModelConfig& model, std::vector<int> expert_ids) {
  if (!source.checkpoint_dir.empty()) {
    return absl::UnimplementedError(absl::StrCat("checkpoint loading is not available yet (",
                                                 source.checkpoint_dir, ")"));
  }
  if (source.format != WeightFormat::kBF16) {
    return absl::UnimplementedError("mxfp8 weights are not available yet; use bf16");
  }
  return ExpertWeightStore::CreateSynthetic(model, std::move(expert_ids), source.seed,
                                            source.num_threads, source.memory_budget_bytes);
}

}  // namespace moeserve
