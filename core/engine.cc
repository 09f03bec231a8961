#include "core/engine.h"

#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/cpu/cpu_experts.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/status_macros.h"
#include "core/weight_loader.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve {

absl::Status ValidateForwardInput(const ModelConfig& model, int64_t max_tokens,
                                  const ForwardInput& in) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (!model.IsMoeLayer(in.layer)) {
    if (in.layer >= 0 && in.layer < model.num_layers) {
      return bad("layer: ", in.layer, " is a dense layer with no experts; MoE layers are ",
                 model.moe_layers.empty() ? "all" : "those listed by GetModelInfo");
    }
    return bad("layer: got ", in.layer, ", expected a value in [0, ", model.num_layers, ")");
  }
  const TensorView& x = in.hidden_states;
  if (x.dtype() != DType::kBF16 && x.dtype() != DType::kFP16 && x.dtype() != DType::kFP32) {
    return bad("hidden_states: dtype ", DTypeName(x.dtype()), " not accepted; expected bf16, "
               "fp16 or fp32");
  }
  if (x.rank() != 2 || x.dim(1) != model.hidden) {
    return bad("hidden_states: got shape ", ShapeToString(x.shape()), ", expected [M, ",
               model.hidden, "]");
  }
  const int64_t m = x.dim(0);
  if (m > max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "hidden_states: M=", m, " tokens exceeds the maximum of ", max_tokens,
        " tokens per request; split the batch"));
  }
  if (in.topk_ids.dtype() != DType::kINT32 && in.topk_ids.dtype() != DType::kINT64) {
    return bad("topk_ids: dtype ", DTypeName(in.topk_ids.dtype()),
               " not accepted; expected int32 or int64");
  }
  if (in.topk_ids.rank() != 2 || in.topk_ids.dim(0) != m || in.topk_ids.dim(1) != model.topk) {
    return bad("topk_ids: got shape ", ShapeToString(in.topk_ids.shape()), ", expected [", m,
               ", ", model.topk, "] ([M, topk])");
  }
  if (in.topk_weights.dtype() != DType::kFP32) {
    return bad("topk_weights: dtype ", DTypeName(in.topk_weights.dtype()),
               " not accepted; expected fp32");
  }
  if (in.topk_weights.rank() != 2 || in.topk_weights.dim(0) != m ||
      in.topk_weights.dim(1) != model.topk) {
    return bad("topk_weights: got shape ", ShapeToString(in.topk_weights.shape()),
               ", expected [", m, ", ", model.topk, "] ([M, topk])");
  }
  const int64_t routes = m * model.topk;
  for (int64_t i = 0; i < routes; ++i) {
    const int64_t id = in.topk_ids.dtype() == DType::kINT32 ? in.topk_ids.data<int32_t>()[i]
                                                            : in.topk_ids.data<int64_t>()[i];
    if (id < 0 || id >= model.num_experts) {
      return bad("topk_ids: value ", id, " at [", i / model.topk, ", ", i % model.topk,
                 "] is outside [0, ", model.num_experts, ") (num_experts)");
    }
  }
  for (int64_t i = 0; i < routes; ++i) {
    const float w = in.topk_weights.data<float>()[i];
    if (!std::isfinite(w)) {
      return bad("topk_weights: value ", w, " at [", i / model.topk, ", ", i % model.topk,
                 "] is not finite; expected finite router weights");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& requested) {
  EngineOptions options = requested;
  {
    WeightSource source;
    source.checkpoint_dir = options.checkpoint_dir;
    MOESERVE_ASSIGN_OR_RETURN(options.model, ResolveModelConfig(source, options.model));
  }
  MOESERVE_RETURN_IF_ERROR(options.model.Validate());
  if (options.backend != "cpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend '", options.backend, "' is not available; expected cpu"));
  }
  if (options.num_ranks != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranks=", options.num_ranks, " is not supported yet; expected 1"));
  }
  if (options.prepare_finalize != "no_ep") {
    return absl::InvalidArgumentError(absl::StrCat(
        "prepare_finalize '", options.prepare_finalize, "' unknown; expected no_ep"));
  }
  if (options.max_tokens_per_request <= 0) {
    return absl::InvalidArgumentError("max_tokens_per_request must be > 0");
  }
  const int threads = options.num_threads > 0
                          ? options.num_threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::unique_ptr<Experts> experts;
  if (options.experts == "reference") {
    experts = std::make_unique<ReferenceExperts>();
  } else if (options.experts == "blas") {
    experts = std::make_unique<BlasExperts>(threads);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("experts '", options.experts, "' unknown; expected reference or blas"));
  }
  auto pf = std::make_unique<NoEpPrepareAndFinalize>(options.max_tokens_per_request);
  auto engine = std::unique_ptr<Engine>(new Engine());
  engine->options_ = options;
  std::vector<int> ids(options.model.num_experts);
  for (int e = 0; e < options.model.num_experts; ++e) ids[e] = e;
  WeightSource source;
  source.checkpoint_dir = options.checkpoint_dir;
  source.seed = options.seed;
  source.format = options.weight_format;
  source.num_threads = threads;
  source.memory_budget_bytes = options.memory_budget_bytes;
  MOESERVE_ASSIGN_OR_RETURN(engine->weights_, LoadExpertWeights(source, options.model, ids));
  MOESERVE_ASSIGN_OR_RETURN(engine->kernel_,
                            ModularKernel::Create(std::move(pf), std::move(experts)));
  EngineInfo& info = engine->info_;
  info.model = options.model;
  info.backend = options.backend;
  info.prepare_finalize = std::string(engine->kernel_->prepare_finalize().name());
  info.experts = std::string(engine->kernel_->experts().name());
  info.weight_format = options.weight_format;
  info.num_ranks = 1;
  info.rank_experts = {ids};
  info.max_tokens_per_request = options.max_tokens_per_request;
  return engine;
}

