// The kernels around the grouped GEMMs of moe_grouped_sm90.cuh (any architecture): the plain
// weight layout, the row gather, SiLU-and-mul and the unpermute with the top-k reduction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "kernels/cuda/moe_grouped_sm90.cuh"

namespace moeserve::kernels {
namespace {

constexpr int kThreads = 256;

// Blocks for a row kernel: one per row, at most 4096 (they stride beyond).
int RowGrid(int64_t rows) { return static_cast<int>(rows < 1 ? 1 : (rows > 4096 ? 4096 : rows)); }

int GridFor(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 65535 * 4 ? 65535 * 4 : blocks));
}

// Packed position (inside a block of 32) of logical K offset q: the inverse of moe_gemm.cu's
// PermutedK. BF16: p = 8 t + 2 u + s holds logical 2 t + s + 8 u; E4M3: p = 8 t + 4 h + 2 s + u
// holds logical 16 h + 8 u + 2 t + s.
__device__ __forceinline__ int PackedPos(int q, bool fp8) {
  if (!fp8) return 8 * ((q % 8) / 2) + 2 * (q / 8) + q % 2;
  const int w = q % 16;
  return 8 * ((w % 8) / 2) + 4 * (q / 16) + 2 * (w % 2) + w / 8;
}

// Element (row, kk) of expert e in the tile-contiguous packed layout of moe_gemm.cu:
// [E][rows / 128][kp / 64][2][128][32].
__device__ __forceinline__ int64_t PackedIndex(int64_t e, int64_t row, int64_t kk, int64_t rows,
                                               int64_t kp, bool fp8) {
  const int64_t mtiles = rows / kMoeGemmTileRows, num_kb = kp / kMoeGemmTileK;
  return ((((e * mtiles + row / 128) * num_kb + kk / 64) * 2 + (kk / 32) % 2) * 128 + row % 128) *
             32 +
         PackedPos(static_cast<int>(kk % 32), fp8);
}

// Packed (+ scale) element -> BF16: BF16 as it is; E4M3 times its E8M0 block scale, exact (an
// E4M3 value has 3 mantissa bits and the scale is a power of two; within BF16's range).
template <typename T>
__device__ __forceinline__ uint16_t ToBf16(const T* p, const uint8_t* s, int64_t idx, int64_t e,
                                           int64_t row, int64_t kk, int64_t rows, int64_t kp) {
  if constexpr (sizeof(T) == 2) {
    return p[idx];
  } else {
    // Scales: [E][rows / 128][kp / 64][128][2].
    const int64_t mtiles = rows / kMoeGemmTileRows, num_kb = kp / kMoeGemmTileK;
    const uint32_t code =
        s[(((e * mtiles + row / 128) * num_kb + kk / 64) * 128 + row % 128) * 2 + (kk / 32) % 2];
    const float scale = code == 255 ? __uint_as_float(0x7fc00000u)  // NaN (also a NaN block)
                                    : __uint_as_float(code != 0 ? (code << 23) : 0x00400000u);
    const __half_raw h =
        __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(p[idx]), __NV_E4M3);
    const __nv_bfloat16 b = __float2bfloat16_rn(__half2float(__half(h)) * scale);
    return *reinterpret_cast<const uint16_t*>(&b);
  }
}

template <typename T>
__global__ void UnpackKernel(const T* __restrict__ pw13, const uint8_t* __restrict__ s13,
                             const T* __restrict__ pw2, const uint8_t* __restrict__ s2,
                             int64_t num_experts, MoePackedLayout l, uint16_t* __restrict__ w13,
                             uint16_t* __restrict__ w2) {
  const int64_t ip = l.intermediate_padded, hp = l.hidden_padded, h = l.hidden;
  const int64_t n13 = num_experts * 2 * ip * hp, n2 = num_experts * h * ip;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n13 + n2;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < n13) {
      const int64_t kk = i % hp, r = (i / hp) % (2 * ip), e = i / (hp * 2 * ip);
      // Packed W13 rows come in groups of 16: 8 gate rows, then the 8 matching up rows.
      const int64_t j = r % ip;
      const int64_t prow = (j / 8) * 16 + (r >= ip ? 8 : 0) + j % 8;
      w13[i] = ToBf16(pw13, s13, PackedIndex(e, prow, kk, 2 * ip, hp, sizeof(T) == 1), e, prow, kk,
                      2 * ip, hp);
    } else {
      const int64_t i2 = i - n13;
      const int64_t kk = i2 % ip, r = (i2 / ip) % h, e = i2 / (ip * h);
      w2[i2] = ToBf16(pw2, s2, PackedIndex(e, r, kk, l.w2_rows, ip, sizeof(T) == 1), e, r, kk,
                      l.w2_rows, ip);
    }
  }
}

