// The MoE router (the gate) on the server: hidden states -> top-k expert ids and weights, for
// frontends that leave routing to moeserve (a ForwardRequest without topk_ids/topk_weights).
//
// Semantics, per token (logits = hidden @ gate^T, computed in FP32):
//   scores  = softmax(logits) over all experts (Mixtral, Qwen-MoE)  | sigmoid(logits) (DeepSeek-V3)
//   choice  = scores + e_score_correction_bias (when the model has one; else scores)
//   groups  (n_group > 1): the experts split into n_group equal consecutive groups, each ranked
//           by the sum of its two largest choice values; only the topk_group best groups stay
//   ids     = the topk experts with the largest choice among the groups kept
//   weights = scores[ids] (the unbiased scores), divided by their sum if renormalize
//             (norm_topk_prob), then times routed_scaling_factor.
// Mixtral is softmax + renormalize (the renormalized softmax of its top-k logits); Qwen3-MoE
// softmax + norm_topk_prob; DeepSeek-V3 sigmoid + bias + groups + norm_topk_prob + scaling.
//
// Order and ties: ids are in descending choice order; equal choice values go to the lower
// expert id (and equal group scores to the lower group). A token whose scores are not finite
// (NaN or Inf in its hidden states) still gets topk distinct ids (NaN ranks lowest) and weight
// 0 on each, so the batcher's finite-weight check holds and the token's output stays NaN, as
// with client-side routing.
#ifndef MOESERVE_CORE_ROUTER_H_
#define MOESERVE_CORE_ROUTER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"

namespace moeserve {

class ThreadPool;
struct ModelConfig;

enum class RouterScoring { kSoftmax, kSigmoid };
absl::string_view RouterScoringName(RouterScoring scoring);  // "softmax" | "sigmoid"

struct RouterConfig {
  RouterScoring scoring = RouterScoring::kSoftmax;
  bool renormalize = false;  // norm_topk_prob
  int n_group = 1;           // expert groups; 1: no grouping
  int topk_group = 1;        // groups kept (n_group > 1)
  float routed_scaling_factor = 1.0f;
  bool correction_bias = false;  // an e_score_correction_bias [num_experts] per layer

  // INVALID_ARGUMENT naming the setting: n_group must divide num_experts, groups (when
  // n_group > 1) hold at least 2 experts, topk_group in [1, n_group], the kept groups hold at
  // least topk experts, routed_scaling_factor finite, > 0 and at most kMaxAbsTopkWeight (1e4,
  // the largest top-k weight a Forward takes).
  absl::Status Validate(int num_experts, int topk) const;
  // E.g. "softmax_topk(renormalize)" or "sigmoid_grouped_topk(n_group=8, topk_group=4,
  // e_score_correction_bias, renormalize, routed_scaling_factor=2.5)"; what ModelInfo reports.
  std::string Describe() const;
};

// Routes M tokens. Pure; host memory only; thread-safe (scratch is per calling thread).
//   hidden        [M, H] BF16, FP16 or FP32, contiguous
//   gate_weight   [E, H] FP32 or BF16 (BF16 is widened per call: store FP32 for speed)
//   bias          [E] FP32 when config.correction_bias, else ignored (may be empty)
//   topk_ids      [M, topk] INT32, written
//   topk_weights  [M, topk] FP32, written
// `pool` (optional) splits the gate GEMM and the selection over its threads. INVALID_ARGUMENT
// for shapes or dtypes that do not fit (naming the tensor), or an invalid config.
absl::Status Route(const RouterConfig& config, const TensorView& hidden,
                   const TensorView& gate_weight, const TensorView& bias,
                   const TensorView& topk_ids, const TensorView& topk_weights,
                   ThreadPool* pool = nullptr);

// A model's gates: one FP32 [E, H] weight (and bias [E] when config.correction_bias) per MoE
// layer, and the config. Immutable after creation; Route is thread-safe (concurrent callers
// share the pool, whose loops run one at a time).
class Router {
 public:
  // The router of `model` with `config` (usually *model.router). `gates[i]` / `biases[i]`
  // belong to model.moe_layers[i] (layer i when moe_layers is empty); every gate FP32
  // [num_experts, hidden], every bias FP32 [num_experts] (`biases` empty without
  // correction_bias). `num_threads` <= 1: route on the calling thread only.
  static absl::StatusOr<std::unique_ptr<Router>> Create(const RouterConfig& config,
                                                        const ModelConfig& model,
                                                        std::vector<Tensor> gates,
                                                        std::vector<Tensor> biases,
                                                        int num_threads);
  ~Router();

  const RouterConfig& config() const { return config_; }
  int topk() const { return topk_; }
  // The gate of MoE layer `layer` (FP32 [E, H]) and its bias (FP32 [E], empty without one);
  // empty views for a layer without experts.
  TensorView gate(int layer) const;
  TensorView bias(int layer) const;

  // Route() with `layer`'s gate. INVALID_ARGUMENT for a layer without experts.
  absl::Status Route(int layer, const TensorView& hidden, const TensorView& topk_ids,
                     const TensorView& topk_weights) const;

 private:
  Router() = default;
  int Slot(int layer) const;  // -1 when `layer` has no gate

  RouterConfig config_;
  int num_experts_ = 0;
  int topk_ = 0;
  int64_t hidden_ = 0;
  std::vector<int> layer_slot_;  // model layer -> index into gates_, or -1
  std::vector<Tensor> gates_;
  std::vector<Tensor> biases_;
  std::unique_ptr<ThreadPool> pool_;
};

// Synthetic gates for a synthetic model (router config: *model.router, which must be set):
// value (layer l, expert e, column h) = SyntheticWeight(seed, l, e, /*tensor=*/2, h, hidden)
// (uniform, std 1/sqrt(hidden), so logits of N(0, 1) hidden states have std about 1), and
// bias[e] = SyntheticWeight(seed, l, e, 3, 0, 100) (std 0.1) when correction_bias. The same
// on every rank and run for the same seed.
absl::StatusOr<std::unique_ptr<Router>> CreateSyntheticRouter(const ModelConfig& model,
                                                              uint64_t seed, int num_threads);

}  // namespace moeserve

#endif  // MOESERVE_CORE_ROUTER_H_
