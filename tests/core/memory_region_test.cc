// Shared-memory regions (core/memory_region.h): opening POSIX shm objects, the registry's
// refusals and in-use counting, resolving a call's tensors (in place, staged, snapshot, written
// back), overlap, and a region that is not mapped here (the remote-kind seam).
#include "core/memory_region.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/background_release.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "tests/testing/shm_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::ShmObject;
using ::testing::HasSubstr;

// Bytes 0, 1, 2, ... (mod 251) so that every offset has a recognizable value.
void FillPattern(const ShmObject& shm) {
  for (size_t i = 0; i < shm.size(); ++i) shm.data()[i] = static_cast<std::byte>(i % 251);
}

TEST(OpenSystemSharedMemory, MapsTheRegisteredRangeReadWrite) {
  ShmObject shm(3 * 4096 + 100);
  ASSERT_TRUE(shm.ok());
  FillPattern(shm);
  // An offset that is not page aligned: the region's byte 0 is the object's byte 5000.
  auto region = OpenSystemSharedMemory(shm.key(), 5000, 3000, nullptr);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->kind(), RegionKind::kSystem);
  EXPECT_EQ((*region)->byte_size(), 3000);
  EXPECT_EQ((*region)->device(), Device::Host());
  EXPECT_TRUE((*region)->is_mapped());
  EXPECT_TRUE((*region)->writable());
  const auto* p = static_cast<const std::byte*>((*region)->mapped_data());
  for (int i = 0; i < 3000; ++i) ASSERT_EQ(p[i], static_cast<std::byte>((5000 + i) % 251)) << i;
  // Written through the region, seen by the frontend's own mapping (MAP_SHARED).
  static_cast<std::byte*>((*region)->mapped_data())[7] = std::byte{0xAB};
  EXPECT_EQ(shm.data()[5007], std::byte{0xAB});
  // CopyIn / CopyOut, bounds checked.
  std::vector<uint8_t> buf(16);
  const TensorView v(buf.data(), DType::kUINT8, {16});
  ASSERT_TRUE((*region)->CopyIn(10, v).ok());
  EXPECT_EQ(buf[0], (5010) % 251);
  EXPECT_EQ((*region)->CopyIn(2990, v).code(), absl::StatusCode::kInvalidArgument);
  buf.assign(16, 0x5A);
  ASSERT_TRUE((*region)->CopyOut(v, 2984).ok());
  EXPECT_EQ(shm.data()[5000 + 2999], std::byte{0x5A});
  EXPECT_EQ((*region)->CopyOut(v, 2985).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*region)->CopyOut(v, -1).code(), absl::StatusCode::kInvalidArgument);
  RegionInfo info;
  (*region)->Describe(&info);
  EXPECT_EQ(info.key, shm.key());
  EXPECT_EQ(info.offset, 5000);
  EXPECT_FALSE(info.pinned);
}

