// proto <-> core conversion: every malformed tensor is INVALID_ARGUMENT naming the field.
#include "server/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "server/status.h"

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
