// The FP8 grouped GEMM of moe_grouped_sm90.cuh (W8A8) through CUTLASS's API: the argument arrays,
// the setup kernel, the tile choice. Compiled for sm_90a alone; without CUTLASS it is a stub
// whose launcher reports cudaErrorNotSupported.
#include <algorithm>

#include "kernels/cuda/moe_grouped_sm90.cuh"

#if MOESERVE_HAVE_CUTLASS_SM90
#include "kernels/cuda/moe_grouped_sm90_fp8_impl.cuh"
#endif

namespace moeserve::kernels {

#if MOESERVE_HAVE_CUTLASS_SM90
namespace {

using namespace cute;
using namespace grouped_sm90_fp8;

size_t Align256(size_t x) { return (x + 255) / 256 * 256; }

ArgArrays Carve(void* base, int e) {
  cutlass_grouped::WorkspaceCarver c(base);
  ArgArrays a;
  a.shapes = c.Take<UnderlyingShape>(e);
  a.ptr_a = c.Take<const ElementAB*>(e);
  a.ptr_b = c.Take<const ElementAB*>(e);
  a.ptr_d = c.Take<ElementD*>(e);
  a.ptr_sfa = c.Take<const float*>(e);
  a.ptr_sfb = c.Take<const float*>(e);
  a.stride_a = c.Take<Stride>(e);
  a.stride_b = c.Take<Stride>(e);
  a.stride_d = c.Take<Stride>(e);
  a.layout_sfa = c.Take<LayoutSFA>(e);
  a.layout_sfb = c.Take<LayoutSFB>(e);
  a.end = c.used();
  a.cutlass_workspace = c.next();
  return a;
}

// Per-expert problem, pointers and scale layouts from the device counts (no host
// synchronization); an empty expert gets 0 rows, which the group scheduler skips.
__global__ void SetupFp8Kernel(MoeGroupedSm90Fp8Gemm g, ArgArrays a) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= g.num_experts) return;
  const int rows = max(g.expert_counts[e], 0);
  const int64_t o = g.expert_offsets[e];
  const int n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  const int64_t kb = g.k / kMoeFp8ScaleK;
  a.shapes[e] = UnderlyingShape(rows, n, k);
  a.ptr_a[e] = reinterpret_cast<const ElementAB*>(g.a) + o * g.k;
  a.ptr_b[e] = reinterpret_cast<const ElementAB*>(g.b) + e * g.b_expert_stride;
  a.ptr_d[e] = reinterpret_cast<ElementD*>(g.d) + o * g.ldd;
  a.ptr_sfa[e] = g.a_scale + o * kb;
  a.ptr_sfb[e] = g.b_scale + e * kb * g.n;
  a.stride_a[e] = Stride{g.k, Int<1>{}, Int<0>{}};
  a.stride_b[e] = Stride{g.k, Int<1>{}, Int<0>{}};
  a.stride_d[e] = Stride{g.ldd, Int<1>{}, Int<0>{}};
  a.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, n, k, 1));
  a.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, n, k, 1));
}

}  // namespace

size_t MoeGroupedSm90Fp8WorkspaceBytes(int num_experts, int num_sms) {
  const ArgArrays a = Carve(nullptr, num_experts);
  const size_t cutlass_bytes = std::max(CooperativeWorkspaceBytes(a, num_experts, num_sms),
                                        PingpongWorkspaceBytes(a, num_experts, num_sms));
  return a.end + Align256(cutlass_bytes);
}

cudaError_t LaunchMoeGroupedSm90Fp8Gemm(const MoeGroupedSm90Fp8Gemm& g, void* workspace,
                                        size_t workspace_bytes, int device, int num_sms,
                                        cudaStream_t stream) {
  if (MoeGroupedSm90Unsupported(device) != nullptr) return cudaErrorNotSupported;
  if (g.num_experts <= 0 || num_sms <= 0 || g.k <= 0 || g.k % kMoeFp8ScaleK != 0 || g.n <= 0 ||
      g.n % kAlignD != 0 || g.ldd % kAlignD != 0 || g.b_expert_stride % kAlignAB != 0 ||
      g.n > 0x7fffffff || g.k > 0x7fffffff || g.a_scale == nullptr || g.b_scale == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (workspace_bytes < MoeGroupedSm90Fp8WorkspaceBytes(g.num_experts, num_sms)) {
    return cudaErrorInvalidValue;
  }
  const ArgArrays a = Carve(workspace, g.num_experts);
  SetupFp8Kernel<<<(g.num_experts + 127) / 128, 128, 0, stream>>>(g, a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (MoeGroupedSm90UsesSmallTiles(g.total_rows_hint, g.num_experts)) {
    return RunPingpong(a, g.num_experts, device, num_sms, stream);
  }
  return RunCooperative(a, g.num_experts, device, num_sms, stream);
}

#else  // !MOESERVE_HAVE_CUTLASS_SM90

size_t MoeGroupedSm90Fp8WorkspaceBytes(int, int) { return 0; }
cudaError_t LaunchMoeGroupedSm90Fp8Gemm(const MoeGroupedSm90Fp8Gemm&, void*, size_t, int, int,
                                        cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif  // MOESERVE_HAVE_CUTLASS_SM90

}  // namespace moeserve::kernels