TEST(OpenSystemSharedMemory, RefusesBadKeysRangesAndMissingObjects) {
  ShmObject shm(8192);
  ASSERT_TRUE(shm.ok());
  for (const std::string& key :
       std::vector<std::string>{"", "/", "noslash", "/a/b", std::string(300, 'x')}) {
    auto r = OpenSystemSharedMemory(key, 0, 16, nullptr);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_THAT(r.status().message(), HasSubstr("key")) << key;
  }
  auto missing = OpenSystemSharedMemory("/moeserve_test_does_not_exist_42", 0, 16, nullptr);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/moeserve_test_does_not_exist_42"));
  // Larger than the object (fstat), by offset, by size and by overflow.
  for (const auto& [offset, size] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 8193}, {1, 8192}, {8192, 1}, {9000, 1}, {1, std::numeric_limits<int64_t>::max()}}) {
    auto r = OpenSystemSharedMemory(shm.key(), offset, size, nullptr);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << offset << "+" << size;
    EXPECT_THAT(r.status().message(), HasSubstr("exceeds the 8192 bytes"));
  }
  EXPECT_EQ(OpenSystemSharedMemory(shm.key(), -1, 16, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenSystemSharedMemory(shm.key(), 0, 0, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The whole object is fine.
  EXPECT_TRUE(OpenSystemSharedMemory(shm.key(), 0, 8192, nullptr).ok());
}

TEST(OpenSystemSharedMemory, ReadOnlyObjectIsMappedReadOnly) {
  if (geteuid() == 0) GTEST_SKIP() << "root opens any object read-write";
  ShmObject shm(4096, 0400);
  ASSERT_TRUE(shm.ok());
  auto region = OpenSystemSharedMemory(shm.key(), 0, 4096, nullptr);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_FALSE((*region)->writable());
}

// Records what a GPU engine's pinner would do (cudaHostRegister / cudaHostUnregister).
class RecordingPinner final : public HostMemoryPinner {
 public:
  absl::Status Pin(void* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    pinned_ = data;
    pinned_bytes_ = bytes;
    return absl::OkStatus();
  }
  void Unpin(void* data) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(data, pinned_);
    // Still mapped while it is unlocked: readable here.
    EXPECT_EQ(static_cast<const std::byte*>(data)[0], std::byte{0});
    ++unpins_;
    unpin_thread_ = std::this_thread::get_id();
  }
  int unpins() {
    std::lock_guard<std::mutex> lock(mu_);
    return unpins_;
  }
  std::thread::id unpin_thread() {
    std::lock_guard<std::mutex> lock(mu_);
    return unpin_thread_;
  }
  size_t pinned_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return pinned_bytes_;
  }

 private:
  std::mutex mu_;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  int unpins_ = 0;
  std::thread::id unpin_thread_;
};

// A pinned region is page-locked when opened (device() PinnedHost), and unlocked when it goes --
// on the background release thread, since cudaHostUnregister waits for the whole device and the
// last holder may be a call's answering thread or the Unregister RPC.
TEST(OpenSystemSharedMemory, PinnedRegionIsUnlockedOffTheReleasingThread) {
  ShmObject shm(2 * 4096);
  ASSERT_TRUE(shm.ok());
  RecordingPinner pinner;
  {
    auto region = OpenSystemSharedMemory(shm.key(), 100, 4096, &pinner);
    ASSERT_TRUE(region.ok()) << region.status();
    EXPECT_EQ((*region)->device(), Device::PinnedHost());
    EXPECT_GE(pinner.pinned_bytes(), 4096u);
  }
  FlushBackgroundReleases();
  EXPECT_EQ(pinner.unpins(), 1);
  EXPECT_NE(pinner.unpin_thread(), std::this_thread::get_id());
}

TEST(CheckRegionRange, BoundsWithoutOverflow) {
  EXPECT_TRUE(CheckRegionRange(100, 0, 100, "x").ok());
  EXPECT_TRUE(CheckRegionRange(100, 100, 0, "x").ok());
  EXPECT_FALSE(CheckRegionRange(100, 100, 1, "x").ok());
  EXPECT_FALSE(CheckRegionRange(100, 101, 0, "x").ok());
  EXPECT_FALSE(CheckRegionRange(100, -1, 1, "x").ok());
  EXPECT_FALSE(CheckRegionRange(100, 1, -1, "x").ok());
  EXPECT_FALSE(CheckRegionRange(100, 50, std::numeric_limits<int64_t>::max(), "x").ok());
  EXPECT_THAT(CheckRegionRange(100, 90, 20, "hidden_states").message(),
              HasSubstr("hidden_states: bytes [90, 90 + 20) lie outside"));
}

