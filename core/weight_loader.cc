#include "core/weight_loader.h"

#include "absl/strings/str_cat.h"
#include "core/checkpoint/expert_loader.h"
#include "core/checkpoint/gate_loader.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/mxfp8_weights.h"

namespace moeserve {

absl::StatusOr<ModelConfig> ResolveModelConfig(const WeightSource& source,
                                               const ModelConfig& configured) {
  if (!source.checkpoint_dir.empty()) {
    // The checkpoint's config.json describes the model; only that file is read here.
    return checkpoint::ReadHfModelConfig(source.checkpoint_dir);
  }
  return configured;
}

int64_t ExpertWeightBytes(const ModelConfig& model, WeightFormat format,
                          const std::vector<int>& experts_per_local_rank) {
  int64_t bytes = 0;
  for (int n : experts_per_local_rank) {
    bytes += model.LayerWeightBytes(n, format) * model.num_moe_layers();
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<ExpertWeightStore>> LoadExpertWeights(const WeightSource& source,
                                                                     const ModelConfig& model,
                                                                     std::vector<int> expert_ids,
                                                                     int rank) {
  LayerLoadedFn on_layer;
  if (source.observer != nullptr) {
    on_layer = [observer = source.observer, rank](int layer, int64_t bytes) {
      return observer->OnShardLoaded(rank, layer, bytes);
    };
  }
  if (!source.checkpoint_dir.empty()) {
    // Maps and validates every safetensors file, then reads this rank's experts only.
    auto ckpt = checkpoint::HfCheckpoint::Open(source.checkpoint_dir);
    if (!ckpt.ok()) return ckpt.status();
    checkpoint::ExpertLoadOptions options;
    options.format = source.format;
    options.num_threads = source.num_threads;
    options.memory_budget_bytes = source.memory_budget_bytes;
    options.on_layer = std::move(on_layer);
    return checkpoint::LoadCheckpointExperts(**ckpt, model, std::move(expert_ids), options);
  }
  if (source.format == WeightFormat::kMXFP8) {
    // Synthetic BF16 weights quantized at load, one layer at a time.
    return CreateSyntheticMxfp8(model, std::move(expert_ids), source.seed, source.num_threads,
                                source.memory_budget_bytes, on_layer);
  }
  return ExpertWeightStore::CreateSynthetic(model, std::move(expert_ids), source.seed,
                                            source.num_threads, source.memory_budget_bytes,
                                            on_layer);
}

absl::Status LoadRouter(const WeightSource& source, const ModelConfig& model, int num_threads,
                        std::unique_ptr<Router>* router, std::string* no_router_reason) {
  router->reset();
  no_router_reason->clear();
  if (!model.router.has_value()) {
    *no_router_reason = model.no_router_reason.empty()
                            ? absl::StrCat("model '", model.name, "' has no router configuration")
                            : model.no_router_reason;
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Router>> loaded;
  if (source.checkpoint_dir.empty()) {
    loaded = CreateSyntheticRouter(model, source.seed, num_threads);
  } else {
    auto ckpt = checkpoint::HfCheckpoint::Open(source.checkpoint_dir);
    if (!ckpt.ok()) return ckpt.status();
    loaded = checkpoint::LoadCheckpointRouter(**ckpt, model, num_threads);
    if (loaded.status().code() == absl::StatusCode::kNotFound) {
      *no_router_reason = std::string(loaded.status().message());
      return absl::OkStatus();
    }
  }
  if (!loaded.ok()) return loaded.status();
  *router = *std::move(loaded);
  return absl::OkStatus();
}

}  // namespace moeserve
