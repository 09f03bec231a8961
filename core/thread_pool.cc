#include "core/thread_pool.h"

#include <algorithm>

#include "core/thread_name.h"

namespace moeserve {

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads > 0 ? num_threads
                                   : std::max(1u, std::thread::hardware_concurrency())) {
  for (int i = 1; i < num_threads_; ++i) {
    workers_.emplace_back([this, i] {
      SetCurrentThreadName("ms-pool" + std::to_string(i));
      WorkerLoop(i);
    });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunShare(int thread_index) {
  while (true) {
    int64_t i;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= n_) return;
      i = next_++;
    }
    (*fn_)(i, thread_index);
  }
}

void ThreadPool::WorkerLoop(int thread_index) {
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunShare(thread_index);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--active_ == 0) done_cv_.notify_all();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  if (num_threads_ == 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::lock_guard<std::mutex> loop_lock(loop_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    active_ = num_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  RunShare(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return active_ == 0; });
  fn_ = nullptr;
}

absl::Status ThreadPool::ParallelForStatus(int64_t n,
                                           const std::function<absl::Status(int64_t, int)>& fn) {
  std::mutex error_mu;
  absl::Status first_error;
  ParallelFor(n, [&](int64_t i, int thread) {
    absl::Status s = fn(i, thread);
    if (s.ok()) return;
    std::lock_guard<std::mutex> lock(error_mu);
    if (first_error.ok()) first_error = std::move(s);
  });
  return first_error;
}

}  // namespace moeserve
