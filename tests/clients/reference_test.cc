#include "clients/cpp/reference.h"

#include <cmath>
#include <map>
#include <vector>

#include "clients/cpp/dtype_convert.h"
#include "gtest/gtest.h"

namespace moeserve::client {
namespace {

double Silu(double x) { return x / (1.0 + std::exp(-x)); }

// hidden = 2, intermediate = 1.
//   expert 0: gate row [1, 0], up row [0, 1], down [1, 2]^T
//   expert 1: gate row [0, 1], up row [1, 0], down [-1, 0.5]^T
std::map<int, ExpertWeightsF32> TwoExperts() {
  std::map<int, ExpertWeightsF32> experts;
  experts[0] = {2, 1, {1, 0, 0, 1}, {1, 2}};
  experts[7] = {2, 1, {0, 1, 1, 0}, {-1, 0.5f}};
  return experts;
}

TEST(ClientReference, HandComputedTwoExperts) {
  const float x[] = {2, 3};
  const int32_t ids[] = {0, 7};
  const float w[] = {0.25f, 0.75f};
  float out[2];
  ASSERT_TRUE(ReferenceMoeForward(x, 1, 2, ids, w, 2, TwoExperts(), out).ok());
  // expert 0: gate = 2, up = 3 -> a0 = silu(2) * 3; y0 = [a0, 2 a0]
  // expert 1: gate = 3, up = 2 -> a1 = silu(3) * 2; y1 = [-a1, 0.5 a1]
  const double a0 = Silu(2) * 3, a1 = Silu(3) * 2;
  EXPECT_NEAR(out[0], 0.25 * a0 - 0.75 * a1, 1e-6);
  EXPECT_NEAR(out[1], 0.25 * 2 * a0 + 0.75 * 0.5 * a1, 1e-6);
  // Spelled out: silu(2) = 1.7615941559557649, silu(3) = 2.8577223804673.
  EXPECT_NEAR(out[0], -2.96538835, 1e-5);
  EXPECT_NEAR(out[1], 4.78568272, 1e-5);
}

TEST(ClientReference, TokensAreIndependentAndNegativeIdsSkipped) {
  const float x[] = {2, 3, -1, 4};
  const int32_t ids[] = {7, -1, 0, 7};
  const float w[] = {1.0f, 100.0f, 0.5f, 0.5f};
  float out[4];
  ASSERT_TRUE(ReferenceMoeForward(x, 2, 2, ids, w, 2, TwoExperts(), out).ok());
  const double a1 = Silu(3) * 2;  // token 0, expert 7 only
  EXPECT_NEAR(out[0], -a1, 1e-6);
  EXPECT_NEAR(out[1], 0.5 * a1, 1e-6);
  // token 1: x = [-1, 4]; expert 0: gate -1, up 4; expert 7: gate 4, up -1.
  const double b0 = Silu(-1) * 4, b1 = Silu(4) * -1;
  EXPECT_NEAR(out[2], 0.5 * b0 - 0.5 * b1, 1e-6);
  EXPECT_NEAR(out[3], 0.5 * 2 * b0 + 0.5 * 0.5 * b1, 1e-6);
}

TEST(ClientReference, MissingExpertOrWrongHiddenIsAnError) {
  const float x[] = {1, 1};
  const int32_t ids[] = {3};
  const float w[] = {1};
  float out[2];
  EXPECT_EQ(ReferenceMoeForward(x, 1, 2, ids, w, 1, TwoExperts(), out).code(),
            absl::StatusCode::kNotFound);
  const int32_t ok_ids[] = {0};
  const float x3[] = {1, 1, 1};
  float out3[3];
  EXPECT_EQ(ReferenceMoeForward(x3, 1, 3, ok_ids, w, 1, TwoExperts(), out3).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ClientReference, ExpertWeightsFromProtoDecodesBf16) {
  // I = 1, H = 2 in BF16, values exactly representable.
  const float w13[] = {1.0f, -0.5f, 0.25f, 3.0f};
  const float w2[] = {2.0f, -1.0f};
  v1::GetExpertWeightsResponse reply;
  reply.mutable_w13()->set_dtype(v1::DTYPE_BF16);
  reply.mutable_w13()->add_shape(2);
  reply.mutable_w13()->add_shape(2);
  reply.mutable_w13()->set_data(*EncodeFloats(w13, 4, v1::DTYPE_BF16));
  reply.mutable_w2()->set_dtype(v1::DTYPE_BF16);
  reply.mutable_w2()->add_shape(2);
  reply.mutable_w2()->add_shape(1);
  reply.mutable_w2()->set_data(*EncodeFloats(w2, 2, v1::DTYPE_BF16));
  auto e = ExpertWeightsFromProto(reply);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->hidden, 2);
  EXPECT_EQ(e->intermediate, 1);
  EXPECT_EQ(e->w13, std::vector<float>(w13, w13 + 4));
  EXPECT_EQ(e->w2, std::vector<float>(w2, w2 + 2));

  reply.mutable_w2()->set_shape(0, 3);  // H mismatch
  EXPECT_EQ(ExpertWeightsFromProto(reply).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ClientReference, RelativeL2Error) {
  const float expected[] = {3, 4};
  const float actual[] = {3, 4.5f};
  EXPECT_NEAR(RelativeL2Error(actual, expected, 2), 0.1, 1e-12);
  EXPECT_EQ(RelativeL2Error(expected, expected, 2), 0.0);
  const float nan_actual[] = {3, NAN};
  EXPECT_TRUE(std::isnan(RelativeL2Error(nan_actual, expected, 2)));
}

}  // namespace
}  // namespace moeserve::client
