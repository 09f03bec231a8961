#include "core/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "core/parallel_copy.h"
#include "core/thread_name.h"
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
  for (const auto& [threads, streaming] :
       std::vector<std::pair<int, bool>>{{1, false}, {3, false}, {8, false}, {3, true}}) {
    ParallelCopier copier(threads, streaming);
    for (size_t bytes :
         {size_t{0}, size_t{1}, size_t{4095}, big - 1, big, big + 7, 3 * big + 4097}) {
      for (size_t offset : {size_t{0}, size_t{3}}) {
        std::vector<uint8_t> src(bytes + offset), dst(bytes + offset + 64, 0xEE);
        for (auto& b : src) b = static_cast<uint8_t>(rng());
        copier.Copy(dst.data() + offset, src.data() + offset, bytes);
        EXPECT_TRUE(std::equal(src.begin() + offset, src.end(), dst.begin() + offset))
            << threads << " threads, " << bytes << " bytes, streaming " << streaming;
        for (size_t i = 0; i < offset; ++i) EXPECT_EQ(dst[i], 0xEE);
        for (size_t i = bytes + offset; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE);
      }
    }
  }
}

// Gather: pieces of every size (empty ones, ones crossing chunk boundaries) land back to back,
// below and above the parallel threshold; several threads gathering through one copier at once
// (as gRPC's threads do) each get exactly their bytes.
// Gathers random pieces (empty ones, ones of up to 700 KiB) of messages of each of `sizes`, then
// from four threads at once through the same copier (sizes base + t * base / 3, five each); true
// when every byte landed in place and none past the end.
bool GatherExactly(ParallelCopier& copier, uint32_t seed, size_t total) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> src(total);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<absl::Span<const uint8_t>> pieces;
  size_t at = 0;
  while (at < total) {
    const size_t n = std::min<size_t>(total - at, rng() % 3 == 0 ? 0 : rng() % (700 * 1024));
    pieces.emplace_back(src.data() + at, n);
    at += n;
  }
  pieces.emplace_back();  // an empty last piece
  std::vector<uint8_t> dst(total + 16, 0xEE);
  copier.Gather(pieces, total, dst.data());
  bool same = std::equal(src.begin(), src.end(), dst.begin());
  for (size_t i = total; i < dst.size(); ++i) same = same && dst[i] == 0xEE;
  return same;
}

void RunGatherCases(ParallelCopier& copier, std::initializer_list<size_t> sizes, size_t base) {
  for (size_t total : sizes) {
    EXPECT_TRUE(GatherExactly(copier, static_cast<uint32_t>(total), total)) << total << " bytes";
  }
  std::vector<std::thread> callers;
  std::atomic<int> good{0};
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int rep = 0; rep < 5; ++rep) {
        good += GatherExactly(copier, 100 + 10 * t + rep, base + t * (base / 3));
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(good.load(), 20);
}

constexpr size_t kChunk = ParallelCopier::kChunkBytes;

class GatherTest : public ::testing::TestWithParam<bool> {};

TEST_P(GatherTest, ConcatenatesPiecesFromConcurrentCallers) {
  ParallelCopier copier(3, /*streaming_stores=*/GetParam());
  RunGatherCases(copier, {0, 5000, kChunk * 2 - 1, kChunk * 2, kChunk * 7 + 123}, 3 << 20);
}

// A low parallel threshold spreads medium messages one chunk per thread (64 KiB at least):
// sizes around those chunk bounds, down to a few bytes.
TEST_P(GatherTest, MediumMessagesSpreadOverThreads) {
  ParallelCopier copier(3, /*streaming_stores=*/GetParam(), /*gather_min_parallel_bytes=*/1);
  RunGatherCases(copier,
                 {1, 4095, 4097, 64 * 1024 - 1, 64 * 1024 + 1, 3 * 64 * 1024 + 7, 229888, 919552,
                  kChunk * 3 - 5},
                 200 * 1024);
}

INSTANTIATE_TEST_SUITE_P(Stores, GatherTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Streaming" : "Cached";
                         });

// StreamingCopy alone: every size around its 16-byte head and 64-byte body, every alignment of
// source and destination; bytes around the destination stay untouched.
TEST(StreamingCopyTest, CopiesEveryByteAtEveryAlignment) {
  std::mt19937 rng(17);
  std::vector<uint8_t> src(4096 + 64), dst(4096 + 128);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  for (size_t bytes : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 200, 1000, 4096}) {
    for (size_t src_off = 0; src_off < 16; src_off += 5) {
      for (size_t dst_off = 0; dst_off < 32; dst_off += 3) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        StreamingCopy(dst.data() + dst_off, src.data() + src_off, bytes);
        ASSERT_TRUE(
            std::equal(src.begin() + src_off, src.begin() + src_off + bytes, dst.begin() + dst_off))
            << bytes << " bytes, offsets " << src_off << "/" << dst_off;
        for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(dst[i], 0xEE);
        for (size_t i = dst_off + bytes; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE);
      }
    }
  }
}

// The pool's threads carry their role's name (what top -H and /proc/PID/task/*/comm show), and
// SetCurrentThreadName keeps the 15 bytes Linux allows rather than failing on a longer one.
TEST(ThreadNameTest, PoolThreadsAreNamedAndLongNamesAreCut) {
#if defined(__linux__)
  auto name_of_this_thread = [] {
    char buf[32] = {};
    pthread_getname_np(pthread_self(), buf, sizeof(buf));
    return std::string(buf);
  };
  ThreadPool pool(3);
  std::mutex mu;
  std::set<std::string> names;
  std::atomic<int> recorded{0};
  pool.ParallelFor(64, [&](int64_t, int thread_index) {
    if (thread_index == 0) {
      // The caller takes part under its own name: it waits for a worker to take an index.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (recorded.load() == 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    names.insert(name_of_this_thread());
    recorded.fetch_add(1);
  });
  for (const std::string& n : names) EXPECT_TRUE(n == "ms-pool1" || n == "ms-pool2") << n;
  EXPECT_FALSE(names.empty());
  std::string seen;
  std::thread([&] {
    SetCurrentThreadName("a-name-longer-than-fifteen-bytes");
    seen = name_of_this_thread();
  }).join();
  EXPECT_EQ(seen, "a-name-longer-t");
#else
  GTEST_SKIP() << "thread names are read back on Linux only";
#endif
}

}  // namespace
}  // namespace moeserve