TEST(RegionRegistry, RegisterStatusUnregister) {
  ShmObject a(4096), b(8192);
  ASSERT_TRUE(a.ok() && b.ok());
  RegionRegistry registry;
  ASSERT_TRUE(registry.RegisterSystem("a", a.key(), 0, 4096).ok());
  ASSERT_TRUE(registry.RegisterSystem("b", b.key(), 100, 1000).ok());

  const absl::Status dup = registry.RegisterSystem("a", b.key(), 0, 16);
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(dup.message(), HasSubstr("'a' is already registered"));
  EXPECT_EQ(registry.RegisterSystem("", a.key(), 0, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterSystem("c", "/moeserve_test_no_such_key", 0, 16).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.RegisterSystem("c", a.key(), 0, 4097).code(),
            absl::StatusCode::kInvalidArgument);

  auto all = registry.Status("");
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].name, "a");
  EXPECT_EQ((*all)[1].name, "b");
  EXPECT_EQ((*all)[1].kind, RegionKind::kSystem);
  EXPECT_EQ((*all)[1].key, b.key());
  EXPECT_EQ((*all)[1].offset, 100);
  EXPECT_EQ((*all)[1].byte_size, 1000);
  EXPECT_EQ((*all)[1].calls_in_flight, 0);
  EXPECT_EQ(registry.Status("zzz").status().code(), absl::StatusCode::kNotFound);

  EXPECT_EQ(registry.Unregister("zzz").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry.Unregister("a").ok());
  EXPECT_EQ(registry.Status("a").status().code(), absl::StatusCode::kNotFound);
  // The name is free again.
  ASSERT_TRUE(registry.RegisterSystem("a", b.key(), 0, 16).ok());
  ASSERT_TRUE(registry.Unregister("").ok());
  EXPECT_TRUE(registry.Status("")->empty());
}

TEST(RegionRegistry, MaxRegions) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionRegistryOptions options;
  options.max_regions = 2;
  RegionRegistry registry(options);
  ASSERT_TRUE(registry.RegisterSystem("r0", shm.key(), 0, 16).ok());
  ASSERT_TRUE(registry.RegisterSystem("r1", shm.key(), 0, 16).ok());
  EXPECT_EQ(registry.RegisterSystem("r2", shm.key(), 0, 16).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(RegionRegistry, UnregisterRefusedWhileACallHoldsTheRegion) {
  ShmObject a(4096), b(4096);
  ASSERT_TRUE(a.ok() && b.ok());
  RegionRegistry registry;
  ASSERT_TRUE(registry.RegisterSystem("a", a.key(), 0, 4096).ok());
  ASSERT_TRUE(registry.RegisterSystem("b", b.key(), 0, 4096).ok());
  auto lease = registry.Acquire("a", "hidden_states.region");
  ASSERT_TRUE(lease.ok());
  auto second = registry.Acquire("a", "topk_ids.region");
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(registry.Status("a")->at(0).calls_in_flight, 2);

  absl::Status s = registry.Unregister("a");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("'a' (2 calls in flight)"));
  // Everything or nothing: "b" stays too.
  s = registry.Unregister("");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.Status("")->size(), 2u);

  second->Release();
  EXPECT_EQ(registry.Status("a")->at(0).calls_in_flight, 1);
  { RegionLease moved = std::move(*lease); }  // released by the destructor of the moved-to lease
  EXPECT_EQ(registry.Status("a")->at(0).calls_in_flight, 0);
  EXPECT_TRUE(registry.Unregister("a").ok());
}

TEST(RegionRegistry, AcquireUnknownNamesTheFieldAndTheRegion) {
  RegionRegistry registry;
  auto lease = registry.Acquire("nope", "hidden_states.region");
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(lease.status().message(),
              HasSubstr("hidden_states.region: no shared-memory region named 'nope'"));
}

TEST(RegionRegistry, LeaseKeepsTheMappingAfterTheRegistryGoes) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  FillPattern(shm);
  RegionLease lease;
  {
    RegionRegistry registry;
    ASSERT_TRUE(registry.RegisterSystem("a", shm.key(), 0, 4096).ok());
    lease = *registry.Acquire("a", "x");
  }
  EXPECT_EQ(static_cast<const std::byte*>(lease.region().mapped_data())[300],
            static_cast<std::byte>(300 % 251));
}

