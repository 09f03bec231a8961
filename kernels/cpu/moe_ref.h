// Plain-loop CPU reference kernels for the MoE expert MLP and the top-k weight-and-reduce.
//
// These are the oracle every other backend is tested against: simple loops, FP32 accumulation,
// no blocking tricks. Shapes use the kernel vocabulary: num_tokens (M), topk, hidden (K),
// intermediate (N). All tensors are dense row-major.
#ifndef MOESERVE_KERNELS_CPU_MOE_REF_H_
#define MOESERVE_KERNELS_CPU_MOE_REF_H_

#include <cstdint>

namespace moeserve::kernels {

// SiLU(x) = x * sigmoid(x).
float SiluRef(float x);

// out[t, j] = silu(in[t, j]) * in[t, intermediate + j] for in [num_tokens, 2 * intermediate]
// (gate half first, then up half) and out [num_tokens, intermediate].
void SiluAndMulRef(const float* in, int64_t num_tokens, int64_t intermediate, float* out);

// One token through one expert's SiLU-gated MLP:
//   y = w2 @ (silu(w13[:I] @ x) * (w13[I:] @ x))
// x [hidden]; w13 [2 * intermediate, hidden]; w2 [hidden, intermediate]; y [hidden];
// scratch holds 3 * intermediate floats.
void ExpertMlpRowRef(const float* x, const float* w13, const float* w2, int64_t hidden,
                     int64_t intermediate, float* y, float* scratch);

// Contiguous top-k weight-and-reduce:
//   out[t, :] = sum_k (topk_ids[t, k] >= 0 ? topk_weights[t, k] * in[t, k, :] : 0)
// in [num_tokens, topk, hidden]; topk_ids may be null (every route valid).
void TopKWeightAndReduceContiguousRef(const float* in, const float* topk_weights,
                                      const int32_t* topk_ids, int64_t num_tokens, int64_t topk,
                                      int64_t hidden, float* out);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CPU_MOE_REF_H_
