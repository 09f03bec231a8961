// Programmatic dependent launch (sm_90+). A kernel launched with LaunchPdl may be scheduled
// while the kernel before it on the stream is still running, so that its launch and ramp overlap
// that kernel's tail (in a captured graph too: the edge becomes a programmatic one). Such a
// kernel must call PdlWait() before it reads or writes any memory the previous kernels touch:
// PdlWait returns once every earlier kernel has completed and its writes are visible. Kernels
// that call PdlLaunchDependents() let the next PDL kernel be scheduled from that point on (all
// of their CTAs must have called it or exited). MOESERVE_PDL=0 (read once) launches normally, for
// A/B runs.
#ifndef MOESERVE_KERNELS_CUDA_PDL_CUH_
#define MOESERVE_KERNELS_CUDA_PDL_CUH_

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

namespace moeserve::kernels {

__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void PdlLaunchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether LaunchPdl asks for programmatic serialization (MOESERVE_PDL unset or not "0").
inline bool PdlEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("MOESERVE_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

// kernel<<<grid, block, smem, stream>>>(args...), allowed to start early (see above).
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchPdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = PdlEnabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CUDA_PDL_CUH_
