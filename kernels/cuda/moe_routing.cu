#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/moe_routing.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/fp16_bits.h"

namespace moeserve::kernels {
namespace {

// One block. Each warp owns a contiguous segment of routes; counters per (warp, expert) in
// shared memory make the scatter stable without atomics: pass 1 counts, a scan turns counts into
// bases, pass 2 walks the segment again in order and places each route.
__global__ void MoeAlignKernel(const int32_t* __restrict__ ids, int64_t num_routes, int num_experts,
                               int32_t* __restrict__ counts, int32_t* __restrict__ offsets,
                               int32_t* __restrict__ sorted, int32_t* __restrict__ slot) {
  PdlWait();
  PdlLaunchDependents();
  extern __shared__ int32_t smem[];
  const int num_warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t* cnt = smem;                             // [num_warps][E]
  int32_t* excl = smem + num_warps * num_experts;  // [E]
  for (int i = threadIdx.x; i < num_warps * num_experts; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  const int64_t seg = ((num_routes + num_warps - 1) / num_warps + 31) / 32 * 32;
  const int64_t begin = warp * seg;
  const int64_t end = begin + seg < num_routes ? begin + seg : num_routes;
  int32_t* my = cnt + warp * num_experts;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t r = base + lane;
    const int e = r < end ? ids[r] : -1;
    const bool valid = e >= 0 && e < num_experts;
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    if (valid && lane == __ffs(peers) - 1) my[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t run = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int32_t c = cnt[w * num_experts + e];
      cnt[w * num_experts + e] = run;
      run += c;
    }
    excl[e] = run;  // total for now
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the totals: each lane a contiguous chunk
    const int chunk = (num_experts + 31) / 32;
    const int lo = lane * chunk, hi = min(num_experts, lo + chunk);
    int32_t sum = 0;
    for (int e = lo; e < hi; ++e) sum += excl[e];
    int32_t inc = sum;
    for (int d = 1; d < 32; d *= 2) {
      const int32_t v = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += v;
    }
    int32_t run = inc - sum;
    for (int e = lo; e < hi; ++e) {
      const int32_t c = excl[e];
      counts[e] = c;
      offsets[e] = run;
      excl[e] = run;
      run += c;
    }
    if (lane == 31) offsets[num_experts] = inc;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < num_warps * num_experts; i += blockDim.x) {
    cnt[i] += excl[i % num_experts];
  }
  __syncthreads();
  const unsigned lt = (1u << lane) - 1;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t r = base + lane;
    const int e = r < end ? ids[r] : -1;
    const bool valid = e >= 0 && e < num_experts;
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    if (valid) {
      const int32_t pos = my[e] + __popc(peers & lt);
      sorted[pos] = static_cast<int32_t>(r);
      slot[r] = pos - excl[e];
    } else if (r < end) {
      slot[r] = -1;
    }
    __syncwarp();
    if (valid && lane == __ffs(peers) - 1) my[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // Unserved tail of sorted_routes.
  for (int64_t i = threadIdx.x; i < num_routes; i += blockDim.x) {
    if (i >= offsets[num_experts]) sorted[i] = -1;
  }
}

// The alignment over several blocks (LaunchMoeAlign with scratch), for many routes: one block's
// pass over 8192 routes is 19-27 us on an H100, its warps stalled on match.any and shared memory
// (short scoreboard; Nsight Compute, 2026-12-05). Block b owns routes [b * 32 * per_warp, (b + 1) *
// 32 * per_warp), each of its kAlignWarps warps a contiguous piece of per_warp. The count kernel
// stores each warp's counts as exclusive prefixes within its block (scratch "warp" [B][32][E]) and
// the block's totals ("block" [B][E]); the place kernel turns them into positions (experts in
// order, then blocks, then warps, then routes: the same stable order as the one-block kernel) and
// places the block's routes.
constexpr int kAlignWarps = 32;

__global__ void MoeAlignCountKernel(const int32_t* __restrict__ ids, int64_t num_routes,
                                    int num_experts, int64_t per_warp,
                                    int32_t* __restrict__ block_totals,
                                    int32_t* __restrict__ warp_bases) {
  PdlWait();
  PdlLaunchDependents();
  extern __shared__ int32_t cnt[];  // [kAlignWarps][E]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, E = num_experts;
  for (int i = threadIdx.x; i < kAlignWarps * E; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) * kAlignWarps + warp) * per_warp;
  const int64_t end = begin + per_warp < num_routes ? begin + per_warp : num_routes;
  int32_t* my = cnt + warp * E;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t r = base + lane;
    const int e = r < end ? ids[r] : -1;
    const bool valid = e >= 0 && e < E;
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    if (valid && lane == __ffs(peers) - 1) my[e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  int32_t* out = warp_bases + static_cast<int64_t>(blockIdx.x) * kAlignWarps * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = 0;
    for (int w = 0; w < kAlignWarps; ++w) {
      out[w * E + e] = run;
      run += cnt[w * E + e];
    }
    block_totals[static_cast<int64_t>(blockIdx.x) * E + e] = run;
  }
}

__global__ void MoeAlignPlaceKernel(const int32_t* __restrict__ ids, int64_t num_routes,
                                    int num_experts, int64_t per_warp,
                                    const int32_t* __restrict__ block_totals,
                                    const int32_t* __restrict__ warp_bases,
                                    int32_t* __restrict__ counts, int32_t* __restrict__ offsets,
                                    int32_t* __restrict__ sorted, int32_t* __restrict__ slot) {
  PdlWait();
  PdlLaunchDependents();
  extern __shared__ int32_t smem[];
  const int E = num_experts, blocks = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t* pos = smem;                     // [kAlignWarps][E]: each warp's next position
  int32_t* excl = smem + kAlignWarps * E;  // [E]: expert e's first position
  int32_t* before = excl + E;              // [E]: routes of e in the blocks before b
  __shared__ int32_t served;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t total = 0, earlier = 0;
    for (int k = 0; k < blocks; ++k) {
      const int32_t c = block_totals[static_cast<int64_t>(k) * E + e];
      if (k < b) earlier += c;
      total += c;
    }
    excl[e] = total;  // the total for now
    before[e] = earlier;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scan of the totals: each lane a contiguous chunk
    const int chunk = (E + 31) / 32;
    const int lo = lane * chunk, hi = min(E, lo + chunk);
    int32_t sum = 0;
    for (int e = lo; e < hi; ++e) sum += excl[e];
    int32_t inc = sum;
    for (int d = 1; d < 32; d *= 2) {
      const int32_t v = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += v;
    }
    int32_t run = inc - sum;
    for (int e = lo; e < hi; ++e) {
      const int32_t c = excl[e];
      if (b == 0) {
        counts[e] = c;
        offsets[e] = run;
      }
      excl[e] = run;
      run += c;
    }
    if (lane == 31) {
      served = inc;
      if (b == 0) offsets[E] = inc;
    }
  }
  __syncthreads();
  const int32_t* mine = warp_bases + static_cast<int64_t>(b) * kAlignWarps * E;
  for (int i = threadIdx.x; i < kAlignWarps * E; i += blockDim.x) {
    const int e = i % E;
    pos[i] = mine[i] + excl[e] + before[e];
  }
  __syncthreads();
  const int64_t begin = (static_cast<int64_t>(b) * kAlignWarps + warp) * per_warp;
  const int64_t end = begin + per_warp < num_routes ? begin + per_warp : num_routes;
  int32_t* my = pos + warp * E;
  const unsigned lt = (1u << lane) - 1;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t r = base + lane;
    const int e = r < end ? ids[r] : -1;
    const bool valid = e >= 0 && e < E;
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    if (valid) {
      const int32_t p = my[e] + __popc(peers & lt);
      sorted[p] = static_cast<int32_t>(r);
      slot[r] = p - excl[e];
    } else if (r < end) {
      slot[r] = -1;
    }
    __syncwarp();
    if (valid && lane == __ffs(peers) - 1) my[e] += __popc(peers);
    __syncwarp();
  }
  // Unserved tail of sorted_routes, this block's share of it.
  const int64_t lo = static_cast<int64_t>(b) * kAlignWarps * per_warp;
  const int64_t hi =
      lo + kAlignWarps * per_warp < num_routes ? lo + kAlignWarps * per_warp : num_routes;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    if (i >= served) sorted[i] = -1;
  }
}