// Blocks stride over rows, threads over a row's 16-byte chunks: the row's source index is read
// once per row, not once per chunk (H200, seed layer, 1024 tokens: 24 -> 18 us).
__global__ void GatherKernel(const uint4* __restrict__ x, const int32_t* __restrict__ sorted,
                             const int32_t* __restrict__ served, int64_t max_rows, int topk,
                             int chunks, uint4* __restrict__ a1) {
  const int64_t rows = min(static_cast<int64_t>(*served), max_rows);
  for (int64_t p = blockIdx.x; p < rows; p += gridDim.x) {
    const uint4* src = x + static_cast<int64_t>(sorted[p] / topk) * chunks;
    uint4* dst = a1 + p * chunks;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = src[c];
  }
}

__device__ __forceinline__ float SiluMul(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

__global__ void SiluMulKernel(const uint4* __restrict__ d1, const int32_t* __restrict__ served,
                              int64_t max_rows, int64_t chunks, uint4* __restrict__ a2) {
  const int64_t rows = min(static_cast<int64_t>(*served), max_rows);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < rows * chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks, c = i % chunks;
    const uint4 g = d1[r * 2 * chunks + c], u = d1[r * 2 * chunks + chunks + c];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u);
    uint4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 gf = __bfloat1622float2(g2[q]), uf = __bfloat1622float2(u2[q]);
      o2[q] = __floats2bfloat162_rn(SiluMul(gf.x, uf.x), SiluMul(gf.y, uf.y));
    }
    a2[i] = o;
  }
}

__global__ void UnpermuteReduceKernel(const uint4* __restrict__ d2, const int32_t* __restrict__ ids,
                                      const float* __restrict__ w,
                                      const int32_t* __restrict__ offsets,
                                      const int32_t* __restrict__ slot, int64_t num_tokens,
                                      int topk, int64_t chunks, int num_experts,
                                      float4* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < num_tokens * chunks; i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / chunks, c = i % chunks;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < topk; ++k) {
      const int64_t r = t * topk + k;
      const int id = ids[r];
      if (id < 0 || id >= num_experts) continue;
      const float wk = w[r];
      const uint4 v = d2[(static_cast<int64_t>(offsets[id]) + slot[r]) * chunks + c];
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(v2[q]);
        acc[2 * q] += wk * f.x;
        acc[2 * q + 1] += wk * f.y;
      }
    }
    out[2 * i] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    out[2 * i + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

// ---- W8A8 ----

constexpr float kE4m3Max = 448.0f;

// Fp8PaddedK, callable on the device.
__host__ __device__ __forceinline__ int64_t PadK128(int64_t k) {
  return (k + kMoeFp8ScaleK - 1) / kMoeFp8ScaleK * kMoeFp8ScaleK;
}

__device__ __forceinline__ float E4m3ToFloat(uint8_t v) {
  return __half2float(
      __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3)));
}
__device__ __forceinline__ uint32_t FloatToE4m3(float f) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}
// 2^(code - 127) as a float (code 0: the subnormal 2^-127), NaN for code 255.
__device__ __forceinline__ float E8m0ToFloat(uint32_t code) {
  return code == 255 ? __uint_as_float(0x7fc00000u)
                     : __uint_as_float(code != 0 ? (code << 23) : 0x00400000u);
}

