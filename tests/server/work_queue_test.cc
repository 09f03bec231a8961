// WorkQueue: every task runs once, Drain runs what is queued and refuses what comes later, and
// with an idle spin one thread polls for tasks (found without a wake-up) and hands a burst on.
#include "server/work_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/time/time.h"

namespace moeserve {
namespace {

void WaitFor(const std::atomic<int>& counter, int n) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (counter.load() < n && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

class WorkQueueTest : public ::testing::TestWithParam<int> {};  // the idle spin in us

TEST_P(WorkQueueTest, RunsEveryTaskOnce) {
  WorkQueue q(3);
  q.SetIdleSpin(absl::Microseconds(GetParam()));
  std::vector<std::atomic<int>> runs(2000);
  for (size_t i = 0; i < runs.size(); ++i) {
    ASSERT_TRUE(q.Submit([&runs, i] { runs[i].fetch_add(1); }));
    if (i % 100 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  q.Drain();
  for (size_t i = 0; i < runs.size(); ++i) ASSERT_EQ(runs[i].load(), 1) << "task " << i;
  EXPECT_FALSE(q.Submit([] {}));
}

TEST_P(WorkQueueTest, ABurstWhileOneThreadPollsRunsOnSeveralThreads) {
  WorkQueue q(4);
  q.SetIdleSpin(absl::Microseconds(GetParam()));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // every thread idle
  // Four tasks that each wait for all four to start: done only if four threads take them.
  std::atomic<int> started{0}, done{0};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(q.Submit([&] {
      started.fetch_add(1);
      WaitFor(started, 4);
      done.fetch_add(1);
    }));
  }
  WaitFor(done, 4);
  EXPECT_EQ(done.load(), 4) << "the burst ran on fewer than four threads";
  q.Drain();
}

INSTANTIATE_TEST_SUITE_P(Spin, WorkQueueTest, ::testing::Values(0, 2000, 200000));

TEST(WorkQueueSpinTest, APollingThreadTakesTheTask) {
  WorkQueue q(2);
  q.SetIdleSpin(absl::Seconds(1));
  std::atomic<int> done{0};
  for (int i = 0; i < 20; ++i) {
    // Idle long enough for a thread to be polling again, well within the spin.
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    ASSERT_TRUE(q.Submit([&done] { done.fetch_add(1); }));
    WaitFor(done, i + 1);
  }
  EXPECT_EQ(done.load(), 20);
  EXPECT_GE(q.spin_takes(), 15);  // a wake-up should be rare while one thread polls
  const auto t0 = std::chrono::steady_clock::now();
  q.Drain();  // a polling thread stops polling at once
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
}

TEST(WorkQueueSpinTest, NoSpinNoPolling) {
  WorkQueue q(2);
  std::atomic<int> done{0};
  for (int i = 0; i < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_TRUE(q.Submit([&done] { done.fetch_add(1); }));
  }
  WaitFor(done, 10);
  EXPECT_EQ(done.load(), 10);
  EXPECT_EQ(q.spin_takes(), 0);
}

// queued(): what the threads have not taken yet (ServingState::WorkersBacklogged reads it to
// decode requests where they arrive rather than behind a backlog).
TEST(WorkQueueBacklogTest, QueuedCountsTasksNoThreadHasTaken) {
  WorkQueue q(2);
  EXPECT_EQ(q.queued(), 0u);
  std::atomic<bool> release{false};
  std::atomic<int> started{0}, done{0};
  auto blocker = [&] {
    started.fetch_add(1);
    while (!release.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    done.fetch_add(1);
  };
  ASSERT_TRUE(q.Submit(blocker));
  ASSERT_TRUE(q.Submit(blocker));
  WaitFor(started, 2);  // both threads busy
  EXPECT_EQ(q.queued(), 0u);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(q.Submit([&done] { done.fetch_add(1); }));
  EXPECT_EQ(q.queued(), 3u);
  EXPECT_GE(q.queued(), static_cast<size_t>(q.num_threads()));  // a backlog
  release.store(true);
  WaitFor(done, 5);
  EXPECT_EQ(q.queued(), 0u);
}

}  // namespace
}  // namespace moeserve
