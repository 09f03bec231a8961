// Grouped expert GEMMs for the MoE MLP on Hopper (sm_90a), BF16 tensor-core math with FP32
// accumulation, for BF16 weights and for MXFP8 weights (E4M3 values, one E8M0 scale per 32 along
// K) that are dequantized exactly to BF16 in registers right before the MMA.
//
// Swap-AB: weights fill the MMA's M side (128 weight rows per tile) and tokens its N side
// (16..256 tokens per tile), so decode-sized batches (1-64 tokens per expert) still stream every
// weight byte once, several stages in flight, over a persistent grid whose tile schedule is read
// on the device from per-expert counts (no host synchronization). Decode tiles have a producer
// warp (bulk copies and cp.async completing on mbarriers) beside 8 mma.sync warps (the MXFP8
// 32-token tile: 2 warpgroups issuing wgmma, kMxfp8DecodeWgmmaMinRoutes); from 32-33 routes per
// expert warpgroup-MMA (wgmma, sm_90a) tiles 64-256 tokens wide take over, with the
// (dequantized) A fragments in registers, software-pipelined (see docs/gpu.md).
//
// Weights live in a packed device layout made once by LaunchPackMoeW13 / LaunchPackMoeW2
// (see MoePackedLayout): K padded to a multiple of 64 and permuted inside each block of 32 so
// that every thread's MMA fragment is one contiguous 8-element load; W13 rows interleaved in
// groups of 8 (8 gate rows, then the 8 matching up rows) so SiLU-and-mul fuses into the first
// GEMM's epilogue from registers; values and scales stored tile by tile: each (expert, 128-row
// tile, 64 K) block is contiguous, [E][row tiles][K/64][2 x 32-K halves][128 rows][32], exactly a
// pipeline stage's shared-memory order, so a stage is one contiguous 8 KB (MXFP8) / 16 KB (BF16)
// copy.
//
// CPU twins: kernels/cpu/moe_routing_ref.h (MoeGroupedMlpRef for the pair of GEMMs,
// DequantizeMxfp8ToBf16Ref for the dequantization).
#ifndef MOESERVE_KERNELS_CUDA_MOE_GEMM_CUH_
#define MOESERVE_KERNELS_CUDA_MOE_GEMM_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moeserve::kernels {

inline constexpr int64_t kMoeGemmTileRows = 128;  // weight rows per tile (BM)
inline constexpr int64_t kMoeGemmTileK = 64;      // K per pipeline stage (BK)
// The largest E8M0 code whose MXFP8 blocks the decode GEMMs dequantize with one multiply
// (2^(code-7) must be a BF16 value); larger codes take a slower exact path (MoeGemmParams).
inline constexpr int kMxfp8NarrowScaleMax = 134;
// Average routes per expert from which the warpgroup-MMA tiles replace the mma.sync decode tiles,
// measured on the H200 (tests/benchmarks/cuda/RESULTS.md, 2026-12-02; seed layer). MXFP8: 64
// routes (256 tokens/rank) 615 us against 905 us, 32 routes 593 us against 514 us. BF16: 32
// routes 717 us against 764 us; at 16 the decode tile is at the HBM floor.
inline constexpr int kMxfp8WgmmaMinRoutes = 33;
// From this average of routes per expert, the MXFP8 32-token decode tile (17-32 routes) issues
// warpgroup MMAs (m64n32k16, A dequantized into registers) instead of mma.sync by default
// (MoeGemmParams::decode_mma). Measured on the H200 (tests/benchmarks/cuda/RESULTS.md,
// 2026-12-03 16:20-16:55): 96-128 tokens/rank 2-15% faster; the 16-token and adaptive tiles
// (1-64 tokens) were 1-15% slower in that form and keep mma.sync.
inline constexpr int kMxfp8DecodeWgmmaMinRoutes = 17;
inline constexpr int kBf16WgmmaMinRoutes = 32;
// The two-CTA cluster decode tile for MXFP8 (MoeGemmParams::decode_pair): both CTAs of a cluster
// take 16-token tiles of one schedule, and an expert of more than 16 routes has its weights
// multicast to both, so a hot expert rides in the same launch as the rest. Measured on the H200
// (tests/benchmarks/cuda/RESULTS.md, 2026-12-03 19:10 and 2026-12-04 01:35), against the narrow
// and adaptive decode launches: 1-48 tokens/rank (top-8 of 32 experts: up to 12 routes per
// expert) up to 16% faster (24-32 tokens hot 495 -> 431 us), 64 tokens hot and random 3-9%
// slower. So it serves by default up to 12 routes per expert.
inline constexpr int kMxfp8DecodePairMaxRoutes = 12;
inline constexpr bool kMxfp8DecodePairOnByDefault = true;

// MoeGemmParams::route_ids serve a W13 launch of at most this many routes.
inline constexpr int64_t kMoeGemmCountRoutesMax = 4096;