// One warp per (row, 128-K block) of the plain FP8 layout; lane l holds K [4 l, 4 l + 4) of it,
// which lie in the 32-block l / 8 of the packed layout.
__global__ void UnpackFp8Kernel(const uint8_t* __restrict__ pw13, const uint8_t* __restrict__ s13,
                                const uint8_t* __restrict__ pw2, const uint8_t* __restrict__ s2,
                                int64_t num_experts, MoePackedLayout l, uint8_t* __restrict__ w13,
                                float* __restrict__ w13s, uint8_t* __restrict__ w2,
                                float* __restrict__ w2s) {
  const int64_t ip = l.intermediate_padded, hp = l.hidden_padded, h = l.hidden;
  const int64_t k1 = PadK128(hp), k2 = PadK128(ip);
  const int64_t kb1 = k1 / kMoeFp8ScaleK, kb2 = k2 / kMoeFp8ScaleK;
  const int64_t n13 = num_experts * 2 * ip * kb1, n2 = num_experts * h * kb2;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; w < n13 + n2;
       w += warps) {
    const bool is13 = w < n13;
    const int64_t i = is13 ? w : w - n13;
    const int64_t kb_n = is13 ? kb1 : kb2, n = is13 ? 2 * ip : h, kp = is13 ? hp : ip;
    const int64_t kb = i % kb_n, r = (i / kb_n) % n, e = i / (kb_n * n);
    int64_t prow = r;
    if (is13) {  // packed W13 rows come in groups of 16: 8 gate rows, then the 8 matching up rows
      const int64_t j = r % ip;
      prow = (j / 8) * 16 + (r >= ip ? 8 : 0) + j % 8;
    }
    const int64_t rows = is13 ? 2 * ip : l.w2_rows;
    const uint8_t* pw = is13 ? pw13 : pw2;
    const uint8_t* ps = is13 ? s13 : s2;
    const int64_t k0 = kb * kMoeFp8ScaleK + 4 * lane;
    // A 32-block's code counts where the block holds logical K (padding blocks' codes do not).
    const bool present = k0 / 32 * 32 < (is13 ? h : l.intermediate);
    uint32_t code = 0;
    if (present) {
      const int64_t mtiles = rows / kMoeGemmTileRows, num_kb = kp / kMoeGemmTileK;
      code = ps[(((e * mtiles + prow / 128) * num_kb + k0 / 64) * 128 + prow % 128) * 2 +
                (k0 / 32) % 2];
    }
    const uint32_t cmax = __reduce_max_sync(0xffffffffu, code);
    uint32_t packed = 0;
    if (present) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float f = E4m3ToFloat(pw[PackedIndex(e, prow, k0 + q, rows, kp, true)]);
        packed |= FloatToE4m3(ldexpf(f, static_cast<int>(code) - static_cast<int>(cmax)))
                  << (8 * q);
      }
    }
    uint8_t* dst = (is13 ? w13 : w2) + (e * n + r) * (is13 ? k1 : k2) + k0;
    *reinterpret_cast<uint32_t*>(dst) = packed;
    if (lane == 0) (is13 ? w13s : w2s)[(e * kb_n + kb) * n + r] = E8m0ToFloat(cmax);
  }
}

// Scale slot of row p, K block kb, in the per-expert [kb_n, count] layout of
// LaunchMoeGatherQuantizeRows (expert: the last e with offsets[e] <= p; p < offsets[E]).
__device__ __forceinline__ int64_t ActScaleIndex(int64_t p, int64_t kb, int64_t kb_n,
                                                 const int32_t* counts, const int32_t* offsets,
                                                 int num_experts) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= p) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t o = offsets[lo];
  return o * kb_n + kb * counts[lo] + (p - o);
}

// Quantizes a warp's 128 values (4 per lane) to E4M3 with scale amax / 448; the block's scale is
// NaN when any value is NaN. Returns the lane's 4 codes, packed.
__device__ __forceinline__ uint32_t QuantizeBlock(const float (&v)[4], float* scale) {
  float amax = 0.0f;
  bool nan = false;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    amax = fmaxf(amax, fabsf(v[q]));
    nan |= v[q] != v[q];
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  nan = __any_sync(0xffffffffu, nan);
  // A block of subnormals would overflow 448 / amax to Inf (and 0 * Inf is NaN): clamp it.
  const float inv = amax > 0.0f ? fminf(kE4m3Max / amax, FLT_MAX) : 0.0f;
  uint32_t packed = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) packed |= FloatToE4m3(v[q] * inv) << (8 * q);
  *scale = nan ? __uint_as_float(0x7fc00000u) : amax / kE4m3Max;
  return packed;
}

