// The grouped GEMM of moe_grouped_sm90.cuh through CUTLASS's API (sm90 ptr-array grouped GEMM):
// the argument arrays, the setup kernel, the tile choice. Compiled for sm_90a alone; without
// CUTLASS (MOESERVE_HAVE_CUTLASS_SM90 unset) it is a stub whose launcher reports
// cudaErrorNotSupported.
//
// Both GEMMs of the MLP share the kernel types (same element types and layouts; the problem
// shapes and pointers are arguments), so there are two CUTLASS instantiations in all, one per
// tile configuration (moe_grouped_sm90_coop.cu, moe_grouped_sm90_pingpong.cu).
#include <algorithm>
#include <atomic>

#include "kernels/cuda/moe_grouped_sm90.cuh"

#if MOESERVE_HAVE_CUTLASS_SM90
#include "kernels/cuda/moe_grouped_sm90_impl.cuh"
#endif

namespace moeserve::kernels {

#if MOESERVE_HAVE_CUTLASS_SM90
namespace {

using namespace cute;
using grouped_sm90::ArgArrays;
using grouped_sm90::Element;
using grouped_sm90::Stride;
using grouped_sm90::UnderlyingShape;

size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

ArgArrays Carve(void* base, int e) {
  cutlass_grouped::WorkspaceCarver c(base);
  ArgArrays a;
  a.shapes = c.Take<UnderlyingShape>(e);
  a.ptr_a = c.Take<const Element*>(e);
  a.ptr_b = c.Take<const Element*>(e);
  a.ptr_d = c.Take<Element*>(e);
  a.stride_a = c.Take<Stride>(e);
  a.stride_b = c.Take<Stride>(e);
  a.stride_d = c.Take<Stride>(e);
  a.end = c.used();
  a.cutlass_workspace = c.next();
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
  a.stride_a[e] = Stride{g.lda, Int<1>{}, Int<0>{}};
  a.stride_b[e] = Stride{g.ldb, Int<1>{}, Int<0>{}};
  a.stride_d[e] = Stride{g.ldd, Int<1>{}, Int<0>{}};
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
  const ArgArrays a = Carve(nullptr, num_experts);
  const size_t cutlass_bytes =
      std::max(grouped_sm90::CooperativeWorkspaceBytes(a, num_experts, num_sms),
               grouped_sm90::PingpongWorkspaceBytes(a, num_experts, num_sms));
  return a.end + Align256(cutlass_bytes);
}

cudaError_t LaunchMoeGroupedSm90Gemm(const MoeGroupedSm90Gemm& g, void* workspace,
                                     size_t workspace_bytes, int device, int num_sms,
                                     cudaStream_t stream) {
  if (MoeGroupedSm90Unsupported(device) != nullptr) return cudaErrorNotSupported;
  if (g.num_experts <= 0 || num_sms <= 0 || g.k % grouped_sm90::kAlign != 0 ||
      g.lda % grouped_sm90::kAlign != 0 || g.ldb % grouped_sm90::kAlign != 0 ||
      g.ldd % grouped_sm90::kAlign != 0 || g.b_expert_stride % grouped_sm90::kAlign != 0 ||
      g.n <= 0 || g.k <= 0 || g.n > 0x7fffffff || g.k > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (workspace_bytes < MoeGroupedSm90WorkspaceBytes(g.num_experts, num_sms)) {
    return cudaErrorInvalidValue;
  }
  const ArgArrays a = Carve(workspace, g.num_experts);
  SetupKernel<<<(g.num_experts + 127) / 128, 128, 0, stream>>>(g, a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (MoeGroupedSm90UsesSmallTiles(g.total_rows_hint, g.num_experts)) {
    return grouped_sm90::RunPingpong(a, g.num_experts, device, num_sms, stream);
  }
  return grouped_sm90::RunCooperative(a, g.num_experts, device, num_sms, stream);
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
