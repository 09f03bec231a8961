// Expert-parallel dispatch/combine helpers on the device (used by the NCCL all-to-all
// PrepareAndFinalize in core/cuda/nccl_all_to_all.*). Launchers are asynchronous on `stream`.
// CPU twins (EpGatherRowsRef, EpCombineReduceRef) are the specification.
#ifndef MOESERVE_KERNELS_CUDA_EP_PACK_CUH_
#define MOESERVE_KERNELS_CUDA_EP_PACK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace moeserve::kernels {

// Dispatch pack: out[s, :] = x[src_row[s], :] for s in [0, num_rows); BF16 rows of `hidden`
// elements (hidden % 8 == 0: 16-byte vectors). Each source token appears once per destination
// rank, so out is the send buffer grouped by destination.
cudaError_t LaunchEpGatherRows(const uint16_t* x, const int32_t* src_row, int64_t num_rows,
                               int64_t hidden, uint16_t* out, cudaStream_t stream);

// Combine reduce on the source rank: out[t, :] = sum over j in [offsets[t], offsets[t+1]) of
// partials[slots[j], :], summed in j order (callers list each token's slots in ascending rank
// order, which makes the sum deterministic and equal to the CPU oracle's). FP32.
cudaError_t LaunchEpCombineReduce(const float* partials, const int32_t* offsets,
                                  const int32_t* slots, int64_t num_tokens, int64_t hidden,
                                  float* out, cudaStream_t stream);

inline void EpGatherRowsRef(const uint16_t* x, const int32_t* src_row, int64_t num_rows,
                            int64_t hidden, uint16_t* out) {
  for (int64_t s = 0; s < num_rows; ++s) {
    for (int64_t h = 0; h < hidden; ++h) out[s * hidden + h] = x[src_row[s] * hidden + h];
  }
}

inline void EpCombineReduceRef(const float* partials, const int32_t* offsets, const int32_t* slots,
                               int64_t num_tokens, int64_t hidden, float* out) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      for (int32_t j = offsets[t]; j < offsets[t + 1]; ++j) acc += partials[slots[j] * hidden + h];
      out[t * hidden + h] = acc;
    }
  }
}

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_EP_PACK_CUH_
