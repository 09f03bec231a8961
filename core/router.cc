#include "core/router.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model_config.h"
#include "core/modular_kernel.h"
#include "core/status_macros.h"
#include "core/thread_pool.h"
#include "core/weights.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve {
namespace {

// Per-thread scratch, grown on demand (routing runs on the server's worker threads and the
// pool's threads).
std::vector<float>& Scratch(int which) {
  thread_local std::vector<float> buffers[3];
  return buffers[which];
}

float* Grow(int which, int64_t n) {
  std::vector<float>& v = Scratch(which);
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// a ranks before b: non-NaN before NaN, then the larger value, then the lower index.
inline bool Before(float a, int ia, float b, int ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

// One selecting thread's scratch.
struct SelectScratch {
  std::vector<float> choice;       // [E]
  std::vector<int> order;          // [max(E, n_group)]
  std::vector<float> group_score;  // [n_group]
  std::vector<char> keep;          // [n_group]
};

// Selects the experts of one token. `logits` [E] are overwritten with the scores.
void SelectOne(const RouterConfig& c, int num_experts, int topk, float* logits, const float* bias,
               int32_t* ids, float* weights, SelectScratch& ws) {
  float* scores = logits;
  // Sigmoid maps an infinite logit to a finite score: the token's inputs decide, not its scores.
  bool finite_logits = true;
  for (int e = 0; e < num_experts; ++e) finite_logits = finite_logits && std::isfinite(logits[e]);
  if (c.scoring == RouterScoring::kSoftmax) {
    float max = -std::numeric_limits<float>::infinity();
    for (int e = 0; e < num_experts; ++e) max = std::max(max, scores[e]);
    double sum = 0;
    for (int e = 0; e < num_experts; ++e) {
      scores[e] = std::exp(scores[e] - max);
      sum += scores[e];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int e = 0; e < num_experts; ++e) scores[e] *= inv;
  } else {
    for (int e = 0; e < num_experts; ++e) scores[e] = 1.0f / (1.0f + std::exp(-scores[e]));
  }
  float* choice = ws.choice.data();
  int* order = ws.order.data();
  for (int e = 0; e < num_experts; ++e) {
    choice[e] = c.correction_bias ? scores[e] + bias[e] : scores[e];
  }

  // Groups: keep the topk_group groups with the largest top-2 sums; the experts of the others
  // can not be chosen (-inf, as DeepSeek-V3's reference and vLLM mask them).
  if (c.n_group > 1 && c.topk_group < c.n_group) {
    const int per_group = num_experts / c.n_group;
    float* gs = ws.group_score.data();
    for (int g = 0; g < c.n_group; ++g) {
      const float* v = choice + g * per_group;
      int best = 0;
      for (int i = 1; i < per_group; ++i) {
        if (Before(v[i], i, v[best], best)) best = i;
      }
      int second = best == 0 ? 1 : 0;
      for (int i = 0; i < per_group; ++i) {
        if (i != best && Before(v[i], i, v[second], second)) second = i;
      }
      gs[g] = v[best] + v[second];
    }
    for (int g = 0; g < c.n_group; ++g) order[g] = g;
    std::partial_sort(order, order + c.topk_group, order + c.n_group,
                      [gs](int a, int b) { return Before(gs[a], a, gs[b], b); });
    char* keep = ws.keep.data();
    std::fill(keep, keep + c.n_group, 0);
    for (int i = 0; i < c.topk_group; ++i) keep[order[i]] = 1;
    for (int g = 0; g < c.n_group; ++g) {
      if (keep[g]) continue;
      std::fill(choice + g * per_group, choice + (g + 1) * per_group,
                -std::numeric_limits<float>::infinity());
    }
  }

  for (int e = 0; e < num_experts; ++e) order[e] = e;
  std::partial_sort(order, order + topk, order + num_experts,
                    [choice](int a, int b) { return Before(choice[a], a, choice[b], b); });
  double sum = 0;
  bool finite = true;
  for (int k = 0; k < topk; ++k) {
    ids[k] = order[k];
    weights[k] = scores[order[k]];
    finite = finite && std::isfinite(weights[k]);
    sum += weights[k];
  }
  if (!finite || !finite_logits) {
    std::fill(weights, weights + topk, 0.0f);
    return;
  }
  // The 1e-20 keeps an all-underflowed (sigmoid) token at 0 instead of NaN, as DeepSeek-V3's
  // reference does; for any normal sum it changes nothing in FP32.
  const double scale =
      (c.renormalize ? 1.0 / (sum + 1e-20) : 1.0) * static_cast<double>(c.routed_scaling_factor);
  for (int k = 0; k < topk; ++k) weights[k] = static_cast<float>(weights[k] * scale);
}

absl::Status CheckTensor(const TensorView& t, absl::string_view name,
                         std::initializer_list<DType> dtypes, const Shape& shape) {
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok = dtype_ok || t.dtype() == d;
  std::vector<std::string> names;
  for (DType d : dtypes) names.emplace_back(DTypeName(d));
  if (!dtype_ok) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", DTypeName(t.dtype()),
                                                   "; expected ", absl::StrJoin(names, " or ")));
  }
  if (t.shape() != shape) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": shape ", ShapeToString(t.shape()),
                                                   "; expected ", ShapeToString(shape)));
  }
  if (!t.is_contiguous() || !t.device().is_host() || (t.numel() > 0 && t.raw_data() == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": must be contiguous host memory, got ", t.DebugString()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view RouterScoringName(RouterScoring scoring) {
  return scoring == RouterScoring::kSoftmax ? "softmax" : "sigmoid";
}

absl::Status RouterConfig::Validate(int num_experts, int topk) const {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("router: ", parts...));
  };
  if (num_experts <= 0 || topk <= 0 || topk > num_experts) {
    return bad("topk (num_experts_per_tok) ", topk, " must be in [1, num_experts=", num_experts,
               "]");
  }
  if (n_group < 1 || num_experts % n_group != 0) {
    return bad("n_group ", n_group, " must be >= 1 and divide num_experts ", num_experts);
  }
  if (n_group > 1) {
    if (num_experts / n_group < 2) {
      return bad("n_group ", n_group, " leaves ", num_experts / n_group,
                 " expert per group; groups are ranked by their top-2 scores, so each needs >= 2");
    }
    if (topk_group < 1 || topk_group > n_group) {
      return bad("topk_group ", topk_group, " must be in [1, n_group=", n_group, "]");
    }
    if (static_cast<int64_t>(topk_group) * (num_experts / n_group) < topk) {
      return bad("topk_group ", topk_group, " groups of ", num_experts / n_group,
                 " experts hold fewer than topk=", topk, " experts");
    }
  }
  // Weights are scores (at most 1) times the factor; a Forward takes |w| <= kMaxAbsTopkWeight.
  if (!std::isfinite(routed_scaling_factor) || routed_scaling_factor <= 0 ||
      routed_scaling_factor > kMaxAbsTopkWeight) {
    return bad("routed_scaling_factor ", routed_scaling_factor, " must be finite, > 0 and at most ",
               kMaxAbsTopkWeight, " (the largest top-k weight a Forward takes)");
  }
  return absl::OkStatus();
}

