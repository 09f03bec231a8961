#include "core/model_config.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"

namespace moeserve {

absl::string_view WeightFormatName(WeightFormat format) {
  return format == WeightFormat::kBF16 ? "bf16" : "mxfp8";
}

absl::StatusOr<WeightFormat> ParseWeightFormat(absl::string_view name) {
  if (name == "bf16") return WeightFormat::kBF16;
  if (name == "mxfp8") return WeightFormat::kMXFP8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown weight format '", name, "'; expected bf16 or mxfp8"));
}

bool ModelConfig::IsMoeLayer(int layer) const {
  if (layer < 0 || layer >= num_layers) return false;
  if (moe_layers.empty()) return true;
  return std::binary_search(moe_layers.begin(), moe_layers.end(), layer);
}

int ModelConfig::num_moe_layers() const {
  return moe_layers.empty() ? num_layers : static_cast<int>(moe_layers.size());
}

int64_t ModelConfig::LayerWeightBytes(int num_experts_on_rank, WeightFormat format) const {
  // Validate()'s bounds keep these far inside int64; checked anyway for a config that skipped
  // it (-1: overflow or a negative size).
  const std::optional<int64_t> values =
      CheckedProduct({num_experts_on_rank, 3, hidden, intermediate});
  if (!values) return -1;
  if (format == WeightFormat::kBF16) return CheckedMul(*values, 2).value_or(-1);
  // One byte per E4M3 value plus one E8M0 byte per 32 along K (rounded up per row).
  const std::optional<int64_t> w13_scales =
      CheckedProduct({num_experts_on_rank, 2, intermediate, (hidden + 31) / 32});
  const std::optional<int64_t> w2_scales =
      CheckedProduct({num_experts_on_rank, hidden, (intermediate + 31) / 32});
  if (!w13_scales || !w2_scales) return -1;
  const std::optional<int64_t> scales = CheckedAdd(*w13_scales, *w2_scales);
  if (!scales) return -1;
  return CheckedAdd(*values, *scales).value_or(-1);
}

int64_t ModelConfig::ActivationBytes(int64_t max_tokens) const {
  // FP32: the fused expert output [M, topk, hidden], the per-route ids and weights, and about
  // four [M, hidden] copies (input conversion, gathered batch, FP32 answer, output).
  const std::optional<int64_t> routes = CheckedProduct({max_tokens, topk, hidden, 4});
  const std::optional<int64_t> ids = CheckedProduct({max_tokens, topk, 8});
  const std::optional<int64_t> rows = CheckedProduct({max_tokens, hidden, 4 * 4});
  if (!routes || !ids || !rows) return -1;
  const std::optional<int64_t> sum = CheckedAdd(*routes, *ids);
  return sum ? CheckedAdd(*sum, *rows).value_or(-1) : -1;
}

absl::Status ModelConfig::Validate() const {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("model '", name, "': ", what));
  };
  if (num_layers <= 0) return bad(absl::StrCat("num_layers must be > 0, got ", num_layers));
  if (num_experts <= 0) return bad(absl::StrCat("num_experts must be > 0, got ", num_experts));
  if (topk <= 0 || topk > num_experts) {
    return bad(absl::StrCat("topk must be in [1, num_experts=", num_experts, "], got ", topk));
  }
  if (hidden <= 0) return bad(absl::StrCat("hidden must be > 0, got ", hidden));
  if (intermediate <= 0) return bad(absl::StrCat("intermediate must be > 0, got ", intermediate));
  // Upper bounds far above any real MoE layer (DeepSeek-V3: 58 layers, 256 experts, hidden 7168,
  // intermediate 2048) that keep every size product (elements, bytes, per layer and in all) far
  // inside int64, so no later computation can overflow.
  if (num_layers > kMaxLayers) {
    return bad(absl::StrCat("num_layers must be <= ", kMaxLayers, ", got ", num_layers));
  }
  if (num_experts > kMaxExperts) {
    return bad(absl::StrCat("num_experts must be <= ", kMaxExperts, ", got ", num_experts));
  }
  if (hidden > kMaxHidden) {
    return bad(absl::StrCat("hidden must be <= ", kMaxHidden, ", got ", hidden));
  }
  if (intermediate > kMaxHidden) {
    return bad(absl::StrCat("intermediate must be <= ", kMaxHidden, ", got ", intermediate));
  }
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    if (moe_layers[i] < 0 || moe_layers[i] >= num_layers ||
        (i > 0 && moe_layers[i] <= moe_layers[i - 1])) {
      return bad("moe_layers must be ascending and within [0, num_layers)");
    }
  }
  if (router.has_value()) {
    if (absl::Status s = router->Validate(num_experts, topk); !s.ok()) return bad(s.message());
  }
  return absl::OkStatus();
}

std::string ModelConfig::DebugString() const {
  return absl::StrFormat(
      "%s (layers=%d moe_layers=%d experts=%d topk=%d hidden=%d intermediate=%d)", name, num_layers,
      num_moe_layers(), num_experts, topk, hidden, intermediate);
}

