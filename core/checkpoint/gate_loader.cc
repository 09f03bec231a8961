#include "core/checkpoint/gate_loader.h"

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve::checkpoint {
namespace {

std::string Where(const SafetensorsTensor& t) {
  return absl::StrCat("'", t.name, "' (", t.file, ")");
}

// `t` widened to FP32 into `dst` (t.numel() values), refusing non-finite values.
absl::Status WidenFinite(const SafetensorsTensor& t, float* dst) {
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    float v;
    switch (t.dtype) {
      case StDType::kF32:
        std::memcpy(&v, t.data + 4 * i, 4);
        break;
      case StDType::kBF16: {
        uint16_t b;
        std::memcpy(&b, t.data + 2 * i, 2);
        v = kernels::Bf16ToFloat(b);
        break;
      }
      case StDType::kF16: {
        uint16_t b;
        std::memcpy(&b, t.data + 2 * i, 2);
        v = kernels::Fp16ToFloat(b);
        break;
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat("router tensor ", Where(t), " has dtype ",
                                                       StDTypeName(t.dtype),
                                                       "; expected BF16, F16 or F32"));
    }
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat("router tensor ", Where(t), ": value ", v,
                                                     " at flat index ", i,
                                                     "; refusing to route with non-finite "
                                                     "weights"));
    }
    dst[i] = v;
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> LoadFp32(const HfCheckpoint& ckpt, const std::string& name,
                                const Shape& shape, absl::string_view what) {
  MOESERVE_ASSIGN_OR_RETURN(const SafetensorsTensor t, ckpt.Find(name));
  if (Shape(t.shape.begin(), t.shape.end()) != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("router tensor ", Where(t), " has shape [", absl::StrJoin(t.shape, ", "),
                     "] but config.json implies ", ShapeToString(shape), " (", what, ")"));
  }
  Tensor out = Tensor::Empty(DType::kFP32, shape);
  MOESERVE_RETURN_IF_ERROR(WidenFinite(t, out.data<float>()));
  return out;
}

}  // namespace

std::string GateWeightName(ExpertNaming naming, int layer) {
  return naming == ExpertNaming::kMixtral
             ? absl::StrCat("model.layers.", layer, ".block_sparse_moe.gate.weight")
             : absl::StrCat("model.layers.", layer, ".mlp.gate.weight");
}

std::string GateBiasName(ExpertNaming naming, int layer) {
  return naming == ExpertNaming::kMixtral
             ? absl::StrCat("model.layers.", layer,
                            ".block_sparse_moe.gate.e_score_correction_bias")
             : absl::StrCat("model.layers.", layer, ".mlp.gate.e_score_correction_bias");
}

absl::StatusOr<std::unique_ptr<Router>> LoadCheckpointRouter(const HfCheckpoint& ckpt,
                                                             const ModelConfig& model,
                                                             int num_threads) {
  if (!model.router.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", model.name, "' has no router configuration: ", model.no_router_reason));
  }
  RouterConfig config = *model.router;
  std::vector<int> layers = model.moe_layers;
  if (layers.empty()) {
    for (int l = 0; l < model.num_layers; ++l) layers.push_back(l);
  }
  // Which layers have the tensors: all or none.
  auto presence = [&](auto name_of, absl::string_view what, bool* all) -> absl::Status {
    int present = 0;
    int missing_layer = -1, present_layer = -1;
    for (int l : layers) {
      if (ckpt.Contains(name_of(ckpt.naming(), l))) {
        ++present;
        present_layer = l;
      } else if (missing_layer < 0) {
        missing_layer = l;
      }
    }
    *all = present == static_cast<int>(layers.size());
    if (present > 0 && !*all) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", ckpt.dir(), ": router ", what, " '", name_of(ckpt.naming(), missing_layer),
          "' is missing, while layer ", present_layer, " has one"));
    }
    return absl::OkStatus();
  };
  bool all_gates = false, all_biases = false;
  MOESERVE_RETURN_IF_ERROR(presence(GateWeightName, "gate weight", &all_gates));
  if (!all_gates) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", ckpt.dir(), " has no router gates (",
                                            GateWeightName(ckpt.naming(), layers[0]), ")"));
  }
  if (config.correction_bias) {
    MOESERVE_RETURN_IF_ERROR(presence(GateBiasName, "e_score_correction_bias", &all_biases));
    config.correction_bias = all_biases;
  }
  std::vector<Tensor> gates, biases;
  for (int l : layers) {
    MOESERVE_ASSIGN_OR_RETURN(
        Tensor g, LoadFp32(ckpt, GateWeightName(ckpt.naming(), l),
                           {model.num_experts, model.hidden}, "[num_experts, hidden_size]"));
    gates.push_back(std::move(g));
    if (config.correction_bias) {
      MOESERVE_ASSIGN_OR_RETURN(Tensor b, LoadFp32(ckpt, GateBiasName(ckpt.naming(), l),
                                                   {model.num_experts}, "[num_experts]"));
      biases.push_back(std::move(b));
    }
  }
  return Router::Create(config, model, std::move(gates), std::move(biases), num_threads);
}

}  // namespace moeserve::checkpoint
