#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/pdl.cuh"

namespace moeserve::kernels {
namespace {

constexpr int kBM = 128;
constexpr int kBK = 64;
constexpr int kThreads = 256;
constexpr int kMaxGemmExperts = 2048;

// Logical K (inside a block of 32) stored at packed position p. Thread t of an MMA quad reads
// packed [8 t, 8 t + 8): logical {2t, 2t+1, 2t+8, 2t+9, 2t+16, 2t+17, 2t+24, 2t+25}, its A
// fragments for two consecutive k16 MMAs. BF16 stores them in register order; E4M3 stores each
// half as {2t, 2t+8, 2t+1, 2t+9}, the byte order in which Fp8x4ToBf16 below yields the
// registers (2t, 2t+1) and (2t+8, 2t+9).
__host__ __device__ inline int PermutedK(int p, bool fp8) {
  const int t = p / 8, q = p % 8;
  if (!fp8) return 2 * t + (q % 2) + (q / 2) * 8;
  const int r = q % 4;
  return 2 * t + 16 * (q / 4) + r / 2 + 8 * (r % 2);
}

// ---------------------------------------------------------------------------------------------
// Packing.

template <typename T>
__global__ void PackKernel(const T* __restrict__ src, const uint8_t* __restrict__ src_scale,
                           int64_t num_experts, int64_t src_rows, int64_t k, int64_t rows,
                           int64_t kp, bool interleave_w13, int64_t half_rows, T* __restrict__ dst,
                           uint8_t* __restrict__ dst_scale, int32_t* __restrict__ max_scale_code) {
  // One thread per packed 32-block (32 values + 1 scale).
  uint32_t max_code = 0;
  const int64_t blocks_per_row = kp / 32;
  const int64_t total = num_experts * rows * blocks_per_row;
  const int64_t src_blocks = (k + 31) / 32;
  const int64_t num_kb = kp / kBK;
  const int64_t mtiles = rows / kBM;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i % blocks_per_row;
    const int64_t row = (i / blocks_per_row) % rows;
    const int64_t e = i / (blocks_per_row * rows);
    int64_t srow;
    if (interleave_w13) {  // 16-row groups: 8 gate rows, then the 8 matching up rows
      const int64_t j = (row / 16) * 8 + row % 8;
      srow = j < half_rows ? ((row % 16) < 8 ? j : half_rows + j) : -1;
    } else {
      srow = row < src_rows ? row : -1;
    }
    // Tile-contiguous: [E][mtiles][num_kb][kc = b % 2][BM rows][32], the order a pipeline stage
    // has in shared memory, so each stage is one contiguous copy.
    const int64_t t_mt = row / kBM, t_r = row % kBM, t_kb = b / 2, t_kc = b % 2;
    T* out = dst + ((((e * mtiles + t_mt) * num_kb + t_kb) * 2 + t_kc) * kBM + t_r) * 32;
    bool nan = false;  // an E4M3 NaN code (S.1111.111) in this block
    for (int p = 0; p < 32; ++p) {
      const int64_t kk = b * 32 + PermutedK(p, sizeof(T) == 1);
      T v = T(0);
      if (srow >= 0 && kk < k) v = src[(e * src_rows + srow) * k + kk];
      if (sizeof(T) == 1) nan |= (v & 0x7f) == 0x7f;
      out[p] = v;
    }
    if (dst_scale != nullptr) {
      uint8_t s = 127;
      if (srow >= 0 && b < src_blocks) s = src_scale[(e * src_rows + srow) * src_blocks + b];
      // The GEMMs' dequantization has no E4M3 NaN; a NaN scale makes the whole block NaN, which
      // gives the row the same (NaN) dot products as the one NaN value would.
      if (nan) s = 255;
      max_code = max(max_code, static_cast<uint32_t>(s));
      // Tile layout [E][mtiles][num_kb][BM][2].
      const int64_t mt = row / kBM, r = row % kBM, kb = b / 2;
      dst_scale[(((e * mtiles + mt) * num_kb + kb) * kBM + r) * 2 + (b % 2)] = s;
    }
  }
  if (max_scale_code != nullptr) {  // every thread gets here: one atomic per warp
    max_code = __reduce_max_sync(0xffffffffu, max_code);
    if (threadIdx.x % 32 == 0) atomicMax(max_scale_code, static_cast<int32_t>(max_code));
  }
}

cudaError_t LaunchPack(const void* src, const uint8_t* src_scale, int64_t num_experts,
                       int64_t src_rows, int64_t k, int64_t rows, int64_t kp, bool interleave,
                       int64_t half_rows, int elem_bytes, void* dst, uint8_t* dst_scale,
                       cudaStream_t stream, int32_t* max_scale_code) {
  if (elem_bytes != 1 && elem_bytes != 2) return cudaErrorInvalidValue;
  if (elem_bytes == 1 && (src_scale == nullptr || dst_scale == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = num_experts * rows * (kp / 32);
  if (total == 0) return cudaSuccess;
  const int blocks = static_cast<int>(total / 256 + 1 < 65535 ? total / 256 + 1 : 65535);
  if (elem_bytes == 2) {
    PackKernel<uint16_t><<<blocks, 256, 0, stream>>>(
        static_cast<const uint16_t*>(src), nullptr, num_experts, src_rows, k, rows, kp, interleave,
        half_rows, static_cast<uint16_t*>(dst), nullptr, nullptr);
  } else {
    PackKernel<uint8_t><<<blocks, 256, 0, stream>>>(
        static_cast<const uint8_t*>(src), src_scale, num_experts, src_rows, k, rows, kp, interleave,
        half_rows, static_cast<uint8_t*>(dst), dst_scale, max_scale_code);
  }
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Dequantization.

__device__ __forceinline__ float E8M0ToFloat(uint32_t code) {
  if (code == 255) return __uint_as_float(0x7fc00000u);            // NaN
  return __uint_as_float(code != 0 ? (code << 23) : 0x00400000u);  // 2^-127 is subnormal
}

// Two E4M3 values (low byte = lower k) times a power of two -> BF16x2, exact.
__device__ __forceinline__ uint32_t DequantPair(uint32_t two, float s) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * s, f.y * s);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// The GEMMs' dequantization (Fp8x4ToBf16) moves an E4M3 code's sign, exponent and mantissa into
// BF16's fields with integer ops only: read as BF16, the moved bits are the value times 2^-120,
// subnormals included: fewer instructions than cvt.e4m3x2, two conversions to FP32, two
// multiplies and a pack per pair. (The decode loop was bound by its instruction count; this and
// the counter-driven loads below took it from 53% to 74-78% of the HBM floor, docs/gpu.md.)
// The block scale 2^(code-127) then becomes a BF16 multiply by 2^(code-7): one IMAD makes the
// multiplier and one FMA applies it, for code <= kMxfp8NarrowScaleMax (134, the largest with
// 2^(code-7) in BF16's range; real checkpoints stay far below). The wide form, for any code,
// multiplies by 2^120 and then 2^(code-127) (NaN for 255); it always runs both, since a branch
// cost the wgmma kernel register spills.
struct Fp8Scale {
  uint32_t m1, m2;  // BF16x2 multipliers (m2: wide form only)
};
template <bool kWide>
__device__ __forceinline__ Fp8Scale MakeFp8Scale(uint32_t code) {
  if constexpr (!kWide) {
    return Fp8Scale{code * 0x00800080u + 120u * 0x00800080u, 0};
  } else {
    const bool twice = code > kMxfp8NarrowScaleMax;
    const uint32_t b1 = twice ? (247u << 7) : ((code + 120u) << 7);
    const uint32_t b2 = !twice ? 0x3f80u : code == 255 ? 0x7fc0u : (code << 7);
    return Fp8Scale{b1 | (b1 << 16), b2 | (b2 << 16)};
  }
}

// a * b per BF16 lane, rounded once (adding -0 keeps every product, -0 included).
__device__ __forceinline__ uint32_t Bf16x2Mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// Four E4M3 codes [b0 b1 b2 b3] (b0 the lowest byte) times the block scale -> BF16x2 lo = (b0,
// b2) and hi = (b1, b3), exact (rounded as the FP32 product rounds to BF16).
template <bool kWide>
__device__ __forceinline__ void Fp8x4ToBf16(uint32_t q, const Fp8Scale& s, uint32_t& lo,
                                            uint32_t& hi) {
  hi = Bf16x2Mul((q & 0x80008000u) | ((q >> 4) & 0x07f007f0u), s.m1);
  lo = Bf16x2Mul(((q << 8) & 0x80008000u) | ((q << 4) & 0x07f007f0u), s.m1);
  if constexpr (kWide) {
    hi = Bf16x2Mul(hi, s.m2);
    lo = Bf16x2Mul(lo, s.m2);
  }
}

// One MMA warp's A fragments of a 32-K half of a packed E4M3 weight tile: `ra`, `rb` are its
// 8 bytes of rows r and r + 8 (the packed order), `code_a`, `code_b` those rows' E8M0 scale codes;
// a[ks] are the fragments of the half's two k16 steps (rows r, r + 8 in mma.sync's / wgmma's
// register order). Shared by the decode tiles (both MMA forms) and the wide wgmma tiles.
template <bool kWide>
__device__ __forceinline__ void Fp8HalfFragments(uint2 ra, uint2 rb, uint32_t code_a,
                                                 uint32_t code_b, uint32_t (&a)[2][4]) {
  const Fp8Scale fa = MakeFp8Scale<kWide>(code_a), fb = MakeFp8Scale<kWide>(code_b);
  Fp8x4ToBf16<kWide>(ra.x, fa, a[0][0], a[0][2]);
  Fp8x4ToBf16<kWide>(rb.x, fb, a[0][1], a[0][3]);
  Fp8x4ToBf16<kWide>(ra.y, fa, a[1][0], a[1][2]);
  Fp8x4ToBf16<kWide>(rb.y, fb, a[1][1], a[1][3]);
}

__global__ void DequantKernel(const uint8_t* __restrict__ q, const uint8_t* __restrict__ scales,
                              int64_t rows, int64_t k, uint16_t* __restrict__ out) {
  const int64_t blocks = (k + 31) / 32;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * k;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k, c = i % k;
    const uint32_t v = DequantPair(q[i], E8M0ToFloat(scales[r * blocks + c / 32]));
    out[i] = static_cast<uint16_t>(v & 0xffffu);
  }
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM.

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void Mma(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void Ldmatrix4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// mbarrier and bulk copy (TMA without a tensor map, sm_90): one instruction moves a contiguous
// range into shared memory and reports its bytes to an mbarrier.
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once this thread's earlier cp.async copies have landed (counts as one of the
// barrier's expected arrivals).
__device__ __forceinline__ void CpAsyncArriveNoinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, uint32_t bytes,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

struct Unit {
  int e = 0, mt = 0, nt = 0, cnt = 0, row0 = 0;
};

// The expert that work unit `u` belongs to: the last e with prefix[e] <= u, where prefix[e] is
// the number of units before expert e (non-decreasing; an expert without units shares the next
// one's prefix, and the search passes over it).
__device__ __forceinline__ int ExpertOfUnit(const int32_t* prefix, int num_experts, int u) {
  int lo = 0, hi = num_experts;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= u)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The persistent grids' schedule, in shared memory. Every thread: each expert's count, clamped
// to [0, count_cap], and its first route row.
__device__ __forceinline__ void LoadExpertCounts(const MoeGemmParams& p, int32_t* s_cnt,
                                                 int32_t* s_row0) {
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) {
    int c = p.expert_counts[e];
    c = c < 0 ? 0 : (c > p.count_cap ? p.count_cap : c);
    s_cnt[e] = c;
    s_row0[e] = p.expert_offsets != nullptr ? p.expert_offsets[e]
                                            : static_cast<int32_t>(e * p.offset_stride);
  }
}
// Warp 0, once the counts are in shared memory: s_prefix[e] = the work units before expert e
// (units_of(count) per expert), s_prefix[E] = all of them and, with kMost, s_prefix[E + 1] = the
// largest count.
// kTotal false: s_prefix[E] is not written (an array of E entries).
template <bool kMost, bool kTotal = true, class UnitsOf>
__device__ __forceinline__ void PrefixUnits(const int32_t* s_cnt, int32_t* s_prefix, int E,
                                            int lane, UnitsOf units_of) {
  const int chunk = (E + 31) / 32;
  const int lo = lane * chunk, hi = min(E, lo + chunk);
  int sum = 0, most = 0;
  for (int e = lo; e < hi; ++e) {
    sum += units_of(s_cnt[e]);
    if (kMost) most = max(most, s_cnt[e]);
  }
  int inc = sum;
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += v;
  }
  if (kMost) most = __reduce_max_sync(0xffffffffu, most);
  int run = inc - sum;
  for (int e = lo; e < hi; ++e) {
    s_prefix[e] = run;
    run += units_of(s_cnt[e]);
  }
  if (lane == 31) {
    if (kTotal) s_prefix[E] = inc;
    if (kMost) s_prefix[E + 1] = most;
  }
}

// kGateUpSilu with p.route_ids: the counts and first rows that MoeAlign writes for those ids
// (an id outside [0, num_experts) serves no expert), computed here so that they need not wait
// for it. Every thread of the block calls it; s_row0 is complete after the next __syncthreads.
__device__ __forceinline__ void CountRouteIds(const MoeGemmParams& p, int32_t* s_cnt,
                                              int32_t* s_row0) {
  const int E = p.num_experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_cnt[e] = 0;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < p.num_routes; r += blockDim.x) {
    const int id = __ldcg(p.route_ids + r);
    if (id >= 0 && id < E) atomicAdd(&s_cnt[id], 1);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    PrefixUnits<false, false>(s_cnt, s_row0, E, static_cast<int>(threadIdx.x),
                              [](int c) { return c; });
  }
}

// Whether a decode launch (with a producer warp) reads its schedule's counts and requests its
// first weight stages before PdlWait (MoeGemmParams::weights_before_wait: W2 from the align's
// counts, complete once W13 has started; W13 from route ids it counts itself). A launch that does
// not waits here and lets its dependents start. Either way every CTA waits before it exits.
template <MoeGemmKind KIND>
__device__ __forceinline__ bool WaitUnlessEarly(const MoeGemmParams& p, bool producer_warp) {
  const bool early = producer_warp && p.weights_before_wait &&
                     (KIND == MoeGemmKind::kDown || p.route_ids != nullptr);
  if (!early) {
    PdlWait();
    PdlLaunchDependents();
  }
  return early;
}

// The schedule's per-expert counts and first rows: counted from the route ids by an early W13,
// else read from the align's outputs.
template <MoeGemmKind KIND>
__device__ __forceinline__ void ScheduleCounts(const MoeGemmParams& p, bool early, int32_t* s_cnt,
                                               int32_t* s_row0) {
  if (KIND == MoeGemmKind::kGateUpSilu && early) {
    CountRouteIds(p, s_cnt, s_row0);
  } else {
    LoadExpertCounts(p, s_cnt, s_row0);
  }
}

// The epilogue's store of one accumulator pair of route row `row` (both GEMM tile kinds): an MMA
// thread holds weight rows r and r + 8 of a column. W13: rows r, r + 8 are the gate and up rows
// of intermediate column r / 2 (packed 8 gate / 8 up), stored as BF16 SiLU(gate) * up. W2: hidden
// columns r and r + 8 of output row scatter[row] (FP32), those inside the layer's hidden size.
template <MoeGemmKind KIND>
__device__ __forceinline__ void StoreAccPair(const MoeGemmParams& p, int64_t row, int64_t r,
                                             float lo, float hi) {
  if constexpr (KIND == MoeGemmKind::kGateUpSilu) {
    const float v = lo / (1.0f + __expf(-lo)) * hi;
    // r = 16 q + g' with g' < 8: intermediate column 8 q + g' = (r - g') / 2 + g'.
    const int64_t j = (r & ~int64_t{15}) / 2 + (r & 7);
    static_cast<__nv_bfloat16*>(p.out)[row * p.out_stride + j] = __float2bfloat16_rn(v);
  } else {
    const int64_t orow = p.scatter != nullptr ? p.scatter[row] : row;
    float* o = static_cast<float*>(p.out) + orow * p.out_stride;
    if (r < p.layout.hidden) o[r] = lo;
    if (r + 8 < p.layout.hidden) o[r + 8] = hi;
  }
}

// Split-K bounds: a split streams at least kMinSplitStages pipeline stages (its fill and the
// partial's round trip through L2 must stay small next to it), and the last split reads every
// other split's partial, so at most kMaxSplits of them.
constexpr int kMinSplitStages = 4;
constexpr int kMaxSplits = 16;
// The decode tiles' split-K bounds as launched: `slots` CTA slots to fill, at least `min_stages`
// stages per split, at most `max_splits` splits (at most kMaxSplitsCap: the last split's reads).
struct SplitK {
  int slots, min_stages, max_splits;
};
constexpr int kMaxSplitsCap = 64;
// MOESERVE_SPLIT_K="MIN_STAGES,MAX_SPLITS,BF16_SLOTS_PER_SM" (read once; for benchmarks' A/Bs),
// else kMinSplitStages, kMaxSplits and one BF16 CTA per SM. A malformed value is ignored with a
// line on stderr, so that an A/B never reads the defaults as its variant unawares.
struct SplitKTuning {
  int min_stages = kMinSplitStages, max_splits = kMaxSplits, bf16_slots_per_sm = 1;
};
const SplitKTuning& SplitKFromEnv() {
  static const SplitKTuning t = [] {
    SplitKTuning v;
    const char* e = std::getenv("MOESERVE_SPLIT_K");
    if (e == nullptr) return v;
    int a = 0, b = 0, c = 0;
    if (std::sscanf(e, "%d,%d,%d", &a, &b, &c) == 3 && a >= 1 && b >= 1 && b <= kMaxSplitsCap &&
        (c == 1 || c == 2)) {
      v = SplitKTuning{a, b, c};
    } else {
      std::fprintf(stderr,
                   "MOESERVE_SPLIT_K=\"%s\" ignored: expected MIN_STAGES,MAX_SPLITS,"
                   "BF16_SLOTS_PER_SM with MIN_STAGES >= 1, 1 <= MAX_SPLITS <= %d and "
                   "BF16_SLOTS_PER_SM 1 or 2\n",
                   e, kMaxSplitsCap);
    }
    return v;
  }();
  return t;
}

// A barrier for `count` threads of the block (warps that have exited do not count).
__device__ __forceinline__ void NamedBarrierSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Warpgroup MMA (wgmma, sm_90a) helpers: the decode tiles (kWg) and the wide tiles below.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOESERVE_WGMMA_DEVICE 1
#endif

__device__ __forceinline__ void WgmmaFence() {
#ifdef MOESERVE_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void WgmmaCommit() {
#ifdef MOESERVE_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
#ifdef MOESERVE_WGMMA_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
__device__ __forceinline__ void WgmmaFenceOperands(float* d, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ uint32_t LdSharedU16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint2 LdSharedV2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 LdSharedV4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void FenceProxyAsyncShared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#ifdef MOESERVE_WGMMA_DEVICE
// m64n32k16: the MXFP8 32-token decode tile.
__device__ __forceinline__ void Wgmma32(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void Wgmma64(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void Wgmma128(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

__device__ __forceinline__ void Wgmma256(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
      "}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
#endif

template <int BN>
__device__ __forceinline__ void Wgmma(float* d, const uint32_t* a, uint64_t desc) {
#ifdef MOESERVE_WGMMA_DEVICE
  static_assert(BN == 32 || BN == 64 || BN == 128 || BN == 256, "no wgmma wrapper for this N");
  if constexpr (BN == 32) Wgmma32(d, a, desc);
  if constexpr (BN == 64) Wgmma64(d, a, desc);
  if constexpr (BN == 128) Wgmma128(d, a, desc);
  if constexpr (BN == 256) Wgmma256(d, a, desc);
#else
  __trap();  // not built for sm_90a: the host launches this path only on sm_90 (WgmmaOnThisDevice)
#endif
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t SmemDescSw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

// KB: 64-K blocks per pipeline stage (2 only with kTma): a stage is KB consecutive packed blocks,
// one contiguous copy, and its activation rows are KB x 64 wide.
// kWg (decode tiles with the producer warp): the MMA warps issue warpgroup MMAs (m64nBNk16,
// A fragments from registers) instead of mma.sync, and a stage holds the activations first, as
// KB blocks of [BN rows][64 K] in the 128-byte swizzled K-major layout (row n at n * 128, its
// 16-byte chunk c at (c ^ (n % 8)) * 16), 1024-aligned; then the weights and their scales.
template <bool kFp8, int BN, int WM, int WN, int STAGES, MoeGemmKind KIND, int KB = 1,
          bool kWg = false>
struct GemmCfg {
  static constexpr int kEsize = kFp8 ? 1 : 2;
  static constexpr int kABlock = kBM * kBK * kEsize;  // one 64-K block of the weight tile
  static constexpr int kSBlock = kFp8 ? kBM * 2 : 0;  // its scales
  static constexpr int kABytes = kABlock * KB;
  static constexpr int kSBytes = kSBlock * KB;
  // mma.sync: BF16 per B row (16 B pad: no bank conflicts).
  static constexpr int kBStride = kBK * KB + 8;
  static constexpr int kBSub = BN * kBK * 2;  // kWg: one 64-K block of activations
  static constexpr int kBBytes = kWg ? kBSub * KB : BN * kBStride * 2;
  // Byte offsets inside a stage: weights (A), their scales (S), activations (B).
  static constexpr int kAOff = kWg ? kBBytes : 0;
  static constexpr int kSOff = kAOff + kABytes;
  static constexpr int kBOff = kWg ? 0 : kABytes + kSBytes;
  static constexpr int kStageAlign = kWg ? 1024 : 128;
  static constexpr int kStageBytes =
      (kABytes + kSBytes + kBBytes + kStageAlign - 1) / kStageAlign * kStageAlign;
  static constexpr int kPipeBytes = kStageBytes * STAGES;
  static constexpr int kWTM = kBM / WM, kWTN = BN / WN;
  static constexpr int kMI = kWTM / 16, kNI = kWTN / 8;
  static constexpr int kBChunks = (BN * 8 + kThreads - 1) / kThreads;
  static_assert(WM * WN * 32 == kThreads, "8 warps");
  static_assert(kNI % 2 == 0, "ldmatrix.x4 loads two n-fragments");
  static_assert(!kWg || (WM == 8 && KB == 2 && (BN == 32 || BN == 64)),
                "warpgroup-MMA decode tiles: 16 rows per warp, two 64-K blocks per stage");
  static constexpr int kBarBytes = 2 * STAGES * 8;  // kTma: full and empty mbarrier per stage
  static size_t SmemBytes(int num_experts) {
    return (kWg ? 1024 : 0) + kPipeBytes + kBarBytes +
           static_cast<size_t>(3 * num_experts + 3) * sizeof(int32_t);
  }
};

// kAdaptive: each stage runs the math of 16, 32 or all of a warp's token columns, three
// straight-line variants chosen once per stage by the tile's live columns (branches inside the
// unrolled MMA loops cost more than they saved). A wide adaptive tile serves a hot expert and
// its cold neighbours alike, and the hot expert's weights stream once; for balanced routing the
// fixed narrow tile is 5-11% faster. `gate`: the kernel returns at once unless its expert counts'
// maximum is above gate.x and at most gate.y, so that a narrow and a wide launch can be queued
// together and the counts (on the device) choose which one works. (Splitting the experts
// between the two launches by their counts measured no better: cuda/RESULTS.md, 2026-12-03 07:00.)
// kTma: a ninth warp produces: one bulk copy (TMA) for each stage's weight tile and one for its
// scales, cp.async for the activation rows, completing on the stage's "full" mbarrier; the 8 MMA
// warps wait on it and release the slot on its "empty" mbarrier, so they issue no load
// instructions and meet at no block barrier. Per-thread cp.async took 54 of the MXFP8 decode
// loop's ~185 instructions per stage per warp, and that loop is bound by its instruction count
// (docs/gpu.md).
// kWg (GemmCfg): the MMA warps issue one warpgroup MMA per 16 K where mma.sync took one per 8
// tokens, and a 32-K half's MMAs run while the next half is dequantized (two sets of A
// registers); a stage's slot is released once its MMAs have completed.
template <bool kFp8, bool kWide, int BN, int WM, int WN, int STAGES, MoeGemmKind KIND,
          bool kAdaptive, bool kTma, int KB, bool kWg = false>
__global__ void __launch_bounds__(kTma ? kThreads + 32 : kThreads, BN <= 32 ? 2 : 1)
    MoeGemmKernel(const MoeGemmParams p, int2 gate, SplitK split) {
  static_assert(KB == 1 || (KB == 2 && kTma), "two-block stages need the producer warp");
  static_assert(!kAdaptive || kTma, "the adaptive tile is a decode (producer warp) tile");
  static_assert(!kWg || kTma, "the warpgroup-MMA decode tile has a producer warp");
  // Launched early (LaunchPdl): what the kernels before wrote is read only after PdlWait.
  const bool early = WaitUnlessEarly<KIND>(p, kTma);
  using C = GemmCfg<kFp8, BN, WM, WN, STAGES, KIND, KB, kWg>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // kWg: the swizzled activation blocks need 1024-byte alignment (SmemBytes reserves it).
  unsigned char* const smem =
      kWg ? reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                             ~static_cast<uintptr_t>(1023))
          : smem_raw;
  const int E = p.num_experts;
  // kTma: stage s's full mbarrier at full0 + 8 s, its empty one at empty0 + 8 s.
  const uint32_t full0 = SmemAddr(smem + C::kPipeBytes), empty0 = full0 + 8 * STAGES;
  int32_t* s_cnt = reinterpret_cast<int32_t*>(smem + C::kPipeBytes + C::kBarBytes);
  int32_t* s_row0 = s_cnt + E;
  int32_t* s_prefix = s_row0 + E;  // [E + 1] units before expert e

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const bool gate_up = KIND == MoeGemmKind::kGateUpSilu;
  const int64_t kp = gate_up ? p.layout.hidden_padded : p.layout.intermediate_padded;
  const int64_t rows_packed = gate_up ? 2 * p.layout.intermediate_padded : p.layout.w2_rows;
  const int64_t k_valid = gate_up ? p.layout.hidden : p.layout.intermediate_padded;
  const int mtiles = static_cast<int>(rows_packed / kBM);
  const int num_kb = static_cast<int>(kp / kBK);

  ScheduleCounts<KIND>(p, early, s_cnt, s_row0);
  if (kTma && tid < STAGES) {
    MbarInit(full0 + 8 * tid, 32);         // the producer's 32 lanes (cp.async arrivals)
    MbarInit(empty0 + 8 * tid, kThreads);  // every MMA thread
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    PrefixUnits<true>(s_cnt, s_prefix, E, lane, [&](int c) { return (c + BN - 1) / BN * mtiles; });
  }
  __syncthreads();
  const int total_units = s_prefix[E];
  if (s_prefix[E + 1] <= gate.x || s_prefix[E + 1] > gate.y) {
    if (early) PdlWait();
    return;
  }
  const int num_st = (num_kb + KB - 1) / KB;  // stages per unit; the last may hold one block
  // Split-K (decode tiles, with a workspace): when the units cannot fill the `split.slots` CTA
  // slots (a few experts of long K, e.g. one token), each unit's stages are split over `splits`
  // CTAs. Every CTA computes the same value from the same counts.
  int splits = 1;
  if constexpr (kTma) {
    if (p.split_workspace != nullptr && total_units > 0 && total_units <= kMoeGemmSplitCounters) {
      const int64_t by_mem =
          kMoeGemmSplitPartialFloats / (static_cast<int64_t>(total_units) * kBM * BN);
      splits = min(min(split.slots / total_units, num_st / split.min_stages),
                   static_cast<int>(by_mem < split.max_splits ? by_mem : split.max_splits));
      splits = max(splits, 1);
    }
  }
  const int total_items = total_units * splits;
  if (static_cast<int>(blockIdx.x) >= total_items) {
    if (early) PdlWait();
    return;
  }
  const int my_items = (total_items - blockIdx.x + gridDim.x - 1) / gridDim.x;
  // Item i of this CTA: unit (w / splits), stages [lo, hi) of its split (w % splits).
  auto item_of = [&](int i) {
    return static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x);
  };
  auto split_lo = [&](int w) { return (w % splits) * num_st / splits; };
  auto split_hi = [&](int w) { return (w % splits + 1) * num_st / splits; };
  const int total_iters = my_items * num_st;  // !kTma (never split)

  auto decode = [&](int u) {
    const int lo = ExpertOfUnit(s_prefix, E, u);
    Unit un;
    un.e = lo;
    un.cnt = s_cnt[lo];
    un.row0 = s_row0[lo];
    const int ntn = (un.cnt + BN - 1) / BN;
    const int local = u - s_prefix[lo];
    un.mt = local / ntn;
    un.nt = local % ntn;
    return un;
  };

  // Producer state. Loads run in order, STAGES - 1 ahead of use, so counters and pointer
  // increments replace the divisions and 64-bit address math of each stage (they were a quarter
  // of the MXFP8 decode loop's instructions).
  const unsigned char* a_ptr = nullptr;
  const uint8_t* s_ptr = nullptr;
  // A unit's first weight block and its scales, and the activation row of its j-th token.
  auto unit_weights = [&](const Unit& pu) {
    const int64_t tile = static_cast<int64_t>(pu.e) * mtiles + pu.mt;
    a_ptr = static_cast<const unsigned char*>(p.weights) + tile * num_kb * C::kABlock;
    if (kFp8) s_ptr = p.scales + tile * num_kb * C::kSBlock;
  };
  auto act_row = [&](const Unit& pu, int j) {
    const int row = pu.row0 + j;
    const int64_t arow = p.gather != nullptr ? p.gather[row] / p.gather_div : row;
    return p.act + arow * p.act_stride;
  };
  const uint16_t* b_ptr[C::kBChunks];  // this thread's activation row + its 8-element chunk
  int p_it = 0, p_unit = 0, p_kb = 0, p_slot = 0, p_k = 0;
  const int b_cc = tid % 8;
  auto producer_unit = [&](int i) {
    const Unit pu = decode(item_of(i));
    unit_weights(pu);
#pragma unroll
    for (int i2 = 0; i2 < C::kBChunks; ++i2) {
      const int c = tid + i2 * kThreads;
      const int j = pu.nt * BN + c / 8;
      b_ptr[i2] = c < BN * 8 && j < pu.cnt ? act_row(pu, j) + b_cc * 8 : nullptr;
    }
  };
  auto load = [&]() {
    if (p_it < total_iters) {
      if (p_kb == 0) {
        producer_unit(p_unit);
        p_k = b_cc * 8;
      }
      unsigned char* st = smem + p_slot * C::kStageBytes;
      const uint32_t a_dst = SmemAddr(st);
#pragma unroll
      for (int i2 = 0; i2 < C::kABytes / 16 / kThreads; ++i2) {
        const int c = tid + i2 * kThreads;
        CpAsync16(a_dst + c * 16, a_ptr + c * 16, 16);
      }
      if (kFp8 && tid < 16) CpAsync16(SmemAddr(st + C::kSOff) + tid * 16, s_ptr + tid * 16, 16);
      const uint32_t b_dst = SmemAddr(st + C::kBOff);
      const bool k_ok = p_k < k_valid;
#pragma unroll
      for (int i2 = 0; i2 < C::kBChunks; ++i2) {
        const int c = tid + i2 * kThreads;
        if (c < BN * 8) {
          const bool ok = b_ptr[i2] != nullptr && k_ok;
          CpAsync16(b_dst + ((c / 8) * C::kBStride + b_cc * 8) * 2, ok ? b_ptr[i2] : p.act,
                    ok ? 16 : 0);
          if (b_ptr[i2] != nullptr) b_ptr[i2] += kBK;
        }
      }
      a_ptr += C::kABytes;
      if (kFp8) s_ptr += kBM * 2;
      p_k += kBK;
      if (++p_kb == num_kb) {
        p_kb = 0;
        ++p_unit;
      }
      p_slot = p_slot + 1 == STAGES ? 0 : p_slot + 1;
      ++p_it;
    }
    CpAsyncCommit();
  };

  if constexpr (kTma) {
    if (warp == kThreads / 32) {
      // The producer warp. Lane l loads the activation chunks c = l + 32 i of each stage (row
      // c / kRowChunks, 16-byte K chunk l % kRowChunks); lane 0 also the weight tile and its
      // scales, one bulk copy each. Rows past the expert's count: zero-filled, or (kAdaptive) not
      // loaded, since their columns are not computed; K past the layer's width: zero-filled.
      constexpr int kRowChunks = 8 * KB;
      constexpr int kChunks = BN * kRowChunks / 32;
      constexpr int kRowStep = 32 / kRowChunks;
      static_assert(BN * kRowChunks % 32 == 0 && 32 % kRowChunks == 0, "");
      const uint16_t* src[kChunks];  // this lane's chunk of each row (p.act past the count)
      uint32_t src_bytes[kChunks];   // 16, or 0 past the count
      const int cc = lane % kRowChunks;
      // The weights of stages [0, pre) were requested before PdlWait (p.weights_before_wait):
      // weights never depend on the kernels before, so their first stages load while those end.
      int pre = 0;
      if (early) {
#pragma unroll 1
        for (int item = 0; item < my_items && pre < STAGES; ++item) {
          const int w = item_of(item);
          const int kb_lo = split_lo(w), kb_hi = split_hi(w);
          unit_weights(decode(w / splits));
          a_ptr += static_cast<int64_t>(kb_lo) * C::kABytes;
          if (kFp8) s_ptr += static_cast<int64_t>(kb_lo) * C::kSBytes;
#pragma unroll 1
          for (int kb = kb_lo; kb < kb_hi && pre < STAGES; ++kb, ++pre) {
            const int nblk = KB == 2 && 2 * kb + 1 == num_kb ? 1 : KB;
            if (lane == 0) {
              const uint32_t full = full0 + 8 * pre;
              unsigned char* st = smem + pre * C::kStageBytes;
              MbarExpectTx(full, (C::kABlock + C::kSBlock) * nblk);
              BulkCopy(SmemAddr(st + C::kAOff), a_ptr, C::kABlock * nblk, full);
              if (kFp8) BulkCopy(SmemAddr(st + C::kSOff), s_ptr, C::kSBlock * nblk, full);
            }
            a_ptr += C::kABytes;
            if (kFp8) s_ptr += C::kSBytes;
          }
        }
        PdlWait();
        PdlLaunchDependents();
      }
      int it = 0, slot = 0;
#pragma unroll 1
      for (int item = 0; item < my_items; ++item) {
        const int w = item_of(item);
        const int kb_lo = split_lo(w), kb_hi = split_hi(w);
        const Unit pu = decode(w / splits);
        unit_weights(pu);
        a_ptr += static_cast<int64_t>(kb_lo) * C::kABytes;
        if (kFp8) s_ptr += static_cast<int64_t>(kb_lo) * C::kSBytes;
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const int j = pu.nt * BN + lane / kRowChunks + kRowStep * i;
          src[i] = p.act;
          src_bytes[i] = 0;
          if (j < pu.cnt) {
            src[i] = act_row(pu, j) + cc * 8 + static_cast<int64_t>(kb_lo) * KB * kBK;
            src_bytes[i] = 16;
          }
        }
#pragma unroll 1
        for (int kb = kb_lo; kb < kb_hi; ++kb, ++it) {
          if (it >= STAGES) MbarWait(empty0 + 8 * slot, ((it / STAGES) & 1) ^ 1);
          // The last stage of a unit with an odd number of 64-K blocks holds one.
          const int nblk = KB == 2 && 2 * kb + 1 == num_kb ? 1 : KB;
          unsigned char* st = smem + slot * C::kStageBytes;
          const uint32_t full = full0 + 8 * slot;
          if (lane == 0 && it >= pre) {
            MbarExpectTx(full, (C::kABlock + C::kSBlock) * nblk);
            BulkCopy(SmemAddr(st + C::kAOff), a_ptr, C::kABlock * nblk, full);
            if (kFp8) BulkCopy(SmemAddr(st + C::kSOff), s_ptr, C::kSBlock * nblk, full);
          }
          const uint32_t b_dst = SmemAddr(st + C::kBOff);
          const bool k_ok = static_cast<int64_t>(kb) * KB * kBK + cc * 8 < k_valid && cc < 8 * nblk;
#pragma unroll
          for (int i = 0; i < kChunks; ++i) {
            const int n = lane / kRowChunks + kRowStep * i;
            const uint32_t dst =
                kWg ? b_dst + (cc / 8) * C::kBSub + n * 128 + (((cc % 8) ^ (n % 8)) << 4)
                    : b_dst + (n * C::kBStride + cc * 8) * 2;
            if (!kAdaptive || src_bytes[i] != 0) CpAsync16(dst, src[i], k_ok ? src_bytes[i] : 0);
            src[i] += src_bytes[i] != 0 ? KB * kBK : 0;
          }
          CpAsyncArriveNoinc(full);
          a_ptr += C::kABytes;
          if (kFp8) s_ptr += C::kSBytes;
          slot = slot + 1 == STAGES ? 0 : slot + 1;
        }
      }
      CpAsyncWait<0>();
      return;
    }
  }
  if (early) {  // the MMA threads: nothing to read before the producer's stages, but outputs
    PdlWait();
    PdlLaunchDependents();
  }

  float acc[C::kMI][C::kNI][4];
  auto zero_acc = [&]() {
#pragma unroll
    for (int mi = 0; mi < C::kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < C::kNI; ++ni)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;
  };
  zero_acc();

  const int warp_m = warp % WM, warp_n = warp / WM;
  const int g = lane / 4, t4 = lane % 4;

  if constexpr (!kTma) {
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) load();
  }
  uint32_t c_phase = 0;

  int c_slot = 0;
  const int wcol0 = (warp / WM) * C::kWTN;
  // kWg: a warp-uniform bound (see below).
  const int c_items = kWg ? __shfl_sync(0xffffffffu, my_items, 0) : my_items;
#pragma unroll 1
  for (int item = 0; item < c_items; ++item) {
    const int w = item_of(item);
    const Unit cu = decode(w / splits);
    const int tile_cols = min(BN, cu.cnt - cu.nt * BN) - wcol0;  // this warp's live columns
    const int kb_hi = split_hi(w);
    if constexpr (kWg) {
      // Bounds from shuffles and parameters: ptxas serializes warpgroup MMAs behind branches it
      // cannot prove warp-uniform (C7518).
      const int kb_lo_u = __shfl_sync(0xffffffffu, split_lo(w), 0);
      const int kb_hi_u = __shfl_sync(0xffffffffu, kb_hi, 0);
      // Groups of two MMAs (one 32-K half of a 64-K block) alternate between two sets of A
      // registers: a group is dequantized while the previous one's MMAs run.
      uint32_t a[2][2][4];  // [32-K half][k16 step][fragment]
      const int r0 = warp * 16 + g;
      int held = -1;  // a slot whose last MMAs may still be reading it
#pragma unroll 1
      for (int c_kb = kb_lo_u; c_kb < kb_hi_u; ++c_kb) {
        MbarWait(full0 + 8 * c_slot, c_phase);
        FenceProxyAsyncShared();  // the producer's cp.async rows -> read by the tensor cores
        const uint32_t st = SmemAddr(smem + c_slot * C::kStageBytes);
        // Block sb's 32-K half kc: dequantize into a[kc], issue, commit.
        auto group = [&](auto sb_c, auto kc_c) {
          constexpr int SB = decltype(sb_c)::value, KC = decltype(kc_c)::value;
          const uint32_t sa = st + C::kAOff + SB * C::kABlock;
          const uint32_t ss = st + C::kSOff + SB * C::kSBlock;
          const uint32_t c0 = LdSharedU16(ss + r0 * 2), c1 = LdSharedU16(ss + (r0 + 8) * 2);
          const uint2 ra = LdSharedV2(sa + (KC * kBM + r0) * 32 + t4 * 8);
          const uint2 rb = LdSharedV2(sa + (KC * kBM + r0 + 8) * 32 + t4 * 8);
          Fp8HalfFragments<kWide>(ra, rb, KC == 0 ? c0 & 0xffu : c0 >> 8,
                                  KC == 0 ? c1 & 0xffu : c1 >> 8, a[KC]);
          const uint64_t desc = SmemDescSw128(st + C::kBOff + SB * C::kBSub);
          WgmmaFence();  // the new A registers (and zeroed accumulators) before the MMAs
#pragma unroll
          for (int ks = 0; ks < 2; ++ks) {
            // k16 step 2 KC + ks sits 32 bytes further along the swizzled 128-byte rows.
            Wgmma<BN>(&acc[0][0][0], a[KC][ks], desc + static_cast<uint64_t>((KC * 2 + ks) * 2));
          }
          WgmmaCommit();
        };
        using I0 = std::integral_constant<int, 0>;
        using I1 = std::integral_constant<int, 1>;
        group(I0(), I0());
        WgmmaWait<1>();  // the previous stage's MMAs are done: its slot and registers are free
        if (held >= 0) MbarArrive(empty0 + 8 * held);
        group(I0(), I1());
        if (2 * c_kb + 1 < num_kb) {  // not the odd last block of the unit
          WgmmaWait<1>();
          group(I1(), I0());
          WgmmaWait<1>();
          group(I1(), I1());
          WgmmaWait<1>();
          held = c_slot;
        } else {
          WgmmaWait<0>();
          MbarArrive(empty0 + 8 * c_slot);
          held = -1;
        }
        if (++c_slot == STAGES) {
          c_slot = 0;
          c_phase ^= 1;
        }
      }
      WgmmaWait<0>();
      WgmmaFenceOperands(&acc[0][0][0], C::kNI * 4);
      if (held >= 0) MbarArrive(empty0 + 8 * held);
    } else {
#pragma unroll 1
      for (int c_kb = split_lo(w); c_kb < kb_hi; ++c_kb) {
        if constexpr (kTma) {
          MbarWait(full0 + 8 * c_slot, c_phase);
        } else {
          CpAsyncWait<STAGES - 2>();
          __syncthreads();
          load();
        }
        const unsigned char* st_base = smem + c_slot * C::kStageBytes;
        // Sub-block sb of the stage: its 64-K block of weights, scales and activation columns.
        auto block_math = [&](int sb) {
          const unsigned char* st = st_base + sb * C::kABlock;
          const unsigned char* st_s = st_base + C::kABytes + sb * C::kSBlock;
          const uint32_t b_base = SmemAddr(st_base + C::kABytes + C::kSBytes) + sb * kBK * 2;
          // MXFP8: both 32-K blocks' scale codes of rows r0 and r0 + 8, one 16-bit load each.
          uint32_t codes[C::kMI][2];
          if (kFp8) {
#pragma unroll
            for (int mi = 0; mi < C::kMI; ++mi) {
              const int r0 = warp_m * C::kWTM + mi * 16 + g;
              codes[mi][0] = *reinterpret_cast<const uint16_t*>(st_s + r0 * 2);
              codes[mi][1] = *reinterpret_cast<const uint16_t*>(st_s + (r0 + 8) * 2);
            }
          }
          auto stage_math = [&](auto npa) {
            constexpr int NPA = decltype(npa)::value;  // pairs of 8-token fragments computed
#pragma unroll
            for (int kc = 0; kc < 2; ++kc) {
              uint32_t a[C::kMI][2][4];
#pragma unroll
              for (int mi = 0; mi < C::kMI; ++mi) {
                const int r0 = warp_m * C::kWTM + mi * 16 + g;
                if (kFp8) {
                  const uint2 ra =
                      *reinterpret_cast<const uint2*>(st + (kc * kBM + r0) * 32 + t4 * 8);
                  const uint2 rb =
                      *reinterpret_cast<const uint2*>(st + (kc * kBM + r0 + 8) * 32 + t4 * 8);
                  Fp8HalfFragments<kWide>(
                      ra, rb, kc == 0 ? codes[mi][0] & 0xffu : codes[mi][0] >> 8,
                      kc == 0 ? codes[mi][1] & 0xffu : codes[mi][1] >> 8, a[mi]);
                } else {
                  const uint4 ra =
                      *reinterpret_cast<const uint4*>(st + (kc * kBM + r0) * 64 + t4 * 16);
                  const uint4 rb =
                      *reinterpret_cast<const uint4*>(st + (kc * kBM + r0 + 8) * 64 + t4 * 16);
                  a[mi][0][0] = ra.x;
                  a[mi][0][1] = rb.x;
                  a[mi][0][2] = ra.y;
                  a[mi][0][3] = rb.y;
                  a[mi][1][0] = ra.z;
                  a[mi][1][1] = rb.z;
                  a[mi][1][2] = ra.w;
                  a[mi][1][3] = rb.w;
                }
              }
#pragma unroll
              for (int ks = 0; ks < 2; ++ks) {
                uint32_t b[C::kNI][2];
#pragma unroll
                for (int np = 0; np < NPA; ++np) {
                  const int n = warp_n * C::kWTN + np * 16 + (lane / 16) * 8 + lane % 8;
                  const int k = kc * 32 + ks * 16 + ((lane / 8) % 2) * 8;
                  uint32_t r[4];
                  Ldmatrix4(r, b_base + (n * C::kBStride + k) * 2);
                  b[2 * np][0] = r[0];
                  b[2 * np][1] = r[1];
                  b[2 * np + 1][0] = r[2];
                  b[2 * np + 1][1] = r[3];
                }
#pragma unroll
                for (int mi = 0; mi < C::kMI; ++mi)
#pragma unroll
                  for (int ni = 0; ni < 2 * NPA; ++ni) Mma(acc[mi][ni], a[mi][ks], b[ni]);
              }
            }
          };
          constexpr int kPairs = C::kNI / 2;
          if (!kAdaptive || kPairs == 1) {
            stage_math(std::integral_constant<int, kPairs>{});
          } else if (tile_cols <= 16) {
            stage_math(std::integral_constant<int, 1>{});
          } else if (kPairs > 2 && tile_cols <= 32) {
            stage_math(std::integral_constant<int, (kPairs > 2 ? 2 : kPairs)>{});
          } else {
            stage_math(std::integral_constant<int, kPairs>{});
          }
        };
        block_math(0);
        if constexpr (KB == 2) {
          if (2 * c_kb + 1 < num_kb) block_math(1);  // not the odd last block of the unit
        }
        if constexpr (kTma) MbarArrive(empty0 + 8 * c_slot);  // this thread is done with the slot
        if (++c_slot == STAGES) {
          c_slot = 0;
          c_phase ^= 1;
        }
      }
    }
    if constexpr (kTma) {
      // Split-K: every split stores its partial sums; the last to arrive adds them all, in split
      // order (deterministic), and runs the epilogue. It also resets the unit's counter.
      if (splits > 1) {
        constexpr int kFrag = C::kMI * C::kNI * 4;
        int32_t* counters = static_cast<int32_t*>(p.split_workspace);
        float* partials = reinterpret_cast<float*>(counters + kMoeGemmSplitCounters);
        const int u = w / splits;
        float* mine = partials + static_cast<int64_t>(w) * kFrag * kThreads;
#pragma unroll
        for (int mi = 0; mi < C::kMI; ++mi)
#pragma unroll
          for (int ni = 0; ni < C::kNI; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q)
              __stcg(mine + ((mi * C::kNI + ni) * 4 + q) * kThreads + tid, acc[mi][ni][q]);
        __threadfence();
        NamedBarrierSync(1, kThreads);
        int* s_last = s_prefix + E + 2;
        if (tid == 0) {
          const bool last = atomicAdd(counters + u, 1) == splits - 1;
          if (last) atomicExch(counters + u, 0);
          *s_last = last ? 1 : 0;
        }
        NamedBarrierSync(1, kThreads);
        const bool last = *s_last != 0;
        NamedBarrierSync(1, kThreads);  // s_last is rewritten by the next item
        zero_acc();  // a split that is not last has stored its partials; the last re-adds them
        if (!last) continue;
        __threadfence();
        const float* first = partials + static_cast<int64_t>(u) * splits * kFrag * kThreads + tid;
        // kChunk partials' loads in flight at once (one L2 round trip each), added in split order.
        constexpr int kChunk = kFrag <= 8 ? 8 : kFrag <= 16 ? 4 : 2;
#pragma unroll 1
        for (int sp0 = 0; sp0 < splits; sp0 += kChunk) {
          float v[kChunk][kFrag];
#pragma unroll
          for (int c = 0; c < kChunk; ++c) {
            const float* f = first + static_cast<int64_t>(sp0 + c) * kFrag * kThreads;
#pragma unroll
            for (int i = 0; i < kFrag; ++i)
              v[c][i] = sp0 + c < splits ? __ldcg(f + i * kThreads) : 0.f;
          }
#pragma unroll
          for (int c = 0; c < kChunk; ++c)
#pragma unroll
            for (int mi = 0; mi < C::kMI; ++mi)
#pragma unroll
              for (int ni = 0; ni < C::kNI; ++ni)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[mi][ni][q] += v[c][(mi * C::kNI + ni) * 4 + q];
        }
      }
    }
    {
      // Epilogue straight from registers.
#pragma unroll
      for (int mi = 0; mi < C::kMI; ++mi) {
        const int64_t R0 = static_cast<int64_t>(cu.mt) * kBM + warp_m * C::kWTM + mi * 16;
#pragma unroll
        for (int ni = 0; ni < C::kNI; ++ni) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int n = cu.nt * BN + warp_n * C::kWTN + ni * 8 + 2 * t4 + c;
            if (n < cu.cnt)
              StoreAccPair<KIND>(p, cu.row0 + n, R0 + g, acc[mi][ni][c], acc[mi][ni][2 + c]);
          }
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;
        }
      }
    }
  }
  if constexpr (!kTma) CpAsyncWait<0>();
}

template <bool kFp8, bool kWide, int BN, int WM, int WN, int STAGES, MoeGemmKind KIND,
          bool kAdaptive = false, bool kTma = false, int KB = 1, bool kWg = false>
cudaError_t Run(const MoeGemmParams& p, int num_sms, cudaStream_t stream,
                int2 gate = int2{-1, INT_MAX}) {
  using C = GemmCfg<kFp8, BN, WM, WN, STAGES, KIND, KB, kWg>;
  auto kernel = MoeGemmKernel<kFp8, kWide, BN, WM, WN, STAGES, KIND, kAdaptive, kTma, KB, kWg>;
  const size_t smem = C::SmemBytes(p.num_experts);
  const int threads = kTma ? kThreads + 32 : kThreads;
  // Per device: a function attribute belongs to the current device's context, and EP ranks
  // drive several GPUs from one process (one thread each).
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) device = 0;
  static size_t configured_on[64] = {};  // largest dynamic shared memory set so far
  static int blocks_per_sm_on[64] = {};
  size_t& configured = configured_on[device];
  int& blocks_per_sm = blocks_per_sm_on[device];
  if (smem > configured) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, smem);
    if (err != cudaSuccess) return err;
    configured = smem;
  }
  const int bps = blocks_per_sm > 0 ? blocks_per_sm : 1;
  // Upper bound of work units from the host-side hints, so tiny problems launch small grids.
  const bool gate_up = KIND == MoeGemmKind::kGateUpSilu;
  const int64_t mtiles = (gate_up ? 2 * p.layout.intermediate_padded : p.layout.w2_rows) / kBM;
  int64_t units = mtiles * (p.num_experts + (p.total_rows_hint + BN - 1) / BN);
  int64_t grid = static_cast<int64_t>(num_sms) * bps;
  // Split-K fills the whole grid from few units (the device decides how many splits).
  const int64_t num_st =
      ((gate_up ? p.layout.hidden_padded : p.layout.intermediate_padded) / kBK + KB - 1) / KB;
  const SplitKTuning& tune = SplitKFromEnv();
  if (kTma && p.split_workspace != nullptr && num_st >= 2 * tune.min_stages) {
    units *= std::min<int64_t>(tune.max_splits, num_st / tune.min_stages);
  }
  if (units < grid) grid = units;
  if (grid < 1) grid = 1;
  // Split-K aims to give each (unit, split) a CTA slot: MXFP8 tiles are bound by their
  // instructions and gain from two CTAs per SM, BF16 tiles stream as fast with one (measured on
  // the H200: splitting BF16 units over both slots of an SM lost 6%).
  const SplitK split{
      static_cast<int>(kFp8 ? grid
                            : std::min<int64_t>(grid, int64_t{num_sms} * tune.bf16_slots_per_sm)),
      tune.min_stages, tune.max_splits};
  return LaunchPdl(kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), smem, stream, p, gate,
                   split);
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM on the warpgroup MMA (wgmma, sm_90a) for tiles of 64-256 tokens.
//
// Same packed weights, schedule and epilogue as MoeGemmKernel. 8 warps = 2 warpgroups; warp w
// owns weight rows 16w..16w+15, so each warpgroup issues m64nBNk16 with its A fragments in
// registers (loaded from shared memory in the packed order, and for MXFP8 dequantized to BF16
// there exactly as above) and B (tokens x 64 K, BF16) from shared memory in the 128-byte
// swizzled K-major layout: row n at n * 128, its 16-byte chunk c at (c ^ (n % 8)) * 16, stage
// base 1024-aligned. All threads load with cp.async, STAGES - 2 stages ahead; one barrier per
// 64 K. Software-pipelined: a stage's MMAs run while the next stage is dequantized (two sets of
// A-fragment registers, wgmma.wait_group 1), and the loop's branches are provably warp-uniform
// (ptxas serializes wgmmas behind divergent branches, C7518). Shared memory is read with
// ld.shared (the aligned dynamic pointer would otherwise compile to generic loads).
constexpr int kWgPipeBudget = 196608;  // shared memory per SM for the pipelines

