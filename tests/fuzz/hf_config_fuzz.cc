// libFuzzer target: a checkpoint's config.json text through ModelConfigFromHfConfigJson.
// Besides no crash, hang or sanitizer report: an accepted config validates, its sizes (weights
// per layer, activations) do not overflow, and its MoE layers are ascending and in range.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/checkpoint/hf_checkpoint.h"
#include "core/model_config.h"

namespace {

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_hf_config: violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = moeserve::checkpoint::ModelConfigFromHfConfigJson(text, "fuzz/config.json", "fuzz");
  if (!config.ok()) {
    Check(config.status().message().find("fuzz/config.json") != std::string::npos,
          "a refusal that does not name the file");
    return 0;
  }
  Check(config->Validate().ok(), "accepted config does not validate");
  Check(config->num_moe_layers() >= 1, "no MoE layer");
  for (size_t i = 0; i < config->moe_layers.size(); ++i) {
    Check(config->IsMoeLayer(config->moe_layers[i]), "listed layer is not MoE");
  }
  for (auto format : {moeserve::WeightFormat::kBF16, moeserve::WeightFormat::kMXFP8}) {
    Check(config->LayerWeightBytes(config->num_experts, format) > 0, "weight bytes overflow");
  }
  Check(config->ActivationBytes(8192) > 0, "activation bytes overflow");
  return 0;
}
