// The CUDA side of core/device_upload.h: request bytes cut into one part per thread, each part
// gathered a chunk at a time into its page-locked slots and copied to a recycled device buffer
// on its own stream, a chunk's copy overlapping the next chunk's gather.
// Registered with the CUDA BackendProvider (upload_host_pieces). No CUDA types here.
#ifndef MOESERVE_CORE_CUDA_HOST_UPLOAD_H_
#define MOESERVE_CORE_CUDA_HOST_UPLOAD_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "core/device_upload.h"

namespace moeserve {

// UploadHostPiecesFn for CUDA. Each call takes a stager (per part: a stream and kUploadSlots
// page-locked chunks) and a device buffer from process-wide pools, so concurrent calls run side
// by side; both are kept for the next call. INVALID_ARGUMENT for size 0, parts outside
// [1, kMaxUploadParts] or a device that is not visible; INTERNAL naming the CUDA call that
// failed (out of device memory included). Blocks until the bytes are on the device.
absl::StatusOr<std::unique_ptr<DeviceBytes>> CudaUploadHostPieces(int device,
                                                                  const HostPieces& pieces,
                                                                  size_t size,
                                                                  const ParallelForFn& parallel_for,
                                                                  int parts);

// A part's chunk: 1 MiB gathers at about 9 GB/s on one core (110 us) while the chunk before it
// crosses PCIe, shared with the other parts' copies (upload_bench chooses it).
inline constexpr size_t kUploadChunkBytes = size_t{1} << 20;
inline constexpr size_t kUploadMaxChunkBytes = size_t{4} << 20;
inline constexpr int kUploadSlots = 3;  // chunks per part in flight
inline constexpr int kMaxUploadParts = 16;

// As CudaUploadHostPieces with chunks of `chunk_bytes` (4 KiB .. kUploadMaxChunkBytes, a
// multiple of 4 KiB; the benchmark's knob).
absl::StatusOr<std::unique_ptr<DeviceBytes>> CudaUploadHostPiecesInChunks(
    int device, const HostPieces& pieces, size_t size, const ParallelForFn& parallel_for, int parts,
    size_t chunk_bytes);

// Tests only: device buffers kept for reuse (count) and stagers kept (count).
size_t UploadFreeBlocksForTesting();
size_t UploadIdleStagersForTesting();

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_HOST_UPLOAD_H_
