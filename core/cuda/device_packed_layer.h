// One layer's resident experts in the decode kernels' packed layout (kernels/cuda/moe_gemm.cuh),
// owned by DeviceWeightStore (core/cuda/cuda_backend.h). Internal to core/cuda: the CUDA Experts
// read it (this header includes the CUDA runtime's through moe_gemm.cuh: core/cuda only).
#ifndef MOESERVE_CORE_CUDA_DEVICE_PACKED_LAYER_H_
#define MOESERVE_CORE_CUDA_DEVICE_PACKED_LAYER_H_

#include <cstdint>

#include "core/weights.h"
#include "kernels/cuda/moe_gemm.cuh"

namespace moeserve {

struct DevicePackedLayer {
  WeightFormat format = WeightFormat::kBF16;
  int64_t num_local_experts = 0;
  kernels::MoePackedLayout layout;
  void* w13 = nullptr;  // device memory, owned (cudaFree on destruction)
  void* w2 = nullptr;
  uint8_t* w13_scale = nullptr;
  uint8_t* w2_scale = nullptr;
  // MXFP8: the largest packed E8M0 scale code (kernels::MoeGemmParams::mxfp8_max_scale_code).
  int32_t max_scale_code = 255;
  ~DevicePackedLayer();
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_DEVICE_PACKED_LAYER_H_
