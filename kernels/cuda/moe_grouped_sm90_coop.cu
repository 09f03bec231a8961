// The cooperative 128x256x64 configuration of the grouped GEMM (moe_grouped_sm90_impl.cuh).
#if MOESERVE_HAVE_CUTLASS_SM90
#include "kernels/cuda/moe_grouped_sm90_impl.cuh"

namespace moeserve::kernels::grouped_sm90 {
namespace {
using Coop = Config<cute::Shape<cute::_128, cute::_256, cute::_64>,
                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
}  // namespace

size_t CooperativeWorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms) {
  return Coop::WorkspaceBytes(a, num_experts, num_sms);
}
cudaError_t RunCooperative(const ArgArrays& a, int num_experts, int device, int num_sms,
                           cudaStream_t stream) {
  return Coop::Run(a, num_experts, device, num_sms, stream);
}

}  // namespace moeserve::kernels::grouped_sm90
#endif  // MOESERVE_HAVE_CUTLASS_SM90