template <bool kFp8, int BN>
struct WgCfg {
  static constexpr int kEsize = kFp8 ? 1 : 2;
  static constexpr int kBBytes = BN * 128;
  static constexpr int kABytes = kBM * kBK * kEsize;
  static constexpr int kSBytes = kFp8 ? kBM * 2 : 0;
  static constexpr int kStageBytes = (kBBytes + kABytes + kSBytes + 1023) / 1024 * 1024;
  // 64-token tiles: two CTAs per SM (128 registers each), so that one CTA's barrier and
  // dependency stalls are covered by the other's work (H200, 256 tokens/rank: 750 -> 615 us).
  // Wider tiles would need more than 128 registers: ptxas then serializes the wgmmas (C7512).
  static constexpr int kCtasPerSm = BN <= 64 ? 2 : 1;
  static constexpr int kStagesFit = kWgPipeBudget / kCtasPerSm / kStageBytes;
  static constexpr int kStages = kStagesFit > 12 ? 12 : kStagesFit;
  static constexpr int kPipeBytes = kStageBytes * kStages;
  static constexpr int kBChunks = BN * 8 / kThreads;
  static_assert(kStages >= 3 && BN * 8 % kThreads == 0, "");
  static size_t SmemBytes(int num_experts) {
    return 1024 + kPipeBytes + static_cast<size_t>(3 * num_experts + 1) * sizeof(int32_t);
  }
};

