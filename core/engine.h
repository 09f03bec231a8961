// The engine: owns the expert weights, the modular kernel(s) and the ranks, and runs one MoE
// layer forward at a time. This is the API the server (and any other frontend) drives.
#ifndef MOESERVE_CORE_ENGINE_H_
#define MOESERVE_CORE_ENGINE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model_config.h"
#include "core/modular_kernel.h"
#include "core/tensor.h"
#include "core/weights.h"

namespace moeserve {

struct EngineOptions {
  ModelConfig model;
  std::string backend = "cpu";                 // "cpu"
  std::string experts = "blas";                // "reference" | "blas"
  std::string prepare_finalize = "no_ep";      // "no_ep"
  WeightFormat weight_format = WeightFormat::kBF16;
  std::string checkpoint_dir;                  // empty: synthetic weights from `seed`
  int num_ranks = 1;
  uint64_t seed = 0;
  int num_threads = 0;                         // 0: all hardware threads
  int64_t max_tokens_per_request = 8192;
  int64_t memory_budget_bytes = 0;             // 0: what the machine has available
};

// One layer call. Views are read-only and must stay valid for the call.
struct ForwardInput {
  int layer = 0;
  TensorView hidden_states;  // [M, hidden] BF16, FP16 or FP32
  TensorView topk_ids;       // [M, topk] INT32 or INT64, each in [0, num_experts)
  TensorView topk_weights;   // [M, topk] FP32, finite
};

struct ForwardTimings {
  double queue_us = 0;
  StageTimings stages;
};

struct EngineInfo {
  ModelConfig model;
  std::string backend;
  std::string prepare_finalize;
  std::string experts;
  WeightFormat weight_format = WeightFormat::kBF16;
  std::string checkpoint_dir;                  // empty: synthetic weights from `seed`
  int num_ranks = 1;
  std::string placement = "contiguous";
  std::vector<std::vector<int>> rank_experts;  // global expert ids per rank
  int64_t max_tokens_per_request = 0;
  std::vector<DType> hidden_dtypes = {DType::kBF16, DType::kFP16, DType::kFP32};
  std::vector<DType> topk_ids_dtypes = {DType::kINT32, DType::kINT64};
};

// Checks a forward against the model: INVALID_ARGUMENT naming the field, what came and what
// was expected; RESOURCE_EXHAUSTED when M exceeds max_tokens. Reads ids and weights (host).
// NaN/Inf in hidden_states is allowed and propagates to that token's output only.
absl::Status ValidateForwardInput(const ModelConfig& model, int64_t max_tokens,
                                  const ForwardInput& input);

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  ~Engine();

  // Validates and runs one forward; output [M, hidden] with hidden_states' dtype (host,
  // caller-owned). Thread-safe: concurrent calls queue and run one at a time.
  absl::Status Forward(const ForwardInput& input, const TensorView& output,
                       ForwardTimings* timings = nullptr);

  // One expert's weights as computed with, rounded to BF16: w13 [2I, H], w2 [H, I].
  absl::Status GetExpertWeightsBf16(int layer, int expert, uint16_t* w13, uint16_t* w2) const;

  const EngineInfo& info() const { return info_; }

 private:
  Engine() = default;
  EngineOptions options_;
  EngineInfo info_;
  std::unique_ptr<ExpertWeightStore> weights_;
  std::unique_ptr<ModularKernel> kernel_;
  std::mutex mu_;  // one forward at a time
  HostBuffer ids32_, out32_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_ENGINE_H_
