// The 64x128x128 ping-pong configuration of the FP8 grouped GEMM (moe_grouped_sm90_fp8_impl.cuh).
#if MOESERVE_HAVE_CUTLASS_SM90
#include "kernels/cuda/moe_grouped_sm90_fp8_impl.cuh"

namespace moeserve::kernels::grouped_sm90_fp8 {
namespace {
using Cfg = Config<cute::Shape<cute::_64, cute::_128, cute::_128>,
                   cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                   cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
}  // namespace

size_t PingpongWorkspaceBytes(const ArgArrays& a, int num_experts, int num_sms) {
  return Cfg::WorkspaceBytes(a, num_experts, num_sms);
}
cudaError_t RunPingpong(const ArgArrays& a, int num_experts, int device, int num_sms,
                        cudaStream_t stream) {
  return Cfg::Run(a, num_experts, device, num_sms, stream);
}

}  // namespace moeserve::kernels::grouped_sm90_fp8
#endif  // MOESERVE_HAVE_CUTLASS_SM90
