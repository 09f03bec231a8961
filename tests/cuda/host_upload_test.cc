// CudaUploadHostPieces: every byte of pieces of random sizes reaches the device, across chunk
// and slot boundaries, from several threads at once; buffers and stagers are recycled; bad
// arguments are refused. Skips where no CUDA device exists.
#include "core/cuda/host_upload.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "core/cuda/cuda_backend.h"
#include "core/device_upload.h"
#include "core/parallel_copy.h"

namespace moeserve {
namespace {

// The parts on a copier's threads, as the server runs them.
ParallelCopier& Copier() {
  static ParallelCopier* copier = new ParallelCopier(4);
  return *copier;
}
void OnCopier(int64_t n, const std::function<void(int64_t)>& task) {
  Copier().ParallelFor(n, task);
}
// The parts one after another on the calling thread.
void Serial(int64_t n, const std::function<void(int64_t)>& task) {
  for (int64_t i = 0; i < n; ++i) task(i);
}

// `bytes` random bytes cut at random into about `pieces` pieces (some empty).
struct Source {
  std::vector<uint8_t> bytes;
  HostPieces pieces;
};
Source MakeSource(size_t bytes, int pieces, std::mt19937& rng) {
  Source s;
  s.bytes.resize(bytes);
  for (auto& b : s.bytes) b = static_cast<uint8_t>(rng());
  std::vector<size_t> cuts = {0, bytes};
  std::uniform_int_distribution<size_t> at(0, bytes);
  for (int i = 1; i < pieces; ++i) cuts.push_back(at(rng));
  std::sort(cuts.begin(), cuts.end());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    s.pieces.emplace_back(s.bytes.data() + cuts[i], cuts[i + 1] - cuts[i]);
  }
  return s;
}

std::vector<uint8_t> ReadBack(DeviceBytes& d) {
  std::vector<uint8_t> out(d.size());
  EXPECT_EQ(cudaMemcpy(out.data(), d.data(), d.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

TEST(HostUploadTest, EveryByteArrivesAcrossChunksAndSlots) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const size_t chunk = kUploadChunkBytes;
  // One byte, within a chunk, exactly one, one more, more chunks than parts, and more chunks
  // per part than slots (slot reuse).
  for (size_t size : {size_t{1}, size_t{4095}, chunk, chunk + 1, 3 * chunk + 17,
                      (kUploadSlots + 2) * 4 * chunk + 12345}) {
    for (int pieces : {1, 7, 900}) {
      for (int parts : {1, 3, 4, kMaxUploadParts}) {
        Source src = MakeSource(size, pieces, rng);
        auto up = CudaUploadHostPieces(0, src.pieces, size, parts == 3 ? Serial : OnCopier, parts);
        ASSERT_TRUE(up.ok()) << up.status();
        EXPECT_EQ((*up)->size(), size);
        EXPECT_EQ((*up)->device(), Device::Cuda(0));
        EXPECT_EQ(reinterpret_cast<uintptr_t>((*up)->data()) % 256, 0u);
        EXPECT_TRUE(ReadBack(**up) == src.bytes)
            << "size=" << size << " pieces=" << pieces << " parts=" << parts;
      }
    }
  }
}

TEST(HostUploadTest, ConcurrentUploadsDoNotMix) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &failures] {
      std::mt19937 rng(100 + t);
      for (int i = 0; i < 6; ++i) {
        const size_t size = kUploadChunkBytes * (1 + (i + t) % 4) * 3 + 1000 * t + i;
        Source src = MakeSource(size, 300, rng);
        // Serial parts: the copier's loops take turns, and these threads are the concurrency.
        auto up = CudaUploadHostPieces(0, src.pieces, size, Serial, 4);
        if (!up.ok() || ReadBack(**up) != src.bytes) ++failures[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
}

TEST(HostUploadTest, BuffersAndStagersAreRecycled) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(6);
  Source src = MakeSource(5 << 20, 40, rng);
  void* first = nullptr;
  {
    auto up = CudaUploadHostPieces(0, src.pieces, src.bytes.size(), OnCopier, 4);
    ASSERT_TRUE(up.ok()) << up.status();
    first = (*up)->data();
  }
  const size_t free_blocks = UploadFreeBlocksForTesting();
  EXPECT_GE(free_blocks, 1u);
  EXPECT_GE(UploadIdleStagersForTesting(), 1u);
  // A call of a similar size takes a kept buffer (maybe this one) instead of a new one.
  auto again = CudaUploadHostPieces(0, src.pieces, src.bytes.size() - 100, OnCopier, 4);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(UploadFreeBlocksForTesting(), free_blocks - 1);
  (void)first;
}

TEST(HostUploadTest, BadArgumentsAreRefused) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(7);
  Source src = MakeSource(1000, 3, rng);
  auto none = CudaUploadHostPieces(0, src.pieces, 0, OnCopier, 4);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  auto far = CudaUploadHostPieces(CudaDeviceCount(), src.pieces, 1000, OnCopier, 4);
  EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(far.status().message().find("not visible"), std::string::npos) << far.status();
  auto negative = CudaUploadHostPieces(-1, src.pieces, 1000, OnCopier, 4);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  for (int parts : {0, kMaxUploadParts + 1}) {
    auto bad = CudaUploadHostPieces(0, src.pieces, 1000, OnCopier, parts);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << parts;
  }
  for (size_t chunk : {size_t{0}, size_t{5000}, kUploadMaxChunkBytes + 4096}) {
    auto bad = CudaUploadHostPiecesInChunks(0, src.pieces, 1000, OnCopier, 4, chunk);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << chunk;
  }
}

}  // namespace
}  // namespace moeserve
