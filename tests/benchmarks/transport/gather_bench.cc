// The gather of a large gRPC request (ParallelCopier::Gather, as GatherPieces runs it): a
// request's bytes arrive as many slices and are copied back to back into one page-aligned
// buffer, which a GPU engine then reads by DMA. Compares cached stores (memcpy) with streaming
// stores (StreamingCopy) at the sizes of issue 11's M (H7168 BF16 plus top-8 routing), for
// several thread counts and slice sizes; the peer is one memcpy of the same bytes from one
// contiguous buffer on one thread, measured in the same run.
//
//   gather_bench [--iters N] [--threads 1,2,4] [--pieces 16384,262144] [--tokens 64,256,1024]
//
// Prints one line per point: "gather tokens=.. bytes=.. piece=.. threads=.. stores=..
// p50_us=.. GB/s=.. vs_memcpy=..", then the peer's line. vs_memcpy > 1 is faster than the peer.
// The buffers are reused (as the server's pool reuses them), so no page faults are timed.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "core/parallel_copy.h"
#include "tests/benchmarks/transport/bench_flags.h"

namespace {

using ::moeserve::bench::ParseList;

template <typename F>
double MedianMicros(int iters, F&& f) {
  f();  // warm-up: first touch, threads started
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  std::vector<int64_t> threads = {1, 2, 4}, pieces = {16384, 262144}, tokens = {64, 256, 1024};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--iters") {
      iters = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--threads") {
      threads = ParseList(argv[i + 1]);
    } else if (flag == "--pieces") {
      pieces = ParseList(argv[i + 1]);
    } else if (flag == "--tokens") {
      tokens = ParseList(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  constexpr int64_t kHidden = 7168, kTopk = 8;
  for (int64_t m : tokens) {
    const size_t bytes = static_cast<size_t>(m * (kHidden * 2 + kTopk * 8));
    // Sources as gRPC leaves them: separate allocations, not 16-byte aligned.
    std::vector<uint8_t> contiguous(bytes + 64);
    for (size_t i = 0; i < contiguous.size(); ++i) contiguous[i] = static_cast<uint8_t>(i * 131);
    auto* dst = static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
    std::memset(dst, 0, bytes);
    const double peer_us =
        MedianMicros(iters, [&] { std::memcpy(dst, contiguous.data() + 3, bytes); });
    for (int64_t piece : pieces) {
      std::vector<std::vector<uint8_t>> storage;
      std::vector<absl::Span<const uint8_t>> spans;
      for (size_t at = 0; at < bytes; at += static_cast<size_t>(piece)) {
        const size_t n = std::min(static_cast<size_t>(piece), bytes - at);
        storage.emplace_back(n + 3);
        std::memcpy(storage.back().data() + 3, contiguous.data() + at, n);
        spans.emplace_back(storage.back().data() + 3, n);
      }
      for (int64_t t : threads) {
        for (bool streaming : {false, true}) {
          moeserve::ParallelCopier copier(static_cast<int>(t), streaming);
          const double us = MedianMicros(iters, [&] { copier.Gather(spans, bytes, dst); });
          if (std::memcmp(dst, contiguous.data(), bytes) != 0) {
            std::fprintf(stderr, "gather wrote wrong bytes\n");
            return 1;
          }
          std::printf(
              "gather tokens=%lld bytes=%zu piece=%lld threads=%lld stores=%s p50_us=%.0f "
              "GB/s=%.1f vs_memcpy=%.2f\n",
              static_cast<long long>(m), bytes, static_cast<long long>(piece),
              static_cast<long long>(t), streaming ? "streaming" : "cached", us, bytes / us / 1e3,
              peer_us / us);
        }
      }
    }
    std::printf("memcpy tokens=%lld bytes=%zu threads=1 p50_us=%.0f GB/s=%.1f\n",
                static_cast<long long>(m), bytes, peer_us, bytes / peer_us / 1e3);
    std::free(dst);
  }
  return 0;
}
