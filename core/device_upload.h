// Host bytes given in pieces (a gRPC message's slices) copied to device memory, the gather
// overlapping the copy: the bytes are cut into one part per thread; each thread gathers its part
// a chunk at a time into page-locked staging and copies each chunk to the device while it
// gathers the next. Why: a large request's gather (0.4-0.5 ms for 14.7 MB on 4-8 threads) and
// its host-to-device copy (0.3 ms) otherwise run one after the other, the second in the
// engine's step (tests/benchmarks/transport/RESULTS.md, upload_bench).
// A backend offers it through BackendProvider::upload_host_pieces; no CUDA types here.
#ifndef MOESERVE_CORE_DEVICE_UPLOAD_H_
#define MOESERVE_CORE_DEVICE_UPLOAD_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"

namespace moeserve {

// Device memory holding uploaded bytes; recycled by its backend when destroyed (any thread).
class DeviceBytes {
 public:
  virtual ~DeviceBytes() = default;
  virtual void* data() = 0;  // device pointer, 256-byte aligned
  virtual size_t size() const = 0;
  virtual Device device() const = 0;
};

using HostPieces = std::vector<absl::Span<const uint8_t>>;
// Runs task(i) for every i in [0, n) on the caller's threads (e.g. ParallelCopier::ParallelFor)
// and returns when all have run; each i runs once, on one thread.
using ParallelForFn = std::function<void(int64_t n, const std::function<void(int64_t i)>& task)>;
// Uploads `pieces` (`size` bytes in all) to device `device` in `parts` parts run through
// `parallel_for` (parts: its thread count). Synchronous: the bytes are on the device when it
// returns, so any stream may read them. Thread-safe. INVALID_ARGUMENT for bad arguments,
// INTERNAL naming the CUDA call that failed; the caller may then gather on the host instead.
using UploadHostPiecesFn = std::function<absl::StatusOr<std::unique_ptr<DeviceBytes>>(
    int device, const HostPieces& pieces, size_t size, const ParallelForFn& parallel_for,
    int parts)>;

// The pieces that hold bytes [offset, offset + bytes) of the concatenation of `pieces` (the
// first and last trimmed); offset + bytes must not pass their total.
HostPieces SubPieces(const HostPieces& pieces, size_t offset, size_t bytes);

}  // namespace moeserve

#endif  // MOESERVE_CORE_DEVICE_UPLOAD_H_