template <bool kFp8, bool kWide, int BN, MoeGemmKind KIND>
__global__ void __launch_bounds__(kThreads, (WgCfg<kFp8, BN>::kCtasPerSm))
    MoeGemmWgmmaKernel(const MoeGemmParams p) {
  PdlWait();
  PdlLaunchDependents();
  using C = WgCfg<kFp8, BN>;
  constexpr int STAGES = C::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  const int E = p.num_experts;
  int32_t* s_cnt = reinterpret_cast<int32_t*>(smem + C::kPipeBytes);
  int32_t* s_row0 = s_cnt + E;
  int32_t* s_prefix = s_row0 + E;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const bool gate_up = KIND == MoeGemmKind::kGateUpSilu;
  const int64_t kp = gate_up ? p.layout.hidden_padded : p.layout.intermediate_padded;
  const int64_t rows_packed = gate_up ? 2 * p.layout.intermediate_padded : p.layout.w2_rows;
  const int64_t k_valid = gate_up ? p.layout.hidden : p.layout.intermediate_padded;
  const int mtiles = static_cast<int>(rows_packed / kBM);
  const int num_kb = static_cast<int>(kp / kBK);

  LoadExpertCounts(p, s_cnt, s_row0);
  __syncthreads();
  if (warp == 0) {
    PrefixUnits<false>(s_cnt, s_prefix, E, lane, [&](int c) { return (c + BN - 1) / BN * mtiles; });
  }
  __syncthreads();
  const int total_units = s_prefix[E];
  if (static_cast<int>(blockIdx.x) >= total_units) return;
  const int my_units = (total_units - blockIdx.x + gridDim.x - 1) / gridDim.x;

  auto decode = [&](int i) {
    const int u = blockIdx.x + i * gridDim.x;
    const int lo = ExpertOfUnit(s_prefix, E, u);
    Unit un;
    un.e = lo;
    un.cnt = s_cnt[lo];
    un.row0 = s_row0[lo];
    const int ntn = (un.cnt + BN - 1) / BN;
    const int local = u - s_prefix[lo];
    un.mt = local / ntn;
    un.nt = local % ntn;
    return un;
  };

  // Producer: this thread's B rows are (tid / 8) + 32 i, always chunk tid % 8. Loads are issued
  // for consecutive stages, so their position advances by counters (no division per stage).
  const unsigned char* a_src = nullptr;
  const uint8_t* s_src = nullptr;
  const uint16_t* b_src[C::kBChunks];  // this thread's activation chunk of the stage, or null
  const int b_cc = tid % 8;
  int ld_kb = 0, ld_unit = 0, ld_slot = 0;
  auto producer_unit = [&](int i) {
    const Unit pu = decode(i);
    a_src = static_cast<const unsigned char*>(p.weights) +
            (static_cast<int64_t>(pu.e) * mtiles + pu.mt) * num_kb * C::kABytes;
    if (kFp8) {
      s_src = p.scales + ((static_cast<int64_t>(pu.e) * mtiles + pu.mt) * num_kb) * (kBM * 2);
    }
#pragma unroll
    for (int i2 = 0; i2 < C::kBChunks; ++i2) {
      const int j = pu.nt * BN + tid / 8 + 32 * i2;
      b_src[i2] = nullptr;
      if (j < pu.cnt) {
        const int row = pu.row0 + j;
        const int64_t src_row = p.gather != nullptr ? p.gather[row] / p.gather_div : row;
        b_src[i2] = p.act + src_row * p.act_stride + b_cc * 8;
      }
    }
  };
  auto load = [&]() {  // the next stage: block ld_kb of this CTA's unit ld_unit
    if (ld_unit < my_units) {
      if (ld_kb == 0) producer_unit(ld_unit);
      unsigned char* st = smem + ld_slot * C::kStageBytes;
      const uint32_t b_dst = SmemAddr(st);
      const int64_t kk = static_cast<int64_t>(ld_kb) * kBK;
      const bool k_ok = kk + b_cc * 8 < k_valid;
#pragma unroll
      for (int i2 = 0; i2 < C::kBChunks; ++i2) {
        const int r = tid / 8 + 32 * i2;
        const bool ok = b_src[i2] != nullptr && k_ok;
        CpAsync16(b_dst + r * 128 + ((b_cc ^ (r & 7)) << 4), ok ? b_src[i2] + kk : p.act,
                  ok ? 16 : 0);
      }
      const uint32_t a_dst = SmemAddr(st + C::kBBytes);
      const unsigned char* a_stage = a_src + static_cast<int64_t>(ld_kb) * C::kABytes;
#pragma unroll
      for (int i2 = 0; i2 < C::kABytes / 16 / kThreads; ++i2) {
        const int c = tid + i2 * kThreads;
        CpAsync16(a_dst + c * 16, a_stage + c * 16, 16);
      }
      if (kFp8 && tid < 16) {
        CpAsync16(SmemAddr(st + C::kBBytes + C::kABytes) + tid * 16,
                  s_src + ld_kb * (kBM * 2) + tid * 16, 16);
      }
      ld_slot = ld_slot + 1 == STAGES ? 0 : ld_slot + 1;
      if (++ld_kb == num_kb) {
        ld_kb = 0;
        ++ld_unit;
      }
    }
    CpAsyncCommit();
  };

  float acc[BN / 8][4];
#pragma unroll
  for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[ni][q] = 0.f;

  const int g = lane / 4, t4 = lane % 4;
  const int r0 = warp * 16 + g;

  // Software pipeline: the MMAs of stage it stay in flight while stage it + 1 is dequantized
  // (wgmma.wait_group 1), so the A fragments alternate between two register sets and the slot
  // refilled at stage it is the one of it - 2, whose MMAs every warp has waited for before the
  // barrier. Prefetch depth: STAGES - 2.
#pragma unroll 1
  for (int s = 0; s < STAGES - 2; ++s) load();

  uint32_t a[2][2][2][4];  // [stage parity][32-K block][k16 step][fragment]
  // Branches around in-flight MMAs must be provably warp-uniform, or ptxas serializes every
  // wgmma (C7518): the loop bounds come from kernel parameters, blockIdx and shuffles.
  const int units = __shfl_sync(0xffffffffu, my_units, 0);
  int slot = 0;  // this stage's pipeline slot
  // Shared-space addresses: the aligned dynamic shared pointer is generic to the compiler, and
  // generic loads (LD.E) cost more than LDS.
  const uint32_t smem_base = SmemAddr(smem);
  auto stage = [&](auto parity) {
    constexpr int P = decltype(parity)::value;
    CpAsyncWait<STAGES - 3>();
    FenceProxyAsyncShared();  // cp.async data -> read by the tensor cores (async proxy)
    __syncthreads();          // every warp's MMAs of stage - 2 are complete: their slot is free
    load();
    const uint32_t st = smem_base + slot * C::kStageBytes;
    const uint32_t sa = st + C::kBBytes;
    const uint64_t desc = SmemDescSw128(st);
    uint32_t codes[2] = {0, 0};  // rows r0 and r0 + 8: both 32-K blocks' scale codes
    if (kFp8) {
      codes[0] = LdSharedU16(sa + C::kABytes + r0 * 2);
      codes[1] = LdSharedU16(sa + C::kABytes + (r0 + 8) * 2);
    }
#pragma unroll
    for (int kc = 0; kc < 2; ++kc) {
      if (kFp8) {
        const uint2 ra = LdSharedV2(sa + (kc * kBM + r0) * 32 + t4 * 8);
        const uint2 rb = LdSharedV2(sa + (kc * kBM + r0 + 8) * 32 + t4 * 8);
        Fp8HalfFragments<kWide>(ra, rb, kc == 0 ? codes[0] & 0xffu : codes[0] >> 8,
                                kc == 0 ? codes[1] & 0xffu : codes[1] >> 8, a[P][kc]);
      } else {
        const uint4 ra = LdSharedV4(sa + (kc * kBM + r0) * 64 + t4 * 16);
        const uint4 rb = LdSharedV4(sa + (kc * kBM + r0 + 8) * 64 + t4 * 16);
        a[P][kc][0][0] = ra.x;
        a[P][kc][0][1] = rb.x;
        a[P][kc][0][2] = ra.y;
        a[P][kc][0][3] = rb.y;
        a[P][kc][1][0] = ra.z;
        a[P][kc][1][1] = rb.z;
        a[P][kc][1][2] = ra.w;
        a[P][kc][1][3] = rb.w;
      }
    }
    WgmmaFence();  // orders the fragment registers (and zeroed accumulators) before the MMAs
#pragma unroll
    for (int kc = 0; kc < 2; ++kc) {
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        // k16 step kc * 2 + ks sits 32 bytes further along the swizzled 128-byte rows.
        Wgmma<BN>(&acc[0][0], a[P][kc][ks], desc + static_cast<uint64_t>((kc * 2 + ks) * 2));
      }
    }
    WgmmaCommit();
    WgmmaWait<1>();  // the previous stage's MMAs are done: its registers and slot may be reused
    slot = slot + 1 == STAGES ? 0 : slot + 1;
  };
