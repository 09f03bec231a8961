#include "core/tensor.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve {
namespace {

TEST(DTypeTest, SizesNamesAndParse) {
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFP32), 4u);
  EXPECT_EQ(DTypeSize(DType::kINT64), 8u);
  EXPECT_EQ(DTypeSize(DType::kFP8E4M3), 1u);
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kINT32, DType::kINT64,
                  DType::kUINT8, DType::kFP8E4M3}) {
    auto parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  auto bad = ParseDType("float128");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("float128"), absl::string_view::npos);
}

TEST(TensorViewTest, ShapeStridesAndSlices) {
  Tensor t = Tensor::Empty(DType::kFP32, {4, 3, 2});
  for (int i = 0; i < 24; ++i) t.data<float>()[i] = static_cast<float>(i);
  TensorView v = t.view();
  EXPECT_EQ(v.rank(), 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.nbytes(), 96u);
  EXPECT_EQ(v.stride(0), 6);
  EXPECT_EQ(v.stride(2), 1);
  EXPECT_TRUE(v.is_contiguous());
  TensorView s = v.Slice(1, 3);
  EXPECT_EQ(s.dim(0), 2);
  EXPECT_EQ(s.data<float>()[0], 6.0f);
  EXPECT_TRUE(s.is_contiguous());
  auto r = v.Reshape({12, 2});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->dim(0), 12);
  EXPECT_FALSE(v.Reshape({5, 5}).ok());
  // A strided (transposed) view is not contiguous and cannot be reshaped.
  TensorView tr(t.data<float>(), DType::kFP32, {2, 12}, {1, 2});
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_FALSE(tr.Reshape({24}).ok());
  EXPECT_EQ(v.DebugString(), "fp32[4, 3, 2]");
}

TEST(TensorViewTest, EmptyTensors) {
  Tensor t = Tensor::Empty(DType::kBF16, {0, 16});
  EXPECT_EQ(t.numel(), 0);
  EXPECT_EQ(t.view().nbytes(), 0u);
  EXPECT_TRUE(TensorView().empty());
}

TEST(TensorViewTest, DeviceTravelsWithViews) {
  float data[12] = {};
  const TensorView host(data, DType::kFP32, {3, 4});
  EXPECT_EQ(host.device(), Device::Host());
  EXPECT_TRUE(host.device().is_host());
  EXPECT_EQ(host.DebugString(), "fp32[3, 4]");
  const TensorView gpu(data, DType::kFP32, {3, 4}, Device::Cuda(1));
  EXPECT_FALSE(gpu.device().is_host());
  EXPECT_EQ(gpu.Slice(1, 3).device(), Device::Cuda(1));
  EXPECT_EQ(gpu.Reshape({12})->device(), Device::Cuda(1));
  EXPECT_EQ(gpu.DebugString(), "fp32[3, 4]@cuda:1");
  EXPECT_NE(Device::Cuda(0), Device::Cuda(1));
  EXPECT_TRUE(Device::PinnedHost().is_host());
  EXPECT_EQ(DeviceName(Device::PinnedHost()), "pinned");
  // Host code never dereferences device memory.
  float out[12];
  const absl::Status s = ConvertTensor(gpu, TensorView(out, DType::kFP32, {3, 4}));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

// Shapes in error messages: in full up to 8 dims, then the first 8 and the count (a client's
// shape of thousands of dims must not make a message larger than a gRPC status carries).
TEST(ShapeToStringTest, LongShapesAreCut) {
  EXPECT_EQ(ShapeToString({}), "[]");
  EXPECT_EQ(ShapeToString({3, 4096}), "[3, 4096]");
  EXPECT_EQ(ShapeToString({1, 2, 3, 4, 5, 6, 7, 8}), "[1, 2, 3, 4, 5, 6, 7, 8]");
  EXPECT_EQ(ShapeToString({1, 2, 3, 4, 5, 6, 7, 8, 9}), "[1, 2, 3, 4, 5, 6, 7, 8, ... (9 dims)]");
  EXPECT_EQ(ShapeToString(std::vector<int64_t>(10000, 1)),
            "[1, 1, 1, 1, 1, 1, 1, 1, ... (10000 dims)]");
}

TEST(HostBufferTest, GrowsAndReuses) {
  HostBuffer b;
  TensorView a = b.Get(DType::kFP32, {10});
  EXPECT_EQ(b.capacity(), 40u);
  TensorView c = b.Get(DType::kBF16, {4});
  EXPECT_EQ(c.raw_data(), a.raw_data());  // fits: reused
  b.Get(DType::kFP32, {100});
  EXPECT_EQ(b.capacity(), 400u);
}

TEST(ConvertTensorTest, AllFloatPairs) {
  Tensor f = Tensor::Empty(DType::kFP32, {3, 5});
  for (int i = 0; i < 15; ++i) f.data<float>()[i] = 0.37f * (i - 7);
  for (DType mid : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    Tensor m = Tensor::Empty(mid, {3, 5});
    ASSERT_TRUE(ConvertTensor(f.view(), m.view()).ok());
    Tensor back = Tensor::Empty(DType::kFP32, {3, 5});
    ASSERT_TRUE(ConvertTensor(m.view(), back.view()).ok());
    for (int i = 0; i < 15; ++i) {
      EXPECT_NEAR(back.data<float>()[i], f.data<float>()[i],
                  std::abs(f.data<float>()[i]) * (mid == DType::kBF16 ? 4e-3 : 1e-3))
          << DTypeName(mid);
    }
  }
  // bf16 -> fp16 goes through float exactly for these values.
  Tensor b = Tensor::Empty(DType::kBF16, {2});
  b.data<uint16_t>()[0] = kernels::FloatToBf16(1.5f);
  b.data<uint16_t>()[1] = kernels::FloatToBf16(-0.25f);
  Tensor h = Tensor::Empty(DType::kFP16, {2});
  ASSERT_TRUE(ConvertTensor(b.view(), h.view()).ok());
  EXPECT_EQ(kernels::Fp16ToFloat(h.data<uint16_t>()[0]), 1.5f);
  EXPECT_EQ(kernels::Fp16ToFloat(h.data<uint16_t>()[1]), -0.25f);
}

TEST(ConvertTensorTest, RejectsMismatchAndUnsupported) {
  Tensor a = Tensor::Empty(DType::kFP32, {2, 3});
  Tensor b = Tensor::Empty(DType::kBF16, {3, 2});
  EXPECT_EQ(ConvertTensor(a.view(), b.view()).code(), absl::StatusCode::kInvalidArgument);
  Tensor i = Tensor::Empty(DType::kINT32, {2, 3});
  EXPECT_EQ(ConvertTensor(a.view(), i.view()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moeserve