std::string RouterConfig::Describe() const {
  std::vector<std::string> parts;
  if (n_group > 1) {
    parts.push_back(absl::StrCat("n_group=", n_group));
    parts.push_back(absl::StrCat("topk_group=", topk_group));
  }
  if (correction_bias) parts.push_back("e_score_correction_bias");
  if (renormalize) parts.push_back("renormalize");
  if (routed_scaling_factor != 1.0f) {
    parts.push_back(absl::StrCat("routed_scaling_factor=", routed_scaling_factor));
  }
  return absl::StrCat(RouterScoringName(scoring), n_group > 1 ? "_grouped_topk(" : "_topk(",
                      absl::StrJoin(parts, ", "), ")");
}

absl::Status Route(const RouterConfig& config, const TensorView& hidden,
                   const TensorView& gate_weight, const TensorView& bias,
                   const TensorView& topk_ids, const TensorView& topk_weights, ThreadPool* pool) {
  if (gate_weight.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gate weight: shape ", ShapeToString(gate_weight.shape()), "; expected [E, H]"));
  }
  const int64_t num_experts = gate_weight.dim(0), h = gate_weight.dim(1);
  MOESERVE_RETURN_IF_ERROR(
      CheckTensor(gate_weight, "gate weight", {DType::kFP32, DType::kBF16}, {num_experts, h}));
  if (hidden.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_states: shape ", ShapeToString(hidden.shape()), "; expected [M, ", h, "]"));
  }
  const int64_t m = hidden.dim(0);
  MOESERVE_RETURN_IF_ERROR(
      CheckTensor(hidden, "hidden_states", {DType::kBF16, DType::kFP16, DType::kFP32}, {m, h}));
  if (topk_ids.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topk_ids: shape ", ShapeToString(topk_ids.shape()), "; expected [", m, ", topk]"));
  }
  const int64_t topk = topk_ids.dim(1);
  MOESERVE_RETURN_IF_ERROR(CheckTensor(topk_ids, "topk_ids", {DType::kINT32}, {m, topk}));
  MOESERVE_RETURN_IF_ERROR(CheckTensor(topk_weights, "topk_weights", {DType::kFP32}, {m, topk}));
  if (num_experts > ModelConfig::kMaxExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("gate weight: ", num_experts, " experts; at most ", ModelConfig::kMaxExperts));
  }
  MOESERVE_RETURN_IF_ERROR(config.Validate(static_cast<int>(num_experts), static_cast<int>(topk)));
  if (config.correction_bias) {
    MOESERVE_RETURN_IF_ERROR(
        CheckTensor(bias, "e_score_correction_bias", {DType::kFP32}, {num_experts}));
  }
  if (m == 0) return absl::OkStatus();
  const int e_count = static_cast<int>(num_experts);

  // Gate as FP32 (converted here only when stored as BF16).
  const float* w = gate_weight.data<float>();
  if (gate_weight.dtype() == DType::kBF16) {
    float* wf = Grow(0, num_experts * h);
    kernels::ConvertBf16ToFp32Ref(gate_weight.data<uint16_t>(), wf, num_experts * h);
    w = wf;
  }
  const int threads = pool != nullptr ? pool->num_threads() : 1;
  const float* b = config.correction_bias ? bias.data<float>() : nullptr;
  const int k = static_cast<int>(topk);
  const size_t in_item = DTypeSize(hidden.dtype());
  // Rows go in chunks so the scratch (FP32 rows and logits, the caller thread's; the pool's
  // threads write disjoint parts of it) stays bounded whatever M is.
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(m, (int64_t{4} << 20) / std::max(h, num_experts)));
  float* logits = Grow(1, chunk * num_experts);
  float* xf = hidden.dtype() == DType::kFP32 ? nullptr : Grow(2, chunk * h);
  for (int64_t c0 = 0; c0 < m; c0 += chunk) {
    const int64_t rows = std::min(chunk, m - c0);
    const float* x = hidden.data<float>() + c0 * h;
    if (xf != nullptr) {
      const TensorView src(static_cast<const char*>(hidden.raw_data()) + c0 * h * in_item,
                           hidden.dtype(), {rows, h});
      MOESERVE_RETURN_IF_ERROR(ConvertTensor(src, TensorView(xf, DType::kFP32, {rows, h})));
      x = xf;
    }
    // Few tokens (decode): split the experts, so every thread streams a part of the gate; many
    // tokens: split the rows. BLAS itself runs single-threaded (the engine sets that).
    const bool split_rows = rows >= 4 * threads;
    const int64_t parts = threads <= 1 ? 1
                                       : (split_rows ? std::min<int64_t>(rows, 2 * threads)
                                                     : std::min<int64_t>(num_experts, threads));
    auto gemm_part = [&](int64_t p, int) {
      if (split_rows || parts == 1) {
        const int64_t r0 = rows * p / parts, r1 = rows * (p + 1) / parts;
        if (r1 > r0) {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(r1 - r0), e_count,
                      static_cast<int>(h), 1.0f, x + r0 * h, static_cast<int>(h), w,
                      static_cast<int>(h), 0.0f, logits + r0 * num_experts, e_count);
        }
      } else {
        const int64_t e0 = num_experts * p / parts, e1 = num_experts * (p + 1) / parts;
        if (e1 > e0) {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                      static_cast<int>(e1 - e0), static_cast<int>(h), 1.0f, x, static_cast<int>(h),
                      w + e0 * h, static_cast<int>(h), 0.0f, logits + e0, e_count);
        }
      }
    };
    if (parts > 1) {
      pool->ParallelFor(parts, gemm_part);
    } else {
      gemm_part(0, 0);
    }

    auto select_rows = [&](int64_t r0, int64_t r1) {
      SelectScratch ws;
      ws.choice.resize(e_count);
      ws.order.resize(std::max(e_count, config.n_group));
      ws.group_score.resize(config.n_group);
      ws.keep.resize(config.n_group);
      for (int64_t r = r0; r < r1; ++r) {
        SelectOne(config, e_count, k, logits + r * num_experts, b,
                  topk_ids.data<int32_t>() + (c0 + r) * k,
                  topk_weights.data<float>() + (c0 + r) * k, ws);
      }
    };
    const int64_t select_parts = pool != nullptr && rows >= 2 * threads ? 2 * threads : 1;
    if (select_parts > 1) {
      pool->ParallelFor(select_parts, [&](int64_t p, int) {
        select_rows(rows * p / select_parts, rows * (p + 1) / select_parts);
      });
    } else {
      select_rows(0, rows);
    }
  }
  return absl::OkStatus();
}