#pragma unroll 1
  for (int ui = 0; ui < units; ++ui) {
    const Unit cu = decode(ui);
#pragma unroll 1
    for (int kb = 0; kb + 1 < num_kb; kb += 2) {
      stage(std::integral_constant<int, 0>());
      stage(std::integral_constant<int, 1>());
    }
    if (num_kb % 2 != 0) stage(std::integral_constant<int, 0>());
    WgmmaWait<0>();
    WgmmaFenceOperands(&acc[0][0], BN / 2);
    const int64_t R0 = static_cast<int64_t>(cu.mt) * kBM + warp * 16;
#pragma unroll
    for (int ni = 0; ni < BN / 8; ++ni) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int n = cu.nt * BN + ni * 8 + 2 * t4 + c;
        if (n < cu.cnt) StoreAccPair<KIND>(p, cu.row0 + n, R0 + g, acc[ni][c], acc[ni][2 + c]);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[ni][q] = 0.f;
    }
  }
  CpAsyncWait<0>();
}

template <bool kFp8, bool kWide, int BN, MoeGemmKind KIND>
cudaError_t RunWgmma(const MoeGemmParams& p, int num_sms, cudaStream_t stream) {
  using C = WgCfg<kFp8, BN>;
  auto kernel = MoeGemmWgmmaKernel<kFp8, kWide, BN, KIND>;
  const size_t smem = C::SmemBytes(p.num_experts);
  int device = 0;  // per device, as in Run()
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) device = 0;
  static size_t configured_on[64] = {};
  size_t& configured = configured_on[device];
  if (smem > configured) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    configured = smem;
  }
  const bool gate_up = KIND == MoeGemmKind::kGateUpSilu;
  const int64_t mtiles = (gate_up ? 2 * p.layout.intermediate_padded : p.layout.w2_rows) / kBM;
  const int64_t units = mtiles * (p.num_experts + (p.total_rows_hint + BN - 1) / BN);
  int64_t grid = static_cast<int64_t>(num_sms) * C::kCtasPerSm;
  if (units < grid) grid = units;
  if (grid < 1) grid = 1;
  return LaunchPdl(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), smem, stream, p);
}