// Split-K workspace (MoeGemmParams::split_workspace): kMoeGemmSplitCounters int32 counters,
// then kMoeGemmSplitPartialFloats FP32 partial sums.
inline constexpr int kMoeGemmSplitCounters = 1024;
inline constexpr int64_t kMoeGemmSplitPartialFloats = int64_t{5} << 18;  // 5 MB
inline constexpr size_t kMoeGemmSplitWorkspaceBytes =
    sizeof(int32_t) * kMoeGemmSplitCounters + sizeof(float) * kMoeGemmSplitPartialFloats;

// Packed sizes for an expert MLP of hidden H and intermediate I.
struct MoePackedLayout {
  int64_t hidden = 0, intermediate = 0;
  int64_t hidden_padded = 0;        // Hp = roundup(H, 64): K of W13
  int64_t intermediate_padded = 0;  // Ip = roundup(I, 64): K of W2; W13 has 2 * Ip rows
  int64_t w2_rows = 0;              // roundup(H, 128)
  int64_t w13_elems_per_expert() const { return 2 * intermediate_padded * hidden_padded; }
  int64_t w2_elems_per_expert() const { return w2_rows * intermediate_padded; }
  // Scale bytes (MXFP8): one per 32 packed K values.
  int64_t w13_scales_per_expert() const { return w13_elems_per_expert() / 32; }
  int64_t w2_scales_per_expert() const { return w2_elems_per_expert() / 32; }
};
inline MoePackedLayout MakeMoePackedLayout(int64_t hidden, int64_t intermediate) {
  MoePackedLayout l;
  l.hidden = hidden;
  l.intermediate = intermediate;
  l.hidden_padded = (hidden + 63) / 64 * 64;
  l.intermediate_padded = (intermediate + 63) / 64 * 64;
  l.w2_rows = (hidden + 127) / 128 * 128;
  return l;
}

// Packs core/weights.h layouts (device pointers) into the kernel layout:
//   w13 [E, 2I, H] (+ w13_scale [E, 2I, ceil(H/32)]) -> packed E x 2Ip x Hp values (+ scales)
//   w2  [E, H, I]  (+ w2_scale  [E, H, ceil(I/32)])  -> packed E x w2_rows x Ip values (+ scales)
// in the tile-contiguous order above (not row-major [E, rows, K]).
// elem_bytes 2 (BF16; scales null) or 1 (E4M3; scales required). Padding is zero (scale 2^0).
// A 32-block holding an E4M3 NaN code gets scale code 255 (NaN): the GEMMs' integer
// dequantization has no NaN, and a NaN block gives its row the same NaN dot products.
// max_scale_code (optional, device int32, MXFP8 only): raised with atomicMax to the largest packed
// scale code, for MoeGemmParams::mxfp8_max_scale_code; initialize it (e.g. to 0) before.
cudaError_t LaunchPackMoeW13(const void* w13, const uint8_t* w13_scale, int64_t num_experts,
                             const MoePackedLayout& layout, int elem_bytes, void* packed,
                             uint8_t* packed_scale, cudaStream_t stream,
                             int32_t* max_scale_code = nullptr);
cudaError_t LaunchPackMoeW2(const void* w2, const uint8_t* w2_scale, int64_t num_experts,
                            const MoePackedLayout& layout, int elem_bytes, void* packed,
                            uint8_t* packed_scale, cudaStream_t stream,
                            int32_t* max_scale_code = nullptr);

// MXFP8 [rows, k] (+ scales [rows, ceil(k/32)]) to BF16 [rows, k], exact for every finite
// product within BF16's range (the E8M0 scale is a power of two).
cudaError_t LaunchDequantizeMxfp8ToBf16(const uint8_t* q, const uint8_t* scales, int64_t rows,
                                        int64_t k, uint16_t* out, cudaStream_t stream);

// Whether MXFP8 decode GEMMs run the two-CTA cluster tile (sm_90a builds).
enum class MoeDecodePair {
  kDefault,  // MOESERVE_DECODE_PAIR=1|0 if set (benchmarks' A/Bs: 1 = on up to 32 routes per
             // expert), else kMxfp8DecodePairOnByDefault up to kMxfp8DecodePairMaxRoutes
  kOff,
  kOn,  // every MXFP8 decode GEMM up to 32 routes per expert (tests)
};

// Which MMA the MXFP8 32-token decode tile issues (sm_90a builds; others always take mma.sync).
enum class MoeDecodeMma {
  kDefault,  // MOESERVE_DECODE_MMA=wgmma|sync if set (benchmarks' A/Bs), else by
             // kMxfp8DecodeWgmmaMinRoutes
  kMmaSync,
  kWgmma,
};

enum class MoeGemmKind {
  kGateUpSilu,  // packed W13 x activations -> silu(gate) * up, BF16 [rows, Ip]
  kDown,        // packed W2 x intermediate  -> FP32 [rows, H]
};