TEST(RegionRegistry, CudaRegionsRefusedOffTheCudaBackend) {
  RegionRegistry registry;  // backend cpu
  const std::string handle(kCudaIpcHandleBytes, '\x01');
  // The handle's length is checked first, whatever the backend.
  for (size_t n : {size_t{0}, size_t{63}, size_t{65}}) {
    const absl::Status s = registry.RegisterCuda("g", std::string(n, '\x01'), 0, 1024);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_THAT(s.message(), HasSubstr("expected a 64-byte cudaIpcMemHandle_t"));
  }
  EXPECT_EQ(registry.RegisterCuda("g", handle, -1, 1024).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.RegisterCuda("g", handle, 0, 0).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status s = registry.RegisterCuda("g", handle, 0, 1024);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  // "needs the cuda backend" in a CUDA build, "built with CUDA" in a CPU-only one.
  EXPECT_THAT(s.message(), HasSubstr("CUDA shared-memory regions need"));
  EXPECT_TRUE(registry.Status("")->empty());
}

class ResolveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(shm_.ok());
    FillPattern(shm_);
    ASSERT_TRUE(registry_.RegisterSystem("r", shm_.key(), 0, shm_.size()).ok());
  }
  absl::StatusOr<RegionTensor> Resolve(int64_t offset, int64_t bytes, DType dtype, Shape shape,
                                       RegionAccess access = RegionAccess::kRead) {
    return RegionTensor::Resolve(registry_, RegionRef{"r", offset, bytes}, dtype, shape, access,
                                 /*device_ok=*/false, "hidden_states.region");
  }

  ShmObject shm_{16384};
  RegionRegistry registry_;
};

TEST_F(ResolveTest, AlignedReadIsAViewOfTheMapping) {
  auto t = Resolve(256, 4 * 8 * 2, DType::kBF16, {4, 8});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->staged());
  EXPECT_EQ(t->view().dtype(), DType::kBF16);
  EXPECT_EQ(t->view().shape(), (Shape{4, 8}));
  EXPECT_EQ(t->view().device(), Device::Host());
  // The server's own mapping (not the frontend's, another mapping of the same object).
  EXPECT_EQ(t->view().raw_data(),
            static_cast<void*>(static_cast<std::byte*>(t->region().mapped_data()) + 256));
  t->view().data<uint16_t>()[1] = 0xBEEF;
  EXPECT_EQ(*shm_.at<uint16_t>(258), 0xBEEF);
  EXPECT_EQ(registry_.Status("r")->at(0).calls_in_flight, 1);
  t->Release();
  EXPECT_EQ(registry_.Status("r")->at(0).calls_in_flight, 0);
}

TEST_F(ResolveTest, Refusals) {
  // byte_size not shape x dtype.
  auto t = Resolve(0, 63, DType::kBF16, {4, 8});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(),
              HasSubstr("byte_size 63 does not match the tensor: shape [4, 8] x 2 bytes of bf16 "
                        "= 64"));
  // Outside the registered range, negative offset.
  t = Resolve(16384 - 32, 64, DType::kBF16, {4, 8});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("in region 'r': bytes [16352, 16352 + 64)"));
  t = Resolve(-64, 64, DType::kBF16, {4, 8});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  t = Resolve(std::numeric_limits<int64_t>::max(), 64, DType::kBF16, {4, 8});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  // Unknown region.
  t = RegionTensor::Resolve(registry_, RegionRef{"other", 0, 64}, DType::kBF16, {4, 8},
                            RegionAccess::kRead, false, "topk_ids.region");
  EXPECT_THAT(t.status().message(), HasSubstr("topk_ids.region: no shared-memory region named"));
  // No lease is left behind by a refusal.
  EXPECT_EQ(registry_.Status("r")->at(0).calls_in_flight, 0);
}

TEST_F(ResolveTest, MisalignedReadIsStagedWithTheSameBytes) {
  auto t = Resolve(2, 4 * 4, DType::kFP32, {2, 2});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->staged());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->view().raw_data()) % 4, 0u);
  EXPECT_EQ(std::memcmp(t->view().raw_data(), shm_.data() + 2, 16), 0);
}

TEST_F(ResolveTest, SnapshotDoesNotSeeLaterWrites) {
  auto t = Resolve(64, 6 * 4, DType::kINT32, {2, 3}, RegionAccess::kSnapshot);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->staged());
  const int32_t before = t->view().data<int32_t>()[1];
  *shm_.at<int32_t>(68) = before + 1000;  // the frontend changes the id after the check
  EXPECT_EQ(t->view().data<int32_t>()[1], before);
}

