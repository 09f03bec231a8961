#include "kernels/cpu/moe_routing_ref.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"

namespace moeserve::kernels {

void MoeAlignRef(const int32_t* ids, int64_t num_routes, int num_experts, int32_t* counts,
                 int32_t* offsets, int32_t* sorted, int32_t* slot) {
  std::vector<int32_t> c(num_experts, 0);
  for (int64_t r = 0; r < num_routes; ++r) {
    if (ids[r] >= 0 && ids[r] < num_experts) ++c[ids[r]];
  }
  int32_t run = 0;
  for (int e = 0; e < num_experts; ++e) {
    counts[e] = c[e];
    offsets[e] = run;
    run += c[e];
  }
  offsets[num_experts] = run;
  std::vector<int32_t> next(offsets, offsets + num_experts);
  for (int64_t r = 0; r < num_routes; ++r) sorted[r] = -1;
  for (int64_t r = 0; r < num_routes; ++r) {
    const int e = ids[r];
    if (e < 0 || e >= num_experts) {
      slot[r] = -1;
      continue;
    }
    slot[r] = next[e] - offsets[e];
    sorted[next[e]++] = static_cast<int32_t>(r);
  }
}

void PermuteToBatchedRef(const uint16_t* x, const int32_t* ids, const int32_t* slot,
                         int64_t num_tokens, int topk, int64_t hidden, int num_experts,
                         int64_t max_tokens, uint16_t* out) {
  for (int64_t r = 0; r < num_tokens * topk; ++r) {
    const int e = ids[r];
    if (e < 0 || e >= num_experts || slot[r] < 0 || slot[r] >= max_tokens) continue;
    std::memcpy(out + (e * max_tokens + slot[r]) * hidden, x + (r / topk) * hidden,
                sizeof(uint16_t) * hidden);
  }
}

void TopKWeightAndReduceNaiveBatchedRef(const float* in, const float* w, const int32_t* ids,
                                        const int32_t* slot, int64_t num_tokens, int topk,
                                        int64_t hidden, int num_experts, int64_t max_tokens,
                                        float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out + t * hidden;
    std::memset(o, 0, sizeof(float) * hidden);
    for (int k = 0; k < topk; ++k) {
      const int64_t r = t * topk + k;
      const int e = ids[r];
      if (e < 0 || e >= num_experts || slot[r] < 0 || slot[r] >= max_tokens) continue;
      const float* row = in + (e * max_tokens + slot[r]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) o[h] += w[r] * row[h];
    }
  }
}

void DequantizeMxfp8ToBf16Ref(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t k,
                              uint16_t* out) {
  const int64_t blocks = Mxfp8ScaleBlocks(k);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const int code = scales[r * blocks + c / 32];
      const float v = E4M3ToFloat(q[r * k + c]);
      out[r * k + c] = FloatToBf16(code == 255 ? std::nanf("") : std::ldexp(v, code - 127));
    }
  }
}

void StageRoutingRef(const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
                     int topk, int64_t padded_tokens, int num_experts, const int32_t* expert_map,
                     int num_local_experts, float max_abs_weight, int32_t* out_ids,
                     float* out_weights, RoutingReportRef* report) {
  *report = RoutingReportRef();
  const int64_t routes = num_tokens * topk;
  for (int64_t r = 0; r < padded_tokens * topk; ++r) {
    int32_t id = -1;
    float w = 0.0f;
    if (r < routes) {
      id = topk_ids[r];
      w = topk_weights[r];
      if (id < 0 || id >= num_experts) {
        if (report->bad_id_route < 0) {
          report->bad_id_route = r;
          report->bad_id_value = id;
        }
        id = -1;
      } else if (expert_map != nullptr) {
        id = expert_map[id];
      }
      if (id < -1 || id >= num_local_experts) id = -1;
      if (!std::isfinite(w) || std::fabs(w) > max_abs_weight) {
        if (report->bad_weight_route < 0) {
          report->bad_weight_route = r;
          report->bad_weight_value = w;
        }
        w = 0.0f;
      }
    }
    out_ids[r] = id;
    out_weights[r] = w;
  }
}

}  // namespace moeserve::kernels