// One grouped GEMM over every local expert. For expert e and its j-th row (j < count):
//   row(e, j) = offsets[e] + j  (offsets null: e * offset_stride),
//   activation row = gather ? gather[row(e, j)] / gather_div : row(e, j)  (kGateUpSilu),
//   output row     = scatter ? scatter[row(e, j)] : row(e, j)             (kDown).
// kGateUpSilu writes act[row(e, j), 0 .. Ip) (BF16, columns >= I are 0); kDown writes
// out[output row, 0 .. H) (FP32). Counts are clamped to count_cap.
struct MoeGemmParams {
  MoeGemmKind kind = MoeGemmKind::kGateUpSilu;
  bool mxfp8 = false;
  int num_experts = 0;
  MoePackedLayout layout;
  const void* weights = nullptr;    // packed W13 or W2
  const uint8_t* scales = nullptr;  // packed scales (MXFP8)
  // The largest packed scale code (LaunchPackMoe* report it). Up to kMxfp8NarrowScaleMax the
  // decode tiles dequantize with one multiply; above it (the default: unknown) with two.
  int mxfp8_max_scale_code = 255;
  // From this average of routes per expert on, the warpgroup-MMA tiles (64, 128 or 256 tokens
  // wide by the average) instead of the mma.sync decode tiles, where built (sm_90a). 0: the
  // measured default of the format (kMxfp8WgmmaMinRoutes, kBf16WgmmaMinRoutes); negative or
  // above 128: only above 128 routes (where they always serve).
  int wgmma_min_routes = 0;
  MoeDecodeMma decode_mma = MoeDecodeMma::kDefault;
  MoeDecodePair decode_pair = MoeDecodePair::kDefault;
  const uint16_t* act = nullptr;  // BF16 activation rows
  int64_t act_stride = 0;         // elements between activation rows
  const int32_t* expert_counts = nullptr;
  const int32_t* expert_offsets = nullptr;
  int64_t offset_stride = 0;
  int32_t count_cap = 0x7fffffff;
  const int32_t* gather = nullptr;
  int gather_div = 1;
  const int32_t* scatter = nullptr;
  void* out = nullptr;
  int64_t out_stride = 0;  // elements between output rows
  // Host-side sizing hints (no device read): the most rows any one expert may have, and the
  // total rows over all experts. They choose the tile shape; max_rows_hint, when set, must
  // bound every count (launches for larger counts are skipped), total_rows_hint need not.
  int64_t max_rows_hint = 0;
  int64_t total_rows_hint = 0;
  // Optional, kMoeGemmSplitWorkspaceBytes of device memory whose counters are zero (cudaMemset
  // once; every launch leaves them zero). With it, the decode tiles split each unit's K over
  // several CTAs when the units are too few to fill the GPU (e.g. one token, or a narrow
  // intermediate): the last split to finish adds the partial sums in a fixed order and runs the
  // epilogue. One launch at a time per workspace (use one per stream).
  void* split_workspace = nullptr;
  // Programmatic dependent launch (kernels/cuda/pdl.cuh): the decode tiles read their schedule
  // and request their first pipeline stages of weights before they wait for the kernel before
  // them, so that those weights load while it drains. kDown: the counts, offsets and scatter
  // indices must have been written at least two kernels back on the stream, and the kernel just
  // before must wait before it lets this one start (every kernel here does): a W2 launched right
  // after the W13 that read the same counts. kGateUpSilu: only with route_ids, whose counts and
  // first rows (offsets = their exclusive prefix, count_cap unset) it computes itself; those ids
  // must be two kernels back: a W13 launched right after the MoeAlign of the same ids.
  // MOESERVE_W2_EARLY=0 / MOESERVE_W13_EARLY=0 / MOESERVE_EARLY_WEIGHTS=0 (both; read once)
  // turn it off, for A/B runs.
  bool weights_before_wait = false;
  // [num_routes] expert ids, as MoeAlign read them; ignored above kMoeGemmCountRoutesMax routes
  // (every CTA counts them).
  const int32_t* route_ids = nullptr;
  int64_t num_routes = 0;
};

// Asynchronous on `stream`. num_sms: the device's multiprocessor count (persistent grid).
cudaError_t LaunchMoeGroupedGemm(const MoeGemmParams& params, int num_sms, cudaStream_t stream);

// Whether LaunchMoeGroupedGemm(params) runs the MXFP8 32-token decode tile with warpgroup MMAs
// (host only; for tests and benchmarks).
bool MoeGemmUsesDecodeWgmma(const MoeGemmParams& params);

// Whether LaunchMoeGroupedGemm(params) runs the two-CTA cluster decode tile (host only; for tests
// and benchmarks).
bool MoeGemmUsesDecodePair(const MoeGemmParams& params);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_MOE_GEMM_CUH_
