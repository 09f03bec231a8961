// Loads one rank's routed-expert weights from an opened Hugging Face checkpoint into an
// ExpertWeightStore, in the format served.
#ifndef MOESERVE_CORE_CHECKPOINT_EXPERT_LOADER_H_
#define MOESERVE_CORE_CHECKPOINT_EXPERT_LOADER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/model_config.h"
#include "core/weights.h"

namespace moeserve::checkpoint {

struct ExpertLoadOptions {
  WeightFormat format = WeightFormat::kBF16;  // format served
  int num_threads = 1;
  int64_t memory_budget_bytes = 0;  // <= 0: what the machine has available
  LayerLoadedFn on_layer;           // runs after each MoE layer; may be empty
};

// Loads, for every MoE layer of `model` (which must describe the checkpoint: its config()),
// the weights of the global experts `expert_ids` (local-index order) into the LayerWeights
// layout of core/weights.h: w13 rows [0, I) = gate, [I, 2I) = up; w2 = down.
//
// Conversions by (checkpoint dtype -> served format):
//   BF16 -> bf16: copied.  F16 / F32 -> bf16: rounded to nearest even.
//   BF16 / F16 / F32 -> mxfp8: rounded to BF16, then quantized (kernels/cpu/mxfp8.h).
//   F8_E4M3 + scales -> mxfp8: copied.  -> bf16: dequantized, rounded to BF16.
// Refuses, naming layer, expert, tensor and file: a missing expert tensor (or MXFP8 scale), a
// shape that does not match config.json, an unsupported dtype, any NaN / Inf weight (or NaN
// E4M3 / E8M0 code). Checks the memory budget before allocating anything.
absl::StatusOr<std::unique_ptr<ExpertWeightStore>> LoadCheckpointExperts(
    const HfCheckpoint& checkpoint, const ModelConfig& model, std::vector<int> expert_ids,
    const ExpertLoadOptions& options);

}  // namespace moeserve::checkpoint

#endif  // MOESERVE_CORE_CHECKPOINT_EXPERT_LOADER_H_
