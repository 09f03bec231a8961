// Recycled host buffers for the per-call tensor bytes (gathered request tensors, answers).
//
// Why: a multi-megabyte block freed to glibc goes back to the kernel (mmap'd chunks), and the
// next call pays a page fault for every 4 KiB it touches in a fresh one. Measured on the H200
// host at 1024 tokens of hidden 7168 BF16 (6.3 MB each way): server total 9.95 ms with plain
// new/delete, 5.50 ms when malloc kept its blocks (tests/benchmarks/transport/RESULTS.md).
//
// With a host pinner installed (a GPU engine), large buffers are also page-locked once, when
// they are first allocated, and stay so while they are recycled (never unlocked while serving,
// up to kMaxPinnedBytes in all): the engine then copies a
// request's gathered bytes to the device, and the answer back into the reply's buffer, by DMA
// with no staging copy (PooledBuffer::pinned(); the views say Device::PinnedHost()).
//
// Process-wide and thread-safe. A buffer returns to the free list when its owner is destroyed
// (possibly on a gRPC thread, when the reply slice that owns it is released).
#ifndef MOESERVE_SERVER_BUFFER_POOL_H_
#define MOESERVE_SERVER_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

namespace moeserve {

class PooledBuffer {
 public:
  // At least `bytes` bytes, 16-byte aligned (page-aligned when pooled), contents unspecified.
  static std::unique_ptr<PooledBuffer> Acquire(size_t bytes);
  ~PooledBuffer();
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;

  void* data() { return data_; }
  size_t capacity() const { return capacity_; }
  // Page-locked by the installed pinner.
  bool pinned() const { return pinned_; }

  // Page-locks [data, data + bytes) (true on success) and undoes it. Installed once, before
  // the first Acquire that should be pinned (buffers allocated earlier stay as they are);
  // later calls are ignored. Both must be thread-safe.
  using Pin = std::function<bool(void* data, size_t bytes)>;
  using Unpin = std::function<void(void* data)>;
  static void InstallHostPinner(Pin pin, Unpin unpin);

  // Unpinned free buffers kept at most (count, bytes); beyond, released ones go back to malloc.
  // A page-locked buffer always returns to the free list and is never unlocked while serving:
  // cudaHostUnregister waits for the whole device and holds every thread's CUDA calls until
  // then. Page-locked bytes are bounded by kMaxPinnedBytes, in use or free.
  static constexpr size_t kMaxFreeBuffers = 32;
  static constexpr size_t kMaxFreeBytes = size_t{1} << 30;
  // Buffers smaller than this are plain allocations (malloc reuses them cheaply).
  static constexpr size_t kMinPooledBytes = size_t{64} << 10;
  // Pooled buffers from this size on are page-locked (with a pinner), up to kMaxPinnedBytes in
  // all; smaller copies cost less than a DMA set-up saves.
  static constexpr size_t kMinPinnedBytes = size_t{128} << 10;
  static constexpr size_t kMaxPinnedBytes = size_t{2} << 30;

 private:
  PooledBuffer(void* data, size_t capacity, bool pooled, bool pinned)
      : data_(data), capacity_(capacity), pooled_(pooled), pinned_(pinned) {}
  void* data_;
  size_t capacity_;
  bool pooled_;  // page-aligned block of the pool (else a plain allocation)
  bool pinned_;
};

// What the pool holds now (the /metrics gauges, tests).
struct PooledBufferStats {
  size_t free_buffers = 0;   // on the free list, pinned or not
  size_t free_bytes = 0;     // their capacity
  size_t free_unpinned = 0;  // of them unpinned (the list's bounds apply to these)
  size_t pinned_bytes = 0;   // page-locked, in use or free (at most kMaxPinnedBytes)
};
PooledBufferStats GetPooledBufferStats();
// Tests only: frees every buffer on the free list (unpinning those pinned).
void DrainPooledBuffersForTesting();

}  // namespace moeserve

#endif  // MOESERVE_SERVER_BUFFER_POOL_H_
