// Host memcpy of large buffers over a few threads: the staging copies between a request's bytes
// and pinned memory are host-bandwidth bound, and one core copies at a fraction of what the
// memory system moves (about 10 GB/s, so 6 MB of activations cost 0.6 ms one way).
#ifndef MOESERVE_CORE_PARALLEL_COPY_H_
#define MOESERVE_CORE_PARALLEL_COPY_H_

#include <cstddef>
#include <memory>

namespace moeserve {

class ThreadPool;

// Not thread-safe: one copy at a time per instance (one per rank).
class ParallelCopier {
 public:
  // num_threads <= 1: plain memcpy. Threads start lazily, at the first large copy.
  explicit ParallelCopier(int num_threads);
  ~ParallelCopier();
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  // memcpy(dst, src, bytes); ranges must not overlap. Below kMinParallelBytes, one thread.
  void Copy(void* dst, const void* src, size_t bytes);

  static constexpr size_t kMinParallelBytes = size_t{1} << 20;

 private:
  const int num_threads_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_PARALLEL_COPY_H_