// How LaunchMoeAlign spreads num_routes over blocks: 0 blocks where it takes one block.
struct AlignSplit {
  int blocks = 0;
  int64_t per_warp = 0;
};
AlignSplit SplitAlign(int64_t num_routes, int num_experts) {
  AlignSplit s;
  if (num_experts > kMoeAlignMultiBlockMaxExperts || num_routes < kMoeAlignMultiBlockMinRoutes) {
    return s;
  }
  const int64_t blocks =
      std::min<int64_t>((num_routes + kMoeAlignBlockRoutes - 1) / kMoeAlignBlockRoutes, 128);
  const int64_t per_block = (num_routes + blocks - 1) / blocks;
  s.per_warp = ((per_block + kAlignWarps - 1) / kAlignWarps + 31) / 32 * 32;
  s.blocks = static_cast<int>(blocks);
  return s;
}

__global__ void PermuteToBatchedKernel(const uint16_t* __restrict__ x,
                                       const int32_t* __restrict__ ids,
                                       const int32_t* __restrict__ slot, int64_t num_routes,
                                       int topk, int64_t hidden, int num_experts,
                                       int64_t max_tokens, uint16_t* __restrict__ out) {
  // One block per route; 16-byte copies when rows are 16-byte aligned.
  for (int64_t r = blockIdx.x; r < num_routes; r += gridDim.x) {
    const int e = ids[r];
    const int s = slot[r];
    if (e < 0 || e >= num_experts || s < 0 || s >= max_tokens) continue;
    const uint16_t* src = x + (r / topk) * hidden;
    uint16_t* dst = out + (e * max_tokens + s) * hidden;
    if (hidden % 8 == 0) {
      for (int64_t i = threadIdx.x; i < hidden / 8; i += blockDim.x) {
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
      }
    } else {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
    }
  }
}