// ---------------------------------------------------------------------------------------------
// Two-CTA cluster decode tile (MXFP8, 16 tokens per CTA; MoeDecodePair, on by default up to
// kMxfp8DecodePairMaxRoutes routes per expert).
//
// The narrow decode tile serves experts of at most 16 routes and a second, adaptive launch the
// rest; an expert above 16 routes then runs alone in a launch that cannot fill the GPU (32 tokens,
// hot routing: 499 us against 430 here). Here both CTAs of a cluster run the 16-wide tile in
// lockstep over "pair units" of one schedule (every unit of a GEMM has the same number of
// stages):
// - an expert of n > 1 token tiles: per 128-row weight tile, ceil(n / 2) pair units; CTA r takes
//   token tile 2q + r and the leader bulk-copies each weight stage once, multicast into both;
// - an expert of one token tile: two weight tiles per pair unit (CTA r takes 2q + r), each CTA
//   copying its own.
// A slot's "empty" barrier counts every MMA thread of both CTAs: each arrives on its own CTA's
// barrier and, through mapa, on the peer's. Neither producer can run a round ahead, so a
// producer refills a slot, in its CTA or by multicast in both, only when both CTAs are done with
// it. (Remote arrives from the follower alone let it run a round ahead; its arrives then
// completed the leader's phases early and the kernel hung on the H200, 2026-12-03 19:50. One
// remote arrive per warp after __syncwarp measured the same speed, but racecheck saw the
// multicast copies into the follower race with its reads: it credits a thread's own arrive.)
// The cluster's CTAs each dequantize the multicast weights, which is what makes the tile lose
// from 16 routes per expert on average (64 tokens/rank, hot and random routing, 3-9% slower).
__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t MapaShared(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void MbarArriveCluster(uint32_t cluster_addr) {
  // Release at CTA scope (the default; the warp's reads are ordered before it by __syncwarp):
  // .release.cluster put a memory barrier in every stage of every MMA warp (ncu: 41% of their
  // stall cycles, the tile 1.5x slower).
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
// One bulk copy into the same offset of every CTA in `mask`, completing on each one's `bar`.
__device__ __forceinline__ void BulkCopyMulticast(uint32_t dst, const void* src, uint32_t bytes,
                                                  uint32_t bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(mask)
      : "memory");
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MOESERVE_CLUSTER_DEVICE 1
#endif

struct PairUnit {
  int e = 0, cnt = 0, row0 = 0, mt = 0, nt = 0;
  bool weights = false;    // this CTA's stages carry weights (its own copy or the multicast)
  bool multicast = false;  // the leader copies the weights into both CTAs
  bool compute = false;    // this CTA has a weight tile and live token columns
};

constexpr int kPairStages = 5;

// Launched in clusters of two CTAs (RunPair's launch attribute), two CTAs per SM.
template <bool kWide, MoeGemmKind KIND>
__global__ void __launch_bounds__(kThreads + 32, 2) MoeGemmPairKernel(const MoeGemmParams p) {
#ifndef MOESERVE_CLUSTER_DEVICE
  __trap();  // not built for sm_90: the host launches this path only on sm_90 (WgmmaOnThisDevice)
#else
  // As MoeGemmKernel: with p.weights_before_wait the schedule and the first stages' weights
  // come before PdlWait.
  const bool early = WaitUnlessEarly<KIND>(p, true);
  constexpr int BN = 16, KB = 2, STAGES = kPairStages;
  using C = GemmCfg<true, BN, 8, 1, STAGES, KIND, KB>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int E = p.num_experts;
  const uint32_t full0 = SmemAddr(smem + C::kPipeBytes), empty0 = full0 + 8 * STAGES;
  int32_t* s_cnt = reinterpret_cast<int32_t*>(smem + C::kPipeBytes + C::kBarBytes);
  int32_t* s_row0 = s_cnt + E;
  int32_t* s_prefix = s_row0 + E;  // [E + 1] pair units before expert e

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const uint32_t rank = ClusterCtaRank(), peer = rank ^ 1u;
  const int cluster = static_cast<int>(blockIdx.x) / 2, clusters = static_cast<int>(gridDim.x) / 2;
  const bool gate_up = KIND == MoeGemmKind::kGateUpSilu;
  const int64_t kp = gate_up ? p.layout.hidden_padded : p.layout.intermediate_padded;
  const int64_t rows_packed = gate_up ? 2 * p.layout.intermediate_padded : p.layout.w2_rows;
  const int64_t k_valid = gate_up ? p.layout.hidden : p.layout.intermediate_padded;
  const int mtiles = static_cast<int>(rows_packed / kBM);
  const int num_kb = static_cast<int>(kp / kBK);
  const int num_st = (num_kb + 1) / 2;
  const int mpairs = (mtiles + 1) / 2;

  ScheduleCounts<KIND>(p, early, s_cnt, s_row0);
  if (tid < STAGES) {
    MbarInit(full0 + 8 * tid, 32);             // the producer's 32 lanes (cp.async arrivals)
    MbarInit(empty0 + 8 * tid, 2 * kThreads);  // the MMA threads of this CTA and of the peer
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto pair_units = [&](int c) {
    const int nt = (c + BN - 1) / BN;
    return nt <= 1 ? nt * mpairs : mtiles * ((nt + 1) / 2);
  };
  if (warp == 0) PrefixUnits<false>(s_cnt, s_prefix, E, lane, pair_units);
  __syncthreads();
  ClusterSync();  // the peer's barriers are initialized before any remote arrive or multicast
  const int total = s_prefix[E];
  const int my_items = cluster < total ? (total - cluster + clusters - 1) / clusters : 0;
  auto decode = [&](int u) {
    const int lo = ExpertOfUnit(s_prefix, E, u);
    PairUnit un;
    un.e = lo;
    un.cnt = s_cnt[lo];
    un.row0 = s_row0[lo];
    const int nt = (un.cnt + BN - 1) / BN;
    const int local = u - s_prefix[lo];
    if (nt <= 1) {
      un.mt = 2 * local + static_cast<int>(rank);
      un.nt = 0;
      un.weights = un.mt < mtiles;
      un.compute = un.weights;
    } else {
      const int q = (nt + 1) / 2;
      un.mt = local / q;
      un.nt = 2 * (local % q) + static_cast<int>(rank);
      un.weights = true;
      un.multicast = true;
      un.compute = un.nt < nt;
    }
    return un;
  };

  if (warp == kThreads / 32) {
    // The producer warp: as MoeGemmKernel's, plus the multicast.
    constexpr int kRowChunks = 8 * KB;
    constexpr int kChunks = BN * kRowChunks / 32;
    constexpr int kRowStep = 32 / kRowChunks;
    const int cc = lane % kRowChunks;
    auto weight_copies = [&](const PairUnit& pu, int slot, int nblk, const unsigned char* a_ptr,
                             const uint8_t* s_ptr) {
      unsigned char* st = smem + slot * C::kStageBytes;
      const uint32_t full = full0 + 8 * slot;
      MbarExpectTx(full, (C::kABlock + C::kSBlock) * nblk);
      if (!pu.multicast) {
        BulkCopy(SmemAddr(st + C::kAOff), a_ptr, C::kABlock * nblk, full);
        BulkCopy(SmemAddr(st + C::kSOff), s_ptr, C::kSBlock * nblk, full);
      } else if (rank == 0) {
        BulkCopyMulticast(SmemAddr(st + C::kAOff), a_ptr, C::kABlock * nblk, full, 0x3);
        BulkCopyMulticast(SmemAddr(st + C::kSOff), s_ptr, C::kSBlock * nblk, full, 0x3);
      }
    };
    auto tile_of = [&](const PairUnit& pu) {
      return static_cast<int64_t>(pu.e) * mtiles + (pu.mt < mtiles ? pu.mt : 0);
    };
    // Stages [0, pre): weights requested before PdlWait (p.weights_before_wait).
    int pre = 0;
    if (early) {
#pragma unroll 1
      for (int item = 0; item < my_items && pre < STAGES; ++item) {
        const PairUnit pu = decode(cluster + item * clusters);
        const int64_t tile = tile_of(pu);
#pragma unroll 1
        for (int kb = 0; kb < num_st && pre < STAGES; ++kb, ++pre) {
          if (lane == 0 && pu.weights) {
            weight_copies(pu, pre, 2 * kb + 1 == num_kb ? 1 : KB,
                          static_cast<const unsigned char*>(p.weights) +
                              (tile * num_kb + 2 * kb) * C::kABlock,
                          p.scales + (tile * num_kb + 2 * kb) * C::kSBlock);
          }
        }
      }
      PdlWait();
      PdlLaunchDependents();
    }
    int it = 0, slot = 0;
#pragma unroll 1
    for (int item = 0; item < my_items; ++item) {
      const PairUnit pu = decode(cluster + item * clusters);
      const int64_t tile = tile_of(pu);
      const unsigned char* a_ptr =
          static_cast<const unsigned char*>(p.weights) + tile * num_kb * C::kABlock;
      const uint8_t* s_ptr = p.scales + tile * num_kb * C::kSBlock;
      const uint16_t* src[kChunks];
      uint32_t src_bytes[kChunks];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int j = pu.nt * BN + lane / kRowChunks + kRowStep * i;
        src[i] = p.act;
        src_bytes[i] = 0;
        if (pu.compute && j < pu.cnt) {
          const int row = pu.row0 + j;
          const int64_t arow = p.gather != nullptr ? p.gather[row] / p.gather_div : row;
          src[i] = p.act + arow * p.act_stride + cc * 8;
          src_bytes[i] = 16;
        }
      }
#pragma unroll 1
      for (int kb = 0; kb < num_st; ++kb, ++it) {
        if (it >= STAGES) MbarWait(empty0 + 8 * slot, ((it / STAGES) & 1) ^ 1);
        const int nblk = 2 * kb + 1 == num_kb ? 1 : KB;
        unsigned char* st = smem + slot * C::kStageBytes;
        const uint32_t full = full0 + 8 * slot;
        if (lane == 0 && pu.weights && it >= pre) weight_copies(pu, slot, nblk, a_ptr, s_ptr);
        const uint32_t b_dst = SmemAddr(st + C::kBOff);
        const bool k_ok = static_cast<int64_t>(kb) * KB * kBK + cc * 8 < k_valid && cc < 8 * nblk;
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const int n = lane / kRowChunks + kRowStep * i;
          CpAsync16(b_dst + (n * C::kBStride + cc * 8) * 2, src[i], k_ok ? src_bytes[i] : 0);
          src[i] += src_bytes[i] != 0 ? KB * kBK : 0;
        }
        CpAsyncArriveNoinc(full);
        a_ptr += C::kABytes;
        s_ptr += C::kSBytes;
        slot = slot + 1 == STAGES ? 0 : slot + 1;
      }
    }
    CpAsyncWait<0>();
  } else {
    if (early) {
      PdlWait();
      PdlLaunchDependents();
    }
    const int g = lane / 4, t4 = lane % 4;
    const uint32_t empty_peer0 = MapaShared(empty0, peer);
    float acc[2][4] = {};
    uint32_t c_phase = 0;
    int c_slot = 0;
#pragma unroll 1
    for (int item = 0; item < my_items; ++item) {
      const PairUnit cu = decode(cluster + item * clusters);
#pragma unroll 1
      for (int c_kb = 0; c_kb < num_st; ++c_kb) {
        MbarWait(full0 + 8 * c_slot, c_phase);
        if (cu.compute) {
          const unsigned char* st_base = smem + c_slot * C::kStageBytes;
          auto block_math = [&](int sb) {
            const unsigned char* st = st_base + C::kAOff + sb * C::kABlock;
            const unsigned char* st_s = st_base + C::kSOff + sb * C::kSBlock;
            const uint32_t b_base = SmemAddr(st_base + C::kBOff) + sb * kBK * 2;
            const int r0 = warp * 16 + g;
            const uint32_t codes0 = *reinterpret_cast<const uint16_t*>(st_s + r0 * 2);
            const uint32_t codes1 = *reinterpret_cast<const uint16_t*>(st_s + (r0 + 8) * 2);
#pragma unroll
            for (int kc = 0; kc < 2; ++kc) {
              uint32_t a[2][4];
              const uint2 ra = *reinterpret_cast<const uint2*>(st + (kc * kBM + r0) * 32 + t4 * 8);
              const uint2 rb =
                  *reinterpret_cast<const uint2*>(st + (kc * kBM + r0 + 8) * 32 + t4 * 8);
              Fp8HalfFragments<kWide>(ra, rb, kc == 0 ? codes0 & 0xffu : codes0 >> 8,
                                      kc == 0 ? codes1 & 0xffu : codes1 >> 8, a);
#pragma unroll
              for (int ks = 0; ks < 2; ++ks) {
                const int n = (lane / 16) * 8 + lane % 8;
                const int k = kc * 32 + ks * 16 + ((lane / 8) % 2) * 8;
                uint32_t r[4];
                Ldmatrix4(r, b_base + (n * C::kBStride + k) * 2);
                const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                Mma(acc[0], a[ks], b0);
                Mma(acc[1], a[ks], b1);
              }
            }
          };
          block_math(0);
          if (2 * c_kb + 1 < num_kb) block_math(1);
        }
        MbarArrive(empty0 + 8 * c_slot);
        MbarArriveCluster(empty_peer0 + 8 * c_slot);
        if (++c_slot == STAGES) {
          c_slot = 0;
          c_phase ^= 1;
        }
      }
      if (cu.compute) {
        const int64_t R0 = static_cast<int64_t>(cu.mt) * kBM + warp * 16;
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int n = cu.nt * BN + ni * 8 + 2 * t4 + c;
            if (n < cu.cnt) StoreAccPair<KIND>(p, cu.row0 + n, R0 + g, acc[ni][c], acc[ni][2 + c]);
          }
        }
      }
#pragma unroll
      for (int ni = 0; ni < 2; ++ni)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[ni][q] = 0.f;
    }
  }
  ClusterSync();  // neither CTA exits while its peer may still arrive on its barriers