TEST_F(ResolveTest, WriteInPlaceAndStagedWriteBack) {
  auto in_place = Resolve(1024, 8 * 4, DType::kFP32, {2, 4}, RegionAccess::kWrite);
  ASSERT_TRUE(in_place.ok());
  EXPECT_FALSE(in_place->staged());
  in_place->view().data<float>()[3] = 1.5f;
  EXPECT_EQ(*shm_.at<float>(1024 + 12), 1.5f);
  EXPECT_TRUE(in_place->Flush().ok());

  auto staged = Resolve(2049, 8 * 4, DType::kFP32, {2, 4}, RegionAccess::kWrite);
  ASSERT_TRUE(staged.ok());
  EXPECT_TRUE(staged->staged());
  for (int i = 0; i < 8; ++i) staged->view().data<float>()[i] = 0.25f * i;
  ASSERT_TRUE(staged->Flush().ok());
  float got[8];
  std::memcpy(got, shm_.data() + 2049, sizeof(got));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i], 0.25f * i);
}

TEST_F(ResolveTest, Overlap) {
  ShmObject other(4096);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(registry_.RegisterSystem("o", other.key(), 0, 4096).ok());
  // The same object under a second name, from byte 1000 of the object.
  ASSERT_TRUE(registry_.RegisterSystem("alias", shm_.key(), 1000, 2000).ok());
  auto in = Resolve(1000, 64, DType::kFP32, {16});
  auto out_overlap = Resolve(1060, 64, DType::kFP32, {16}, RegionAccess::kWrite);
  auto out_disjoint = Resolve(1064, 64, DType::kFP32, {16}, RegionAccess::kWrite);
  auto out_other = RegionTensor::Resolve(registry_, RegionRef{"o", 1000, 64}, DType::kFP32, {16},
                                         RegionAccess::kWrite, false, "output_region");
  // Bytes [1020, 1084) of the object through the alias.
  auto out_alias = RegionTensor::Resolve(registry_, RegionRef{"alias", 20, 64}, DType::kFP32, {16},
                                         RegionAccess::kWrite, false, "output_region");
  ASSERT_TRUE(in.ok() && out_overlap.ok() && out_disjoint.ok() && out_other.ok() && out_alias.ok());
  EXPECT_TRUE(out_overlap->Overlaps(*in));
  EXPECT_TRUE(in->Overlaps(*out_overlap));
  EXPECT_FALSE(out_disjoint->Overlaps(*in));
  EXPECT_FALSE(out_other->Overlaps(*in));
  EXPECT_TRUE(out_alias->Overlaps(*in));
  // Empty ranges overlap nothing.
  auto empty = Resolve(1000, 0, DType::kFP32, {0, 4}, RegionAccess::kWrite);
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(empty->Overlaps(*in));
}

// A region this process cannot address, as a remote (RDMA) kind would be: bytes reachable only
// through CopyIn / CopyOut.
class FakeRemoteRegion final : public MemoryRegion {
 public:
  explicit FakeRemoteRegion(int64_t bytes) : bytes_(bytes) {}
  RegionKind kind() const override { return RegionKind::kRemote; }
  int64_t byte_size() const override { return static_cast<int64_t>(bytes_.size()); }
  Device device() const override { return Device::Host(); }
  std::string backing_id() const override { return "fake-remote"; }
  absl::Status CopyIn(int64_t offset, const TensorView& dst) const override {
    const int64_t n = static_cast<int64_t>(dst.nbytes());
    if (absl::Status s = CheckRegionRange(byte_size(), offset, n, "CopyIn"); !s.ok()) return s;
    std::memcpy(dst.raw_data(), bytes_.data() + offset, n);
    ++copies_in;
    return absl::OkStatus();
  }
  absl::Status CopyOut(const TensorView& src, int64_t offset) const override {
    const int64_t n = static_cast<int64_t>(src.nbytes());
    if (absl::Status s = CheckRegionRange(byte_size(), offset, n, "CopyOut"); !s.ok()) return s;
    std::memcpy(bytes_.data() + offset, src.raw_data(), n);
    ++copies_out;
    return absl::OkStatus();
  }
  void Describe(RegionInfo* info) const override { info->key = "remote://fake"; }
  absl::Status CopyInMany(absl::Span<const CopyInRange> copies) const override {
    ++batches;
    return MemoryRegion::CopyInMany(copies);
  }

