#include "kernels/cuda/ep_pack.cuh"

namespace moeserve::kernels {
namespace {

// One block per output row (grid-stride over rows), 16-byte vectors along hidden.
__global__ void EpGatherRowsKernel(const uint4* __restrict__ x, const int32_t* __restrict__ src,
                                   int64_t num_rows, int64_t vecs, uint4* __restrict__ out) {
  for (int64_t s = blockIdx.x; s < num_rows; s += gridDim.x) {
    const uint4* in = x + static_cast<int64_t>(src[s]) * vecs;
    uint4* o = out + s * vecs;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) o[v] = in[v];
  }
}

// One block per token (grid-stride), float4 along hidden when aligned.
__global__ void EpCombineReduceKernel(const float* __restrict__ partials,
                                      const int32_t* __restrict__ offsets,
                                      const int32_t* __restrict__ slots, int64_t num_tokens,
                                      int64_t hidden, float* __restrict__ out) {
  const bool vec = hidden % 4 == 0;
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int32_t b = offsets[t], e = offsets[t + 1];
    if (vec) {
      const int64_t n4 = hidden / 4;
      for (int64_t v = threadIdx.x; v < n4; v += blockDim.x) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int32_t j = b; j < e; ++j) {
          const float4 p = reinterpret_cast<const float4*>(
              partials + static_cast<int64_t>(slots[j]) * hidden)[v];
          acc.x += p.x, acc.y += p.y, acc.z += p.z, acc.w += p.w;
        }
        reinterpret_cast<float4*>(out + t * hidden)[v] = acc;
      }
    } else {
      for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
        float acc = 0.f;
        for (int32_t j = b; j < e; ++j)
          acc += partials[static_cast<int64_t>(slots[j]) * hidden + h];
        out[t * hidden + h] = acc;
      }
    }
  }
}

int GridFor(int64_t rows) { return static_cast<int>(rows < 65535 ? rows : 65535); }

}  // namespace

cudaError_t LaunchEpGatherRows(const uint16_t* x, const int32_t* src_row, int64_t num_rows,
                               int64_t hidden, uint16_t* out, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  const int64_t vecs = hidden / 8;
  const int threads = vecs >= 256 ? 256 : (vecs >= 128 ? 128 : 64);
  EpGatherRowsKernel<<<GridFor(num_rows), threads, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), src_row, num_rows, vecs, reinterpret_cast<uint4*>(out));
  return cudaGetLastError();
}

cudaError_t LaunchEpCombineReduce(const float* partials, const int32_t* offsets,
                                  const int32_t* slots, int64_t num_tokens, int64_t hidden,
                                  float* out, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  EpCombineReduceKernel<<<GridFor(num_tokens), 256, 0, stream>>>(partials, offsets, slots,
                                                                 num_tokens, hidden, out);
  return cudaGetLastError();
}

}  // namespace moeserve::kernels
