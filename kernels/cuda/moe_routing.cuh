// MoE routing on the device: align (group routes by local expert), permute to the batched
// layout, and the top-k weight-and-reduce. All launchers are asynchronous on `stream`, take
// device pointers, and never synchronize with the host. CPU twins: kernels/cpu/moe_routing_ref.h.
//
// A route is r = token * topk + k. Expert ids are local indices in [0, num_experts); any other
// value (-1 for a remote expert) is a route that no local expert serves.
#ifndef MOESERVE_KERNELS_CUDA_MOE_ROUTING_CUH_
#define MOESERVE_KERNELS_CUDA_MOE_ROUTING_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moeserve::kernels {

// Most local experts LaunchMoeAlign handles: its counters (one row per warp, plus one) live in
// the 48 KiB of shared memory a launch gets without opting in, so one warp's two rows of E
// int32 must fit (12288 was advertised and failed to launch above 6144).
inline constexpr int kMoeAlignMaxExperts = 48 * 1024 / 4 / 2;

// Where LaunchMoeAlign may spread its work over several blocks (given scratch): at most this many
// experts (each block's counters for 32 warps in 32 KiB of shared memory), from
// kMoeAlignMultiBlockMinRoutes routes, a block per kMoeAlignBlockRoutes. On an H100 (Nsight
// Compute, 2026-12-05) the one block took 10-11 us at 2048 routes and 19-27 us at 8192; the two
// launches about 5 + 7.5 us at any count, so they pay from about 3000 routes.
inline constexpr int kMoeAlignMultiBlockMaxExperts = 256;
inline constexpr int64_t kMoeAlignMultiBlockMinRoutes = 4096;
inline constexpr int64_t kMoeAlignBlockRoutes = 1024;

// Groups the num_routes routes of topk_ids by expert, stable (ascending route order inside an
// expert). Outputs (device, written in full):
//   expert_counts [num_experts]      routes per expert
//   expert_offsets [num_experts + 1] exclusive prefix sum; [num_experts] = routes served
//   sorted_routes [num_routes]       route ids grouped by expert; -1 past the served ones
//   route_slot [num_routes]          position of each route inside its expert's group, or -1
// O(num_routes) work. num_routes may be 0. With `scratch` (device, MoeAlignScratchInts int32;
// may be null), from kMoeAlignMultiBlockMinRoutes routes of at most kMoeAlignMultiBlockMaxExperts
// experts, two launches of a block per kMoeAlignBlockRoutes routes (up to 128 blocks); else one
// block. The same outputs either way.
int64_t MoeAlignScratchInts(int64_t num_routes, int num_experts);
cudaError_t LaunchMoeAlign(const int32_t* topk_ids, int64_t num_routes, int num_experts,
                           int32_t* expert_counts, int32_t* expert_offsets, int32_t* sorted_routes,
                           int32_t* route_slot, cudaStream_t stream, int32_t* scratch = nullptr);

// BF16 rows of x [num_tokens, hidden] to out [num_experts, max_tokens, hidden]: route r with
// expert e and slot s = route_slot[r] < max_tokens copies row r / topk to out[e, s]. Rows of
// out past an expert's count are left as they are.
cudaError_t LaunchPermuteToBatched(const uint16_t* x, const int32_t* topk_ids,
                                   const int32_t* route_slot, int64_t num_tokens, int topk,
                                   int64_t hidden, int num_experts, int64_t max_tokens,
                                   uint16_t* out, cudaStream_t stream);

// out[t, :] = sum_k w[t, k] * in[row(t, k), :] over routes whose expert id is in
// [0, num_experts) (topk_ids may be null: every route is valid), FP32. out [num_tokens, hidden].
//   Contiguous:   in [num_tokens, topk, hidden], row(t, k) = t * topk + k.
//   NaiveBatched: in [num_experts, max_tokens, hidden], row = id * max_tokens + route_slot[r].
cudaError_t LaunchTopKWeightAndReduceContiguous(const float* in, const float* topk_weights,
                                                const int32_t* topk_ids, int64_t num_tokens,
                                                int topk, int64_t hidden, int num_experts,
                                                float* out, cudaStream_t stream);
// The same sums rounded once to out_kind as they are stored (BF16 to nearest even, FP16 as
// ConvertFp32ToFp16Ref): bit-identical to the FP32 form followed by LaunchConvertFp32ToBf16 /
// LaunchConvertFp32ToFp16, without the FP32 round trip through memory. `out` may be page-locked
// host memory (8-byte stores over PCIe where hidden % 4 == 0), so a small answer lands in its
// host staging with no copy after it.
enum class ReduceOutput { kFp32, kBf16, kFp16 };
cudaError_t LaunchTopKWeightAndReduceContiguous(const float* in, const float* topk_weights,
                                                const int32_t* topk_ids, int64_t num_tokens,
                                                int topk, int64_t hidden, int num_experts,
                                                void* out, ReduceOutput out_kind,
                                                cudaStream_t stream);
cudaError_t LaunchTopKWeightAndReduceNaiveBatched(const float* in, const float* topk_weights,
                                                  const int32_t* topk_ids,
                                                  const int32_t* route_slot, int64_t num_tokens,
                                                  int topk, int64_t hidden, int num_experts,
                                                  int64_t max_tokens, float* out,
                                                  cudaStream_t stream);

// What LaunchStageRouting found wrong, first offender of each kind (-1: none). Written by one
// thread with plain stores, so it may live in mapped page-locked host memory and be read after
// the stream's next synchronization.
struct RoutingReport {
  int64_t bad_id_route = -1;      // route index of the first id outside [0, num_experts)
  int64_t bad_id_value = 0;       // that id
  int64_t bad_weight_route = -1;  // route index of the first weight not finite or > max_abs
  float bad_weight_value = 0;     // that weight
};

// Copies the num_tokens * topk routes of (topk_ids INT32, topk_weights FP32), contiguous device
// memory the caller owns, into out_ids / out_weights [padded_tokens, topk], checking each on
// the way: an id outside [0, num_experts) is written as -1 (a route no expert serves) and a
// weight that is not finite or whose magnitude exceeds max_abs_weight as 0, and the first of
// each goes to *report. A valid id is written as expert_map[id] (device, [num_experts]), or as
// it is when expert_map is null; a result outside [0, num_local_experts) is written as -1.
// Routes of rows [num_tokens, padded_tokens) are padding: -1 and 0. So nothing downstream ever
// indexes out of bounds, whatever the client sent. One thread block; *report is written in
// full. num_tokens may be 0.
cudaError_t LaunchStageRouting(const int32_t* topk_ids, const float* topk_weights,
                               int64_t num_tokens, int topk, int64_t padded_tokens, int num_experts,
                               const int32_t* expert_map, int num_local_experts,
                               float max_abs_weight, int32_t* out_ids, float* out_weights,
                               RoutingReport* report, cudaStream_t stream);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_MOE_ROUTING_CUH_
