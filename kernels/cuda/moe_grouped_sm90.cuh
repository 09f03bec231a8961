// Prefill-sized MoE expert GEMMs on Hopper (sm_90a): CUTLASS's ptr-array grouped GEMM
// (KernelPtrArrayTmaWarpSpecializedCooperative 128x256x64 tiles, or ...Pingpong 64x256x64 for
// small groups: TMA loads, a warp-specialized producer and two consumer warpgroups issuing
// wgmma, persistent grid; GroupProblemShape with the per-expert row counts read on the device,
// no host synchronization), plus the small kernels around it.
//
// One MLP on the grouped path (R = routes served, rows grouped by expert as LaunchMoeAlign
// orders them):
//   LaunchMoeGatherRows        x [M, H] -> a1 [R, H]                       (permute)
//   LaunchMoeGroupedSm90Gemm   a1 x W13_e^T -> d1 [R, 2 Ip] (gate | up), BF16
//   LaunchMoeSiluMul           d1 -> a2 [R, Ip] = silu(gate) * up          (BF16)
//   LaunchMoeGroupedSm90Gemm   a2 x W2_e^T -> d2 [R, H], BF16
//   LaunchMoeUnpermuteReduce   out[t] = sum_k w[t, k] * d2[row(t, k)]      (FP32 [M, H])
// SiLU-and-mul is a separate kernel: CUTLASS's epilogue writes every accumulator element it
// computes (an EVT node cannot combine two output columns into one), so a fused version needs
// an epilogue of our own. The top-k weighting and the unpermute are one kernel with the
// reduction over top-k (the epilogue's TMA store cannot scatter rows or add across routes; a
// per-row scale there would save nothing, as the reduction reads every row anyway).
//
// Weights for this path are plain row-major per expert (MoePlainLayout), made on the device from
// the decode kernels' packed layout by LaunchUnpackMoeWeightsPlain.
//
// Built for sm_90a only (kernels/cuda/CMakeLists.txt). In a build without CUTLASS or without the
// 90a target, and on any device that is not compute capability 9.0, the GEMM launcher returns
// cudaErrorNotSupported and MoeGroupedSm90Unsupported() says why. The other launchers here run
// on any architecture.
#ifndef MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_CUH_
#define MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/moe_gemm.cuh"

