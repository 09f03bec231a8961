// Large hidden_states uploaded to the device while gathered (InstallDeviceUpload): which
// requests are uploaded, that every byte arrives, and that a failed upload falls back to the
// host gather. A fake upload stands in for the GPU (host memory labelled cuda:3); its own
// binary, since the upload is installed once per process.
#include "core/device_upload.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "inference/infer_wire.h"
#include "moeserve/v1/forward_wire.h"
#include "server/convert.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

constexpr int kDevice = 3;
constexpr int64_t kMinBytes = int64_t{1} << 20;
constexpr size_t kFakeChunk = size_t{256} << 10;  // odd chunk boundaries within pieces

class FakeDeviceBytes final : public DeviceBytes {
 public:
  explicit FakeDeviceBytes(size_t size) : bytes_(size) {}
  void* data() override { return bytes_.data(); }
  size_t size() const override { return bytes_.size(); }
  Device device() const override { return Device::Cuda(kDevice); }

 private:
  std::vector<uint8_t> bytes_;
};

std::atomic<int> uploads{0};
std::atomic<bool> fail_uploads{false};

std::atomic<int> last_parts{0};

// As the CUDA upload does it: one task per part on the server's threads, each copying its
// part's pieces a chunk at a time.
absl::StatusOr<std::unique_ptr<DeviceBytes>> FakeUpload(int device, const HostPieces& pieces,
                                                        size_t size,
                                                        const ParallelForFn& parallel_for,
                                                        int parts) {
  ++uploads;
  last_parts = parts;
  if (device != kDevice) return absl::InternalError("wrong device");
  if (fail_uploads) return absl::InternalError("cudaMalloc: out of memory (fake)");
  auto out = std::make_unique<FakeDeviceBytes>(size);
  auto* dst = static_cast<uint8_t*>(out->data());
  const size_t chunks = (size + kFakeChunk - 1) / kFakeChunk;
  parallel_for(static_cast<int64_t>(chunks), [&](int64_t c) {
    const size_t at = static_cast<size_t>(c) * kFakeChunk;
    const size_t n = std::min(kFakeChunk, size - at);
    size_t done = 0;
    for (const auto& p : SubPieces(pieces, at, n)) {
      std::memcpy(dst + at + done, p.data(), p.size());
      done += p.size();
    }
  });
  return std::unique_ptr<DeviceBytes>(std::move(out));
}

class DeviceUploadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    SetGatherOptions(3, false);  // before the copier's first use
    InstallDeviceUpload(FakeUpload, kDevice, kMinBytes);
  }
  void SetUp() override {
    uploads = 0;
    fail_uploads = false;
  }
};

struct Request {
  std::string x, ids, w;
  std::vector<grpc::Slice> slices;
};

// BF16 hidden states [m, hidden] of random bytes; routing unless `server_routing`; cut into
// `pieces` slices. `x_bytes_delta` makes the byte length disagree with the shape.
Request MakeRequest(int64_t m, int64_t hidden, int pieces, bool server_routing, std::mt19937& rng,
                    int64_t x_bytes_delta = 0) {
  const int64_t topk = 4;
  Request r;
  r.x.resize(m * hidden * 2 + x_bytes_delta);
  for (char& c : r.x) c = static_cast<char>(rng());
  r.ids.resize(m * topk * 4);
  r.w.resize(m * topk * 4);
  for (int64_t i = 0; i < m * topk; ++i) {
    const int32_t id = static_cast<int32_t>(i % 5);
    const float wt = 0.25f;
    std::memcpy(&r.ids[i * 4], &id, 4);
    std::memcpy(&r.w[i * 4], &wt, 4);
  }
  v1::ForwardRequest header;
  *header.mutable_hidden_states() = testing::TensorHeader(v1::DTYPE_BF16, {m, hidden});
  absl::StatusOr<grpc::ByteBuffer> encoded;
  if (server_routing) {
    encoded = v1wire::EncodeForwardRequest(header, grpc::Slice(r.x.data(), r.x.size()),
                                           grpc::Slice(), grpc::Slice());
  } else {
    *header.mutable_topk_ids() = testing::TensorHeader(v1::DTYPE_INT32, {m, topk});
    *header.mutable_topk_weights() = testing::TensorHeader(v1::DTYPE_FP32, {m, topk});
    encoded = v1wire::EncodeForwardRequest(header, grpc::Slice(r.x.data(), r.x.size()),
                                           grpc::Slice(r.ids.data(), r.ids.size()),
                                           grpc::Slice(r.w.data(), r.w.size()));
  }
  EXPECT_TRUE(encoded.ok()) << encoded.status();
  r.slices = testing::RecutSlices(*encoded, pieces, rng);
  return r;
}

