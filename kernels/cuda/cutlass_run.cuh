// Internal to the CUTLASS grouped GEMMs (kernels/cuda/moe_grouped_sm90*_impl.cuh; sm_90a): one
// launch of a CUTLASS 3.x device GEMM, shared by every configuration.
#ifndef MOESERVE_KERNELS_CUDA_CUTLASS_RUN_CUH_
#define MOESERVE_KERNELS_CUDA_CUTLASS_RUN_CUH_

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

namespace moeserve::kernels {

inline cutlass::KernelHardwareInfo CutlassHardware(int device, int num_sms) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = num_sms;
  return hw;
}

// Checks `args`, initializes the kernel's parameters in `workspace` (on `stream`) and launches
// it there. Asynchronous; cudaErrorInvalidValue when CUTLASS cannot implement the arguments.
template <class Gemm>
cudaError_t RunCutlassGemm(const typename Gemm::Arguments& args, void* workspace,
                           cudaStream_t stream) {
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess ||
      gemm.run(stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaGetLastError();
}

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_CUTLASS_RUN_CUH_
