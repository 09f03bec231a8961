// Recycled host buffers for the per-call tensor bytes (gathered request tensors, answers).
//
// Why: a multi-megabyte block freed to glibc goes back to the kernel (mmap'd chunks), and the
// next call pays a page fault for every 4 KiB it touches in a fresh one. Measured on the H200
// host at 1024 tokens of hidden 7168 BF16 (6.3 MB each way): server total 9.95 ms with plain
// new/delete, 5.50 ms when malloc kept its blocks (tests/benchmarks/transport/RESULTS.md).
//
// Process-wide and thread-safe. A buffer returns to the free list when its owner is destroyed
// (possibly on a gRPC thread, when the reply slice that owns it is released).
#ifndef MOESERVE_SERVER_BUFFER_POOL_H_
#define MOESERVE_SERVER_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace moeserve {

class PooledBuffer {
 public:
  // At least `bytes` bytes, 16-byte aligned, contents unspecified.
  static std::unique_ptr<PooledBuffer> Acquire(size_t bytes);
  ~PooledBuffer();
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;

  void* data() { return words_.get(); }
  size_t capacity() const { return capacity_; }

  // Free buffers kept at most (count, bytes); beyond, released buffers go back to malloc.
  static constexpr size_t kMaxFreeBuffers = 32;
  static constexpr size_t kMaxFreeBytes = size_t{1} << 30;
  // Buffers smaller than this are plain allocations (malloc reuses them cheaply).
  static constexpr size_t kMinPooledBytes = size_t{64} << 10;

 private:
  PooledBuffer(std::unique_ptr<uint64_t[]> words, size_t capacity)
      : words_(std::move(words)), capacity_(capacity) {}
  std::unique_ptr<uint64_t[]> words_;
  size_t capacity_;
};

// Tests only: buffers on the free list now (count, bytes).
size_t PooledFreeBuffersForTesting();

}  // namespace moeserve

#endif  // MOESERVE_SERVER_BUFFER_POOL_H_