#endif
}

template <bool kWide, MoeGemmKind KIND>
cudaError_t RunPair(const MoeGemmParams& p, int num_sms, cudaStream_t stream) {
  using C = GemmCfg<true, 16, 8, 1, kPairStages, KIND, 2>;
  auto kernel = MoeGemmPairKernel<kWide, KIND>;
  const size_t smem = C::SmemBytes(p.num_experts);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) device = 0;
  static size_t configured_on[64] = {};
  size_t& configured = configured_on[device];
  if (smem > configured) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    configured = smem;
  }
  const bool gate_up = KIND == MoeGemmKind::kGateUpSilu;
  const int64_t mtiles = (gate_up ? 2 * p.layout.intermediate_padded : p.layout.w2_rows) / kBM;
  // Pair units: at most one per weight tile and two token tiles of each expert, plus one per
  // expert for rounding.
  const int64_t units = (mtiles + 1) * (p.num_experts + (p.total_rows_hint + 31) / 32);
  int64_t clusters = num_sms;  // two CTAs per SM (1 per SM would halve the bytes in flight)
  if (units < clusters) clusters = units;
  if (clusters < 1) clusters = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(2 * clusters));
  cfg.blockDim = dim3(kThreads + 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // as LaunchPdl
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = PdlEnabled() ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

#if MOESERVE_CUDA_WGMMA
// Whether the current device runs the sm_90a kernels (warpgroup MMAs, the cluster tile). A build
// for several architectures (e.g. "90a;100a") has them compiled as traps for the others, so the
// choice is the device's, not the build's. Cached per device ordinal.
bool WgmmaOnThisDevice() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> known[kMaxDevices];  // 0: not asked yet, 1: sm_90, -1: other
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    cudaGetLastError();
    return false;
  }
  int8_t v = known[device].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess;
    if (!ok) cudaGetLastError();
    v = ok && major == 9 && minor == 0 ? 1 : -1;
    known[device].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// Whether an MXFP8 decode GEMM runs the two-CTA cluster tile: MoeGemmParams::decode_pair, else
