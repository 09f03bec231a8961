#include "clients/cpp/reference.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "clients/cpp/dtype_convert.h"

namespace moeserve::client {

absl::StatusOr<ExpertWeightsF32> ExpertWeightsFromProto(const v1::GetExpertWeightsResponse& reply) {
  const v1::Tensor& w13 = reply.w13();
  const v1::Tensor& w2 = reply.w2();
  if (w13.shape_size() != 2 || w2.shape_size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("expert weights have rank ", w13.shape_size(),
                                                   " (w13) and ", w2.shape_size(),
                                                   " (w2); expected 2 and 2"));
  }
  const int64_t two_i = w13.shape(0);
  const int64_t h = w13.shape(1);
  if (two_i <= 0 || two_i % 2 != 0 || h <= 0 || w2.shape(0) != h || w2.shape(1) != two_i / 2) {
    return absl::InvalidArgumentError(absl::StrCat("expert weight shapes w13 [", two_i, ", ", h,
                                                   "] and w2 [", w2.shape(0), ", ", w2.shape(1),
                                                   "] do not fit [2I, H] and [H, I]"));
  }
  ExpertWeightsF32 out;
  out.hidden = h;
  out.intermediate = two_i / 2;
  absl::StatusOr<std::vector<float>> w13f = DecodeFloats(w13);
  if (!w13f.ok()) return w13f.status();
  absl::StatusOr<std::vector<float>> w2f = DecodeFloats(w2);
  if (!w2f.ok()) return w2f.status();
  out.w13 = std::move(*w13f);
  out.w2 = std::move(*w2f);
  return out;
}

absl::Status ReferenceMoeForward(const float* hidden_states, int64_t num_tokens, int64_t hidden,
                                 const int32_t* topk_ids, const float* topk_weights, int64_t topk,
                                 const std::map<int, ExpertWeightsF32>& experts, float* out) {
  std::vector<double> acc(static_cast<size_t>(hidden));
  std::vector<float> act;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* x = hidden_states + t * hidden;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t k = 0; k < topk; ++k) {
      const int32_t id = topk_ids[t * topk + k];
      if (id < 0) continue;
      auto it = experts.find(id);
      if (it == experts.end()) {
        return absl::NotFoundError(
            absl::StrCat("no weights for expert ", id, " (token ", t, ", slot ", k, ")"));
      }
      const ExpertWeightsF32& e = it->second;
      if (e.hidden != hidden) {
        return absl::InvalidArgumentError(
            absl::StrCat("expert ", id, " has hidden ", e.hidden, "; the input has ", hidden));
      }
      const int64_t inter = e.intermediate;
      act.resize(static_cast<size_t>(inter));
      for (int64_t j = 0; j < inter; ++j) {
        const float* gate_row = e.w13.data() + j * hidden;
        const float* up_row = e.w13.data() + (inter + j) * hidden;
        double gate = 0.0, up = 0.0;
        for (int64_t c = 0; c < hidden; ++c) {
          gate += static_cast<double>(gate_row[c]) * x[c];
          up += static_cast<double>(up_row[c]) * x[c];
        }
        const double silu = gate / (1.0 + std::exp(-gate));
        act[j] = static_cast<float>(silu * up);
      }
      const double weight = topk_weights[t * topk + k];
      for (int64_t r = 0; r < hidden; ++r) {
        const float* down_row = e.w2.data() + r * inter;
        double y = 0.0;
        for (int64_t j = 0; j < inter; ++j) y += static_cast<double>(down_row[j]) * act[j];
        acc[r] += weight * static_cast<float>(y);
      }
    }
    for (int64_t r = 0; r < hidden; ++r) out[t * hidden + r] = static_cast<float>(acc[r]);
  }
  return absl::OkStatus();
}

double RelativeL2Error(const float* actual, const float* expected, int64_t n) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    diff += d * d;
    norm += static_cast<double>(expected[i]) * expected[i];
  }
  if (std::isnan(diff) || std::isnan(norm)) return std::numeric_limits<double>::quiet_NaN();
  if (norm == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

}  // namespace moeserve::client
