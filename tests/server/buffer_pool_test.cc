// The recycled buffers behind request gathers and answers.
#include "server/buffer_pool.h"

#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moeserve {
namespace {

// A released large buffer is handed out again (same memory, no fresh pages), best fit first;
// small ones are plain allocations; the free list stays within its bounds; contents are
// writable over the whole requested size.
TEST(PooledBufferTest, ReusesLargeBuffersBestFitAndStaysBounded) {
  DrainPooledBuffersForTesting();  // other tests in this process may have filled the list
  const size_t big = size_t{8} << 20, medium = size_t{1} << 20;
  const size_t free_before = PooledFreeBuffersForTesting();
  void* big_data = nullptr;
  void* medium_data = nullptr;
  {
    auto b = PooledBuffer::Acquire(big);
    auto m = PooledBuffer::Acquire(medium);
    ASSERT_GE(b->capacity(), big);
    std::memset(b->data(), 0x5a, big);
    std::memset(m->data(), 0x5a, medium);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 16, 0u);
    big_data = b->data();
    medium_data = m->data();
  }
  EXPECT_EQ(PooledFreeBuffersForTesting(), free_before + 2);
  {
    auto m = PooledBuffer::Acquire(medium - 100);  // the medium one fits best
    EXPECT_EQ(m->data(), medium_data);
    auto b = PooledBuffer::Acquire(big);
    EXPECT_EQ(b->data(), big_data);
    EXPECT_EQ(PooledFreeBuffersForTesting(), free_before);
  }
  // Small buffers do not enter the list.
  { auto s = PooledBuffer::Acquire(100); }
  EXPECT_EQ(PooledFreeBuffersForTesting(), free_before + 2);
  // Many released at once: the list keeps at most kMaxFreeBuffers.
  {
    std::vector<std::unique_ptr<PooledBuffer>> many;
    for (size_t i = 0; i < PooledBuffer::kMaxFreeBuffers + 8; ++i) {
      many.push_back(PooledBuffer::Acquire(PooledBuffer::kMinPooledBytes));
    }
  }
  EXPECT_LE(PooledFreeBuffersForTesting(), PooledBuffer::kMaxFreeBuffers);
}

// Of equal fits the buffer released last is handed out first (its lines are the likeliest still
// cached: on the development VM a 16-token request's gather took 26-31 us so, 42 us with the
// first released).
TEST(PooledBufferTest, EqualFitsGoLastReleasedFirst) {
  DrainPooledBuffersForTesting();
  const size_t size = size_t{256} << 10;
  auto first = PooledBuffer::Acquire(size);
  auto second = PooledBuffer::Acquire(size);
  auto third = PooledBuffer::Acquire(size);
  void* const second_data = second->data();
  void* const third_data = third->data();
  first.reset();
  third.reset();
  second.reset();  // released last
  auto a = PooledBuffer::Acquire(size);
  EXPECT_EQ(a->data(), second_data);
  auto b = PooledBuffer::Acquire(size - 4096);  // still an equal fit: same capacity
  EXPECT_EQ(b->data(), third_data);
}

// With a host pinner (a GPU engine), new pooled buffers from kMinPinnedBytes on are page-locked
// once, whole pages, and stay so while recycled; a buffer dropped from a full free list is
// unlocked before it is freed; a pin that fails leaves the buffer usable and unpinned.
TEST(PooledBufferTest, LargeBuffersArePinnedOnceAndUnpinnedWhenFreed) {
  DrainPooledBuffersForTesting();  // earlier tests in this process may have filled the list
  static std::mutex mu;
  static std::set<void*> locked;
  static int pins = 0, unpins = 0;
  static bool fail_next = false;
  PooledBuffer::InstallHostPinner(
      [](void* data, size_t bytes) {
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % 4096, 0u);
        EXPECT_EQ(bytes % 4096, 0u);
        if (fail_next) {
          fail_next = false;
          return false;
        }
        EXPECT_TRUE(locked.insert(data).second) << "pinned twice";
        ++pins;
        return true;
      },
      [](void* data) {
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_EQ(locked.erase(data), 1u) << "unpinned what was not pinned";
        ++unpins;
      });
  // Larger than any buffer the tests before this one (same process) left on the free list,
  // so that these are fresh allocations.
  const size_t big = size_t{48} << 20;
  const int pins0 = pins;  // (the test may run more than once in a process)
  void* first = nullptr;
  {
    auto b = PooledBuffer::Acquire(big + 5);
    EXPECT_TRUE(b->pinned());
    EXPECT_EQ(b->capacity() % 4096, 0u);
    std::memset(b->data(), 1, big + 5);
    first = b->data();
    auto small = PooledBuffer::Acquire(PooledBuffer::kMinPooledBytes);  // pooled, not pinned
    EXPECT_FALSE(small->pinned());
  }
  EXPECT_EQ(pins, pins0 + 1);
  {
    auto again = PooledBuffer::Acquire(big);  // recycled: pinned already, no second pin
    EXPECT_EQ(again->data(), first);
    EXPECT_TRUE(again->pinned());
    EXPECT_EQ(pins, pins0 + 1);
  }
  {
    fail_next = true;
    auto unpinned = PooledBuffer::Acquire(size_t{96} << 20);
    EXPECT_FALSE(unpinned->pinned());
    std::memset(unpinned->data(), 2, size_t{96} << 20);
  }
  // More than the free list keeps: the ones dropped are unlocked, and none is left locked
  // outside the list.
  {
    std::vector<std::unique_ptr<PooledBuffer>> many;
    for (size_t i = 0; i < PooledBuffer::kMaxFreeBuffers + 6; ++i) {
      many.push_back(PooledBuffer::Acquire(size_t{40} << 20));
    }
  }
  EXPECT_GT(unpins, 0);
  EXPECT_EQ(pins - unpins, static_cast<int>(locked.size()));
  EXPECT_LE(PooledFreeBuffersForTesting(), PooledBuffer::kMaxFreeBuffers);
}

// Acquire and release from several threads at once (gRPC releases reply slices on its own
// threads).
TEST(PooledBufferTest, ThreadSafe) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = PooledBuffer::kMinPooledBytes * (1 + (i + t) % 5);
        auto b = PooledBuffer::Acquire(bytes);
        ASSERT_GE(b->capacity(), bytes);
        static_cast<char*>(b->data())[bytes - 1] = static_cast<char>(i);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(PooledFreeBuffersForTesting(), PooledBuffer::kMaxFreeBuffers);
}

}  // namespace
}  // namespace moeserve