namespace moeserve::kernels {

// Why the grouped GEMM cannot run on `device` (a static string), or null when it can.
const char* MoeGroupedSm90Unsupported(int device);

// Plain per-expert layout of the grouped path, in the padded sizes of MoePackedLayout:
//   w13 [E, 2 Ip, Hp]: rows [0, Ip) gate, [Ip, 2 Ip) up (rows >= I of each half are zero),
//   w2  [E, H, Ip]; K padding is zero. Row-major, K contiguous (CUTLASS "B column-major").
inline int64_t PlainW13ElemsPerExpert(const MoePackedLayout& l) {
  return 2 * l.intermediate_padded * l.hidden_padded;
}
inline int64_t PlainW2ElemsPerExpert(const MoePackedLayout& l) {
  return l.hidden * l.intermediate_padded;
}

// Packed weights (LaunchPackMoeW13 / W2 layout) -> the plain BF16 layout above. elem_bytes 2
// (BF16; scales null) or 1 (MXFP8: E4M3 values and their packed E8M0 scales, dequantized exactly
// to BF16 here, once, so the grouped GEMM runs on BF16 weights).
cudaError_t LaunchUnpackMoeWeightsPlain(const void* packed_w13, const uint8_t* packed_w13_scale,
                                        const void* packed_w2, const uint8_t* packed_w2_scale,
                                        int64_t num_experts, const MoePackedLayout& layout,
                                        int elem_bytes, void* plain_w13, void* plain_w2,
                                        cudaStream_t stream);

// One grouped GEMM: for each expert e with c = max(counts[e], 0) rows starting at row
// o = offsets[e]:  d[o + i, j] = sum_k a[o + i, k] * b[e][j, k]  (i < c, j < n), BF16 in,
// FP32 accumulation, BF16 out. b[e] = b + e * b_expert_stride, rows ldb apart. Device pointers;
// a, b, d 16-byte aligned, lda / ldb / ldd multiples of 8 elements, k % 8 == 0.
struct MoeGroupedSm90Gemm {
  int num_experts = 0;
  const int32_t* expert_counts = nullptr;   // [E]
  const int32_t* expert_offsets = nullptr;  // [E]
  int64_t n = 0, k = 0;
  const uint16_t* a = nullptr;
  int64_t lda = 0;
  const uint16_t* b = nullptr;
  int64_t ldb = 0;
  int64_t b_expert_stride = 0;
  uint16_t* d = nullptr;
  int64_t ldd = 0;
  // Host-side hint (no device read): the rows over all experts (M * topk). It picks the tile
  // rows by the average expert's padding (MoeGroupedSm90UsesSmallTiles).
  int64_t total_rows_hint = 0;
};

// Whether a grouped GEMM of `total_rows` over `num_experts` takes the 64-row tiles: when the
// average expert's rows, padded to 64-row tiles, are at most 4/5 of their padding to 128-row
// tiles. That is up to 64 rows per expert (a 128-row tile would do twice the MMA work on the
// same weight bytes) and 129-192 (three 64-row tiles against two of 128). H200, seed and DSV3
// BF16 MLPs (tests/benchmarks/cuda/RESULTS.md, 2026-12-02 22:30): 130 and 150 rows per expert
// 11-14% faster on 64-row tiles; 256 and 512 rows 3-6% slower; 260-320 rows mixed (-19% to
// +7%), so they stay on 128-row tiles.
inline bool MoeGroupedSm90UsesSmallTiles(int64_t total_rows, int num_experts) {
  if (num_experts <= 0) return true;
  const int64_t avg = (total_rows + num_experts - 1) / num_experts;
  return 5 * ((avg + 63) / 64 * 64) <= 4 * ((avg + 127) / 128 * 128);
}

// Device scratch the launcher needs (argument arrays and CUTLASS's workspace), 256-byte aligned.
size_t MoeGroupedSm90WorkspaceBytes(int num_experts, int num_sms);

// Asynchronous on `stream`; `device` is the current device (its capability is checked once).
cudaError_t LaunchMoeGroupedSm90Gemm(const MoeGroupedSm90Gemm& g, void* workspace,
                                     size_t workspace_bytes, int device, int num_sms,
                                     cudaStream_t stream);

// a1[p, :] = x[sorted_routes[p] / topk, :] for p < min(*served_rows, max_rows) (read on the
// device); x [M, h] BF16, rows `h` apart, h % 8 == 0; a1 [max_rows, h]; x and a1 16-byte
// aligned (cudaErrorInvalidValue otherwise); rows from *served_rows on are not written.
// max_rows: an upper bound of the rows (M * topk) for the grid.
cudaError_t LaunchMoeGatherRows(const uint16_t* x, const int32_t* sorted_routes,
                                const int32_t* served_rows, int64_t max_rows, int topk, int64_t h,
                                uint16_t* a1, cudaStream_t stream);

// a2[r, j] = silu(d1[r, j]) * d1[r, ip + j] for r < *served_rows, j < ip; d1 [R, 2 ip], a2
// [R, ip], BF16, computed in FP32. ip % 8 == 0.
cudaError_t LaunchMoeSiluMul(const uint16_t* d1, const int32_t* served_rows, int64_t max_rows,
                             int64_t ip, uint16_t* a2, cudaStream_t stream);

// out[t, :] = sum over k with 0 <= ids[t, k] < num_experts of
//             w[t, k] * d2[offsets[ids[t, k]] + route_slot[t * topk + k], :]
// FP32 [M, h] (zero for a token with no local route). d2 BF16 [R, h]. h % 8 == 0.
cudaError_t LaunchMoeUnpermuteReduce(const uint16_t* d2, const int32_t* topk_ids,
                                     const float* topk_weights, const int32_t* expert_offsets,
                                     const int32_t* route_slot, int64_t num_tokens, int topk,
                                     int64_t h, int num_experts, float* out, cudaStream_t stream);

// ---- W8A8: MXFP8 weights and activations quantized to FP8 on the fly (issue 13) ----
//
// The same MLP with both GEMMs on FP8 tensor cores (CUTLASS's sm90 ptr-array grouped GEMM with
// blockwise scaling: FP8 wgmma, each 128-deep K block's partial sum promoted to FP32 times its two
// scales). Scales are FP32, one per row per 128 K:
//   activations: LaunchMoeGatherQuantizeRows / LaunchMoeSiluMulQuantize quantize each 128 K
//     block of a row to E4M3 with scale amax / 448 (a block with a NaN gets a NaN scale);
//   weights: LaunchUnpackMoeWeightsPlainFp8 turns each row's four E8M0 32-block scales into one
//     scale per 128 (the largest of the four) and shifts the values of the other blocks by the
//     power of two between them, rounding to E4M3 (exact unless a value falls below E4M3's
//     normal range there).
// Not exact against the BF16 path: the activations carry E4M3's 3 mantissa bits (about 2-4%
// relative L2 on a layer; measured in tests/benchmarks/cuda/RESULTS.md). Hence opt-in.
//
// K of the FP8 path is padded to the 128-wide scale block with zeros.
inline constexpr int64_t kMoeFp8ScaleK = 128;
inline int64_t Fp8PaddedK(int64_t k) {
  return (k + kMoeFp8ScaleK - 1) / kMoeFp8ScaleK * kMoeFp8ScaleK;
}
// Plain FP8 weights (E4M3, row-major, K contiguous) and their scales (FP32, row index fastest:
// CUTLASS's MN-major scale layout):
//   w13 [E, 2 Ip, K1], K1 = Fp8PaddedK(Hp); w13 scales [E, K1 / 128, 2 Ip]
//   w2  [E, H, K2],    K2 = Fp8PaddedK(Ip); w2 scales  [E, K2 / 128, H]
inline int64_t PlainFp8W13ElemsPerExpert(const MoePackedLayout& l) {
  return 2 * l.intermediate_padded * Fp8PaddedK(l.hidden_padded);
}
inline int64_t PlainFp8W2ElemsPerExpert(const MoePackedLayout& l) {
  return l.hidden * Fp8PaddedK(l.intermediate_padded);
}

// Packed MXFP8 weights (LaunchPackMoeW13 / W2 layout, with scales) -> the plain FP8 layout above.
cudaError_t LaunchUnpackMoeWeightsPlainFp8(const uint8_t* packed_w13,
                                           const uint8_t* packed_w13_scale,
                                           const uint8_t* packed_w2, const uint8_t* packed_w2_scale,
                                           int64_t num_experts, const MoePackedLayout& layout,
                                           uint8_t* w13, float* w13_scale, uint8_t* w2,
                                           float* w2_scale, cudaStream_t stream);

// Activation scales of a grouped FP8 GEMM over K (kb = K / 128 blocks): expert e's rows
// [o, o + c) (o = offsets[e], c = counts[e]) own scales [o * kb, (o + c) * kb), row r of the
// expert's block j at o * kb + j * c + r (the expert's [kb, c] matrix, row index fastest).
//
// a1q[p, :] = E4M3(x[sorted_routes[p] / topk, :] / s[p, j]) for p < offsets[num_experts], K
// padded to kp = Fp8PaddedK(h) with zeros; s in the layout above. x [M, h] BF16, h % 8 == 0.
cudaError_t LaunchMoeGatherQuantizeRows(const uint16_t* x, const int32_t* sorted_routes,
                                        const int32_t* expert_counts, const int32_t* expert_offsets,
                                        int num_experts, int64_t max_rows, int topk, int64_t h,
                                        uint8_t* a1q, float* a1_scale, cudaStream_t stream);

// a2 = silu(d1[:, :ip]) * d1[:, ip:] (FP32) quantized as above to a2q [R, Fp8PaddedK(ip)] E4M3
// and its scales; d1 [R, 2 ip] BF16, ip % 8 == 0.
cudaError_t LaunchMoeSiluMulQuantize(const uint16_t* d1, const int32_t* expert_counts,
                                     const int32_t* expert_offsets, int num_experts,
                                     int64_t max_rows, int64_t ip, uint8_t* a2q, float* a2_scale,
                                     cudaStream_t stream);

// One grouped FP8 GEMM: for expert e with c = counts[e] rows from row o = offsets[e]:
//   d[o + i, j] = sum over K blocks b of sa(i, b) * sb_e(j, b) * sum_{k in b} a[o + i, k] * w_e[j,
//   k]
// a E4M3 [R, k] (lda = k), its scales as LaunchMoeGatherQuantizeRows lays them out; w_e = b +
// e * b_expert_stride E4M3 [n, k] (ldb = k), its scales b_scale + e * (k / 128) * n, [k / 128,
// n]; d BF16, rows ldd apart. k % 128 == 0, n % 8 == 0 (16-byte rows of d), ldd % 8 == 0.
struct MoeGroupedSm90Fp8Gemm {
  int num_experts = 0;
  const int32_t* expert_counts = nullptr;   // [E]
  const int32_t* expert_offsets = nullptr;  // [E]
  int64_t n = 0, k = 0;
  const uint8_t* a = nullptr;
  const float* a_scale = nullptr;
  const uint8_t* b = nullptr;
  const float* b_scale = nullptr;
  int64_t b_expert_stride = 0;  // elements
  uint16_t* d = nullptr;
  int64_t ldd = 0;
  int64_t total_rows_hint = 0;  // as MoeGroupedSm90Gemm's: picks the tile rows
};

size_t MoeGroupedSm90Fp8WorkspaceBytes(int num_experts, int num_sms);

// Asynchronous on `stream`; cudaErrorNotSupported where MoeGroupedSm90Unsupported(device) says so.
cudaError_t LaunchMoeGroupedSm90Fp8Gemm(const MoeGroupedSm90Fp8Gemm& g, void* workspace,
                                        size_t workspace_bytes, int device, int num_sms,
                                        cudaStream_t stream);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_CUH_
