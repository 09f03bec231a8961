// Host memcpy of large buffers over a few threads: the staging copies between a request's bytes
// and pinned memory are host-bandwidth bound, and one core copies at a fraction of what the
// memory system moves (about 10 GB/s, so 6 MB of activations cost 0.6 ms one way).
#ifndef MOESERVE_CORE_PARALLEL_COPY_H_
#define MOESERVE_CORE_PARALLEL_COPY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>

#include "absl/types/span.h"

namespace moeserve {

class ThreadPool;

// Thread-safe: concurrent copies take turns on the pool, each still spread over its threads.
class ParallelCopier {
 public:
  // num_threads <= 1: plain memcpy. Threads start lazily, at the first large copy.
  explicit ParallelCopier(int num_threads);
  ~ParallelCopier();
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  // memcpy(dst, src, bytes); ranges must not overlap. From kMinParallelBytes on, one equal
  // share (page-rounded) per thread.
  void Copy(void* dst, const void* src, size_t bytes);
  // Concatenates `pieces` (`size` bytes in all, e.g. a gRPC message's slices) into dst, in
  // chunks of kChunkBytes spread over the threads from two chunks on.
  void Gather(absl::Span<const absl::Span<const uint8_t>> pieces, size_t size, void* dst);

  static constexpr size_t kMinParallelBytes = size_t{1} << 20;
  static constexpr size_t kChunkBytes = size_t{1} << 20;

 private:
  ThreadPool* Pool();  // started at the first parallel copy

  const int num_threads_;
  std::once_flag pool_once_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_PARALLEL_COPY_H_
