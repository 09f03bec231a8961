#include "core/mxfp8_weights.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/thread_pool.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"

namespace moeserve {
namespace {

// Quantizes one expert's tensor `name` ([rows, k] BF16) or says which weight is not finite.
absl::Status QuantizeTensor(const uint16_t* in, int64_t rows, int64_t k, uint8_t* q,
                            uint8_t* scales, int layer, int64_t local, int global,
                            absl::string_view name) {
  int64_t bad = -1;
  const kernels::Mxfp8Status s =
      kernels::QuantizeMxfp8RowsFromBf16Ref(in, rows, k, q, scales, &bad);
  if (s == kernels::Mxfp8Status::kOk) return absl::OkStatus();
  const std::string expert = global >= 0 ? absl::StrCat("expert ", global, " (local ", local, ")")
                                         : absl::StrCat("local expert ", local);
  if (s == kernels::Mxfp8Status::kNonFinite) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, ", ", expert, ", ", name, " [", rows, ", ", k, "]: value ",
                     kernels::Bf16ToFloat(in[bad]), " at [", bad / k, ", ", bad % k,
                     "] is not finite; MXFP8 quantization needs finite weights"));
  }
  return absl::InternalError(
      absl::StrCat("layer ", layer, ", ", expert, ", ", name, ": ", kernels::Mxfp8StatusName(s)));
}

}  // namespace

absl::StatusOr<QuantizedLayer> QuantizeLayerToMxfp8(const LayerWeights& bf16, int layer,
                                                    absl::Span<const int> expert_ids,
                                                    int num_threads) {
  if (bf16.format != WeightFormat::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": expected bf16 weights, got ",
                                                   WeightFormatName(bf16.format)));
  }
  const int64_t num_local = bf16.num_local_experts, h = bf16.hidden, n = bf16.intermediate;
  if (bf16.w13.dtype() != DType::kBF16 || bf16.w13.shape() != Shape{num_local, 2 * n, h} ||
      !bf16.w13.is_contiguous() || bf16.w2.dtype() != DType::kBF16 ||
      bf16.w2.shape() != Shape{num_local, h, n} || !bf16.w2.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, ": expected contiguous bf16 w13 [", num_local, ", ", 2 * n,
                     ", ", h, "] and w2 [", num_local, ", ", h, ", ", n, "], got ",
                     bf16.w13.DebugString(), " and ", bf16.w2.DebugString()));
  }
  if (!expert_ids.empty() && static_cast<int64_t>(expert_ids.size()) != num_local) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": ", expert_ids.size(),
                                                   " expert ids for ", num_local, " experts"));
  }
  const int64_t w13_blocks = kernels::Mxfp8ScaleBlocks(h), w2_blocks = kernels::Mxfp8ScaleBlocks(n);
  QuantizedLayer out;
  MOESERVE_ASSIGN_OR_RETURN(Tensor w13, Tensor::Allocate(DType::kFP8E4M3, {num_local, 2 * n, h}));
  MOESERVE_ASSIGN_OR_RETURN(Tensor w2, Tensor::Allocate(DType::kFP8E4M3, {num_local, h, n}));
  MOESERVE_ASSIGN_OR_RETURN(Tensor w13_scale,
                            Tensor::Allocate(DType::kUINT8, {num_local, 2 * n, w13_blocks}));
  MOESERVE_ASSIGN_OR_RETURN(Tensor w2_scale,
                            Tensor::Allocate(DType::kUINT8, {num_local, h, w2_blocks}));

  // One status per expert so that the error reported does not depend on thread timing.
  std::vector<absl::Status> status(num_local);
  ThreadPool pool(num_threads);
  pool.ParallelFor(num_local, [&](int64_t e, int) {
    const int global = expert_ids.empty() ? -1 : expert_ids[e];
    status[e] = QuantizeTensor(
        bf16.w13.data<uint16_t>() + e * 2 * n * h, 2 * n, h, w13.data<uint8_t>() + e * 2 * n * h,
        w13_scale.data<uint8_t>() + e * 2 * n * w13_blocks, layer, e, global, "w13 (gate/up)");
    if (!status[e].ok()) return;
    status[e] =
        QuantizeTensor(bf16.w2.data<uint16_t>() + e * h * n, h, n, w2.data<uint8_t>() + e * h * n,
                       w2_scale.data<uint8_t>() + e * h * w2_blocks, layer, e, global, "w2 (down)");
  });
  for (const absl::Status& s : status) MOESERVE_RETURN_IF_ERROR(s);

  LayerWeights& lw = out.weights;
  lw.format = WeightFormat::kMXFP8;
  lw.num_local_experts = num_local;
  lw.hidden = h;
  lw.intermediate = n;
  lw.w13 = w13.view();
  lw.w2 = w2.view();
  lw.w13_scale = w13_scale.view();
  lw.w2_scale = w2_scale.view();
  out.storage.push_back(std::move(w13));
  out.storage.push_back(std::move(w2));
  out.storage.push_back(std::move(w13_scale));
  out.storage.push_back(std::move(w2_scale));
  return out;
}

