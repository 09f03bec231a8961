#include "core/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace moeserve {
namespace {

TEST(ThreadPoolTest, EveryIndexRunsOnceOnAValidThread) {
  for (int threads : {1, 2, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int round = 0; round < 20; ++round) {
      std::vector<std::atomic<int>> hits(257);
      std::atomic<bool> bad_thread{false};
      pool.ParallelFor(257, [&](int64_t i, int t) {
        hits[i]++;
        if (t < 0 || t >= threads) bad_thread = true;
      });
      for (auto& h : hits) EXPECT_EQ(h.load(), 1);
      EXPECT_FALSE(bad_thread);
    }
    pool.ParallelFor(0, [](int64_t, int) { FAIL(); });
  }
}

}  // namespace
}  // namespace moeserve