absl::StatusOr<ForwardInput> Convert(Request& r, bool device_ok, GatheredBytes* gathered) {
  absl::StatusOr<v1wire::ForwardRequestView> view = v1wire::DecodeForwardRequest(r.slices);
  if (!view.ok()) return view.status();
  ForwardRegions held;
  // The view's slices are reference-counted copies of r.slices: they outlive `view` here.
  return ForwardInputFromWire(*view, gathered, nullptr, device_ok, &held);
}

TEST_F(DeviceUploadTest, LargeHiddenStatesArriveOnTheDeviceByteForByte) {
  std::mt19937 rng(7);
  // 1 MiB + 2 rows and 5.4 MiB; some pieces straddle the fake's chunks.
  for (int64_t m : {74, 400}) {
    Request r = MakeRequest(m, 7168, 300, /*server_routing=*/false, rng);
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> in = Convert(r, /*device_ok=*/true, &gathered);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(in->hidden_states.device(), Device::Cuda(kDevice)) << "m=" << m;
    ASSERT_EQ(gathered.device.size(), 1u);
    ASSERT_EQ(in->hidden_states.nbytes(), r.x.size());
    EXPECT_EQ(in->hidden_states.shape(), (Shape{m, 7168}));
    EXPECT_EQ(std::memcmp(gathered.device[0]->data(), r.x.data(), r.x.size()), 0) << "m=" << m;
    // Routing stays on the host, intact.
    EXPECT_TRUE(in->topk_ids.device().is_host());
    EXPECT_EQ(std::memcmp(in->topk_ids.raw_data(), r.ids.data(), r.ids.size()), 0);
    EXPECT_EQ(std::memcmp(in->topk_weights.raw_data(), r.w.data(), r.w.size()), 0);
  }
  EXPECT_EQ(uploads.load(), 2);
  EXPECT_EQ(last_parts.load(), 3) << "one part per gather thread";
}

TEST_F(DeviceUploadTest, SmallRequestsAndHostEnginesAreGatheredOnTheHost) {
  std::mt19937 rng(8);
  {                                                     // below min_bytes
    Request r = MakeRequest(70, 7168, 50, false, rng);  // 0.96 MiB
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> in = Convert(r, true, &gathered);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_TRUE(in->hidden_states.device().is_host());
    EXPECT_EQ(std::memcmp(in->hidden_states.raw_data(), r.x.data(), r.x.size()), 0);
  }
  {  // an engine that takes host tensors only
    Request r = MakeRequest(400, 7168, 50, false, rng);
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> in = Convert(r, false, &gathered);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_TRUE(in->hidden_states.device().is_host());
    EXPECT_TRUE(gathered.device.empty());
    EXPECT_EQ(std::memcmp(in->hidden_states.raw_data(), r.x.data(), r.x.size()), 0);
  }
  {  // server-side routing reads hidden_states on the host
    Request r = MakeRequest(400, 7168, 50, /*server_routing=*/true, rng);
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> in = Convert(r, true, &gathered);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_TRUE(in->hidden_states.device().is_host());
    EXPECT_TRUE(in->topk_ids.empty());
  }
  EXPECT_EQ(uploads.load(), 0);
}

