// proto <-> core conversion: every malformed tensor is INVALID_ARGUMENT naming the field.
#include "server/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/memory_region.h"
#include "moeserve/v1/forward_wire.h"
#include "server/status.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

v1::Tensor MakeTensor(int dtype, std::initializer_list<int64_t> shape, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(static_cast<v1::DType>(dtype));
  for (int64_t d : shape) t.add_shape(d);
  t.mutable_data()->assign(bytes, '\0');
  return t;
}

TEST(ConvertTest, ValidTensorViewsTheBytes) {
  v1::Tensor t = MakeTensor(v1::DTYPE_BF16, {2, 64}, 2 * 64 * 2);
  absl::StatusOr<TensorView> v = TensorViewFromProto(t, "hidden_states");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->dtype(), DType::kBF16);
  EXPECT_EQ(v->shape(), (Shape{2, 64}));
  EXPECT_EQ(v->raw_data(), static_cast<const void*>(t.data().data()));  // no copy
}

TEST(ConvertTest, EveryWireDTypeMaps) {
  const std::pair<v1::DType, DType> cases[] = {{v1::DTYPE_BF16, DType::kBF16},
                                               {v1::DTYPE_FP16, DType::kFP16},
                                               {v1::DTYPE_FP32, DType::kFP32},
                                               {v1::DTYPE_INT32, DType::kINT32},
                                               {v1::DTYPE_INT64, DType::kINT64}};
  for (const auto& [wire, core] : cases) {
    v1::Tensor t = MakeTensor(wire, {3, 5}, 15 * DTypeSize(core));
    absl::StatusOr<TensorView> v = TensorViewFromProto(t, "x");
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->dtype(), core);
    EXPECT_EQ(DTypeToProto(core), wire);
  }
}

TEST(ConvertTest, ByteLengthMismatchNamesFieldAndSizes) {
  v1::Tensor t = MakeTensor(v1::DTYPE_BF16, {1, 64}, 100);
  absl::StatusOr<TensorView> v = TensorViewFromProto(t, "hidden_states");
  ASSERT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v.status().message(),
            "hidden_states: data has 100 bytes, expected 128 (shape [1, 64] x 2 bytes of bf16)");
  // One byte too many is as wrong as one too few.
  t = MakeTensor(v1::DTYPE_FP32, {2, 3}, 25);
  EXPECT_THAT(TensorViewFromProto(t, "topk_weights").status().message(),
              HasSubstr("topk_weights: data has 25 bytes, expected 24"));
}

TEST(ConvertTest, UnspecifiedDTypeRejected) {
  v1::Tensor t = MakeTensor(v1::DTYPE_UNSPECIFIED, {1, 4}, 8);
  absl::Status s = TensorViewFromProto(t, "topk_ids").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("topk_ids"));
  EXPECT_THAT(s.message(), HasSubstr("DTYPE_UNSPECIFIED"));
}

TEST(ConvertTest, UnknownDTypeValueRejected) {
  for (int dtype : {6, 42, -1, 1000000}) {
    v1::Tensor t = MakeTensor(dtype, {1, 4}, 8);
    absl::Status s = TensorViewFromProto(t, "hidden_states").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << dtype;
    EXPECT_THAT(s.message(), HasSubstr("hidden_states: unknown dtype value"));
  }
}

TEST(ConvertTest, NegativeDimRejected) {
  v1::Tensor t = MakeTensor(v1::DTYPE_FP32, {-1, 4}, 0);
  absl::Status s = TensorViewFromProto(t, "topk_weights").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("topk_weights"));
  EXPECT_THAT(s.message(), HasSubstr("negative dim -1"));
  // Two negative dims whose product is positive are still rejected.
  t = MakeTensor(v1::DTYPE_FP32, {-2, -2}, 16);
  EXPECT_EQ(TensorViewFromProto(t, "x").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConvertTest, ShapeProductOverflowRejected) {
  const int64_t big = int64_t{1} << 32;
  for (auto shape : {std::initializer_list<int64_t>{big, big},
                     std::initializer_list<int64_t>{std::numeric_limits<int64_t>::max(), 2},
                     std::initializer_list<int64_t>{int64_t{1} << 62, 1}}) {  // x 4 bytes
    v1::Tensor t = MakeTensor(v1::DTYPE_FP32, shape, 16);
    absl::Status s = TensorViewFromProto(t, "hidden_states").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("hidden_states"));
    EXPECT_THAT(s.message(), HasSubstr("overflows"));
  }
}

