// A small FIFO of tasks run by a fixed set of threads, so that compute never runs on gRPC's
// callback threads. Optionally one idle thread at a time polls for the next task instead of
// sleeping (SetIdleSpin): on the H200 host a sleeping worker's wake-up cost 60-110 us per
// large request (tests/benchmarks/transport/RESULTS.md).
#ifndef MOESERVE_SERVER_WORK_QUEUE_H_
#define MOESERVE_SERVER_WORK_QUEUE_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/time.h"

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
  // Tasks queued and not yet taken by a thread (a snapshot). Thread-safe.
  size_t queued() const { return queued_.load(std::memory_order_acquire); }
  // From now on an idle thread (one at a time) polls for a task for up to `spin` before it
  // sleeps; 0 (the default): idle threads sleep at once. Thread-safe.
  void SetIdleSpin(absl::Duration spin);
  // Tasks a polling thread found (for tests and metrics).
  int64_t spin_takes() const { return spin_takes_.load(std::memory_order_relaxed); }

 private:
  void Loop();
  // Polls (without mu_) until a task is queued, Drain has begun or the spin has passed.
  bool PollForTask(absl::Duration spin) const;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  bool spinning_ = false;  // a thread polls (guarded by mu_): Submit need not wake one for
                           // the first task queued
  // What a polling thread reads without mu_ (written under it).
  std::atomic<size_t> queued_{0};
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> idle_spin_ns_{0};
  std::atomic<int64_t> spin_takes_{0};
  std::vector<std::thread> threads_;
  std::once_flag joined_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_WORK_QUEUE_H_
