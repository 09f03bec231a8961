// Loads a Hugging Face checkpoint's router gates (the `mlp.gate` Linear of every MoE layer and,
// for DeepSeek-V3, its e_score_correction_bias) into a core Router, for server-side routing.
//
// Tensor names (layer l):
//   kMixtral:    model.layers.{l}.block_sparse_moe.gate.weight                 [E, H]
//   kMlpExperts: model.layers.{l}.mlp.gate.weight                              [E, H]
//                model.layers.{l}.mlp.gate.e_score_correction_bias (DeepSeek-V3) [E]
// Dtypes BF16, F16 or F32, widened exactly to FP32 (the router computes in FP32).
#ifndef MOESERVE_CORE_CHECKPOINT_GATE_LOADER_H_
#define MOESERVE_CORE_CHECKPOINT_GATE_LOADER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/model_config.h"
#include "core/router.h"

namespace moeserve::checkpoint {

std::string GateWeightName(ExpertNaming naming, int layer);
std::string GateBiasName(ExpertNaming naming, int layer);

// The router of `model` (which must describe the checkpoint, with model.router set) from the
// checkpoint's gates. NOT_FOUND when no MoE layer has a gate tensor (a checkpoint of the
// experts only: the caller serves without a router). A correction bias that no layer has
// is taken as absent (the config's correction_bias is cleared: a zero bias). Other problems
// refuse with INVALID_ARGUMENT naming the tensor and file: a gate or bias present for some
// layers only, a shape
// other than [num_experts, hidden_size] / [num_experts], an unsupported dtype, a NaN or Inf.
// `num_threads`: the router's threads (Router::Create).
absl::StatusOr<std::unique_ptr<Router>> LoadCheckpointRouter(const HfCheckpoint& checkpoint,
                                                             const ModelConfig& model,
                                                             int num_threads);

}  // namespace moeserve::checkpoint

#endif  // MOESERVE_CORE_CHECKPOINT_GATE_LOADER_H_
