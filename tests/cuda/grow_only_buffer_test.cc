// GrowOnlyBuffer: a growth never waits for the device (cudaFree would wait for every stream,
// a collective waiting on a failed peer included); the allocation it replaces lives until
// ReleaseSuperseded; where the new one does not fit beside it, it is freed first; a failed
// allocation leaves no last error. Skips where no CUDA device exists.
#include "core/cuda/grow_only_buffer.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>

#include "core/cuda/cuda_backend.h"
#include "tests/cuda/held_stream.h"

namespace moeserve {
namespace {

using ::moeserve::testing::HeldStream;
using ::moeserve::testing::ReturnsWhileHeld;

TEST(GrowOnlyBufferTest, GrowthDoesNotWaitForTheDevice) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (auto memory : {GrowOnlyBuffer::Memory::kDevice, GrowOnlyBuffer::Memory::kPinnedHost}) {
    SCOPED_TRACE(memory == GrowOnlyBuffer::Memory::kDevice ? "device" : "pinned host");
    GrowOnlyBuffer buffer(memory, 0, /*quarter_slack=*/false);
    ASSERT_TRUE(buffer.Get(size_t{1} << 20).ok());
    HeldStream held;
    absl::StatusOr<void*> grown;
    EXPECT_TRUE(ReturnsWhileHeld(held, [&] { grown = buffer.Get(size_t{8} << 20); }))
        << "the growth waited for a stream it has nothing to do with";
    ASSERT_TRUE(grown.ok()) << grown.status();
    EXPECT_EQ(buffer.superseded_bytes(), size_t{1} << 20);
  }
}

TEST(GrowOnlyBufferTest, ReplacedAllocationLivesUntilReleased) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  GrowOnlyBuffer buffer(GrowOnlyBuffer::Memory::kDevice, 0, /*quarter_slack=*/false);
  absl::StatusOr<void*> first = buffer.Get(4096);
  ASSERT_TRUE(first.ok());
  absl::StatusOr<void*> second = buffer.Get(size_t{1} << 20);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(*first, *second);
  EXPECT_EQ(buffer.superseded_bytes(), 4096u);
  // Work queued before the growth may still use it: a live allocation.
  cudaPointerAttributes a;
  ASSERT_EQ(cudaPointerGetAttributes(&a, *first), cudaSuccess);
  EXPECT_EQ(a.type, cudaMemoryTypeDevice);
  EXPECT_EQ(cudaMemset(*first, 0, 4096), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  buffer.ReleaseSuperseded();
  EXPECT_EQ(buffer.superseded_bytes(), 0u);
  const cudaError_t err = cudaPointerGetAttributes(&a, *first);
  cudaGetLastError();
  EXPECT_TRUE(err != cudaSuccess || a.type == cudaMemoryTypeUnregistered) << "not freed";
  absl::StatusOr<void*> again = buffer.Get(size_t{1} << 20);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *second);  // no growth, nothing moved
}

// Two of these do not fit on the device: the old allocation goes first (waiting for the device,
// as every growth did before), and the growth succeeds.
TEST(GrowOnlyBufferTest, NoRoomBesideTheOldAllocationFreesItFirst) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  const size_t big = free_bytes / 5 * 3;
  GrowOnlyBuffer buffer(GrowOnlyBuffer::Memory::kDevice, 0, /*quarter_slack=*/false);
  ASSERT_TRUE(buffer.Get(big).ok());
  absl::StatusOr<void*> grown = buffer.Get(big + (size_t{1} << 20));
  ASSERT_TRUE(grown.ok()) << grown.status();
  EXPECT_EQ(buffer.superseded_bytes(), 0u);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// A failed allocation is returned as RESOURCE_EXHAUSTED and leaves no "last error" behind: the
// launchers that return cudaGetLastError() would otherwise fail the thread's next healthy call.
TEST(GrowOnlyBufferTest, FailedAllocationLeavesNoLastError) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (auto memory : {GrowOnlyBuffer::Memory::kDevice, GrowOnlyBuffer::Memory::kPinnedHost}) {
    GrowOnlyBuffer buffer(memory, 0, false);
    ASSERT_TRUE(buffer.Get(4096).ok());
    const absl::StatusOr<void*> huge = buffer.Get(size_t{1} << 50);
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_TRUE(buffer.Get(4096).ok());  // usable again
  }
}

}  // namespace
}  // namespace moeserve
