// The recycled buffers behind request gathers and answers.
#include "server/buffer_pool.h"

#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moeserve {
namespace {

// A released large buffer is handed out again (same memory, no fresh pages), best fit first;
// small ones are plain allocations; the free list stays within its bounds; contents are
// writable over the whole requested size.
TEST(PooledBufferTest, ReusesLargeBuffersBestFitAndStaysBounded) {
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