TEST(ConvertTest, ZeroDimIsEmptyNotOverflow) {
  v1::Tensor t = MakeTensor(v1::DTYPE_BF16, {0, std::numeric_limits<int64_t>::max()}, 0);
  absl::StatusOr<TensorView> v = TensorViewFromProto(t, "hidden_states");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->numel(), 0);
  t = MakeTensor(v1::DTYPE_BF16, {0, 64}, 2);
  EXPECT_EQ(TensorViewFromProto(t, "hidden_states").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ConvertTest, ForwardInputNamesTheBadField) {
  v1::ForwardRequest r;
  r.set_layer(1);
  *r.mutable_hidden_states() = MakeTensor(v1::DTYPE_FP16, {2, 8}, 32);
  *r.mutable_topk_ids() = MakeTensor(v1::DTYPE_INT64, {2, 2}, 32);
  *r.mutable_topk_weights() = MakeTensor(v1::DTYPE_FP32, {2, 2}, 16);
  absl::StatusOr<ForwardInput> in = ForwardInputFromProto(r);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->layer, 1);
  EXPECT_EQ(in->topk_ids.dtype(), DType::kINT64);
  r.mutable_topk_ids()->mutable_data()->pop_back();
  EXPECT_THAT(ForwardInputFromProto(r).status().message(), HasSubstr("topk_ids: data has 31"));
  r.mutable_topk_ids()->mutable_data()->push_back('\0');
  r.mutable_topk_weights()->set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(ForwardInputFromProto(r).status().message(), HasSubstr("topk_weights"));
}

TEST(ConvertTest, AllocateProtoTensorSizesTheReply) {
  v1::Tensor t;
  TensorView v = AllocateProtoTensor(DType::kFP16, {3, 7}, &t);
  EXPECT_EQ(t.dtype(), v1::DTYPE_FP16);
  EXPECT_THAT(t.shape(), ::testing::ElementsAre(3, 7));
  EXPECT_EQ(t.data().size(), 3u * 7u * 2u);
  EXPECT_EQ(v.raw_data(), static_cast<const void*>(t.data().data()));
  EXPECT_EQ(v.shape(), (Shape{3, 7}));
  v = AllocateProtoTensor(DType::kBF16, {0, 7}, &t);
  EXPECT_EQ(t.data().size(), 0u);
}

TEST(ConvertTest, TimingsAddServerQueue) {
  ForwardTimings ft;
  ft.queue_us = 2;
  ft.stages.prepare_us = 3;
  ft.stages.experts_us = 4;
  ft.stages.finalize_us = 5;
  v1::StageTimings st;
  ForwardTimingsToProto(ft, 10, 100, &st);
  EXPECT_EQ(st.queue_us(), 12);
  EXPECT_EQ(st.prepare_us(), 3);
  EXPECT_EQ(st.experts_us(), 4);
  EXPECT_EQ(st.finalize_us(), 5);
  EXPECT_EQ(st.total_us(), 100);
}

// The request's bytes cut into `pieces` slices of random sizes, as gRPC may deliver them.
absl::StatusOr<v1wire::ForwardRequestView> Recut(const grpc::ByteBuffer& buffer, int pieces,
                                                 std::mt19937& rng) {
  return v1wire::DecodeForwardRequest(testing::RecutSlices(buffer, pieces, rng));
}

v1::Tensor Header(v1::DType dtype, std::initializer_list<int64_t> shape) {
  return testing::TensorHeader(dtype, shape);
}