// MOESERVE_DECODE_PAIR=1|0 (read once; for benchmarks' A/Bs), else `measured_default`.
bool DecodePair(const MoeGemmParams& p, bool measured_default) {
  if (p.decode_pair == MoeDecodePair::kOn) return true;
  if (p.decode_pair == MoeDecodePair::kOff) return false;
  static const int from_env = [] {
    const char* v = std::getenv("MOESERVE_DECODE_PAIR");
    if (v == nullptr || (v[0] != '0' && v[0] != '1') || v[1] != '\0') return -1;
    return v[0] - '0';
  }();
  return from_env >= 0 ? from_env == 1 : measured_default;
}
#endif

// Decode tiles (a 128-row weight tile by 16-64 tokens): the producer warp fills stages of KB
// 64-K blocks. MXFP8 stages hold two blocks, 16 KB of weights like a BF16 stage, so the per-stage
// work of both warp roles is spread over twice the bytes. Stage counts: as many as fit two
// blocks per SM (one for 64 tokens) with room for the schedule of kMaxGemmExperts experts.
template <bool kFp8, int BN>
struct DecodeTile {
  static constexpr int kKB = kFp8 ? 2 : 1;
  static constexpr int kStages = kFp8 ? (BN == 16 ? 5 : BN == 32 ? 4 : 5) : 6;
};
// kWg: the warpgroup-MMA form of the tile (sm_90a builds; only the MXFP8 32-token tile takes it,
// MoeGemmUsesDecodeWgmma).
template <bool kFp8, bool kWide, int BN, MoeGemmKind KIND, bool kAdaptive = false, bool kWg = false>
cudaError_t RunDecode(const MoeGemmParams& p, int num_sms, cudaStream_t stream,
                      int2 gate = int2{-1, INT_MAX}) {
  using T = DecodeTile<kFp8, BN>;
  return Run<kFp8, kWide, BN, 8, 1, T::kStages, KIND, kAdaptive, true, T::kKB, kWg>(p, num_sms,
                                                                                    stream, gate);
}