// Rounds the FP32 sums to the output: BF16 to nearest even, FP16 as the host twin
// (ConvertFp32ToFp16Ref), so that reduce-then-convert and the fused form agree bit for bit.
template <ReduceOutput kOut>
__device__ __forceinline__ uint16_t RoundHalf(float x) {
  if constexpr (kOut == ReduceOutput::kBf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return Fp32BitsToFp16Bits(__float_as_uint(x));
  }
}

template <ReduceOutput kOut>
__device__ __forceinline__ void StoreReduced(void* out, int64_t index, float4 acc, bool vec) {
  if constexpr (kOut == ReduceOutput::kFp32) {
    if (vec) {
      reinterpret_cast<float4*>(out)[index] = acc;
    } else {
      static_cast<float*>(out)[index] = acc.x;
    }
  } else if (vec) {
    // 8 bytes a thread: the output may be page-locked host memory written over PCIe.
    uint2 packed;
    packed.x = static_cast<uint32_t>(RoundHalf<kOut>(acc.x)) |
               (static_cast<uint32_t>(RoundHalf<kOut>(acc.y)) << 16);
    packed.y = static_cast<uint32_t>(RoundHalf<kOut>(acc.z)) |
               (static_cast<uint32_t>(RoundHalf<kOut>(acc.w)) << 16);
    reinterpret_cast<uint2*>(out)[index] = packed;
  } else {
    static_cast<uint16_t*>(out)[index] = RoundHalf<kOut>(acc.x);
  }
}

template <bool kBatched, ReduceOutput kOut>
__global__ void TopKReduceKernel(const float* __restrict__ in, const float* __restrict__ w,
                                 const int32_t* __restrict__ ids, const int32_t* __restrict__ slot,
                                 int64_t num_tokens, int topk, int64_t hidden, int num_experts,
                                 int64_t max_tokens, void* __restrict__ out) {
  PdlWait();
  PdlLaunchDependents();
  const bool vec = hidden % 4 == 0;
  const int64_t per_row = vec ? hidden / 4 : hidden;
  const int64_t total = num_tokens * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_row, c = i % per_row;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int k = 0; k < topk; ++k) {
      const int64_t r = t * topk + k;
      const int e = ids != nullptr ? ids[r] : 0;
      if (ids != nullptr && (e < 0 || e >= num_experts)) continue;
      int64_t row = r;
      if (kBatched) {
        const int s = slot[r];
        if (s < 0 || s >= max_tokens) continue;
        row = e * max_tokens + s;
      }
      const float wt = w[r];
      if (vec) {
        const float4 v = reinterpret_cast<const float4*>(in + row * hidden)[c];
        acc.x += wt * v.x;
        acc.y += wt * v.y;
        acc.z += wt * v.z;
        acc.w += wt * v.w;
      } else {
        acc.x += wt * in[row * hidden + c];
      }
    }
    // Element (t, c) of the output: t * per_row + c == i.
    StoreReduced<kOut>(out, i, acc, vec);
  }
}

int ReduceBlocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<int>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

}  // namespace

int64_t MoeAlignScratchInts(int64_t num_routes, int num_experts) {
  const AlignSplit s = SplitAlign(num_routes, num_experts);
  return static_cast<int64_t>(s.blocks) * (kAlignWarps + 1) * num_experts;
}

cudaError_t LaunchMoeAlign(const int32_t* topk_ids, int64_t num_routes, int num_experts,
                           int32_t* expert_counts, int32_t* expert_offsets, int32_t* sorted_routes,
                           int32_t* route_slot, cudaStream_t stream, int32_t* scratch) {
  if (num_experts <= 0 || num_experts > kMoeAlignMaxExperts) return cudaErrorInvalidValue;
  if (const AlignSplit split = SplitAlign(num_routes, num_experts);
      scratch != nullptr && split.blocks > 0) {
    int32_t* block_totals = scratch;
    int32_t* warp_bases = scratch + static_cast<int64_t>(split.blocks) * num_experts;
    const size_t count_smem = static_cast<size_t>(kAlignWarps) * num_experts * sizeof(int32_t);
    const size_t place_smem = static_cast<size_t>(kAlignWarps + 2) * num_experts * sizeof(int32_t);
    if (const cudaError_t err = LaunchPdl(
            MoeAlignCountKernel, dim3(split.blocks), dim3(kAlignWarps * 32), count_smem, stream,
            topk_ids, num_routes, num_experts, split.per_warp, block_totals, warp_bases);
        err != cudaSuccess) {
      return err;
    }
    return LaunchPdl(MoeAlignPlaceKernel, dim3(split.blocks), dim3(kAlignWarps * 32), place_smem,
                     stream, topk_ids, num_routes, num_experts, split.per_warp,
                     static_cast<const int32_t*>(block_totals),
                     static_cast<const int32_t*>(warp_bases), expert_counts, expert_offsets,
                     sorted_routes, route_slot);
  }
  int warps = static_cast<int>(48 * 1024 / 4 / num_experts) - 1;
  // A warp per 128 routes or more: a decode step's few routes need one warp, not 32 of them
  // zeroing counters and meeting at every barrier.
  const int64_t useful = (num_routes + 127) / 128;
  if (useful < warps) warps = static_cast<int>(useful);
  warps = warps < 1 ? 1 : (warps > 32 ? 32 : warps);
  const size_t smem = static_cast<size_t>(warps + 1) * num_experts * sizeof(int32_t);
  return LaunchPdl(MoeAlignKernel, dim3(1), dim3(warps * 32), smem, stream, topk_ids, num_routes,
                   num_experts, expert_counts, expert_offsets, sorted_routes, route_slot);
}

cudaError_t LaunchPermuteToBatched(const uint16_t* x, const int32_t* topk_ids,
                                   const int32_t* route_slot, int64_t num_tokens, int topk,
                                   int64_t hidden, int num_experts, int64_t max_tokens,
                                   uint16_t* out, cudaStream_t stream) {
  const int64_t routes = num_tokens * topk;
  if (routes == 0) return cudaSuccess;
  const int blocks = static_cast<int>(routes < 8192 ? routes : 8192);
  PermuteToBatchedKernel<<<blocks, 128, 0, stream>>>(x, topk_ids, route_slot, routes, topk, hidden,
                                                     num_experts, max_tokens, out);
  return cudaGetLastError();
}

