// Model description: the shape of every MoE layer moeserve serves.
#ifndef MOESERVE_CORE_MODEL_CONFIG_H_
#define MOESERVE_CORE_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/router.h"

namespace moeserve {

// Weight storage of the experts.
enum class WeightFormat {
  kBF16,   // BF16 values
  kMXFP8,  // FP8 E4M3 values, one E8M0 scale per 32 consecutive values along K
};
absl::string_view WeightFormatName(WeightFormat format);
absl::StatusOr<WeightFormat> ParseWeightFormat(absl::string_view name);

// Every MoE layer has num_experts experts, each a SiLU-gated MLP
//   y = down(silu(gate(x)) * up(x)),  gate/up: hidden -> intermediate, down: intermediate ->
//   hidden,
// and every token is routed to topk of them.
struct ModelConfig {
  // Validate()'s upper bounds (sizes beyond them are refused, so size products fit in int64).
  static constexpr int kMaxLayers = 1024;
  static constexpr int kMaxExperts = 16384;
  static constexpr int64_t kMaxHidden = int64_t{1} << 18;  // also bounds intermediate

  std::string name;
  int num_layers = 0;
  int num_experts = 0;
  int topk = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  // Layer indices that carry experts, ascending. Empty means all of [0, num_layers).
  // Checkpoints with dense layers (e.g. DeepSeek's first_k_dense_replace) list theirs here.
  std::vector<int> moe_layers;
  // How the model routes tokens (its gate), for server-side routing. Unset when the model's
  // routing is not one moeserve implements; no_router_reason then says why.
  std::optional<RouterConfig> router;
  std::string no_router_reason;

  bool IsMoeLayer(int layer) const;
  int num_moe_layers() const;
  // Bytes of expert weights for one layer's `num_experts_on_rank` experts in `format`
  // (MXFP8 counts the E8M0 scales).
  // -1 if the size overflows int64 (never for a config that passed Validate()).
  int64_t LayerWeightBytes(int num_experts_on_rank, WeightFormat format) const;
  // Estimated host bytes of one engine step's buffers at `max_tokens` tokens (the largest are
  // FP32 [tokens, topk, hidden]); -1 on overflow.
  int64_t ActivationBytes(int64_t max_tokens) const;
  absl::Status Validate() const;
  std::string DebugString() const;
};

struct ModelOverrides {
  std::optional<int> num_layers;
  std::optional<int> num_experts;
  std::optional<int> topk;
  std::optional<int64_t> hidden;
  std::optional<int64_t> intermediate;
};

// Presets: "tiny" (default, fast on 2 cores), "qwen3-30b-a3b", "deepseek-v3", "seed-megamoe".
// Their routers (synthetic gates, core/router.h): softmax top-k with renormalization, except
// deepseek-v3: sigmoid, e_score_correction_bias, 8 groups keeping 4, renormalized, times 2.5.
absl::StatusOr<ModelConfig> ModelPreset(absl::string_view name);
std::vector<std::string> ModelPresetNames();
// Overridden sizes that no longer allow the preset's expert groups (n_group must divide
// num_experts, the kept groups must hold topk experts) fall back to ungrouped top-k.
absl::StatusOr<ModelConfig> ApplyOverrides(ModelConfig config, const ModelOverrides& overrides);

// Bytes of memory currently available to this process (MemAvailable, bounded by the cgroup
// limit where one is set).
int64_t AvailableHostMemoryBytes();

// Refuses (RESOURCE_EXHAUSTED) when `needed_bytes` exceed `available_bytes` times a safety
// fraction, with a message naming what was asked and how to shrink it.
absl::Status CheckMemoryBudget(const ModelConfig& config, int64_t needed_bytes,
                               int64_t available_bytes);
// Refuses (RESOURCE_EXHAUSTED, naming the estimate and --max_tokens_per_request) a token limit
// whose step buffers (ModelConfig::ActivationBytes, once per step in flight: each engine lane
// has its own) exceed half of `available_bytes`.
absl::Status CheckActivationBudget(const ModelConfig& config, int64_t max_tokens,
                                   int64_t available_bytes, int steps_in_flight = 1);

}  // namespace moeserve

#endif  // MOESERVE_CORE_MODEL_CONFIG_H_
