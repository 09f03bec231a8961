// The kernels around the grouped GEMMs of moe_grouped_sm90.cuh (any architecture): the plain
// weight layout, the row gather, SiLU-and-mul and the unpermute with the top-k reduction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>

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

}  // namespace moeserve::kernels