cudaError_t LaunchTopKWeightAndReduceContiguous(const float* in, const float* topk_weights,
                                                const int32_t* topk_ids, int64_t num_tokens,
                                                int topk, int64_t hidden, int num_experts,
                                                void* out, ReduceOutput out_kind,
                                                cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  const int64_t n = num_tokens * (hidden % 4 == 0 ? hidden / 4 : hidden);
  auto launch = [&](auto kernel) {
    return LaunchPdl(kernel, dim3(ReduceBlocks(n)), dim3(256), 0, stream, in, topk_weights,
                     topk_ids, static_cast<const int32_t*>(nullptr), num_tokens, topk, hidden,
                     num_experts, int64_t{0}, out);
  };
  switch (out_kind) {
    case ReduceOutput::kFp32:
      return launch(TopKReduceKernel<false, ReduceOutput::kFp32>);
    case ReduceOutput::kBf16:
      return launch(TopKReduceKernel<false, ReduceOutput::kBf16>);
    case ReduceOutput::kFp16:
      return launch(TopKReduceKernel<false, ReduceOutput::kFp16>);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchTopKWeightAndReduceContiguous(const float* in, const float* topk_weights,
                                                const int32_t* topk_ids, int64_t num_tokens,
                                                int topk, int64_t hidden, int num_experts,
                                                float* out, cudaStream_t stream) {
  return LaunchTopKWeightAndReduceContiguous(in, topk_weights, topk_ids, num_tokens, topk, hidden,
                                             num_experts, out, ReduceOutput::kFp32, stream);
}

cudaError_t LaunchTopKWeightAndReduceNaiveBatched(const float* in, const float* topk_weights,
                                                  const int32_t* topk_ids,
                                                  const int32_t* route_slot, int64_t num_tokens,
                                                  int topk, int64_t hidden, int num_experts,
                                                  int64_t max_tokens, float* out,
                                                  cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  if (topk_ids == nullptr || route_slot == nullptr) return cudaErrorInvalidValue;
  const int64_t n = num_tokens * (hidden % 4 == 0 ? hidden / 4 : hidden);
  return LaunchPdl(TopKReduceKernel<true, ReduceOutput::kFp32>, dim3(ReduceBlocks(n)), dim3(256), 0,
                   stream, in, topk_weights, topk_ids, route_slot, num_tokens, topk, hidden,
                   num_experts, max_tokens, out);
}

namespace {

constexpr unsigned long long kNoRoute = ~0ull;

// One block: each thread stages a strided share of the routes; the first offender of each kind
// is the smallest route index, found with shared-memory atomics.
__global__ void StageRoutingKernel(const int32_t* __restrict__ ids, const float* __restrict__ w,
                                   int64_t routes, int64_t padded_routes, int num_experts,
                                   const int32_t* __restrict__ map, int num_local, float max_abs,
                                   int32_t* __restrict__ out_ids, float* __restrict__ out_w,
                                   RoutingReport* report) {
  __shared__ unsigned long long first_id, first_w;
  if (threadIdx.x == 0) first_id = first_w = kNoRoute;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < padded_routes; r += blockDim.x) {
    int32_t id = -1;
    float x = 0.0f;
    if (r < routes) {
      id = ids[r];  // read once: the staged value is the checked one
      x = w[r];
      if (id < 0 || id >= num_experts) {
        atomicMin(&first_id, static_cast<unsigned long long>(r));
        id = -1;
      } else if (map != nullptr) {
        id = map[id];
      }
      if (id < -1 || id >= num_local) id = -1;
      if (!isfinite(x) || fabsf(x) > max_abs) {
        atomicMin(&first_w, static_cast<unsigned long long>(r));
        x = 0.0f;
      }
    }
    out_ids[r] = id;
    out_w[r] = x;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    RoutingReport rep;
    if (first_id != kNoRoute) {
      rep.bad_id_route = static_cast<int64_t>(first_id);
      rep.bad_id_value = ids[first_id];
    }
    if (first_w != kNoRoute) {
      rep.bad_weight_route = static_cast<int64_t>(first_w);
      rep.bad_weight_value = w[first_w];
    }
    *report = rep;
  }
}

}  // namespace

cudaError_t LaunchStageRouting(const int32_t* topk_ids, const float* topk_weights,
                               int64_t num_tokens, int topk, int64_t padded_tokens, int num_experts,
                               const int32_t* expert_map, int num_local_experts,
                               float max_abs_weight, int32_t* out_ids, float* out_weights,
                               RoutingReport* report, cudaStream_t stream) {
  if (num_tokens < 0 || padded_tokens < num_tokens || topk <= 0 || report == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t padded_routes = padded_tokens * topk;
  const int threads = static_cast<int>(
      std::min<int64_t>(1024, std::max<int64_t>(32, (padded_routes + 31) / 32 * 32)));
  StageRoutingKernel<<<1, threads, 0, stream>>>(
      topk_ids, topk_weights, num_tokens * topk, padded_routes, num_experts, expert_map,
      num_local_experts, max_abs_weight, out_ids, out_weights, report);
  return cudaGetLastError();
}

}  // namespace moeserve::kernels
