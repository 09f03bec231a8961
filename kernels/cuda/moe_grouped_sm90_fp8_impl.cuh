// Internal to kernels/cuda/moe_grouped_sm90*.cu (CUTLASS, sm_90a only): the FP8 grouped GEMM
// configurations with blockwise scaling (W8A8, moe_grouped_sm90.cuh) and their argument arrays.
// One configuration per .cu file so they compile in parallel.
#ifndef MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_FP8_IMPL_CUH_
#define MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_FP8_IMPL_CUH_

#include <cuda_runtime.h>

#include <cstddef>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "kernels/cuda/cutlass_run.cuh"

namespace moeserve::kernels::grouped_sm90_fp8 {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)
using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;
using ElementAB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // activations [rows, K]
using LayoutB = cutlass::layout::ColumnMajor;  // weights [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // [rows, N]
constexpr int kAlignAB = 16;                   // 16 bytes of E4M3
constexpr int kAlignD = 8;                     // 16 bytes of BF16
using Stride = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
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

// E4M3 x E4M3 -> FP32 (promoted per 128 K with both scales) -> BF16, cluster 1x1 (as the BF16
// configurations, moe_grouped_sm90_impl.cuh).
template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct Config {
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideA, Stride> &&
                std::is_same_v<typename GemmKernel::InternalStrideB, Stride> &&
                std::is_same_v<typename GemmKernel::InternalStrideD, Stride>);

  static typename Gemm::Arguments Arguments(const ArgArrays& a, int num_experts, int device,
                                            int num_sms) {
    const cutlass::KernelHardwareInfo hw = CutlassHardware(device, num_sms);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {num_experts, a.shapes, nullptr},  // shapes on the device only
                                  {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b, a.ptr_sfa,
                                   a.layout_sfa, a.ptr_sfb, a.layout_sfb},
                                  {{}, nullptr, a.stride_d, a.ptr_d, a.stride_d},
                                  hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }

  static size_t WorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms) {
    return Gemm::get_workspace_size(Arguments(a, num_experts, 0, num_sms));
  }

  static cudaError_t Run(const ArgArrays& a, int num_experts, int device, int num_sms,
                         cudaStream_t stream) {
    return RunCutlassGemm<Gemm>(Arguments(a, num_experts, device, num_sms), a.cutlass_workspace,
                                stream);
  }
};

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
