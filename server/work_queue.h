// A small FIFO of tasks run by a fixed set of threads, so that compute never runs on gRPC's
// callback threads.
#ifndef MOESERVE_SERVER_WORK_QUEUE_H_
#define MOESERVE_SERVER_WORK_QUEUE_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moeserve {

class WorkQueue {
 public:
  // Starts max(1, num_threads) threads.
  explicit WorkQueue(int num_threads);
  // Drain() then join.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `task`; false (and `task` is not run) once Drain() has begun. Thread-safe.
  bool Submit(std::function<void()> task);
  // Stops accepting tasks, runs every task already queued, and joins the threads. Idempotent.
  void Drain();
  int num_threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  std::once_flag joined_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_WORK_QUEUE_H_