// Four BF16 values at p -> floats.
__device__ __forceinline__ void LoadBf16x4(const uint16_t* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

// Row p's values [k0, k0 + 4) of the gathered rows: x[sorted[p] / topk].
struct GatheredRows {
  const uint16_t* x;
  const int32_t* sorted;
  int topk;
  int64_t k;  // h
  __device__ void Load(int64_t p, int64_t k0, float (&v)[4]) const {
    LoadBf16x4(x + static_cast<int64_t>(sorted[p] / topk) * k + k0, v);
  }
};

// Row p's values [k0, k0 + 4) of silu(d1[:, :ip]) * d1[:, ip:].
struct SiluMulRows {
  const uint16_t* d1;
  int64_t k;  // ip
  __device__ void Load(int64_t p, int64_t k0, float (&v)[4]) const {
    float g[4], u[4];
    LoadBf16x4(d1 + p * 2 * k + k0, g);
    LoadBf16x4(d1 + p * 2 * k + k + k0, u);
#pragma unroll
    for (int q = 0; q < 4; ++q) v[q] = SiluMul(g[q], u[q]);
  }
};

// One warp per (row, 128-K block) of the served rows: the rows' K (rows.k, a multiple of 8, so a
// lane's 4 values are all in or all out) padded to 128 with zero codes; scales in the
// per-expert layout of LaunchMoeGatherQuantizeRows.
template <class Rows>
__global__ void QuantizeRowsKernel(Rows src, const int32_t* __restrict__ counts,
                                   const int32_t* __restrict__ offsets, int num_experts,
                                   int64_t max_rows, uint8_t* __restrict__ aq,
                                   float* __restrict__ as) {
  const int64_t rows = min(static_cast<int64_t>(offsets[num_experts]), max_rows);
  const int64_t kp = PadK128(src.k), kb_n = kp / kMoeFp8ScaleK;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
       w < rows * kb_n; w += warps) {
    const int64_t p = w / kb_n, kb = w % kb_n, k0 = kb * kMoeFp8ScaleK + 4 * lane;
    float v[4] = {0, 0, 0, 0};
    if (k0 < src.k) src.Load(p, k0, v);
    float scale;
    const uint32_t packed = QuantizeBlock(v, &scale);
    *reinterpret_cast<uint32_t*>(aq + p * kp + k0) = packed;
    if (lane == 0) as[ActScaleIndex(p, kb, kb_n, counts, offsets, num_experts)] = scale;
  }
}

// Blocks for a warp-per-item kernel: 8 warps each, at most 8192 blocks (they stride beyond).
int WarpGrid(int64_t items) {
  const int64_t blocks = (items + kThreads / 32 - 1) / (kThreads / 32);
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 8192 ? 8192 : blocks));
}

}  // namespace

cudaError_t LaunchUnpackMoeWeightsPlain(const void* packed_w13, const uint8_t* packed_w13_scale,
                                        const void* packed_w2, const uint8_t* packed_w2_scale,
                                        int64_t num_experts, const MoePackedLayout& layout,
                                        int elem_bytes, void* plain_w13, void* plain_w2,
                                        cudaStream_t stream) {
  if (elem_bytes != 1 && elem_bytes != 2) return cudaErrorInvalidValue;
  if (elem_bytes == 1 && (packed_w13_scale == nullptr || packed_w2_scale == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int64_t n = num_experts * (PlainW13ElemsPerExpert(layout) + PlainW2ElemsPerExpert(layout));
  if (n == 0) return cudaSuccess;
  auto* o13 = static_cast<uint16_t*>(plain_w13);
  auto* o2 = static_cast<uint16_t*>(plain_w2);
  if (elem_bytes == 2) {
    UnpackKernel<uint16_t><<<GridFor(n), kThreads, 0, stream>>>(
        static_cast<const uint16_t*>(packed_w13), nullptr, static_cast<const uint16_t*>(packed_w2),
        nullptr, num_experts, layout, o13, o2);
  } else {
    UnpackKernel<uint8_t><<<GridFor(n), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(packed_w13), packed_w13_scale,
        static_cast<const uint8_t*>(packed_w2), packed_w2_scale, num_experts, layout, o13, o2);
  }
  return cudaGetLastError();
}

cudaError_t LaunchMoeGatherRows(const uint16_t* x, const int32_t* sorted_routes,
                                const int32_t* served_rows, int64_t max_rows, int topk, int64_t h,
                                uint16_t* a1, cudaStream_t stream) {
  if (h % 8 != 0 || h / 8 > INT_MAX || topk <= 0) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(a1) % 16 != 0) {
    return cudaErrorInvalidValue;  // the kernel copies 16-byte units
  }
  if (max_rows == 0 || h == 0) return cudaSuccess;
  const int chunks = static_cast<int>(h / 8);
  GatherKernel<<<RowGrid(max_rows), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), sorted_routes, served_rows, max_rows, topk, chunks,
      reinterpret_cast<uint4*>(a1));
  return cudaGetLastError();
}

