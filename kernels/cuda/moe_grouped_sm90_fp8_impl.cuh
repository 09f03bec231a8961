// Internal to kernels/cuda/moe_grouped_sm90*.cu (CUTLASS, sm_90a only): the FP8 grouped GEMM's
// operands with blockwise scaling (W8A8, moe_grouped_sm90.cuh) and their argument arrays. One
// configuration per .cu file so they compile in parallel.
#ifndef MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_FP8_IMPL_CUH_
#define MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_FP8_IMPL_CUH_

#include <cuda_runtime.h>

#include <cstddef>

#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "kernels/cuda/cutlass_grouped.cuh"

namespace moeserve::kernels::grouped_sm90_fp8 {

using cutlass_grouped::Stride;
using cutlass_grouped::UnderlyingShape;
using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
constexpr int kAlignAB = 16;  // 16 bytes of E4M3
constexpr int kAlignD = 8;    // 16 bytes of BF16
// One FP32 scale per row (M or N) per 128 K; Hopper reads them row index fastest.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

struct ArgArrays {
  UnderlyingShape* shapes;
  const ElementAB** ptr_a;
  const ElementAB** ptr_b;
  ElementD** ptr_d;
  const float** ptr_sfa;
  const float** ptr_sfb;
  Stride* stride_a;
  Stride* stride_b;
  Stride* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  void* cutlass_workspace;
  size_t end;  // bytes used up to the CUTLASS workspace
};

// E4M3 x E4M3 -> FP32 (promoted per 128 K with both scales) -> BF16.
struct Traits {
  using ElementAB = grouped_sm90_fp8::ElementAB;
  using ElementD = grouped_sm90_fp8::ElementD;
  using MainloopLayoutA = cute::tuple<cutlass_grouped::LayoutA*, LayoutSFA*>;
  using MainloopLayoutB = cute::tuple<cutlass_grouped::LayoutB*, LayoutSFB*>;
  static constexpr int kAlignAB = grouped_sm90_fp8::kAlignAB;
  static constexpr int kAlignD = grouped_sm90_fp8::kAlignD;
  using ArgArrays = grouped_sm90_fp8::ArgArrays;
  template <class Args>
  static Args Mainloop(const ArgArrays& a) {
    return {a.ptr_a,   a.stride_a,   a.ptr_b,   a.stride_b,
            a.ptr_sfa, a.layout_sfa, a.ptr_sfb, a.layout_sfb};
  }
};

template <class TileShape, class KernelSchedule, class EpilogueSchedule>
using Config =
    cutlass_grouped::PtrArrayGroupedGemm<Traits, TileShape, KernelSchedule, EpilogueSchedule>;

// 128x128x128, cooperative: more than 64 rows per expert. moe_grouped_sm90_fp8_coop.cu.
size_t CooperativeWorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms);
cudaError_t RunCooperative(const ArgArrays& a, int num_experts, int device, int num_sms,
                           cudaStream_t stream);
// 64x128x128, ping-pong: up to 64 rows per expert. moe_grouped_sm90_fp8_pingpong.cu.
size_t PingpongWorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms);
cudaError_t RunPingpong(const ArgArrays& a, int num_experts, int device, int num_sms,
                        cudaStream_t stream);

}  // namespace moeserve::kernels::grouped_sm90_fp8

#endif  // MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_FP8_IMPL_CUH_
