#include "server/work_queue.h"

#include <algorithm>
#include <utility>

#include "core/spin_wait.h"
#include "core/thread_name.h"

namespace moeserve {

WorkQueue::WorkQueue(int num_threads) {
  const int n = std::max(1, num_threads);
  threads_.reserve(n);
  for (int i = 0; i < n; ++i) {
    threads_.emplace_back([this, i] {
      SetCurrentThreadName("ms-worker" + std::to_string(i));
      Loop();
    });
  }
}

WorkQueue::~WorkQueue() { Drain(); }

bool WorkQueue::Submit(std::function<void()> task) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
    queued_.store(tasks_.size(), std::memory_order_release);
    // A polling thread takes the first task: no wake-up for it. Every task queued behind it
    // wakes a sleeping thread (a merged step's answers come in a burst and go out at once).
    wake = !spinning_ || tasks_.size() > 1;
  }
  if (wake) cv_.notify_one();
  return true;
}

void WorkQueue::SetIdleSpin(absl::Duration spin) {
  idle_spin_ns_.store(std::max<int64_t>(0, absl::ToInt64Nanoseconds(spin)),
                      std::memory_order_relaxed);
}

void WorkQueue::Drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    draining_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  std::call_once(joined_, [this] {
    for (std::thread& t : threads_) t.join();
  });
}

bool WorkQueue::PollForTask(absl::Duration spin) const {
  return PollFor(
      spin, [this] { return queued_.load(std::memory_order_acquire) > 0; },
      [this] { return draining_.load(std::memory_order_acquire); });
}

void WorkQueue::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const absl::Duration spin = absl::Nanoseconds(idle_spin_ns_.load(std::memory_order_relaxed));
    if (tasks_.empty() && !stopping_ && !spinning_ && spin > absl::ZeroDuration()) {
      spinning_ = true;
      lock.unlock();
      const bool found = PollForTask(spin);
      lock.lock();
      spinning_ = false;
      if (found && !tasks_.empty()) spin_takes_.fetch_add(1, std::memory_order_relaxed);
    }
    cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping and drained
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    queued_.store(tasks_.size(), std::memory_order_release);
    // Tasks queued while this thread polled woke nobody: hand the next one on.
    const bool more = !tasks_.empty();
    lock.unlock();
    if (more) cv_.notify_one();
    task();
    task = nullptr;  // its captures die outside mu_
    lock.lock();
  }
}

}  // namespace moeserve
