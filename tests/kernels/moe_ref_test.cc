#include "kernels/cpu/moe_ref.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/moe_routing_ref.h"

namespace moeserve::kernels {
namespace {

TEST(SiluTest, KnownValues) {
  EXPECT_FLOAT_EQ(SiluRef(0.0f), 0.0f);
  EXPECT_NEAR(SiluRef(1.0f), 1.0f / (1.0f + std::exp(-1.0f)), 1e-7);
  EXPECT_NEAR(SiluRef(-2.0f), -2.0f / (1.0f + std::exp(2.0f)), 1e-7);
  EXPECT_NEAR(SiluRef(30.0f), 30.0f, 1e-5);
  EXPECT_NEAR(SiluRef(-100.0f), 0.0f, 1e-30);
}

TEST(ExpertMlpRowRefTest, HandComputedCase) {
  // hidden 2, intermediate 1.
  // gate row [1, 2], up row [3, -1], down column [2, -0.5].
  const std::vector<float> w13 = {1, 2, 3, -1};
  const std::vector<float> w2 = {2, -0.5};
  const std::vector<float> x = {0.5, 0.25};
  // gate = 0.5 + 0.5 = 1; up = 1.5 - 0.25 = 1.25; act = silu(1) * 1.25.
  const float act = 1.0f / (1.0f + std::exp(-1.0f)) * 1.25f;
  std::vector<float> y(2), scratch(3);
  ExpertMlpRowRef(x.data(), w13.data(), w2.data(), 2, 1, y.data(), scratch.data());
  EXPECT_NEAR(y[0], 2 * act, 1e-6);
  EXPECT_NEAR(y[1], -0.5 * act, 1e-6);
}

TEST(StageRoutingRefTest, CopiesPadsAndReportsFirstOffenders) {
  // 3 tokens, topk 2, padded to 4 rows, 4 experts.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<int32_t> ids = {0, 3, 4, 1, -1, 2};  // route 2 (value 4), route 4 (-1)
  const std::vector<float> w = {0.5f, 0.25f, 1.0f, nan, 2e4f, -3.0f};  // routes 3 and 4
  std::vector<int32_t> out_ids(8, 77);
  std::vector<float> out_w(8, 77.0f);
  RoutingReportRef report;
  StageRoutingRef(ids.data(), w.data(), 3, 2, 4, 4, nullptr, 4, 1e4f, out_ids.data(), out_w.data(),
                  &report);
  EXPECT_EQ(out_ids, (std::vector<int32_t>{0, 3, -1, 1, -1, 2, -1, -1}));
  EXPECT_EQ(out_w, (std::vector<float>{0.5f, 0.25f, 1.0f, 0.0f, 0.0f, -3.0f, 0.0f, 0.0f}));
  EXPECT_EQ(report.bad_id_route, 2);
  EXPECT_EQ(report.bad_id_value, 4);
  EXPECT_EQ(report.bad_weight_route, 3);
  EXPECT_TRUE(std::isnan(report.bad_weight_value));

  // Clean input: nothing reported, everything copied.
  const std::vector<int32_t> good_ids = {1, 2};
  const std::vector<float> good_w = {0.75f, -1e4f};
  StageRoutingRef(good_ids.data(), good_w.data(), 1, 2, 1, 4, nullptr, 4, 1e4f, out_ids.data(),
                  out_w.data(), &report);
  EXPECT_EQ(report.bad_id_route, -1);
  EXPECT_EQ(report.bad_weight_route, -1);
  EXPECT_EQ(out_ids[1], 2);
  EXPECT_EQ(out_w[1], -1e4f);

  // Through an expert map: global 1 -> local 0, global 2 -> not on this rank (-1).
  const std::vector<int32_t> map = {-1, 0, -1, 1};
  StageRoutingRef(good_ids.data(), good_w.data(), 1, 2, 1, 4, map.data(), 2, 1e4f, out_ids.data(),
                  out_w.data(), &report);
  EXPECT_EQ(out_ids[0], 0);
  EXPECT_EQ(out_ids[1], -1);
  EXPECT_EQ(report.bad_id_route, -1);
}

TEST(TopKWeightAndReduceContiguousRefTest, WeightsSumsAndSkipsRemoteRoutes) {
  // 2 tokens, topk 2, hidden 3.
  const std::vector<float> in = {1,  2, 3, 10, 20, 30,  // token 0: routes 0, 1
                                 -1, 0, 1, 5,  5,  5};  // token 1: routes 0, 1
  const std::vector<float> w = {0.5, 0.25, 2, 7};
  const std::vector<int32_t> ids = {3, 1, 0, -1};  // token 1's second route is remote
  std::vector<float> out(6, 99.0f);
  TopKWeightAndReduceContiguousRef(in.data(), w.data(), ids.data(), 2, 2, 3, out.data());
  EXPECT_FLOAT_EQ(out[0], 0.5f * 1 + 0.25f * 10);
  EXPECT_FLOAT_EQ(out[2], 0.5f * 3 + 0.25f * 30);
  EXPECT_FLOAT_EQ(out[3], -2.0f);
  EXPECT_FLOAT_EQ(out[5], 2.0f);
}

}  // namespace
}  // namespace moeserve::kernels
