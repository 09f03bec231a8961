#include "server/buffer_pool.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

namespace moeserve {
namespace {

constexpr size_t kPage = 4096;

struct Block {
  void* data;
  size_t capacity;
  bool pinned;
};

struct FreeList {
  std::mutex mu;
  std::vector<Block> buffers;
  size_t bytes = 0;
  PooledBuffer::Pin pin;
  PooledBuffer::Unpin unpin;
  size_t pinned_bytes = 0;
};

// Never destroyed: reply slices may release buffers during process exit.
FreeList& Pool() {
  static FreeList* pool = new FreeList();
  return *pool;
}

}  // namespace

void PooledBuffer::InstallHostPinner(Pin pin, Unpin unpin) {
  FreeList& pool = Pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  if (pool.pin || !pin || !unpin) return;
  pool.pin = std::move(pin);
  pool.unpin = std::move(unpin);
}

std::unique_ptr<PooledBuffer> PooledBuffer::Acquire(size_t bytes) {
  bytes = std::max<size_t>(bytes, 8);
  if (bytes < kMinPooledBytes) {
    // Plain: 16-byte aligned from malloc.
    return std::unique_ptr<PooledBuffer>(
        new PooledBuffer(std::aligned_alloc(16, (bytes + 15) / 16 * 16), bytes, false, false));
  }
  FreeList& pool = Pool();
  PooledBuffer::Pin pin;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    // Best fit among the free buffers, so a small call does not take a large one; of equal
    // fits the one released last, whose lines are likeliest still in the CPU's caches (a call
    // writes its request into it next).
    auto best = pool.buffers.end();
    for (auto it = pool.buffers.begin(); it != pool.buffers.end(); ++it) {
      if (it->capacity >= bytes && (best == pool.buffers.end() || it->capacity <= best->capacity)) {
        best = it;
      }
    }
    if (best != pool.buffers.end()) {
      const Block b = *best;
      pool.bytes -= b.capacity;
      pool.buffers.erase(best);
      return std::unique_ptr<PooledBuffer>(new PooledBuffer(b.data, b.capacity, true, b.pinned));
    }
    if (bytes >= kMinPinnedBytes && pool.pin &&
        pool.pinned_bytes + (bytes + kPage - 1) / kPage * kPage <= kMaxPinnedBytes) {
      pin = pool.pin;
    }
  }
  // Whole pages, so that page-locking one buffer never touches another's pages.
  const size_t capacity = (bytes + kPage - 1) / kPage * kPage;
  void* data = std::aligned_alloc(kPage, capacity);
  bool pinned = false;
  if (data != nullptr && pin && pin(data, capacity)) {
    pinned = true;
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.pinned_bytes += capacity;
  }
  return std::unique_ptr<PooledBuffer>(new PooledBuffer(data, capacity, true, pinned));
}

PooledBuffer::~PooledBuffer() {
  if (data_ == nullptr) return;
  if (pooled_) {
    FreeList& pool = Pool();
    std::unique_lock<std::mutex> lock(pool.mu);
    if (pool.buffers.size() < kMaxFreeBuffers && pool.bytes + capacity_ <= kMaxFreeBytes) {
      pool.bytes += capacity_;
      pool.buffers.push_back(Block{data_, capacity_, pinned_});
      return;
    }
    if (pinned_) {
      pool.pinned_bytes -= capacity_;
      const PooledBuffer::Unpin unpin = pool.unpin;
      lock.unlock();
      unpin(data_);
    }
  }
  std::free(data_);
}

void DrainPooledBuffersForTesting() {
  FreeList& pool = Pool();
  std::vector<Block> blocks;
  PooledBuffer::Unpin unpin;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    blocks.swap(pool.buffers);
    pool.bytes = 0;
    unpin = pool.unpin;
    for (const Block& b : blocks) {
      if (b.pinned) pool.pinned_bytes -= b.capacity;
    }
  }
  for (const Block& b : blocks) {
    if (b.pinned) unpin(b.data);
    std::free(b.data);
  }
}

size_t PooledFreeBuffersForTesting() {
  FreeList& pool = Pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  return pool.buffers.size();
}

}  // namespace moeserve