absl::StatusOr<ModelConfig> ModelPreset(absl::string_view name) {
  ModelConfig c;
  c.name = std::string(name);
  if (name == "tiny") {
    c.num_layers = 2, c.num_experts = 16, c.topk = 4, c.hidden = 256, c.intermediate = 128;
  } else if (name == "qwen3-30b-a3b") {
    c.num_layers = 48, c.num_experts = 128, c.topk = 8, c.hidden = 2048, c.intermediate = 768;
  } else if (name == "deepseek-v3") {
    c.num_layers = 58, c.num_experts = 256, c.topk = 8, c.hidden = 7168, c.intermediate = 2048;
  } else if (name == "seed-megamoe") {
    // The seed's one MegaMoE layer (FlashInfer's Cake MXFP8 EP16 backend).
    c.num_layers = 1, c.num_experts = 512, c.topk = 8, c.hidden = 3072, c.intermediate = 5120;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown model preset '", name,
                     "'; expected one of tiny, qwen3-30b-a3b, deepseek-v3, "
                     "seed-megamoe"));
  }
  RouterConfig router;
  router.renormalize = true;
  if (name == "deepseek-v3") {
    router.scoring = RouterScoring::kSigmoid;
    router.correction_bias = true;
    router.n_group = 8;
    router.topk_group = 4;
    router.routed_scaling_factor = 2.5f;
  }
  c.router = router;
  return c;
}

std::vector<std::string> ModelPresetNames() {
  return {"tiny", "qwen3-30b-a3b", "deepseek-v3", "seed-megamoe"};
}

absl::StatusOr<ModelConfig> ApplyOverrides(ModelConfig c, const ModelOverrides& o) {
  if (o.num_layers) c.num_layers = *o.num_layers, c.moe_layers.clear();
  if (o.num_experts) c.num_experts = *o.num_experts;
  if (o.topk) c.topk = *o.topk;
  if (o.hidden) c.hidden = *o.hidden;
  if (o.intermediate) c.intermediate = *o.intermediate;
  if (c.router.has_value() && !c.router->Validate(c.num_experts, c.topk).ok()) {
    c.router->n_group = 1;
    c.router->topk_group = 1;
  }
  if (auto s = c.Validate(); !s.ok()) return s;
  return c;
}

int64_t AvailableHostMemoryBytes() {
  int64_t available = -1;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t value_kb;
  std::string unit;
  while (meminfo >> key >> value_kb >> unit) {
    if (key == "MemAvailable:") {
      available = value_kb * 1024;
      break;
    }
  }
  if (available < 0) {
    available = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  }
  // A container's cgroup limit may be far below the host's free memory.
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    std::string limit;
    if (f >> limit && limit != "max") {
      int64_t bytes = 0;
      std::istringstream(limit) >> bytes;
      int64_t usage = 0;
      std::ifstream u(std::string(path).find("memory.max") != std::string::npos
                          ? "/sys/fs/cgroup/memory.current"
                          : "/sys/fs/cgroup/memory/memory.usage_in_bytes");
      u >> usage;
      if (bytes > 0 && bytes - usage < available) available = std::max<int64_t>(0, bytes - usage);
      break;
    }
  }
  return available;
}

absl::Status CheckMemoryBudget(const ModelConfig& config, int64_t needed_bytes,
                               int64_t available_bytes) {
  // Leave room for activations, workspaces and the rest of the process.
  const double kUsableFraction = 0.85;
  if (needed_bytes >= 0 &&
      static_cast<double>(needed_bytes) <= kUsableFraction * static_cast<double>(available_bytes)) {
    return absl::OkStatus();
  }
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  if (needed_bytes < 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "model ", config.DebugString(), ": its expert weights' byte size overflows 64 bits"));
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "model %s needs %.2f GiB of expert weights but only %.2f GiB of memory is available "
      "(%.0f%% usable); serve fewer layers (--num_layers), smaller sizes (--hidden, "
      "--intermediate, --num_experts), more ranks, or a machine with more memory",
      config.DebugString(), needed_bytes / kGiB, available_bytes / kGiB, kUsableFraction * 100));
}

absl::Status CheckActivationBudget(const ModelConfig& config, int64_t max_tokens,
                                   int64_t available_bytes, int steps_in_flight) {
  // Weights take up to 85% (CheckMemoryBudget); one step's buffers must fit in what is left of
  // the rest, or the first large request would fail (or the machine swap) instead of startup.
  const double kUsableFraction = 0.5;
  const int64_t per_step = config.ActivationBytes(max_tokens);
  const int64_t needed =
      per_step < 0 ? -1 : CheckedMul(per_step, int64_t{std::max(steps_in_flight, 1)}).value_or(-1);
  if (needed >= 0 &&
      static_cast<double>(needed) <= kUsableFraction * static_cast<double>(available_bytes)) {
    return absl::OkStatus();
  }
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const std::string size = needed < 0 ? std::string("more than 2^63 bytes")
                                      : absl::StrFormat("about %.2f GiB", needed / kGiB);
  return absl::ResourceExhaustedError(absl::StrFormat(
      "model %s: max_tokens_per_request=%d needs %s of activation buffers for %d step(s) in "
      "flight (tokens x topk x hidden x 4 bytes and more, per step) but only %.2f GiB of memory "
      "is available (%.0f%% usable); lower --max_tokens_per_request or --steps_in_flight",
      config.DebugString(), max_tokens, size, std::max(steps_in_flight, 1), available_bytes / kGiB,
      kUsableFraction * 100));
}

}  // namespace moeserve
