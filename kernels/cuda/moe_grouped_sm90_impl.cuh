// Internal to kernels/cuda/moe_grouped_sm90*.cu (built with CUTLASS for sm_90a only): the BF16
// grouped GEMM's operands and argument arrays. Each configuration is instantiated in a .cu file
// of its own so the two compile in parallel.
#ifndef MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_IMPL_CUH_
#define MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_IMPL_CUH_

#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/cutlass_grouped.cuh"

namespace moeserve::kernels::grouped_sm90 {

using cutlass_grouped::Stride;
using cutlass_grouped::UnderlyingShape;
using Element = cutlass::bfloat16_t;
constexpr int kAlign = 8;  // 16 bytes of BF16

// The argument arrays, carved from the caller's workspace.
struct ArgArrays {
  UnderlyingShape* shapes;
  const Element** ptr_a;
  const Element** ptr_b;
  Element** ptr_d;
  Stride* stride_a;
  Stride* stride_b;
  Stride* stride_d;
  void* cutlass_workspace;
  size_t end;  // bytes used up to the CUTLASS workspace
};

// BF16 x BF16 -> FP32 accumulation -> BF16.
struct Traits {
  using ElementAB = Element;
  using ElementD = Element;
  using MainloopLayoutA = cutlass_grouped::LayoutA*;
  using MainloopLayoutB = cutlass_grouped::LayoutB*;
  static constexpr int kAlignAB = kAlign;
  static constexpr int kAlignD = kAlign;
  using ArgArrays = grouped_sm90::ArgArrays;
  template <class Args>
  static Args Mainloop(const ArgArrays& a) {
    return {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b};
  }
};

template <class TileShape, class KernelSchedule, class EpilogueSchedule>
using Config =
    cutlass_grouped::PtrArrayGroupedGemm<Traits, TileShape, KernelSchedule, EpilogueSchedule>;

// 128x256x64 tiles, cooperative (two consumer warpgroups of 64x256): experts with more than 64
// rows. Defined in moe_grouped_sm90_coop.cu.
size_t CooperativeWorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms);
cudaError_t RunCooperative(const ArgArrays& a, int num_experts, int device, int num_sms,
                           cudaStream_t stream);
// 64x256x64 tiles, ping-pong (each consumer warpgroup a tile of its own): up to 64 rows per
// expert, where a 128-row tile would do twice the MMA work. Defined in
// moe_grouped_sm90_pingpong.cu.
size_t PingpongWorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms);
cudaError_t RunPingpong(const ArgArrays& a, int num_experts, int device, int num_sms,
                        cudaStream_t stream);

}  // namespace moeserve::kernels::grouped_sm90

#endif  // MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_IMPL_CUH_
