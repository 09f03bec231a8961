// Internal to the CUTLASS grouped GEMMs (kernels/cuda/moe_grouped_sm90*.cu; sm_90a): what every
// configuration shares. One CUTLASS sm90 ptr-array grouped GEMM type per (operand traits, tile,
// schedules), its arguments built from per-expert arrays on the device, and the carving of those
// arrays out of the caller's workspace.
#ifndef MOESERVE_KERNELS_CUDA_CUTLASS_GROUPED_CUH_
#define MOESERVE_KERNELS_CUDA_CUTLASS_GROUPED_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace moeserve::kernels::cutlass_grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K)
using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;
using LayoutA = cutlass::layout::RowMajor;     // activations [rows, K]
using LayoutB = cutlass::layout::ColumnMajor;  // weights [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // [rows, N]
// Every operand: (leading stride, 1, no batch stride).
using Stride = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;

// Takes 256-byte aligned arrays from a workspace, one after another. With a null base it only
// counts (the workspace size).
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(reinterpret_cast<uintptr_t>(base)) {}
  template <class T>
  T* Take(int64_t count) {
    T* p = reinterpret_cast<T*>(base_ + used_);
    used_ += (sizeof(T) * static_cast<size_t>(count) + 255) / 256 * 256;
    return p;
  }
  size_t used() const { return used_; }
  void* next() const { return reinterpret_cast<void*>(base_ + used_); }

 private:
  uintptr_t base_;
  size_t used_ = 0;
};

// The operands' traits (Traits):
//   ElementAB, ElementD, kAlignAB, kAlignD: element types and alignments (in elements);
//   MainloopLayoutA / MainloopLayoutB: the mainloop builder's layout tags (LayoutA* alone, or with
//     the scale factors' layout for blockwise scaling);
//   ArgArrays: the per-expert device arrays, with at least shapes, ptr_d and stride_d;
//   Mainloop<Args>(arrays): the mainloop's arguments from them.
// FP32 accumulation; cluster 1x1 (a cluster along M would round each expert's M tiles up to the
// cluster size; along N its multicast would share only the activations, which L2 holds anyway);
// as many stages as fit beside the epilogue.
template <class Traits, class TileShape, class KernelSchedule, class EpilogueSchedule>
struct PtrArrayGroupedGemm {
  using ArgArrays = typename Traits::ArgArrays;
  using ElementD = typename Traits::ElementD;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*,
      Traits::kAlignD, ElementD, LayoutD*, Traits::kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::ElementAB,
      typename Traits::MainloopLayoutA, Traits::kAlignAB, typename Traits::ElementAB,
      typename Traits::MainloopLayoutB, Traits::kAlignAB, float, TileShape, ClusterShape,
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
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = num_sms;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {num_experts, a.shapes, nullptr},  // shapes on the device only
        Traits::template Mainloop<typename GemmKernel::MainloopArguments>(a),
        {{}, nullptr, a.stride_d, a.ptr_d, a.stride_d},
        hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }

  static size_t WorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms) {
    return Gemm::get_workspace_size(Arguments(a, num_experts, 0, num_sms));
  }

  // Checks the arguments, initializes the kernel's parameters in a.cutlass_workspace (on
  // `stream`) and launches it there. Asynchronous; cudaErrorInvalidValue when CUTLASS cannot
  // implement the arguments.
  static cudaError_t Run(const ArgArrays& a, int num_experts, int device, int num_sms,
                         cudaStream_t stream) {
    const typename Gemm::Arguments args = Arguments(a, num_experts, device, num_sms);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    if (gemm.initialize(args, a.cutlass_workspace, stream) != cutlass::Status::kSuccess ||
        gemm.run(stream) != cutlass::Status::kSuccess) {
      const cudaError_t err = cudaGetLastError();
      return err != cudaSuccess ? err : cudaErrorLaunchFailure;
    }
    return cudaGetLastError();
  }
};

}  // namespace moeserve::kernels::cutlass_grouped

#endif  // MOESERVE_KERNELS_CUDA_CUTLASS_GROUPED_CUH_
