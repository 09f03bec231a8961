#include "server/buffer_pool.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace moeserve {
namespace {

struct FreeList {
  std::mutex mu;
  std::vector<std::pair<size_t, std::unique_ptr<uint64_t[]>>> buffers;  // (capacity, words)
  size_t bytes = 0;
};

// Never destroyed: reply slices may release buffers during process exit.
FreeList& Pool() {
  static FreeList* pool = new FreeList();
  return *pool;
}

}  // namespace

std::unique_ptr<PooledBuffer> PooledBuffer::Acquire(size_t bytes) {
  const size_t words = std::max<size_t>(1, (bytes + 7) / 8);
  if (bytes >= kMinPooledBytes) {
    FreeList& pool = Pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    // Best fit among the free buffers, so a small call does not take a large one.
    auto best = pool.buffers.end();
    for (auto it = pool.buffers.begin(); it != pool.buffers.end(); ++it) {
      if (it->first >= words * 8 && (best == pool.buffers.end() || it->first < best->first)) {
        best = it;
      }
    }
    if (best != pool.buffers.end()) {
      std::unique_ptr<PooledBuffer> b(new PooledBuffer(std::move(best->second), best->first));
      pool.bytes -= best->first;
      pool.buffers.erase(best);
      return b;
    }
  }
  return std::unique_ptr<PooledBuffer>(
      new PooledBuffer(std::unique_ptr<uint64_t[]>(new uint64_t[words]), words * 8));
}

PooledBuffer::~PooledBuffer() {
  if (words_ == nullptr || capacity_ < kMinPooledBytes) return;
  FreeList& pool = Pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  if (pool.buffers.size() >= kMaxFreeBuffers || pool.bytes + capacity_ > kMaxFreeBytes) return;
  pool.bytes += capacity_;
  pool.buffers.emplace_back(capacity_, std::move(words_));
}

size_t PooledFreeBuffersForTesting() {
  FreeList& pool = Pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  return pool.buffers.size();
}

}  // namespace moeserve
