#include "core/weights.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"

namespace moeserve {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

float SyntheticWeight(uint64_t seed, int layer, int expert, int tensor, int64_t index,
                      int64_t fan_in) {
  uint64_t h = SplitMix64(seed ^ 0x6d6f657365727665ull);
  h = SplitMix64(h ^ static_cast<uint64_t>(layer));
  h = SplitMix64(h ^ (static_cast<uint64_t>(expert) << 2 | static_cast<uint64_t>(tensor)));
  h = SplitMix64(h ^ static_cast<uint64_t>(index));
  // Uniform in [-1, 1) has std 1/sqrt(3).
  const float u = static_cast<float>(static_cast<int64_t>(h >> 40) - (int64_t{1} << 23)) /
                  static_cast<float>(int64_t{1} << 23);
  return u * std::sqrt(3.0f / static_cast<float>(fan_in));
}

absl::Status DequantizeExpertToFp32(const LayerWeights& w, int64_t e, float* w13_out,
                                    float* w2_out) {
  if (e < 0 || e >= w.num_local_experts) {
    return absl::OutOfRangeError(
        absl::StrCat("local expert ", e, " not in [0, ", w.num_local_experts, ")"));
  }
  const int64_t h = w.hidden, n = w.intermediate;
  const int64_t w13_elems = 2 * n * h, w2_elems = h * n;
  if (w.format == WeightFormat::kBF16) {
    kernels::ConvertBf16ToFp32Ref(w.w13.data<uint16_t>() + e * w13_elems, w13_out, w13_elems);
    kernels::ConvertBf16ToFp32Ref(w.w2.data<uint16_t>() + e * w2_elems, w2_out, w2_elems);
    return absl::OkStatus();
  }
  if (w.format != WeightFormat::kMXFP8) {
    return absl::InternalError(absl::StrCat("unknown weight format ", static_cast<int>(w.format)));
  }
  if (w.w13_scale.raw_data() == nullptr || w.w2_scale.raw_data() == nullptr) {
    return absl::InternalError("mxfp8 weights without their E8M0 scales");
  }
  // Exact: E4M3 x 2^(code - 127) is representable in FP32 (see kernels/cpu/mxfp8.h).
  const int64_t w13_blocks = 2 * n * kernels::Mxfp8ScaleBlocks(h);
  const int64_t w2_blocks = h * kernels::Mxfp8ScaleBlocks(n);
  kernels::DequantizeMxfp8RowsRef(w.w13.data<uint8_t>() + e * w13_elems,
                                  w.w13_scale.data<uint8_t>() + e * w13_blocks, 2 * n, h, w13_out);
  kernels::DequantizeMxfp8RowsRef(w.w2.data<uint8_t>() + e * w2_elems,
                                  w.w2_scale.data<uint8_t>() + e * w2_blocks, h, n, w2_out);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ExpertWeightStore>> ExpertWeightStore::CreateSynthetic(
    const ModelConfig& config, std::vector<int> expert_ids, uint64_t seed, int num_threads,
    int64_t memory_budget_bytes, const LayerLoadedFn& on_layer) {
  MOESERVE_RETURN_IF_ERROR(config.Validate());
  for (int id : expert_ids) {
    if (id < 0 || id >= config.num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert id ", id, " not in [0, ", config.num_experts, ")"));
    }
  }
  const int num_local = static_cast<int>(expert_ids.size());
  const int64_t needed =
      config.LayerWeightBytes(num_local, WeightFormat::kBF16) * config.num_moe_layers();
  const int64_t budget = memory_budget_bytes > 0 ? memory_budget_bytes : AvailableHostMemoryBytes();
  MOESERVE_RETURN_IF_ERROR(CheckMemoryBudget(config, needed, budget));

  const int64_t h = config.hidden, n = config.intermediate;
  std::vector<LayerWeights> layers;
  std::vector<Tensor> storage;
  std::vector<int> moe_layers = config.moe_layers;
  if (moe_layers.empty()) {
    for (int l = 0; l < config.num_layers; ++l) moe_layers.push_back(l);
  }
  num_threads = std::max(1, num_threads);
  for (int layer : moe_layers) {
    MOESERVE_ASSIGN_OR_RETURN(Tensor w13, Tensor::Allocate(DType::kBF16, {num_local, 2 * n, h}));
    MOESERVE_ASSIGN_OR_RETURN(Tensor w2, Tensor::Allocate(DType::kBF16, {num_local, h, n}));
    auto fill = [&](int begin, int end) {
      for (int e = begin; e < end; ++e) {
        const int g = expert_ids[e];
        uint16_t* p13 = w13.data<uint16_t>() + int64_t{e} * 2 * n * h;
        for (int64_t i = 0; i < 2 * n * h; ++i) {
          p13[i] = kernels::FloatToBf16(SyntheticWeight(seed, layer, g, 0, i, h));
        }
        uint16_t* p2 = w2.data<uint16_t>() + int64_t{e} * h * n;
        for (int64_t i = 0; i < h * n; ++i) {
          p2[i] = kernels::FloatToBf16(SyntheticWeight(seed, layer, g, 1, i, n));
        }
      }
    };
    std::vector<std::thread> threads;
    const int per = (num_local + num_threads - 1) / num_threads;
    for (int t = 0; t < num_threads; ++t) {
      const int b = t * per, e = std::min(num_local, b + per);
      if (b < e) threads.emplace_back(fill, b, e);
    }
    for (auto& t : threads) t.join();
    LayerWeights lw;
    lw.format = WeightFormat::kBF16;
    lw.num_local_experts = num_local;
    lw.hidden = h;
    lw.intermediate = n;
    lw.w13 = w13.view();
    lw.w2 = w2.view();
    layers.push_back(lw);
    storage.push_back(std::move(w13));
    storage.push_back(std::move(w2));
    if (on_layer) {
      MOESERVE_RETURN_IF_ERROR(
          on_layer(layer, config.LayerWeightBytes(num_local, WeightFormat::kBF16)));
    }
  }
  return FromLayers(config, std::move(expert_ids), std::move(layers), std::move(storage));
}

absl::StatusOr<std::unique_ptr<ExpertWeightStore>> ExpertWeightStore::FromLayers(
    const ModelConfig& config, std::vector<int> expert_ids, std::vector<LayerWeights> layers,
    std::vector<Tensor> storage) {
  MOESERVE_RETURN_IF_ERROR(config.Validate());
  if (static_cast<int>(layers.size()) != config.num_moe_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("expected weights for ", config.num_moe_layers(),
                                                   " MoE layers, got ", layers.size()));
  }
  auto store = std::unique_ptr<ExpertWeightStore>(new ExpertWeightStore());
  store->config_ = config;
  store->expert_ids_ = std::move(expert_ids);
  store->layer_slot_.assign(config.num_layers, -1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const int layer = config.moe_layers.empty() ? static_cast<int>(i) : config.moe_layers[i];
    store->layer_slot_[layer] = static_cast<int>(i);
    const LayerWeights& lw = layers[i];
    if (lw.num_local_experts != static_cast<int64_t>(store->expert_ids_.size()) ||
        lw.hidden != config.hidden || lw.intermediate != config.intermediate) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, ": weight shapes do not match the model"));
    }
  }
  for (const Tensor& t : storage) store->total_bytes_ += static_cast<int64_t>(t.nbytes());
  store->layers_ = std::move(layers);
  store->storage_ = std::move(storage);
  return store;
}

const LayerWeights* ExpertWeightStore::layer(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(layer_slot_.size())) return nullptr;
  const int slot = layer_slot_[layer];
  return slot < 0 ? nullptr : &layers_[slot];
}

}  // namespace moeserve
