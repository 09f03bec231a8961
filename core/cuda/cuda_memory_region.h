// The CUDA side of shared-memory regions (core/memory_region.h): page-locking a system region's
// mapping for DMA and opening a client's CUDA IPC allocation. Registered with the CUDA
// BackendProvider (RegisterCudaBackend); core reaches them only through it. No CUDA types here.
#ifndef MOESERVE_CORE_CUDA_CUDA_MEMORY_REGION_H_
#define MOESERVE_CORE_CUDA_CUDA_MEMORY_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/memory_region.h"

namespace moeserve {

// cudaHostRegister(portable): every device copies the range by DMA. INTERNAL naming the CUDA
// error when it cannot.
absl::Status CudaRegisterHostMemory(void* data, size_t bytes);
void CudaUnregisterHostMemory(void* data);

// Opens a cudaIpcMemHandle_t (kCudaIpcHandleBytes of `raw_handle`, taken from the base of an
// allocation of another process) on device `device_id` and returns its first `byte_size` bytes
// as a region (kind kCuda, device Cuda(n), mapped_data() the device pointer). INVALID_ARGUMENT
// for a device that is not visible, a handle CUDA cannot open, or byte_size beyond the
// allocation. The same allocation registered twice shares one mapping (CUDA opens a handle
// once per process). CopyIn / CopyOut are cudaMemcpy's on the region's own stream, synchronous.
absl::StatusOr<std::unique_ptr<MemoryRegion>> OpenCudaIpcRegion(absl::string_view raw_handle,
                                                                int device_id, int64_t byte_size);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_CUDA_MEMORY_REGION_H_