// A tensor split over many slices is gathered once, byte for byte, also when it is large
// enough for the threaded gather (2 MB and more), and the routing beside it is intact.
TEST(ConvertTest, GatheredTensorsKeepEveryByte) {
  std::mt19937 rng(21);
  for (int64_t m : {3, 700}) {  // 43 KB and 10 MB of fp32 hidden states
    const int64_t hidden = 3584, topk = 4;
    std::string x(m * hidden * 4, '\0'), ids(m * topk * 4, '\0'), w(m * topk * 4, '\0');
    for (char& c : x) c = static_cast<char>(rng());
    for (int64_t i = 0; i < m * topk; ++i) {
      const int32_t id = static_cast<int32_t>(i % 7);
      const float wt = 0.25f;
      std::memcpy(&ids[i * 4], &id, 4);
      std::memcpy(&w[i * 4], &wt, 4);
    }
    v1::ForwardRequest header;
    header.set_layer(0);
    *header.mutable_hidden_states() = Header(v1::DTYPE_FP32, {m, hidden});
    *header.mutable_topk_ids() = Header(v1::DTYPE_INT32, {m, topk});
    *header.mutable_topk_weights() = Header(v1::DTYPE_FP32, {m, topk});
    auto encoded = v1wire::EncodeForwardRequest(header, grpc::Slice(x.data(), x.size()),
                                                grpc::Slice(ids.data(), ids.size()),
                                                grpc::Slice(w.data(), w.size()));
    ASSERT_TRUE(encoded.ok()) << encoded.status();
    auto request = Recut(*encoded, m == 3 ? 9 : 400, rng);
    ASSERT_TRUE(request.ok()) << request.status();
    GatheredBytes gathered;
    auto input = ForwardInputFromWire(*request, &gathered);
    ASSERT_TRUE(input.ok()) << input.status();
    EXPECT_FALSE(gathered.host.empty()) << "a tensor over several slices should be gathered";
    ASSERT_EQ(input->hidden_states.nbytes(), x.size());
    EXPECT_EQ(std::memcmp(input->hidden_states.raw_data(), x.data(), x.size()), 0) << "m=" << m;
    EXPECT_EQ(std::memcmp(input->topk_ids.raw_data(), ids.data(), ids.size()), 0);
    EXPECT_EQ(std::memcmp(input->topk_weights.raw_data(), w.data(), w.size()), 0);
    EXPECT_TRUE(input->hidden_states.device().is_host());
  }
}

// Host memory posing as a CUDA region (or, on_gpu false, a system one): the server decides where
// each tensor is read without touching a device (the engine is not called here).
class FakeCudaRegion final : public MemoryRegion {
 public:
  explicit FakeCudaRegion(size_t bytes, bool on_gpu = true) : bytes_(bytes, 0), on_gpu_(on_gpu) {}
  RegionKind kind() const override { return on_gpu_ ? RegionKind::kCuda : RegionKind::kSystem; }
  int64_t byte_size() const override { return static_cast<int64_t>(bytes_.size()); }
  Device device() const override { return on_gpu_ ? Device::Cuda(0) : Device::Host(); }
  void* mapped_data() const override { return bytes_.data(); }
  std::string backing_id() const override {
    return absl::StrCat("fake-cuda:", reinterpret_cast<uintptr_t>(this));
  }
  absl::Status CopyIn(int64_t offset, const TensorView& dst) const override {
    std::memcpy(dst.raw_data(), bytes_.data() + offset, dst.nbytes());
    ++copies_in;
    return absl::OkStatus();
  }
  absl::Status CopyOut(const TensorView& src, int64_t offset) const override {
    std::memcpy(bytes_.data() + offset, src.raw_data(), src.nbytes());
    return absl::OkStatus();
  }
  void Describe(RegionInfo*) const override {}
  mutable std::vector<uint8_t> bytes_;
  mutable std::atomic<int> copies_in{0};
  const bool on_gpu_;
};