Router::~Router() = default;

absl::StatusOr<std::unique_ptr<Router>> Router::Create(const RouterConfig& config,
                                                       const ModelConfig& model,
                                                       std::vector<Tensor> gates,
                                                       std::vector<Tensor> biases,
                                                       int num_threads) {
  MOESERVE_RETURN_IF_ERROR(config.Validate(model.num_experts, model.topk));
  const int layers = model.num_moe_layers();
  if (static_cast<int>(gates.size()) != layers ||
      (config.correction_bias ? static_cast<int>(biases.size()) != layers : !biases.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat("router: ", gates.size(), " gates and ", biases.size(), " biases for ", layers,
                     " MoE layers (biases: one per layer with correction_bias, else none)"));
  }
  auto router = std::unique_ptr<Router>(new Router());
  router->config_ = config;
  router->num_experts_ = model.num_experts;
  router->topk_ = model.topk;
  router->hidden_ = model.hidden;
  router->layer_slot_.assign(model.num_layers, -1);
  for (int i = 0; i < layers; ++i) {
    const int layer = model.moe_layers.empty() ? i : model.moe_layers[i];
    router->layer_slot_[layer] = i;
    const Tensor& g = gates[i];
    if (g.dtype() != DType::kFP32 || g.shape() != Shape{model.num_experts, model.hidden}) {
      return absl::InvalidArgumentError(absl::StrCat(
          "router: layer ", layer, " gate is ", DTypeName(g.dtype()), ShapeToString(g.shape()),
          "; expected fp32[", model.num_experts, ", ", model.hidden, "]"));
    }
    if (config.correction_bias &&
        (biases[i].dtype() != DType::kFP32 || biases[i].shape() != Shape{model.num_experts})) {
      return absl::InvalidArgumentError(absl::StrCat(
          "router: layer ", layer, " e_score_correction_bias is ", DTypeName(biases[i].dtype()),
          ShapeToString(biases[i].shape()), "; expected fp32[", model.num_experts, "]"));
    }
  }
  router->gates_ = std::move(gates);
  router->biases_ = std::move(biases);
  if (num_threads > 1) router->pool_ = std::make_unique<ThreadPool>(num_threads);
  return router;
}

