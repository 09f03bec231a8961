#include "kernels/cpu/moe_ref.h"

#include <cmath>
#include <cstring>

namespace moeserve::kernels {

float SiluRef(float x) { return x / (1.0f + std::exp(-x)); }

void SiluAndMulRef(const float* in, int64_t num_tokens, int64_t intermediate, float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* gate = in + t * 2 * intermediate;
    const float* up = gate + intermediate;
    float* o = out + t * intermediate;
    for (int64_t j = 0; j < intermediate; ++j) o[j] = SiluRef(gate[j]) * up[j];
  }
}

void ExpertMlpRowRef(const float* x, const float* w13, const float* w2, int64_t hidden,
                     int64_t intermediate, float* y, float* scratch) {
  float* gate_up = scratch;                 // [2 * intermediate]
  float* act = scratch + 2 * intermediate;  // [intermediate]
  for (int64_t n = 0; n < 2 * intermediate; ++n) {
    const float* w = w13 + n * hidden;
    float acc = 0.0f;
    for (int64_t k = 0; k < hidden; ++k) acc += w[k] * x[k];
    gate_up[n] = acc;
  }
  SiluAndMulRef(gate_up, 1, intermediate, act);
  for (int64_t h = 0; h < hidden; ++h) {
    const float* w = w2 + h * intermediate;
    float acc = 0.0f;
    for (int64_t n = 0; n < intermediate; ++n) acc += w[n] * act[n];
    y[h] = acc;
  }
}

void TopKWeightAndReduceContiguousRef(const float* in, const float* topk_weights,
                                      const int32_t* topk_ids, int64_t num_tokens, int64_t topk,
                                      int64_t hidden, float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out + t * hidden;
    std::memset(o, 0, sizeof(float) * hidden);
    for (int64_t k = 0; k < topk; ++k) {
      if (topk_ids != nullptr && topk_ids[t * topk + k] < 0) continue;
      const float w = topk_weights[t * topk + k];
      const float* row = in + (t * topk + k) * hidden;
      for (int64_t h = 0; h < hidden; ++h) o[h] += w * row[h];
    }
  }
}

}  // namespace moeserve::kernels