// Routing in CUDA regions is read in place only for an engine that checks it on the device,
// only when both topk tensors are there, the ids are int32 and no echo is asked for; otherwise
// both are host copies (and the ids always a private copy, also from a system region).
TEST(ConvertTest, RoutingStaysOnTheDeviceOnlyWhenTheEngineChecksItThere) {
  RegionRegistry registry;
  auto gpu_owned = std::make_unique<FakeCudaRegion>(1 << 16);
  auto other_owned = std::make_unique<FakeCudaRegion>(1 << 16);
  auto host_owned = std::make_unique<FakeCudaRegion>(1 << 16, /*on_gpu=*/false);
  FakeCudaRegion* gpu = gpu_owned.get();
  FakeCudaRegion* host = host_owned.get();
  ASSERT_TRUE(registry.Register("gpu", std::move(gpu_owned)).ok());
  ASSERT_TRUE(registry.Register("gpu2", std::move(other_owned)).ok());
  ASSERT_TRUE(registry.Register("host", std::move(host_owned)).ok());
  struct Case {
    const char* what;
    bool device_routing_ok;
    v1::DType ids_dtype;
    bool return_routing;
    bool weights_inline;  // weights as bytes, not in a region
    const char* weights_region;
    bool want_device;
    const char* ids_region = "gpu";
  };
  const Case cases[] = {
      {"engine checks on the device", true, v1::DTYPE_INT32, false, false, "gpu2", true},
      {"engine checks on the host", false, v1::DTYPE_INT32, false, false, "gpu2", false},
      {"int64 ids", true, v1::DTYPE_INT64, false, false, "gpu2", false},
      {"return_routing", true, v1::DTYPE_INT32, true, false, "gpu2", false},
      {"weights inline", true, v1::DTYPE_INT32, false, true, "", false},
      {"weights in a system region", true, v1::DTYPE_INT32, false, false, "host", false},
      {"both in a system region", true, v1::DTYPE_INT32, false, false, "host", false, "host"},
      {"ids in a system region", true, v1::DTYPE_INT32, false, false, "gpu2", false, "host"},
  };
  const int64_t m = 4, topk = 2, hidden = 8;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const int64_t id_bytes = m * topk * (c.ids_dtype == v1::DTYPE_INT64 ? 8 : 4);
    v1::ForwardRequest header;
    header.set_return_routing(c.return_routing);
    *header.mutable_hidden_states() = Header(v1::DTYPE_BF16, {m, hidden});
    auto* hr = header.mutable_hidden_states()->mutable_region();
    hr->set_name("gpu");
    hr->set_offset(0);
    hr->set_byte_size(m * hidden * 2);
    *header.mutable_topk_ids() = Header(c.ids_dtype, {m, topk});
    auto* ir = header.mutable_topk_ids()->mutable_region();
    ir->set_name(c.ids_region);
    ir->set_offset(4096);
    ir->set_byte_size(id_bytes);
    *header.mutable_topk_weights() = Header(v1::DTYPE_FP32, {m, topk});
    std::string w_bytes(m * topk * 4, '\0');
    if (!c.weights_inline) {
      auto* wr = header.mutable_topk_weights()->mutable_region();
      wr->set_name(c.weights_region);
      wr->set_offset(8192);
      wr->set_byte_size(m * topk * 4);
      w_bytes.clear();
    }
    auto encoded = v1wire::EncodeForwardRequest(header, grpc::Slice(), grpc::Slice(),
                                                grpc::Slice(w_bytes.data(), w_bytes.size()));
    ASSERT_TRUE(encoded.ok()) << encoded.status();
    auto request = v1wire::DecodeForwardRequest(*encoded);
    ASSERT_TRUE(request.ok()) << request.status();
    GatheredBytes gathered;
    ForwardRegions held;
    const int copies_before = gpu->copies_in.load();
    auto input = ForwardInputFromWire(*request, &gathered, &registry, /*device_hidden_ok=*/true,
                                      &held, c.device_routing_ok);
    ASSERT_TRUE(input.ok()) << input.status();
    EXPECT_EQ(input->hidden_states.device(), Device::Cuda(0));  // in place either way
    EXPECT_EQ(input->topk_ids.device().is_host(), !c.want_device);
    EXPECT_EQ(input->topk_weights.device().is_host(), !c.want_device);
    if (c.want_device) {
      EXPECT_EQ(input->topk_ids.raw_data(), gpu->bytes_.data() + 4096);
      EXPECT_EQ(gpu->copies_in.load(), copies_before);
    } else {
      // A private copy, wherever the ids' region is.
      EXPECT_NE(input->topk_ids.raw_data(), gpu->bytes_.data() + 4096);
      EXPECT_NE(input->topk_ids.raw_data(), host->bytes_.data() + 4096);
    }
    held.Release();
  }
}

TEST(StatusTest, EveryCodeMapsToTheSameGrpcCode) {
  for (int c = 0; c <= 16; ++c) {
    const absl::Status s(static_cast<absl::StatusCode>(c), c == 0 ? "" : "msg");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    if (c != 0) {
      EXPECT_EQ(g.error_message(), "msg");
    }
  }
}

}  // namespace
}  // namespace moeserve
