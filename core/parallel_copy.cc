#include "core/parallel_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/thread_pool.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace moeserve {

void StreamingCopy(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // memcpy up to a 16-byte aligned destination; SSE2 is in every x86-64.
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15);
  if (head > 0) std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {  // a cache line per iteration
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  if (i < bytes) std::memcpy(d + i, s + i, bytes - i);
  // Streaming stores are weakly ordered: visible to other threads (and to DMA started after
  // the copy is reported done) only after the fence.
  _mm_sfence();
#else
  if (bytes > 0) std::memcpy(dst, src, bytes);
#endif
}

ParallelCopier::ParallelCopier(int num_threads, bool streaming_stores,
                               size_t gather_min_parallel_bytes)
    : num_threads_(std::max(1, num_threads)),
      streaming_stores_(streaming_stores),
      gather_min_parallel_bytes_(gather_min_parallel_bytes) {}

void ParallelCopier::CopyPart(void* dst, const void* src, size_t bytes) const {
  if (streaming_stores_) {
    StreamingCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}
ParallelCopier::~ParallelCopier() = default;

ThreadPool* ParallelCopier::Pool() {
  std::call_once(pool_once_, [this] { pool_ = std::make_unique<ThreadPool>(num_threads_); });
  return pool_.get();
}

void ParallelCopier::Copy(void* dst, const void* src, size_t bytes) {
  if (num_threads_ == 1 || bytes < kMinParallelBytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return;
  }
  // Equal shares rounded to 4 KiB so that no two threads write the same page.
  const size_t parts = static_cast<size_t>(num_threads_);
  const size_t share = ((bytes + parts - 1) / parts + 4095) / 4096 * 4096;
  Pool()->ParallelFor(static_cast<int64_t>(parts), [&](int64_t i, int) {
    const size_t begin = std::min(bytes, static_cast<size_t>(i) * share);
    const size_t end = std::min(bytes, begin + share);
    if (end > begin) {
      CopyPart(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
    }
  });
}

void ParallelCopier::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (num_threads_ == 1 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Pool()->ParallelFor(n, [&fn](int64_t i, int) { fn(i); });
}

void ParallelCopier::Gather(absl::Span<const absl::Span<const uint8_t>> pieces, size_t size,
                            void* dst) {
  uint8_t* out = static_cast<uint8_t*>(dst);
  if (num_threads_ == 1 || size < std::max<size_t>(gather_min_parallel_bytes_, 2)) {
    size_t done = 0;
    for (const absl::Span<const uint8_t> piece : pieces) {
      const size_t n = std::min(piece.size(), size - done);
      if (n > 0) std::memcpy(out + done, piece.data(), n);
      done += n;
    }
    return;
  }
  std::vector<size_t> starts(pieces.size() + 1, 0);  // each piece's offset in dst
  for (size_t i = 0; i < pieces.size(); ++i) starts[i + 1] = starts[i] + pieces[i].size();
  // kChunkBytes chunks from two on; a smaller message (gather_min_parallel_bytes below that)
  // one chunk per thread, page-rounded so that no two threads write one page.
  const size_t per_thread = (size + num_threads_ - 1) / num_threads_;
  const size_t chunk = size >= 2 * kChunkBytes
                           ? kChunkBytes
                           : std::clamp<size_t>((per_thread + 4095) / 4096 * 4096,
                                                kMinGatherChunkBytes, kChunkBytes);
  const int64_t chunks = static_cast<int64_t>((size + chunk - 1) / chunk);
  Pool()->ParallelFor(chunks, [&](int64_t c, int) {
    const size_t begin = static_cast<size_t>(c) * chunk;
    const size_t end = std::min(size, begin + chunk);
    // The pieces overlapping [begin, end).
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; i < pieces.size() && starts[i] < end; ++i) {
      const size_t from = std::max(begin, starts[i]);
      const size_t to = std::min(end, starts[i + 1]);
      if (to > from) CopyPart(out + from, pieces[i].data() + (from - starts[i]), to - from);
    }
  });
}

}  // namespace moeserve
