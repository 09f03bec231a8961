// The ping-pong 64x256x64 configuration of the grouped GEMM (moe_grouped_sm90_impl.cuh).
#if MOESERVE_HAVE_CUTLASS_SM90
#include "kernels/cuda/moe_grouped_sm90_impl.cuh"

namespace moeserve::kernels::grouped_sm90 {
namespace {
using Pingpong = Config<cute::Shape<cute::_64, cute::_256, cute::_64>,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
}  // namespace

size_t PingpongWorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms) {
  return Pingpong::WorkspaceBytes(a, num_experts, num_sms);
}
cudaError_t RunPingpong(const ArgArrays& a, int num_experts, int device, int num_sms,
                        cudaStream_t stream) {
  return Pingpong::Run(a, num_experts, device, num_sms, stream);
}

}  // namespace moeserve::kernels::grouped_sm90
#endif  // MOESERVE_HAVE_CUTLASS_SM90
