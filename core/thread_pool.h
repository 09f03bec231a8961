// A fixed pool of worker threads running ParallelFor loops.
#ifndef MOESERVE_CORE_THREAD_POOL_H_
#define MOESERVE_CORE_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace moeserve {

class ThreadPool {
 public:
  // num_threads <= 0 means std::thread::hardware_concurrency(). The calling thread takes part
  // in every loop, so a pool of 1 starts no extra thread.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(i, thread_index) for every i in [0, n), thread_index in [0, num_threads()), and
  // returns when all calls are done. Indices are handed out dynamically. One loop at a time:
  // concurrent callers are serialized.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int)>& fn);
  // ParallelFor whose calls may fail: every index still runs; returns the first error seen
  // (in completion order), OK if none.
  absl::Status ParallelForStatus(int64_t n, const std::function<absl::Status(int64_t, int)>& fn);

 private:
  void WorkerLoop(int thread_index);
  void RunShare(int thread_index);

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex loop_mu_;  // serializes ParallelFor callers
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t next_ = 0;
  uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_THREAD_POOL_H_