cudaError_t LaunchMoeSiluMul(const uint16_t* d1, const int32_t* served_rows, int64_t max_rows,
                             int64_t ip, uint16_t* a2, cudaStream_t stream) {
  if (ip % 8 != 0) return cudaErrorInvalidValue;
  if (max_rows == 0 || ip == 0) return cudaSuccess;
  const int64_t chunks = ip / 8;
  SiluMulKernel<<<GridFor(max_rows * chunks), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(d1), served_rows, max_rows, chunks,
      reinterpret_cast<uint4*>(a2));
  return cudaGetLastError();
}

cudaError_t LaunchMoeUnpermuteReduce(const uint16_t* d2, const int32_t* topk_ids,
                                     const float* topk_weights, const int32_t* expert_offsets,
                                     const int32_t* route_slot, int64_t num_tokens, int topk,
                                     int64_t h, int num_experts, float* out, cudaStream_t stream) {
  if (h % 8 != 0 || topk <= 0) return cudaErrorInvalidValue;
  if (num_tokens == 0 || h == 0) return cudaSuccess;
  const int64_t chunks = h / 8;
  UnpermuteReduceKernel<<<GridFor(num_tokens * chunks), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(d2), topk_ids, topk_weights, expert_offsets, route_slot,
      num_tokens, topk, chunks, num_experts, reinterpret_cast<float4*>(out));
  return cudaGetLastError();
}

cudaError_t LaunchUnpackMoeWeightsPlainFp8(const uint8_t* packed_w13,
                                           const uint8_t* packed_w13_scale,
                                           const uint8_t* packed_w2, const uint8_t* packed_w2_scale,
                                           int64_t num_experts, const MoePackedLayout& layout,
                                           uint8_t* w13, float* w13_scale, uint8_t* w2,
                                           float* w2_scale, cudaStream_t stream) {
  if (packed_w13_scale == nullptr || packed_w2_scale == nullptr || num_experts < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t items = num_experts *
                        (2 * layout.intermediate_padded * Fp8PaddedK(layout.hidden_padded) +
                         layout.hidden * Fp8PaddedK(layout.intermediate_padded)) /
                        kMoeFp8ScaleK;
  if (items == 0) return cudaSuccess;
  UnpackFp8Kernel<<<WarpGrid(items), kThreads, 0, stream>>>(packed_w13, packed_w13_scale, packed_w2,
                                                            packed_w2_scale, num_experts, layout,
                                                            w13, w13_scale, w2, w2_scale);
  return cudaGetLastError();
}

cudaError_t LaunchMoeGatherQuantizeRows(const uint16_t* x, const int32_t* sorted_routes,
                                        const int32_t* expert_counts, const int32_t* expert_offsets,
                                        int num_experts, int64_t max_rows, int topk, int64_t h,
                                        uint8_t* a1q, float* a1_scale, cudaStream_t stream) {
  if (h % 8 != 0 || topk <= 0 || num_experts <= 0) return cudaErrorInvalidValue;
  if (max_rows == 0 || h == 0) return cudaSuccess;
  QuantizeRowsKernel<<<WarpGrid(max_rows * (Fp8PaddedK(h) / kMoeFp8ScaleK)), kThreads, 0, stream>>>(
      GatheredRows{x, sorted_routes, topk, h}, expert_counts, expert_offsets, num_experts, max_rows,
      a1q, a1_scale);
  return cudaGetLastError();
}

cudaError_t LaunchMoeSiluMulQuantize(const uint16_t* d1, const int32_t* expert_counts,
                                     const int32_t* expert_offsets, int num_experts,
                                     int64_t max_rows, int64_t ip, uint8_t* a2q, float* a2_scale,
                                     cudaStream_t stream) {
  if (ip % 8 != 0 || num_experts <= 0) return cudaErrorInvalidValue;
  if (max_rows == 0 || ip == 0) return cudaSuccess;
  QuantizeRowsKernel<<<WarpGrid(max_rows * (Fp8PaddedK(ip) / kMoeFp8ScaleK)), kThreads, 0,
                       stream>>>(SiluMulRows{d1, ip}, expert_counts, expert_offsets, num_experts,
                                 max_rows, a2q, a2_scale);
  return cudaGetLastError();
}

}  // namespace moeserve::kernels