int64_t Mxfp8LoadPeakBytes(const ModelConfig& config, int num_local_experts) {
  return config.LayerWeightBytes(num_local_experts, WeightFormat::kMXFP8) *
             config.num_moe_layers() +
         config.LayerWeightBytes(num_local_experts, WeightFormat::kBF16);
}

absl::StatusOr<std::unique_ptr<ExpertWeightStore>> CreateSyntheticMxfp8(
    const ModelConfig& config, std::vector<int> expert_ids, uint64_t seed, int num_threads,
    int64_t memory_budget_bytes, const LayerLoadedFn& on_layer) {
  MOESERVE_RETURN_IF_ERROR(config.Validate());
  const int num_local = static_cast<int>(expert_ids.size());
  const int64_t budget = memory_budget_bytes > 0 ? memory_budget_bytes : AvailableHostMemoryBytes();
  MOESERVE_RETURN_IF_ERROR(
      CheckMemoryBudget(config, Mxfp8LoadPeakBytes(config, num_local), budget));

  std::vector<int> moe_layers = config.moe_layers;
  if (moe_layers.empty()) {
    for (int l = 0; l < config.num_layers; ++l) moe_layers.push_back(l);
  }
  std::vector<LayerWeights> layers;
  std::vector<Tensor> storage;
  for (int layer : moe_layers) {
    // A one-MoE-layer model whose only MoE layer is `layer`: CreateSynthetic then generates
    // exactly the BF16 values the full model has there (they depend on the layer index only).
    ModelConfig one = config;
    one.num_layers = layer + 1;
    one.moe_layers = {layer};
    std::unique_ptr<ExpertWeightStore> bf16;
    MOESERVE_ASSIGN_OR_RETURN(bf16, ExpertWeightStore::CreateSynthetic(
                                        one, expert_ids, seed, num_threads, memory_budget_bytes));
    QuantizedLayer q;
    MOESERVE_ASSIGN_OR_RETURN(
        q, QuantizeLayerToMxfp8(*bf16->layer(layer), layer, expert_ids, num_threads));
    bf16.reset();  // free this layer's BF16 before the next one is generated
    layers.push_back(q.weights);
    for (Tensor& t : q.storage) storage.push_back(std::move(t));
    if (on_layer) {
      MOESERVE_RETURN_IF_ERROR(
          on_layer(layer, config.LayerWeightBytes(num_local, WeightFormat::kMXFP8)));
    }
  }
  return ExpertWeightStore::FromLayers(config, std::move(expert_ids), std::move(layers),
                                       std::move(storage));
}

absl::StatusOr<std::unique_ptr<ExpertWeightStore>> QuantizeStoreToMxfp8(
    const ExpertWeightStore& bf16, int num_threads) {
  const ModelConfig& config = bf16.config();
  std::vector<LayerWeights> layers;
  std::vector<Tensor> storage;
  for (int layer = 0; layer < config.num_layers; ++layer) {
    const LayerWeights* lw = bf16.layer(layer);
    if (lw == nullptr) continue;
    QuantizedLayer q;
    MOESERVE_ASSIGN_OR_RETURN(q, QuantizeLayerToMxfp8(*lw, layer, bf16.expert_ids(), num_threads));
    layers.push_back(q.weights);
    for (Tensor& t : q.storage) storage.push_back(std::move(t));
  }
  return ExpertWeightStore::FromLayers(config, bf16.expert_ids(), std::move(layers),
                                       std::move(storage));
}

}  // namespace moeserve