  mutable std::vector<uint8_t> bytes_;
  mutable std::atomic<int> copies_in{0}, copies_out{0}, batches{0};
};

TEST(RegionTensor, UnmappedRegionIsStagedThroughCopyInAndCopyOut) {
  RegionRegistry registry;
  auto owned = std::make_unique<FakeRemoteRegion>(4096);
  FakeRemoteRegion* remote = owned.get();
  std::mt19937 rng(3);
  for (auto& b : remote->bytes_) b = static_cast<uint8_t>(rng());
  ASSERT_TRUE(registry.Register("remote", std::move(owned)).ok());
  EXPECT_EQ(registry.Status("remote")->at(0).kind, RegionKind::kRemote);

  auto in = RegionTensor::Resolve(registry, RegionRef{"remote", 128, 64}, DType::kFP32, {4, 4},
                                  RegionAccess::kRead, /*device_ok=*/true, "hidden_states.region");
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_TRUE(in->staged());
  EXPECT_EQ(remote->copies_in.load(), 1);
  EXPECT_EQ(std::memcmp(in->view().raw_data(), remote->bytes_.data() + 128, 64), 0);

  auto out = RegionTensor::Resolve(registry, RegionRef{"remote", 1024, 64}, DType::kFP32, {4, 4},
                                   RegionAccess::kWrite, true, "output_region");
  ASSERT_TRUE(out.ok());
  for (int i = 0; i < 16; ++i) out->view().data<float>()[i] = 1.0f + i;
  ASSERT_TRUE(out->Flush().ok());
  EXPECT_EQ(remote->copies_out.load(), 1);
  float got[16];
  std::memcpy(got, remote->bytes_.data() + 1024, sizeof(got));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(got[i], 1.0f + i);
}

// A call's staged reads, deferred, are filled per region in one CopyInMany (a CUDA region waits
// once for all of them); the bytes are the region's.
TEST(RegionTensor, DeferredCopiesAreFilledTogetherPerRegion) {
  RegionRegistry registry;
  auto a_owned = std::make_unique<FakeRemoteRegion>(4096);
  auto b_owned = std::make_unique<FakeRemoteRegion>(4096);
  FakeRemoteRegion* a = a_owned.get();
  FakeRemoteRegion* b = b_owned.get();
  std::mt19937 rng(std::random_device{}());
  for (auto* r : {a, b}) {
    for (auto& x : r->bytes_) x = static_cast<uint8_t>(rng());
  }
  ASSERT_TRUE(registry.Register("a", std::move(a_owned)).ok());
  ASSERT_TRUE(registry.Register("b", std::move(b_owned)).ok());
  CallLeases leases;
  std::vector<RegionTensor> tensors;
  for (auto [name, offset] : {std::pair<const char*, int64_t>{"a", 0}, {"b", 512}, {"a", 2048}}) {
    auto t = RegionTensor::Resolve(registry, RegionRef{name, offset, 64}, DType::kINT32, {4, 4},
                                   RegionAccess::kSnapshot, false, "topk_ids.region", &leases,
                                   /*defer_copy=*/true);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(t->pending_copy());
    tensors.push_back(std::move(*t));
  }
  EXPECT_EQ(a->copies_in.load() + b->copies_in.load(), 0);
  ASSERT_TRUE(RegionTensor::FillPending(absl::MakeSpan(tensors)).ok());
  EXPECT_EQ(a->batches.load(), 1);  // both of a's tensors in one batch
  EXPECT_EQ(b->batches.load(), 1);
  EXPECT_EQ(a->copies_in.load(), 2);
  EXPECT_EQ(b->copies_in.load(), 1);
  EXPECT_EQ(std::memcmp(tensors[0].view().raw_data(), a->bytes_.data(), 64), 0);
  EXPECT_EQ(std::memcmp(tensors[1].view().raw_data(), b->bytes_.data() + 512, 64), 0);
  EXPECT_EQ(std::memcmp(tensors[2].view().raw_data(), a->bytes_.data() + 2048, 64), 0);
  for (const RegionTensor& t : tensors) EXPECT_FALSE(t.pending_copy());
  // Nothing pending: no copy again.
  ASSERT_TRUE(RegionTensor::FillPending(absl::MakeSpan(tensors)).ok());
  EXPECT_EQ(a->batches.load(), 1);
}