TEST_F(DeviceUploadTest, AFailedUploadFallsBackToTheHostGather) {
  std::mt19937 rng(9);
  fail_uploads = true;
  Request r = MakeRequest(400, 7168, 120, false, rng);
  GatheredBytes gathered;
  absl::StatusOr<ForwardInput> in = Convert(r, true, &gathered);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(uploads.load(), 1);
  EXPECT_TRUE(in->hidden_states.device().is_host());
  EXPECT_TRUE(gathered.device.empty());
  EXPECT_EQ(std::memcmp(in->hidden_states.raw_data(), r.x.data(), r.x.size()), 0);
}

TEST_F(DeviceUploadTest, ABadByteLengthIsRefusedBeforeAnyUpload) {
  std::mt19937 rng(10);
  Request r = MakeRequest(400, 7168, 120, false, rng, /*x_bytes_delta=*/-2);
  GatheredBytes gathered;
  absl::StatusOr<ForwardInput> in = Convert(r, true, &gathered);
  ASSERT_FALSE(in.ok());
  EXPECT_EQ(in.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(in.status().message().find("hidden_states"), std::string::npos) << in.status();
  EXPECT_EQ(uploads.load(), 0);
}

TEST_F(DeviceUploadTest, KServeHiddenStatesAreUploadedToo) {
  std::mt19937 rng(11);
  const int64_t m = 400, hidden = 7168, topk = 4;
  std::string x(m * hidden * 2, '\0'), ids(m * topk * 4, '\0'), w(m * topk * 4, '\0');
  for (char& c : x) c = static_cast<char>(rng());
  for (int64_t i = 0; i < m * topk; ++i) {
    const int32_t id = static_cast<int32_t>(i % 5);
    std::memcpy(&ids[i * 4], &id, 4);
  }
  for (bool routed : {true, false}) {
    inference::ModelInferRequest header;
    header.set_model_name("layer0");
    auto add = [&header](const char* name, const char* dtype, std::initializer_list<int64_t> s) {
      auto* in = header.add_inputs();
      in->set_name(name);
      in->set_datatype(dtype);
      for (int64_t d : s) in->add_shape(d);
    };
    add("hidden_states", "BF16", {m, hidden});
    std::vector<grpc::Slice> raw = {grpc::Slice(x.data(), x.size())};
    if (routed) {
      add("topk_ids", "INT32", {m, topk});
      add("topk_weights", "FP32", {m, topk});
      raw.emplace_back(ids.data(), ids.size());
      raw.emplace_back(w.data(), w.size());
    }
    absl::StatusOr<grpc::ByteBuffer> encoded = inference_wire::EncodeModelInferRequest(header, raw);
    ASSERT_TRUE(encoded.ok()) << encoded.status();
    std::vector<grpc::Slice> slices = testing::RecutSlices(*encoded, 200, rng);
    grpc::ByteBuffer buffer(slices.data(), slices.size());
    absl::StatusOr<inference_wire::ModelInferRequestView> view =
        inference_wire::DecodeModelInferRequest(buffer);
    ASSERT_TRUE(view.ok()) << view.status();
    GatheredBytes gathered;
    ForwardRegions held;
    absl::StatusOr<ForwardInput> in =
        ForwardInputFromKServe(*view, 0, &gathered, nullptr, /*device_hidden_ok=*/true, &held);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(in->hidden_states.device().is_host(), !routed) << "routed=" << routed;
    const void* bytes = routed ? gathered.device.at(0)->data() : in->hidden_states.raw_data();
    EXPECT_EQ(std::memcmp(bytes, x.data(), x.size()), 0);
  }
  EXPECT_EQ(uploads.load(), 1);
}

}  // namespace
}  // namespace moeserve
