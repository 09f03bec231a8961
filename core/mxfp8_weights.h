// MXFP8 expert weights: BF16 layers quantized at load (numerics in kernels/cpu/mxfp8.h).
//
// Layout of a quantized layer is LayerWeights' kMXFP8 layout (core/weights.h): w13 FP8E4M3
// [E, 2I, H], w2 FP8E4M3 [E, H, I], w13_scale UINT8 (E8M0) [E, 2I, ceil(H/32)], w2_scale UINT8
// [E, H, ceil(I/32)]. A row whose K is not a multiple of 32 ends with a partial block scaled on
// its own values.
#ifndef MOESERVE_CORE_MXFP8_WEIGHTS_H_
#define MOESERVE_CORE_MXFP8_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/model_config.h"
#include "core/tensor.h"
#include "core/weights.h"

namespace moeserve {

// One quantized layer: `weights` (format kMXFP8) views into `storage`
// (w13, w2, w13_scale, w2_scale, in that order).
struct QuantizedLayer {
  LayerWeights weights;
  std::vector<Tensor> storage;
};

// Quantizes one BF16 layer (host) to MXFP8, experts in parallel on `num_threads` threads
// (<= 0: all hardware threads). `layer` (model layer index) and `expert_ids` (global ids in
// local order, or empty to name local indices only) are used in error messages. A NaN or Inf
// weight is refused with INVALID_ARGUMENT naming the layer, expert, tensor and position.
// Does not modify or free `bf16`.
absl::StatusOr<QuantizedLayer> QuantizeLayerToMxfp8(const LayerWeights& bf16, int layer,
                                                    absl::Span<const int> expert_ids,
                                                    int num_threads);

// Peak host bytes of loading `num_local_experts` experts per layer as MXFP8 from BF16: every
// layer in MXFP8 (values and scales) plus the one BF16 layer being quantized.
int64_t Mxfp8LoadPeakBytes(const ModelConfig& config, int num_local_experts);

// The synthetic BF16 weights ExpertWeightStore::CreateSynthetic(config, expert_ids, seed)
// holds, quantized to MXFP8 one layer at a time (generate a layer in BF16, quantize it, free
// it), so the peak is Mxfp8LoadPeakBytes, not the whole model in BF16. Checks that peak against
// the memory budget first (memory_budget_bytes <= 0: what the machine has available).
// `on_layer` runs after each layer is quantized.
absl::StatusOr<std::unique_ptr<ExpertWeightStore>> CreateSyntheticMxfp8(
    const ModelConfig& config, std::vector<int> expert_ids, uint64_t seed, int num_threads,
    int64_t memory_budget_bytes = 0, const LayerLoadedFn& on_layer = nullptr);

// An MXFP8 copy of every layer of a BF16 store (which is left as is, so both are resident
// afterwards: for tests and benchmarks that compare the two; loaders should quantize layer by
// layer with QuantizeLayerToMxfp8 instead).
absl::StatusOr<std::unique_ptr<ExpertWeightStore>> QuantizeStoreToMxfp8(
    const ExpertWeightStore& bf16, int num_threads);

}  // namespace moeserve

#endif  // MOESERVE_CORE_MXFP8_WEIGHTS_H_
