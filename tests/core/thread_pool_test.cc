#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <vector>

#include "core/parallel_copy.h"
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

// Every byte lands once, whatever the size (around the parallel threshold and page multiples),
// the thread count or the alignment; bytes around the destination stay untouched.
TEST(ParallelCopierTest, CopiesEveryByteExactly) {
  std::mt19937 rng(9);
  const size_t big = ParallelCopier::kMinParallelBytes;
  for (int threads : {1, 3, 8}) {
    ParallelCopier copier(threads);
    for (size_t bytes :
         {size_t{0}, size_t{1}, size_t{4095}, big - 1, big, big + 7, 3 * big + 4097}) {
      for (size_t offset : {size_t{0}, size_t{3}}) {
        std::vector<uint8_t> src(bytes + offset), dst(bytes + offset + 64, 0xEE);
        for (auto& b : src) b = static_cast<uint8_t>(rng());
        copier.Copy(dst.data() + offset, src.data() + offset, bytes);
        EXPECT_TRUE(std::equal(src.begin() + offset, src.end(), dst.begin() + offset))
            << threads << " threads, " << bytes << " bytes";
        for (size_t i = 0; i < offset; ++i) EXPECT_EQ(dst[i], 0xEE);
        for (size_t i = bytes + offset; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE);
      }
    }
  }
}

}  // namespace
}  // namespace moeserve
