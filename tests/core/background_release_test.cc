// The background release thread (core/background_release.h): releases run in order, never on
// the thread that queues them, and FlushBackgroundReleases waits for the ones queued before it.
#include "core/background_release.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace moeserve {
namespace {

TEST(BackgroundRelease, RunsInOrderOffTheCallingThread) {
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  const BackgroundReleaseCounts before = GetBackgroundReleaseCounts();
  for (int i = 0; i < 200; ++i) {
    ReleaseInBackground([&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
    });
  }
  FlushBackgroundReleases();
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
  for (const std::thread::id& t : threads) EXPECT_NE(t, std::this_thread::get_id());
  const BackgroundReleaseCounts after = GetBackgroundReleaseCounts();
  EXPECT_EQ(after.queued - before.queued, 200u);
  EXPECT_GE(after.done - before.done, 200u);
}

// A release that blocks (as cudaHostUnregister does while the device is busy) holds up neither
// the thread that queued it nor that thread's next releases being queued; Flush waits for it.
TEST(BackgroundRelease, QueueingNeverWaitsForARunningRelease) {
  std::mutex mu;
  std::condition_variable cv;
  bool go = false, first_done = false, second_done = false;
  ReleaseInBackground([&] {
    std::unique_lock<std::mutex> lock(mu);
    // Bounded, so that a regression fails instead of hanging.
    cv.wait_for(lock, std::chrono::seconds(10), [&] { return go; });
    first_done = true;
  });
  ReleaseInBackground([&] {
    std::lock_guard<std::mutex> lock(mu);
    second_done = true;
  });
  {
    std::lock_guard<std::mutex> lock(mu);
    // Both queued while the first is blocked: neither has run to its end.
    EXPECT_FALSE(first_done);
    EXPECT_FALSE(second_done);
    go = true;
  }
  cv.notify_all();
  FlushBackgroundReleases();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_TRUE(first_done);
  EXPECT_TRUE(second_done);
}

TEST(BackgroundRelease, ConcurrentQueuersAndFlushers) {
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  threads.reserve(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        ReleaseInBackground([&] { ran.fetch_add(1); });
        if (i % 100 == 0) FlushBackgroundReleases();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  FlushBackgroundReleases();
  EXPECT_EQ(ran.load(), 2000);
}

TEST(BackgroundRelease, EmptyReleaseIsIgnored) {
  const BackgroundReleaseCounts before = GetBackgroundReleaseCounts();
  ReleaseInBackground(nullptr);
  FlushBackgroundReleases();
  EXPECT_EQ(GetBackgroundReleaseCounts().queued, before.queued);
}

}  // namespace
}  // namespace moeserve