Engine::~Engine() = default;

absl::Status Engine::Forward(const ForwardInput& input, const TensorView& output,
                             ForwardTimings* timings) {
  MOESERVE_RETURN_IF_ERROR(
      ValidateForwardInput(options_.model, options_.max_tokens_per_request, input));
  const int64_t m = input.hidden_states.dim(0), k = options_.model.hidden;
  const int topk = options_.model.topk;
  if (output.dtype() != input.hidden_states.dtype() || output.shape() != Shape{m, k}) {
    return absl::InvalidArgumentError(absl::StrCat("output must be ",
                                                   DTypeName(input.hidden_states.dtype()), "[",
                                                   m, ", ", k, "], got ", output.DebugString()));
  }
  const auto t_queue = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (timings) {
    timings->queue_us = std::chrono::duration<double, std::micro>(
                            std::chrono::steady_clock::now() - t_queue)
                            .count();
  }
  if (m == 0) return absl::OkStatus();
  TensorView ids = input.topk_ids;
  if (ids.dtype() == DType::kINT64) {
    ids = ids32_.Get(DType::kINT32, {m, topk});
    for (int64_t i = 0; i < m * topk; ++i) {
      ids.data<int32_t>()[i] = static_cast<int32_t>(input.topk_ids.data<int64_t>()[i]);
    }
  }
  const bool fp32_out = output.dtype() == DType::kFP32;
  TensorView out32 = fp32_out ? output : out32_.Get(DType::kFP32, {m, k});
  ModularKernelArgs args;
  args.hidden_states = input.hidden_states;
  args.topk_ids = ids;
  args.topk_weights = input.topk_weights;
  args.weights = weights_->layer(input.layer);
  args.num_experts = options_.model.num_experts;
  MOESERVE_RETURN_IF_ERROR(
      kernel_->Forward(args, out32, timings ? &timings->stages : nullptr));
  if (!fp32_out) MOESERVE_RETURN_IF_ERROR(ConvertTensor(out32, output));
  return absl::OkStatus();
}

absl::Status Engine::GetExpertWeightsBf16(int layer, int expert, uint16_t* w13,
                                          uint16_t* w2) const {
  const LayerWeights* lw = weights_->layer(layer);
  if (lw == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " has no experts"));
  }
  if (expert < 0 || expert >= options_.model.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("expert: got ", expert, ", expected [0, ",
                                                   options_.model.num_experts, ")"));
  }
  const auto& ids = weights_->expert_ids();
  const auto it = std::find(ids.begin(), ids.end(), expert);
  if (it == ids.end()) return absl::NotFoundError(absl::StrCat("expert ", expert, " not hosted"));
  const int64_t e = it - ids.begin();
  const int64_t k = lw->hidden, n = lw->intermediate;
  std::vector<float> f13(2 * n * k), f2(k * n);
  MOESERVE_RETURN_IF_ERROR(DequantizeExpertToFp32(*lw, e, f13.data(), f2.data()));
  kernels::ConvertFp32ToBf16Ref(f13.data(), w13, 2 * n * k);
  kernels::ConvertFp32ToBf16Ref(f2.data(), w2, k * n);
  return absl::OkStatus();
}

}  // namespace moeserve
