#include "core/background_release.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "core/thread_name.h"

namespace moeserve {
namespace {

class Releaser {
 public:
  void Queue(std::function<void()> release) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      std::thread([this] {
        SetCurrentThreadName("ms-release");
        Run();
      }).detach();
      started_ = true;
    }
    pending_.push_back(std::move(release));
    ++queued_;
    work_.notify_one();
  }

  void Flush() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = queued_;
    idle_.wait(lock, [&] { return done_ >= target; });
  }

  BackgroundReleaseCounts Counts() {
    std::lock_guard<std::mutex> lock(mu_);
    return {queued_, done_};
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [&] { return !pending_.empty(); });
      std::function<void()> release = std::move(pending_.front());
      pending_.pop_front();
      lock.unlock();
      release();
      release = nullptr;  // whatever it captured goes here too, off the lock
      lock.lock();
      ++done_;
      idle_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_, idle_;
  std::deque<std::function<void()>> pending_;
  bool started_ = false;
  uint64_t queued_ = 0, done_ = 0;
};

// Never destroyed: memory is let go during exit as well (see the header).
Releaser& TheReleaser() {
  static Releaser* releaser = new Releaser;
  return *releaser;
}

}  // namespace

void ReleaseInBackground(std::function<void()> release) {
  if (release) TheReleaser().Queue(std::move(release));
}

void FlushBackgroundReleases() { TheReleaser().Flush(); }

BackgroundReleaseCounts GetBackgroundReleaseCounts() { return TheReleaser().Counts(); }

}  // namespace moeserve
