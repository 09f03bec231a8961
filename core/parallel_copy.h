// Host memcpy of large buffers over a few threads: the staging copies between a request's bytes
// and pinned memory are host-bandwidth bound, and one core copies at a fraction of what the
// memory system moves (about 10 GB/s, so 6 MB of activations cost 0.6 ms one way).
#ifndef MOESERVE_CORE_PARALLEL_COPY_H_
#define MOESERVE_CORE_PARALLEL_COPY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/types/span.h"

namespace moeserve {

class ThreadPool;

// memcpy(dst, src, bytes) with non-temporal (streaming) stores on x86-64, ending with a store
// fence; plain memcpy elsewhere. For a copy that the next reader is a DMA engine or another
// core, not this core's caches: ordinary stores first read every destination line (read for
// ownership) and leave it dirty in the caches; streaming stores write whole lines to memory.
// Faster beyond the last-level cache, slower within it (gather_bench).
void StreamingCopy(void* dst, const void* src, size_t bytes);

// Thread-safe: concurrent copies take turns on the pool, each still spread over its threads.
class ParallelCopier {
 public:
  // num_threads <= 1: plain memcpy. Threads start lazily, at the first large copy.
  // streaming_stores: the parallel copies (from kMinParallelBytes / two chunks on) write with
  // StreamingCopy, not memcpy.
  // gather_min_parallel_bytes: Gather spreads a message over the threads from this size on
  // (below it one memcpy per piece on the calling thread).
  explicit ParallelCopier(int num_threads, bool streaming_stores = false,
                          size_t gather_min_parallel_bytes = kGatherMinParallelBytes);
  ~ParallelCopier();
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  // memcpy(dst, src, bytes); ranges must not overlap. From kMinParallelBytes on, one equal
  // share (page-rounded) per thread.
  void Copy(void* dst, const void* src, size_t bytes);
  // Concatenates `pieces` (`size` bytes in all, e.g. a gRPC message's slices) into dst, spread
  // over the threads from gather_min_parallel_bytes on: in kChunkBytes chunks from two of them
  // on, else one chunk per thread (page-rounded, at least kMinGatherChunkBytes).
  void Gather(absl::Span<const absl::Span<const uint8_t>> pieces, size_t size, void* dst);
  // Runs fn(i) for every i in [0, n) on the copier's threads (the caller's among them) and
  // returns when all are done: work that copies in its own way (core/device_upload.h).
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);
  int num_threads() const { return num_threads_; }

  static constexpr size_t kMinParallelBytes = size_t{1} << 20;
  static constexpr size_t kChunkBytes = size_t{1} << 20;
  static constexpr size_t kMinGatherChunkBytes = size_t{64} << 10;
  static constexpr size_t kGatherMinParallelBytes = 2 * kChunkBytes;

 private:
  ThreadPool* Pool();  // started at the first parallel copy

  void CopyPart(void* dst, const void* src, size_t bytes) const;

  const int num_threads_;
  const bool streaming_stores_;
  const size_t gather_min_parallel_bytes_;
  std::once_flag pool_once_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_PARALLEL_COPY_H_
