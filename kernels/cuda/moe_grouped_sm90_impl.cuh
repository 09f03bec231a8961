// Internal to kernels/cuda/moe_grouped_sm90*.cu (built with CUTLASS for sm_90a only): the
// CUTLASS grouped GEMM configurations and the argument arrays they share. Each configuration is
// instantiated in a .cu file of its own so the two compile in parallel.
#ifndef MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_IMPL_CUH_
#define MOESERVE_KERNELS_CUDA_MOE_GROUPED_SM90_IMPL_CUH_

#include <cuda_runtime.h>

#include <cstddef>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "kernels/cuda/cutlass_run.cuh"

namespace moeserve::kernels::grouped_sm90 {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)
using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;
using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // activations [rows, K]
using LayoutB = cutlass::layout::ColumnMajor;  // weights [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // [rows, N]
constexpr int kAlign = 8;                      // 16 bytes of BF16
// Every operand: (leading stride, 1, no batch stride).
using Stride = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;

// The argument arrays, carved from the caller's workspace (each 256-byte aligned).
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

// BF16 x BF16 -> FP32 accumulation -> BF16, cluster 1x1 (a cluster along M would round each
// expert's M tiles up to the cluster size; along N the multicast would share only the
// activations, which L2 holds anyway); as many stages as fit beside the epilogue.
template <class TileShape, class KernelSchedule, class EpilogueSchedule>
struct Config {
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign,
      Element, LayoutD*, kAlign, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
      LayoutB*, kAlign, float, TileShape, ClusterShape,
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
                                  {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b},
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