int Router::Slot(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(layer_slot_.size())) return -1;
  return layer_slot_[layer];
}

TensorView Router::gate(int layer) const {
  const int s = Slot(layer);
  return s < 0 ? TensorView() : gates_[s].view();
}

TensorView Router::bias(int layer) const {
  const int s = Slot(layer);
  return s < 0 || biases_.empty() ? TensorView() : biases_[s].view();
}

absl::Status Router::Route(int layer, const TensorView& hidden, const TensorView& topk_ids,
                           const TensorView& topk_weights) const {
  const int s = Slot(layer);
  if (s < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", layer, " has no router gate (not a MoE layer)"));
  }
  return moeserve::Route(config_, hidden, gates_[s].view(),
                         biases_.empty() ? TensorView() : biases_[s].view(), topk_ids, topk_weights,
                         pool_.get());
}

absl::StatusOr<std::unique_ptr<Router>> CreateSyntheticRouter(const ModelConfig& model,
                                                              uint64_t seed, int num_threads) {
  if (!model.router.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("model '", model.name, "' has no router configuration"));
  }
  const RouterConfig& config = *model.router;
  MOESERVE_RETURN_IF_ERROR(config.Validate(model.num_experts, model.topk));
  const int64_t e_count = model.num_experts, h = model.hidden;
  const int layers = model.num_moe_layers();
  std::vector<Tensor> gates(layers), biases(config.correction_bias ? layers : 0);
  for (int i = 0; i < layers; ++i) {
    gates[i] = Tensor::Empty(DType::kFP32, {e_count, h});
    if (config.correction_bias) biases[i] = Tensor::Empty(DType::kFP32, {e_count});
  }
  // One (layer, expert) row per index; seeded per value, so the split does not matter.
  ThreadPool fill(std::max(1, num_threads));
  fill.ParallelFor(int64_t{layers} * e_count, [&](int64_t i, int) {
    const int slot = static_cast<int>(i / e_count);
    const int e = static_cast<int>(i % e_count);
    const int layer = model.moe_layers.empty() ? slot : model.moe_layers[slot];
    float* p = gates[slot].data<float>() + e * h;
    for (int64_t c = 0; c < h; ++c) p[c] = SyntheticWeight(seed, layer, e, 2, c, h);
    if (config.correction_bias) {
      biases[slot].data<float>()[e] = SyntheticWeight(seed, layer, e, 3, 0, 100);
    }
  });
  return Router::Create(config, model, std::move(gates), std::move(biases), num_threads);
}

}  // namespace moeserve
