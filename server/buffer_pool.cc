#include "server/buffer_pool.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace moeserve {
namespace {

constexpr size_t kPage = 4096;

struct Block {
  void* data;
  bool pinned;
};

struct FreeList {
  std::mutex mu;
  // Free buffers by capacity; equal capacities in release order (the last is the newest).
  std::multimap<size_t, Block> buffers;
  // The unpinned free buffers, which the bounds apply to (pinned ones always stay).
  size_t unpinned_count = 0;
  size_t unpinned_bytes = 0;
  PooledBuffer::Pin pin;
  PooledBuffer::Unpin unpin;
  size_t pinned_bytes = 0;  // every pinned buffer, in use or free
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
  // A new buffer is whole pages, so that page-locking one never touches another's pages.
  const size_t capacity = (bytes + kPage - 1) / kPage * kPage;
  FreeList& pool = Pool();
  PooledBuffer::Pin pin;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    // Best fit, so that a small call does not take a large one; of equal fits the one released
    // last, whose lines are likeliest still in the CPU's caches (a call writes its request into
    // it next).
    auto fit = pool.buffers.lower_bound(bytes);
    if (fit != pool.buffers.end()) {
      fit = std::prev(pool.buffers.upper_bound(fit->first));
      const size_t free_capacity = fit->first;
      const Block b = fit->second;
      pool.buffers.erase(fit);
      if (!b.pinned) {
        --pool.unpinned_count;
        pool.unpinned_bytes -= free_capacity;
      }
      return std::unique_ptr<PooledBuffer>(new PooledBuffer(b.data, free_capacity, true, b.pinned));
    }
    // The bytes are reserved here, so that concurrent calls never pin past the bound together
    // (pinned buffers are kept for good); given back if the pin fails.
    if (bytes >= kMinPinnedBytes && pool.pin && pool.pinned_bytes + capacity <= kMaxPinnedBytes) {
      pin = pool.pin;
      pool.pinned_bytes += capacity;
    }
  }
  void* data = std::aligned_alloc(kPage, capacity);
  const bool pinned = data != nullptr && pin && pin(data, capacity);
  if (pin && !pinned) {
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.pinned_bytes -= capacity;
  }
  return std::unique_ptr<PooledBuffer>(new PooledBuffer(data, capacity, true, pinned));
}

PooledBuffer::~PooledBuffer() {
  if (data_ == nullptr) return;
  if (pooled_) {
    FreeList& pool = Pool();
    std::lock_guard<std::mutex> lock(pool.mu);
    // A pinned buffer always stays: unlocking it (cudaHostUnregister) would wait for the whole
    // device and hold every thread's CUDA calls meanwhile (scripts/gpu/alloc_wait_probe.cu on an
    // H100, 2026-12-05), a stall of every call in flight. Pinned bytes are bounded anyway
    // (kMaxPinnedBytes), in use or free.
    if (pinned_ || (pool.unpinned_count < kMaxFreeBuffers &&
                    pool.unpinned_bytes + capacity_ <= kMaxFreeBytes)) {
      if (!pinned_) {
        ++pool.unpinned_count;
        pool.unpinned_bytes += capacity_;
      }
      pool.buffers.emplace(capacity_, Block{data_, pinned_});
      return;
    }
  }
  std::free(data_);
}

void DrainPooledBuffersForTesting() {
  FreeList& pool = Pool();
  std::multimap<size_t, Block> blocks;
  PooledBuffer::Unpin unpin;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    blocks.swap(pool.buffers);
    pool.unpinned_count = 0;
    pool.unpinned_bytes = 0;
    unpin = pool.unpin;
    for (const auto& [capacity, b] : blocks) {
      if (b.pinned) pool.pinned_bytes -= capacity;
    }
  }
  for (const auto& [capacity, b] : blocks) {
    if (b.pinned) unpin(b.data);
    std::free(b.data);
  }
}

PooledBufferStats GetPooledBufferStats() {
  FreeList& pool = Pool();
  std::lock_guard<std::mutex> lock(pool.mu);
  PooledBufferStats stats;
  stats.free_buffers = pool.buffers.size();
  for (const auto& [capacity, b] : pool.buffers) stats.free_bytes += capacity;
  stats.free_unpinned = pool.unpinned_count;
  stats.pinned_bytes = pool.pinned_bytes;
  return stats;
}

}  // namespace moeserve
