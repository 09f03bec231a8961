// The recycled buffers behind request gathers and answers.
#include "server/buffer_pool.h"

#include <atomic>
#include <chrono>
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
  const size_t free_before = GetPooledBufferStats().free_buffers;
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
  EXPECT_EQ(GetPooledBufferStats().free_buffers, free_before + 2);
  {
    auto m = PooledBuffer::Acquire(medium - 100);  // the medium one fits best
    EXPECT_EQ(m->data(), medium_data);
    auto b = PooledBuffer::Acquire(big);
    EXPECT_EQ(b->data(), big_data);
    EXPECT_EQ(GetPooledBufferStats().free_buffers, free_before);
  }
  // Small buffers do not enter the list.
  { auto s = PooledBuffer::Acquire(100); }
  EXPECT_EQ(GetPooledBufferStats().free_buffers, free_before + 2);
  // Many released at once: the list keeps at most kMaxFreeBuffers unpinned ones (those of
  // kMinPooledBytes are never pinned).
  {
    std::vector<std::unique_ptr<PooledBuffer>> many;
    for (size_t i = 0; i < PooledBuffer::kMaxFreeBuffers + 8; ++i) {
      many.push_back(PooledBuffer::Acquire(PooledBuffer::kMinPooledBytes));
    }
  }
  EXPECT_LE(GetPooledBufferStats().free_unpinned, PooledBuffer::kMaxFreeBuffers);
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
// once, whole pages, and stay so while recycled; a pin that fails leaves the buffer usable and
// unpinned. A pinned buffer is never unlocked while serving (cudaHostUnregister waits for the
// whole device and holds every thread's CUDA calls): however many are released at once, all
// return to the free list, and past kMaxPinnedBytes new buffers are simply not pinned. Unpinned
// ones beyond the list's bounds go back to malloc.
TEST(PooledBufferTest, PinnedBuffersArePinnedOnceAndNeverUnlockedWhileServing) {
  DrainPooledBuffersForTesting();  // earlier tests in this process may have filled the list
  static std::mutex mu;
  static std::set<void*> locked;
  static int pins = 0, unpins = 0;
  static bool fail_next = false;
  static std::atomic<bool> slow_pins{false};
  PooledBuffer::InstallHostPinner(
      [](void* data, size_t bytes) {
        // A slow pin (cudaHostRegister takes ms) widens the window between the bound's check
        // and the pin, for the concurrent part below.
        if (slow_pins) std::this_thread::sleep_for(std::chrono::milliseconds(2));
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
  EXPECT_EQ(GetPooledBufferStats().pinned_bytes, 0u);
  {
    fail_next = true;
    auto unpinned = PooledBuffer::Acquire(size_t{96} << 20);
    EXPECT_FALSE(unpinned->pinned());
    std::memset(unpinned->data(), 2, size_t{96} << 20);
  }
  DrainPooledBuffersForTesting();  // (so that no later Acquire is given the unpinned one)
  // Larger than any buffer the tests before this one (same process) left on the free list,
  // so that these are fresh allocations.
  const size_t big = size_t{48} << 20;
  const int pins0 = pins, unpins0 = unpins;  // (the test may run more than once in a process)
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
  // More pinned buffers released at once than the list keeps unpinned ones: all stay, locked.
  const size_t each = size_t{40} << 20;
  const size_t count = PooledBuffer::kMaxFreeBuffers + 6;
  {
    std::vector<std::unique_ptr<PooledBuffer>> many;
    for (size_t i = 0; i < count; ++i) many.push_back(PooledBuffer::Acquire(each));
    for (const auto& b : many) EXPECT_TRUE(b->pinned());
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(unpins, unpins0) << "a pinned buffer was unlocked while serving";
    EXPECT_EQ(pins - unpins, static_cast<int>(locked.size()));
  }
  EXPECT_GE(GetPooledBufferStats().free_buffers, count + 1);
  EXPECT_LE(GetPooledBufferStats().pinned_bytes, PooledBuffer::kMaxPinnedBytes);
  // Past kMaxPinnedBytes in use, new buffers are not pinned (and the pinned bytes stay bounded).
  {
    std::vector<std::unique_ptr<PooledBuffer>> held;
    size_t pinned_held = 0;
    while (pinned_held <= PooledBuffer::kMaxPinnedBytes) {
      held.push_back(PooledBuffer::Acquire(each));
      if (!held.back()->pinned()) break;
      pinned_held += held.back()->capacity();
    }
    EXPECT_FALSE(held.back()->pinned());
    EXPECT_LE(GetPooledBufferStats().pinned_bytes, PooledBuffer::kMaxPinnedBytes);
    // Unpinned ones beyond the bounds go back to malloc.
    for (size_t i = 0; i < PooledBuffer::kMaxFreeBuffers + 4; ++i) {
      held.push_back(PooledBuffer::Acquire(PooledBuffer::kMinPooledBytes));
    }
  }
  EXPECT_LE(GetPooledBufferStats().free_unpinned, PooledBuffer::kMaxFreeBuffers);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(unpins, unpins0);
  }
  // Concurrent calls, each pinning slowly, never pin past the bound together.
  DrainPooledBuffersForTesting();
  {
    slow_pins = true;
    std::vector<std::unique_ptr<PooledBuffer>> held(80);
    std::vector<std::thread> threads;
    threads.reserve(8);
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        for (int i = t; i < 80; i += 8) held[i] = PooledBuffer::Acquire(each);
      });
    }
    for (std::thread& t : threads) t.join();
    slow_pins = false;
    size_t pinned_held = 0;
    for (const auto& b : held) pinned_held += b->pinned() ? b->capacity() : 0;
    EXPECT_LE(pinned_held, PooledBuffer::kMaxPinnedBytes);  // 80 x 40 MiB would be 3.1 GiB
    EXPECT_EQ(GetPooledBufferStats().pinned_bytes, pinned_held);
  }
  // Only a drain (tests, shutdown) unlocks them.
  DrainPooledBuffersForTesting();
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(pins, unpins);
  EXPECT_TRUE(locked.empty());
  EXPECT_EQ(GetPooledBufferStats().pinned_bytes, 0u);
}

}  // namespace
}  // namespace moeserve
