// NcclHostTransfer on a group of one rank (one GPU): host bytes survive a Broadcast and an
// AllToAllV round trip as their staging grows, and a growth does not wait for the device (its
// replaced staging is kept, not cudaFree'd: cudaFree waits for every stream, a step's collective
// included). Skips where no CUDA device exists or NCCL is not built in.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "core/cuda/cuda_backend.h"
#include "tests/cuda/held_stream.h"

#ifdef MOESERVE_HAVE_NCCL
#include "core/comm/nccl_communicator.h"
#include "core/comm/nccl_host_transfer.h"
#endif

namespace moeserve {
namespace {

#ifndef MOESERVE_HAVE_NCCL
TEST(NcclHostTransferTest, Disabled) { GTEST_SKIP() << "built without NCCL"; }
#else

using ::moeserve::testing::HeldStream;
using ::moeserve::testing::ReturnsWhileHeld;

struct OneRank {
  std::shared_ptr<CudaContext> ctx;
  std::shared_ptr<NcclCommGroup> group;
};

OneRank MakeOneRank() {
  OneRank r;
  r.ctx = CudaContext::Create(0).value();
  r.group = NcclCommGroup::Create({0}, {r.ctx->stream()}, absl::Seconds(30)).value();
  return r;
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(NcclHostTransferTest, BytesSurviveAsTheStagingGrows) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  OneRank rank = MakeOneRank();
  NcclHostTransfer transfer(rank.group->communicator(0));
  for (const size_t bytes : {size_t{100}, size_t{5000}, size_t{1} << 20, size_t{9} << 20}) {
    SCOPED_TRACE(bytes);
    const std::vector<uint8_t> want = RandomBytes(bytes, bytes);
    std::vector<uint8_t> host = want;
    ASSERT_TRUE(transfer.Broadcast(host.data(), static_cast<int64_t>(bytes), 0).ok());
    EXPECT_EQ(host, want);
    // One rank: its whole send buffer comes back, at an offset of 3 bytes.
    std::vector<uint8_t> recv(bytes + 3, 0);
    const int64_t n = static_cast<int64_t>(bytes);
    const int64_t zero = 0, three = 3;
    ASSERT_TRUE(
        transfer.AllToAllV(want.data(), {&n, 1}, {&zero, 1}, recv.data(), {&n, 1}, {&three, 1})
            .ok());
    EXPECT_EQ(std::vector<uint8_t>(recv.begin() + 3, recv.end()), want);
  }
}

TEST(NcclHostTransferTest, GrowthDoesNotWaitForTheDevice) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  OneRank rank = MakeOneRank();
  NcclHostTransfer transfer(rank.group->communicator(0));
  std::vector<uint8_t> small = RandomBytes(size_t{1} << 20, 1);
  ASSERT_TRUE(transfer.Broadcast(small.data(), static_cast<int64_t>(small.size()), 0).ok());
  const std::vector<uint8_t> want = RandomBytes(size_t{8} << 20, 2);
  std::vector<uint8_t> large = want;
  HeldStream held;  // another stream busy, as a step in flight
  absl::Status status;
  EXPECT_TRUE(ReturnsWhileHeld(held, [&] {
    status = transfer.Broadcast(large.data(), static_cast<int64_t>(large.size()), 0);
  })) << "the staging's growth waited for a stream it does not use";
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(large, want);
}

#endif  // MOESERVE_HAVE_NCCL

}  // namespace
}  // namespace moeserve
