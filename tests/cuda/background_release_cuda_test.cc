// Releases that wait for the whole device run on the background release thread
// (core/background_release.h), so the thread letting go of the memory does not wait for steps in
// flight: a pinned system shared-memory region unregistered while a stream is held, and a
// page-locked pooled-size allocation freed through ReleaseInBackground. Skips where no CUDA
// device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/background_release.h"
#include "core/cuda/cuda_backend.h"
#include "core/memory_region.h"
#include "tests/cuda/held_stream.h"
#include "tests/testing/shm_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::HeldStream;
using ::moeserve::testing::ReturnsWhileHeld;
using ::moeserve::testing::ShmObject;

TEST(BackgroundReleaseCuda, UnregisteringAPinnedRegionDoesNotWaitForTheDevice) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  ShmObject shm(size_t{1} << 20);
  ASSERT_TRUE(shm.ok());
  RegionRegistryOptions options;
  options.backend = Backend::kCuda;
  RegionRegistry registry(options);
  ASSERT_TRUE(registry.RegisterSystem("in", shm.key(), 0, int64_t{1} << 20).ok());
  absl::StatusOr<std::vector<RegionInfo>> info = registry.Status("in");
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->size(), 1u);
  ASSERT_TRUE((*info)[0].pinned) << "the CUDA backend page-locks system regions";
  HeldStream held;
  absl::Status unregistered;
  EXPECT_TRUE(ReturnsWhileHeld(held, [&] { unregistered = registry.Unregister("in"); }))
      << "Unregister waited for a stream it has nothing to do with (cudaHostUnregister)";
  EXPECT_TRUE(unregistered.ok()) << unregistered;
  FlushBackgroundReleases();  // the unlock has run once the device was free
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(BackgroundReleaseCuda, QueuedFreeDoesNotHoldUpTheCaller) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, size_t{4} << 20), cudaSuccess);
  HeldStream held;
  EXPECT_TRUE(
      ReturnsWhileHeld(held, [&] { ReleaseInBackground([pinned] { cudaFreeHost(pinned); }); }));
  FlushBackgroundReleases();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace moeserve