// Calls take and drop leases on many threads while another thread keeps trying to unregister and
// re-register: every Unregister either succeeds with no lease out or is refused, never in between.
TEST(RegionRegistry, ConcurrentLeasesAndUnregister) {
  ShmObject shm(4096);
  ASSERT_TRUE(shm.ok());
  RegionRegistry registry;
  ASSERT_TRUE(registry.RegisterSystem("a", shm.key(), 0, 4096).ok());
  std::atomic<bool> stop{false};
  std::atomic<int64_t> acquired{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      while (!stop.load()) {
        auto lease = registry.Acquire("a", "x");
        if (!lease.ok()) continue;  // unregistered just now
        ++acquired;
        // The region stays mapped while held.
        EXPECT_EQ(lease->region().byte_size(), 4096);
        volatile std::byte b = static_cast<const std::byte*>(lease->region().mapped_data())[4095];
        (void)b;
      }
    });
  }
  // The callers must be running before the unregisters start: on a loaded machine the loop
  // below can finish before any of them is scheduled (seen on the 2-core CI machine).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (acquired.load() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  int unregistered = 0, refused = 0;
  for (int i = 0; i < 300; ++i) {
    const absl::Status s = registry.Unregister("a");
    if (s.ok()) {
      ++unregistered;
      ASSERT_TRUE(registry.RegisterSystem("a", shm.key(), 0, 4096).ok());
    } else {
      ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      ++refused;
    }
  }
  stop = true;
  for (auto& t : callers) t.join();
  EXPECT_GT(acquired.load(), 0);
  EXPECT_EQ(unregistered + refused, 300);
  EXPECT_EQ(registry.Status("a")->at(0).calls_in_flight, 0);
}

// An engine that takes host memory only refuses device views (a CUDA region would be staged for
// it instead) without touching them.
TEST(Engine, HostOnlyEngineRefusesDeviceTensors) {
  EngineOptions options;
  options.model = ModelPreset("tiny").value();
  options.backend = "cpu";
  options.num_threads = 1;
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_FALSE((*engine)->info().device_tensors);
  const ModelConfig& model = (*engine)->info().model;
  const int64_t m = 2;
  std::vector<int32_t> ids(m * model.topk);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % model.num_experts);
  std::vector<float> w(m * model.topk, 0.5f);
  std::vector<uint16_t> host(m * model.hidden);
  // Never dereferenced: the refusal comes first.
  void* fake_device = reinterpret_cast<void*>(uintptr_t{0x7f0000000000});
  ForwardInput in;
  in.layer = 0;
  in.topk_ids = TensorView(static_cast<const void*>(ids.data()), DType::kINT32, {m, model.topk});
  in.topk_weights = TensorView(static_cast<const void*>(w.data()), DType::kFP32, {m, model.topk});
  in.hidden_states = TensorView(fake_device, DType::kBF16, {m, model.hidden}, Device::Cuda(0));
  const TensorView host_out(host.data(), DType::kBF16, {m, model.hidden});
  absl::Status s = (*engine)->Forward(in, host_out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("takes host tensors only"));
  in.hidden_states =
      TensorView(static_cast<const void*>(host.data()), DType::kBF16, {m, model.hidden});
  s = (*engine)->Forward(in,
                         TensorView(fake_device, DType::kBF16, {m, model.hidden}, Device::Cuda(0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

}  // namespace
}  // namespace moeserve