// Whether the MXFP8 32-token decode tile issues warpgroup MMAs (else mma.sync):
// MoeGemmParams::decode_mma, else MOESERVE_DECODE_MMA=wgmma|sync (read once; for benchmarks'
// A/Bs), else `measured_default`.
bool DecodeWgmma(const MoeGemmParams& p, bool measured_default) {
#if MOESERVE_CUDA_WGMMA
  if (!WgmmaOnThisDevice()) return false;
  if (p.decode_mma == MoeDecodeMma::kWgmma) return true;
  if (p.decode_mma == MoeDecodeMma::kMmaSync) return false;
  static const int from_env = [] {
    const char* v = std::getenv("MOESERVE_DECODE_MMA");
    if (v == nullptr) return -1;
    return std::strcmp(v, "wgmma") == 0 ? 1 : std::strcmp(v, "sync") == 0 ? 0 : -1;
  }();
  return from_env >= 0 ? from_env == 1 : measured_default;
#else
  (void)p;
  (void)measured_default;
  return false;
#endif
}

template <bool kFp8, int BN, MoeGemmKind KIND>
cudaError_t RunWgmmaFor(const MoeGemmParams& p, int num_sms, cudaStream_t stream, bool wide) {
  if constexpr (!kFp8) return RunWgmma<false, false, BN, KIND>(p, num_sms, stream);
  return wide ? RunWgmma<true, true, BN, KIND>(p, num_sms, stream)
              : RunWgmma<true, false, BN, KIND>(p, num_sms, stream);
}

// Routes per expert from which the warpgroup-MMA tiles serve (Dispatch).
int WgmmaFromRoutes(const MoeGemmParams& p) {
  const int asked = p.wgmma_min_routes != 0 ? p.wgmma_min_routes
                    : p.mxfp8               ? kMxfp8WgmmaMinRoutes
                                            : kBf16WgmmaMinRoutes;
  return asked > 0 && asked <= 128 ? asked : 129;
}

// Whether Dispatch runs the two-CTA cluster tile (sm_90a builds; below the warpgroup-MMA tiles'
// threshold, which Dispatch tests first).
bool PairServes(const MoeGemmParams& p, int64_t avg, bool wide) {
#if MOESERVE_CUDA_WGMMA
  if (!p.mxfp8 || avg > 32 || avg >= WgmmaFromRoutes(p) || !WgmmaOnThisDevice()) return false;
  return DecodePair(p, kMxfp8DecodePairOnByDefault && !wide && avg <= kMxfp8DecodePairMaxRoutes);
#else
  (void)p;
  (void)avg;
  (void)wide;
  return false;
#endif
}

template <bool kFp8, MoeGemmKind KIND>
cudaError_t Dispatch(const MoeGemmParams& p, int num_sms, cudaStream_t stream) {
  const int64_t avg = (p.total_rows_hint + p.num_experts - 1) / p.num_experts;
  // MXFP8 scale codes above kMxfp8NarrowScaleMax (or NaN blocks) need the two-multiply
  // dequantization; one decode tile shape serves every count there (rare in real checkpoints).
  const bool wide = kFp8 && p.mxfp8_max_scale_code > kMxfp8NarrowScaleMax;
#if MOESERVE_CUDA_WGMMA
  // From kMxfp8WgmmaMinRoutes / kBf16WgmmaMinRoutes routes per expert: the pipelined wgmma
  // tiles, as wide as the average (H200, seed layer, MXFP8: 256 tokens/rank 620 us against 915 us
  // for the 64-token mma.sync tile, 512 tokens 1040 against 2187 us for the 128-token one; BF16:
  // 128 tokens 717 against 764 us, 256 tokens 746 against 1030 us; tests/benchmarks/cuda/
  // RESULTS.md). Below those counts the mma.sync decode tiles win.
  // Above 128 routes per expert the 256-token tiles, whatever wgmma_min_routes says (2.0x the
  // mma.sync tile for MXFP8 even before they were pipelined): a negative or larger threshold
  // acts as 129.
  if (WgmmaOnThisDevice()) {
    if (avg >= WgmmaFromRoutes(p)) {
      if (avg <= 64) return RunWgmmaFor<kFp8, 64, KIND>(p, num_sms, stream, wide);
      if (avg <= 128) return RunWgmmaFor<kFp8, 128, KIND>(p, num_sms, stream, wide);
      return RunWgmmaFor<kFp8, 256, KIND>(p, num_sms, stream, wide);
    }
  }
  if constexpr (kFp8) {
    if (PairServes(p, avg, wide)) {
      return wide ? RunPair<true, KIND>(p, num_sms, stream)
                  : RunPair<false, KIND>(p, num_sms, stream);
    }
  }
#endif
  if (wide && avg <= 64) return RunDecode<kFp8, true, 64, KIND>(p, num_sms, stream);
  if (!wide) {
    // A hot expert (more routes than the narrow tile holds) would stream its weights once per
    // narrow tile: the narrow launch works only if every count fits it, else the adaptive wide
    // one does (both are queued; the counts on the device decide, the other returns at once).
    // Measured on the H200 (cuda/RESULTS.md 17:55): hot routing at 64 tokens 11% faster,
    // balanced unchanged. The same pair at 32/64 tokens per tile made 128 balanced tokens 4-5%
    // slower (its 64-token tile has 6 stages) and is not used.
    if constexpr (kFp8) {
      if (avg <= 16) {
        const cudaError_t err = RunDecode<true, false, 16, KIND>(p, num_sms, stream, int2{-1, 16});
        // No expert can exceed the narrow tile (the host's bound says so, e.g. one or two decode
        // tokens): the adaptive launch would return at once, and costs ~3 us of launch.
        if (err != cudaSuccess || (p.max_rows_hint > 0 && p.max_rows_hint <= 16)) return err;
        return RunDecode<true, false, 32, KIND, true>(p, num_sms, stream, int2{16, INT_MAX});
      }
    }
    if (avg <= 16) return RunDecode<kFp8, false, 16, KIND>(p, num_sms, stream);
    if (avg <= 32) {
#if MOESERVE_CUDA_WGMMA
      // MXFP8: warpgroup MMAs, where they won on the H200; the other decode tiles keep mma.sync
      // (tests/benchmarks/cuda/RESULTS.md, 2026-12-03 16:20).
      if constexpr (kFp8) {
        if (MoeGemmUsesDecodeWgmma(p)) {
          return RunDecode<true, false, 32, KIND, false, true>(p, num_sms, stream);
        }
      }
#endif
      return RunDecode<kFp8, false, 32, KIND>(p, num_sms, stream);
    }
    if (avg <= 64) return RunDecode<kFp8, false, 64, KIND>(p, num_sms, stream);
  }
  // Large tiles are MMA-bound: they always take the exact two-multiply dequantization.
  return Run < kFp8, kFp8, 128, 2, 4, kFp8 ? 5 : 4, KIND > (p, num_sms, stream);
}

}  // namespace

cudaError_t LaunchPackMoeW13(const void* w13, const uint8_t* w13_scale, int64_t num_experts,
                             const MoePackedLayout& l, int elem_bytes, void* packed,
                             uint8_t* packed_scale, cudaStream_t stream, int32_t* max_scale_code) {
  return LaunchPack(w13, w13_scale, num_experts, 2 * l.intermediate, l.hidden,
                    2 * l.intermediate_padded, l.hidden_padded, true, l.intermediate, elem_bytes,
                    packed, packed_scale, stream, max_scale_code);
}

cudaError_t LaunchPackMoeW2(const void* w2, const uint8_t* w2_scale, int64_t num_experts,
                            const MoePackedLayout& l, int elem_bytes, void* packed,
                            uint8_t* packed_scale, cudaStream_t stream, int32_t* max_scale_code) {
  return LaunchPack(w2, w2_scale, num_experts, l.hidden, l.intermediate, l.w2_rows,
                    l.intermediate_padded, false, 0, elem_bytes, packed, packed_scale, stream,
                    max_scale_code);
}

cudaError_t LaunchDequantizeMxfp8ToBf16(const uint8_t* q, const uint8_t* scales, int64_t rows,
                                        int64_t k, uint16_t* out, cudaStream_t stream) {
  const int64_t n = rows * k;
  if (n == 0) return cudaSuccess;
  const int blocks = static_cast<int>(n / 256 + 1 < 65535 ? n / 256 + 1 : 65535);
  DequantKernel<<<blocks, 256, 0, stream>>>(q, scales, rows, k, out);
  return cudaGetLastError();
}

bool MoeGemmUsesDecodeWgmma(const MoeGemmParams& p) {
  if (!p.mxfp8 || p.num_experts <= 0 || p.total_rows_hint <= 0) return false;
  const int64_t avg = (p.total_rows_hint + p.num_experts - 1) / p.num_experts;
  if (p.mxfp8_max_scale_code > kMxfp8NarrowScaleMax || avg <= 16 || avg > 32) return false;
#if MOESERVE_CUDA_WGMMA
  if (avg >= WgmmaFromRoutes(p)) return false;  // the warpgroup-MMA tiles serve
#endif
  if (PairServes(p, avg, false)) return false;
  return DecodeWgmma(p, avg >= kMxfp8DecodeWgmmaMinRoutes);
}

bool MoeGemmUsesDecodePair(const MoeGemmParams& p) {
  if (!p.mxfp8 || p.num_experts <= 0 || p.total_rows_hint <= 0) return false;
  const int64_t avg = (p.total_rows_hint + p.num_experts - 1) / p.num_experts;
  return PairServes(p, avg, p.mxfp8_max_scale_code > kMxfp8NarrowScaleMax);
}

cudaError_t LaunchMoeGroupedGemm(const MoeGemmParams& params, int num_sms, cudaStream_t stream) {
  if (params.num_experts <= 0 || params.num_experts > kMaxGemmExperts || num_sms <= 0) {
    return cudaErrorInvalidValue;
  }
  auto allowed = [](const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr || std::strcmp(v, "0") != 0;
  };
  static const bool any_early = allowed("MOESERVE_EARLY_WEIGHTS");
  static const bool w13_early = any_early && allowed("MOESERVE_W13_EARLY");
  static const bool w2_early = any_early && allowed("MOESERVE_W2_EARLY");
  MoeGemmParams p = params;
  const bool down = p.kind == MoeGemmKind::kDown;
  p.weights_before_wait =
      p.weights_before_wait && PdlEnabled() &&
      (down ? w2_early
            : w13_early && p.route_ids != nullptr && p.num_routes <= kMoeGemmCountRoutesMax);
  if (!p.weights_before_wait) p.route_ids = nullptr;
  if (p.total_rows_hint == 0) return cudaSuccess;
  if (p.layout.hidden % 8 != 0 || p.act_stride % 8 != 0) return cudaErrorInvalidValue;
  if (p.mxfp8 && p.scales == nullptr) return cudaErrorInvalidValue;
  if (p.kind == MoeGemmKind::kGateUpSilu) {
    return p.mxfp8 ? Dispatch<true, MoeGemmKind::kGateUpSilu>(p, num_sms, stream)
                   : Dispatch<false, MoeGemmKind::kGateUpSilu>(p, num_sms, stream);
  }
  return p.mxfp8 ? Dispatch<true, MoeGemmKind::kDown>(p, num_sms, stream)
                 : Dispatch<false, MoeGemmKind::kDown>(p, num_sms, stream);
}

}  // namespace moeserve::kernels
