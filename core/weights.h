// Expert weights of one rank: every MoE layer's local experts, resident in host memory.
#ifndef MOESERVE_CORE_WEIGHTS_H_
#define MOESERVE_CORE_WEIGHTS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model_config.h"
#include "core/tensor.h"

namespace moeserve {

// Views of one layer's local expert weights. Local index e corresponds to global expert
// expert_ids[e]. W13 stacks gate (rows [0, I)) over up (rows [I, 2I)), as vLLM's w13.
//   kBF16:  w13 BF16 [E_local, 2I, H], w2 BF16 [E_local, H, I]; scales empty.
//   kMXFP8: w13 FP8E4M3 [E_local, 2I, H], w2 FP8E4M3 [E_local, H, I];
//           w13_scale UINT8 (E8M0) [E_local, 2I, ceil(H/32)], w2_scale UINT8 [E_local, H,
//           ceil(I/32)] (one scale per 32 consecutive values along K, the GEMM's reduction dim).
struct LayerWeights {
  WeightFormat format = WeightFormat::kBF16;
  int64_t num_local_experts = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  TensorView w13;
  TensorView w2;
  TensorView w13_scale;
  TensorView w2_scale;
};

// Dequantizes (exactly: BF16 and E4M3 x 2^k are representable in FP32) local expert `e` of
// `weights` into w13_out [2I, H] and w2_out [H, I] (FP32, host).
absl::Status DequantizeExpertToFp32(const LayerWeights& weights, int64_t e, float* w13_out,
                                    float* w2_out);

// Deterministic synthetic weight value for (seed, layer, global expert, tensor, index): uniform
// with standard deviation 1/sqrt(fan_in), like a trained model's (about 0.02 at fan-in 2048).
// Depends only on these arguments, so any placement of experts over ranks sees equal values.
float SyntheticWeight(uint64_t seed, int layer, int expert, int tensor, int64_t index,
                      int64_t fan_in);

// Called by a loader after each MoE layer of its experts is resident, with the model layer index
// and that layer's bytes (e.g. to report progress); a non-OK status (e.g. CANCELLED when the
// process is told to stop) ends the load with that status. May be empty.
using LayerLoadedFn = std::function<absl::Status(int layer, int64_t bytes)>;

// Owns one rank's expert weights for every MoE layer of a model. Immutable after Create, so
// safe to read from any thread.
class ExpertWeightStore {
 public:
  // Synthetic BF16 weights for `expert_ids` (global ids hosted by this rank), generated with
  // `num_threads` threads. Checks the memory budget first (memory_budget_bytes <= 0 means what
  // the machine has available). `on_layer` runs after each layer.
  static absl::StatusOr<std::unique_ptr<ExpertWeightStore>> CreateSynthetic(
      const ModelConfig& config, std::vector<int> expert_ids, uint64_t seed, int num_threads,
      int64_t memory_budget_bytes = 0, const LayerLoadedFn& on_layer = nullptr);

  // Takes ownership of per-layer storage built elsewhere (e.g. a checkpoint loader).
  // `layers[i]` are the weights of config.moe_layers[i] (or layer i when that is empty);
  // `storage` keeps their memory alive.
  static absl::StatusOr<std::unique_ptr<ExpertWeightStore>> FromLayers(
      const ModelConfig& config, std::vector<int> expert_ids, std::vector<LayerWeights> layers,
      std::vector<Tensor> storage);

  const ModelConfig& config() const { return config_; }
  WeightFormat format() const { return layers_.empty() ? WeightFormat::kBF16 : layers_[0].format; }
  // Global expert ids in local-index order.
  const std::vector<int>& expert_ids() const { return expert_ids_; }
  // Weights of MoE layer `layer` (model layer index); null if it has no experts.
  const LayerWeights* layer(int layer) const;
  int64_t total_bytes() const { return total_bytes_; }

 private:
  ExpertWeightStore() = default;
  ModelConfig config_;
  std::vector<int> expert_ids_;
  std::vector<int> layer_slot_;  // model layer -> index into layers_, or -1
  std::vector<LayerWeights> layers_;
  std::vector<Tensor> storage_;
  int64_t total_bytes_ = 0;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_WEIGHTS_H_
