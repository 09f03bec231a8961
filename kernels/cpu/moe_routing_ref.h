// CPU twins of the CUDA MoE routing and MXFP8 kernels (kernels/cuda/moe_routing.cuh,
// kernels/cuda/moe_gemm.cuh). Same contracts, plain loops. The grouped GEMM pair's twin is the
// expert MLP reference ExpertMlpRowRef (kernels/cpu/moe_ref.h) applied route by route.
#ifndef MOESERVE_KERNELS_CPU_MOE_ROUTING_REF_H_
#define MOESERVE_KERNELS_CPU_MOE_ROUTING_REF_H_

#include <cstdint>

namespace moeserve::kernels {

// Twin of LaunchStageRouting (kernels/cuda/moe_routing.cuh; the report has the same fields).
struct RoutingReportRef {
  int64_t bad_id_route = -1;
  int64_t bad_id_value = 0;
  int64_t bad_weight_route = -1;
  float bad_weight_value = 0;
};
void StageRoutingRef(const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
                     int topk, int64_t padded_tokens, int num_experts, const int32_t* expert_map,
                     int num_local_experts, float max_abs_weight, int32_t* out_ids,
                     float* out_weights, RoutingReportRef* report);

// Twin of LaunchMoeAlign: counts [E], offsets [E + 1], sorted_routes [R] (-1 past the served
// ones), route_slot [R] (-1 for routes no local expert serves).
void MoeAlignRef(const int32_t* topk_ids, int64_t num_routes, int num_experts,
                 int32_t* expert_counts, int32_t* expert_offsets, int32_t* sorted_routes,
                 int32_t* route_slot);

// Twin of LaunchPermuteToBatched (BF16 bit patterns).
void PermuteToBatchedRef(const uint16_t* x, const int32_t* topk_ids, const int32_t* route_slot,
                         int64_t num_tokens, int topk, int64_t hidden, int num_experts,
                         int64_t max_tokens, uint16_t* out);

// Twin of LaunchTopKWeightAndReduceNaiveBatched.
void TopKWeightAndReduceNaiveBatchedRef(const float* in, const float* topk_weights,
                                        const int32_t* topk_ids, const int32_t* route_slot,
                                        int64_t num_tokens, int topk, int64_t hidden,
                                        int num_experts, int64_t max_tokens, float* out);

// Twin of LaunchDequantizeMxfp8ToBf16.
void DequantizeMxfp8ToBf16Ref(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t k,
                              uint16_t* out);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CPU_MOE_ROUTING_REF_H_
