// A Hugging Face checkpoint directory: config.json plus the weights, either one
// model.safetensors or shards model-0000i-of-0000n.safetensors listed by
// model.safetensors.index.json ({"weight_map": {tensor name: shard file}}).
//
// Only the routed experts' weights are read (moeserve serves the expert layers; attention,
// routers, shared experts and dense MLPs stay with the model frontend).
//
// Expert tensor naming (detected from the tensor names present):
//   kMixtral:    model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight
//                (w1 = gate, w3 = up, w2 = down)
//   kMlpExperts: model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight
//                (Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3)
// Each is a Linear weight [out, in]: gate and up [intermediate, hidden], down
// [hidden, intermediate]. Supported dtypes: BF16, F16, F32, or pre-quantized MXFP8: an F8_E4M3
// weight plus its E8M0 scales in "<weight name>_scale" (e.g. "...gate_proj.weight_scale"),
// dtype U8 or F8_E8M0, shape [out, ceil(in / 32)] (one scale per 32 consecutive values of a
// row, as in core/weights.h).
#ifndef MOESERVE_CORE_CHECKPOINT_HF_CHECKPOINT_H_
#define MOESERVE_CORE_CHECKPOINT_HF_CHECKPOINT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/checkpoint/safetensors.h"
#include "core/model_config.h"

namespace moeserve::checkpoint {

enum class ExpertNaming { kMixtral, kMlpExperts };
absl::string_view ExpertNamingName(ExpertNaming naming);

// The three weight names of one expert.
struct ExpertTensorNames {
  std::string gate, up, down;
};
ExpertTensorNames ExpertTensorNamesFor(ExpertNaming naming, int layer, int expert);
// Name of the E8M0 scales of a pre-quantized MXFP8 weight: weight name + "_scale".
std::string Mxfp8ScaleName(absl::string_view weight_name);

// The model described by a config.json's text (`path` is named in errors). Reads
//   experts: n_routed_experts | num_experts | num_local_experts; topk: num_experts_per_tok;
//   hidden: hidden_size; intermediate: moe_intermediate_size | intermediate_size;
//   layers: num_hidden_layers;
// and which layers carry experts:
//   DeepSeek (first_k_dense_replace [, moe_layer_freq]): l >= k and l % freq == 0;
//   Qwen-MoE (mlp_only_layers / decoder_sparse_step): l not in mlp_only_layers and
//     (l + 1) % decoder_sparse_step == 0;
//   otherwise (Mixtral) every layer.
// moe_layers is left empty when every layer is MoE. `name` becomes ModelConfig::name.
// The router (ModelConfig::router, core/router.h), by model_type, with the Hugging Face
// configuration classes' defaults for absent keys:
//   mixtral: softmax, renormalized (always);
//   qwen2_moe, qwen3_moe: softmax, renormalize = norm_topk_prob (default false);
//   deepseek_v3: scoring_func (default sigmoid), topk_method noaux_tc (n_group, topk_group,
//     e_score_correction_bias), norm_topk_prob (default true), routed_scaling_factor (2.5);
//   deepseek_v2: scoring_func (softmax), topk_method greedy only, norm_topk_prob (false),
//     routed_scaling_factor (1.0).
// Other model types, scoring functions or top-k methods, or group settings that do not fit
// the experts, leave the router unset with no_router_reason saying why (the experts are
// still served; only server-side routing is unavailable).
absl::StatusOr<ModelConfig> ModelConfigFromHfConfigJson(absl::string_view json_text,
                                                        absl::string_view path,
                                                        absl::string_view name);
// The same for `dir`/config.json; the name is the directory's last component.
absl::StatusOr<ModelConfig> ReadHfModelConfig(const std::string& dir);

// An opened checkpoint: config parsed, every safetensors file mapped and validated, the index
// checked against the files. Immutable after Open; safe to read from any thread.
class HfCheckpoint {
 public:
  static absl::StatusOr<std::unique_ptr<HfCheckpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  ExpertNaming naming() const { return naming_; }
  // Paths of the safetensors files, sorted.
  std::vector<std::string> files() const;

  bool Contains(const std::string& name) const { return where_.count(name) > 0; }
  // NOT_FOUND naming the checkpoint and the tensor when absent.
  absl::StatusOr<SafetensorsTensor> Find(const std::string& name) const;

 private:
  HfCheckpoint() = default;
  std::string dir_;
  ModelConfig config_;
  ExpertNaming naming_ = ExpertNaming::kMlpExperts;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;  // by path
  std::map<std::string, const SafetensorsFile*> where_;            // tensor -> file
};

}  // namespace moeserve::checkpoint

#endif  // MOESERVE_CORE_CHECKPOINT_HF_CHECKPOINT_H_
