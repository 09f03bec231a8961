// The grouped GEMM of moe_grouped_sm90.cuh through CUTLASS's API (sm90 ptr-array grouped GEMM).
// Compiled for sm_90a alone; without CUTLASS (MOESERVE_HAVE_CUTLASS_SM90 unset) it is a stub
// whose launcher reports cudaErrorNotSupported.
//
// One kernel type serves both GEMMs of the MLP (same element types and layouts; the problem
// shapes and pointers are arguments), so the file holds a single CUTLASS instantiation:
// 128x256x64 tiles, cooperative (two consumer warpgroups of 64x256), cluster 1x1, stages as
// many as fit next to the epilogue's shared memory. Cluster 1x1 because a cluster along M would
// round each expert's M tiles up to the cluster size (an expert with 64 routes would occupy two
// CTAs); along N the multicast would share the activations, which L2 already holds.
#include <atomic>

#include "kernels/cuda/moe_grouped_sm90.cuh"

#if MOESERVE_HAVE_CUTLASS_SM90
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace moeserve::kernels {

#if MOESERVE_HAVE_CUTLASS_SM90
namespace {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K)
using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // activations [rows, K]
using LayoutB = cutlass::layout::ColumnMajor;  // weights [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;     // [rows, N]
constexpr int kAlign = 8;                      // 16 bytes of BF16

using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign, Element,
    LayoutD*, kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
    LayoutB*, kAlign, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel =
    cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;

// The argument arrays, carved from the caller's workspace (each 256-byte aligned).
struct ArgArrays {
  UnderlyingShape* shapes;
  const Element** ptr_a;
  const Element** ptr_b;
  Element** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  void* cutlass_workspace;
  size_t end;  // bytes used up to the CUTLASS workspace
};

size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

ArgArrays Carve(void* base, int e) {
  ArgArrays a;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    void* p = static_cast<char*>(base) + off;
    off += Align256(bytes);
    return p;
  };
  a.shapes = static_cast<UnderlyingShape*>(take(sizeof(UnderlyingShape) * e));
  a.ptr_a = static_cast<const Element**>(take(sizeof(void*) * e));
  a.ptr_b = static_cast<const Element**>(take(sizeof(void*) * e));
  a.ptr_d = static_cast<Element**>(take(sizeof(void*) * e));
  a.stride_a = static_cast<StrideA*>(take(sizeof(StrideA) * e));
  a.stride_b = static_cast<StrideB*>(take(sizeof(StrideB) * e));
  a.stride_d = static_cast<StrideD*>(take(sizeof(StrideD) * e));
  a.end = off;
  a.cutlass_workspace = static_cast<char*>(base) + off;
  return a;
}

// Per-expert problem (rows = that expert's count, 0 for an empty expert, which the group
// scheduler skips) and pointers, from the device counts: no host synchronization.
__global__ void SetupKernel(MoeGroupedSm90Gemm g, ArgArrays a) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= g.num_experts) return;
  const int rows = max(g.expert_counts[e], 0);
  const int64_t o = g.expert_offsets[e];
  a.shapes[e] = UnderlyingShape(rows, static_cast<int>(g.n), static_cast<int>(g.k));
  a.ptr_a[e] = reinterpret_cast<const Element*>(g.a) + o * g.lda;
  a.ptr_b[e] = reinterpret_cast<const Element*>(g.b) + e * g.b_expert_stride;
  a.ptr_d[e] = reinterpret_cast<Element*>(g.d) + o * g.ldd;
  a.stride_a[e] = StrideA{g.lda, Int<1>{}, Int<0>{}};
  a.stride_b[e] = StrideB{g.ldb, Int<1>{}, Int<0>{}};
  a.stride_d[e] = StrideD{g.ldd, Int<1>{}, Int<0>{}};
}

typename Gemm::Arguments MakeArguments(const ArgArrays& a, int num_experts, int device,
                                       int num_sms) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = num_sms;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_experts, a.shapes, nullptr},  // problem shapes on the device only
      {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b},
      {{}, nullptr, a.stride_d, a.ptr_d, a.stride_d},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

// Compute capability (major * 10 + minor) per device, read once; 0 when unreadable.
int CachedComputeCapability(int device) {
  static std::atomic<int> cc_plus_one[64];  // 0: not read yet
  if (device < 0 || device >= 64) return 0;
  int v = cc_plus_one[device].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    v = major * 10 + minor + 1;
    cc_plus_one[device].store(v, std::memory_order_relaxed);
  }
  return v - 1;
}

}  // namespace

const char* MoeGroupedSm90Unsupported(int device) {
  const int cc = CachedComputeCapability(device);
  if (cc == 0) return "no CUDA device with that index";
  if (cc != 90) {
    return "the sm_90a grouped GEMM needs a compute capability 9.0 device (H100/H200); this "
           "one is not";
  }
  return nullptr;
}

size_t MoeGroupedSm90WorkspaceBytes(int num_experts, int num_sms) {
  ArgArrays a = Carve(nullptr, num_experts);
  typename Gemm::Arguments args = MakeArguments(a, num_experts, 0, num_sms);
  return a.end + Align256(Gemm::get_workspace_size(args));
}

cudaError_t LaunchMoeGroupedSm90Gemm(const MoeGroupedSm90Gemm& g, void* workspace,
                                     size_t workspace_bytes, int device, int num_sms,
                                     cudaStream_t stream) {
  if (MoeGroupedSm90Unsupported(device) != nullptr) return cudaErrorNotSupported;
  if (g.num_experts <= 0 || num_sms <= 0 || g.k % kAlign != 0 || g.lda % kAlign != 0 ||
      g.ldb % kAlign != 0 || g.ldd % kAlign != 0 || g.b_expert_stride % kAlign != 0 || g.n <= 0 ||
      g.k <= 0 || g.n > 0x7fffffff || g.k > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (workspace_bytes < MoeGroupedSm90WorkspaceBytes(g.num_experts, num_sms)) {
    return cudaErrorInvalidValue;
  }
  const ArgArrays a = Carve(workspace, g.num_experts);
  SetupKernel<<<(g.num_experts + 127) / 128, 128, 0, stream>>>(g, a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  typename Gemm::Arguments args = MakeArguments(a, g.num_experts, device, num_sms);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, a.cutlass_workspace, stream) != cutlass::Status::kSuccess) {
    err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

#else  // !MOESERVE_HAVE_CUTLASS_SM90

const char* MoeGroupedSm90Unsupported(int) {
  return "this build has no sm_90a grouped GEMM (CUTLASS headers not found or the CUDA "
         "architectures lack 90a; see cmake/FindCutlass.cmake)";
}
size_t MoeGroupedSm90WorkspaceBytes(int, int) { return 0; }
cudaError_t LaunchMoeGroupedSm90Gemm(const MoeGroupedSm90Gemm&, void*, size_t, int, int,
                                     cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif  // MOESERVE_HAVE_CUTLASS_SM90

}  // namespace moeserve::kernels
