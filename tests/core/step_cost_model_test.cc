// StepCostModel: the line a step's time follows in its tokens, from the steps seen.
#include "core/step_cost_model.h"

#include <random>

#include "gtest/gtest.h"

namespace moeserve {
namespace {

double PredictUs(const StepCostModel& model, int64_t tokens) {
  return absl::ToDoubleMicroseconds(model.Predict(tokens));
}

TEST(StepCostModelTest, NothingLearnedPredictsZero) {
  StepCostModel model;
  EXPECT_EQ(model.steps(), 0);
  EXPECT_EQ(model.Predict(16), absl::ZeroDuration());
  model.Add(0, absl::Milliseconds(5));  // no tokens: not a step
  EXPECT_EQ(model.steps(), 0);
}

// A GPU decode step: a large fixed part (the weight read) and a small cost per token, seen
// through noisy steps of mixed sizes; the fit extrapolates to sizes it never saw.
TEST(StepCostModelTest, FitsFixedCostPlusCostPerToken) {
  StepCostModel model;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int64_t> sizes(16, 256);
  std::normal_distribution<double> noise(0.0, 5.0);
  for (int i = 0; i < 200; ++i) {
    const int64_t n = sizes(rng);
    model.Add(n, absl::Microseconds(385.0 + 0.8 * static_cast<double>(n) + noise(rng)));
  }
  EXPECT_NEAR(model.fixed_us(), 385.0, 15.0);
  EXPECT_NEAR(model.per_token_us(), 0.8, 0.1);
  EXPECT_NEAR(PredictUs(model, 1024), 385.0 + 819.2, 60.0);
  EXPECT_NEAR(PredictUs(model, 1), 385.8, 15.0);
}

// Steps of one size say nothing of the slope: first the time per token (no fixed part, the
// cautious guess for larger steps); once sizes varied, that slope is kept through the mean.
TEST(StepCostModelTest, OneSizeKeepsTheLastSlopeItCouldFit) {
  StepCostModel model;
  for (int i = 0; i < 10; ++i) model.Add(16, absl::Microseconds(400));
  EXPECT_DOUBLE_EQ(model.fixed_us(), 0.0);
  EXPECT_DOUBLE_EQ(model.per_token_us(), 25.0);
  EXPECT_NEAR(PredictUs(model, 16), 400.0, 1e-6);
  for (int i = 0; i < 20; ++i) {
    const int64_t n = i % 2 == 0 ? 16 : 256;
    model.Add(n, absl::Microseconds(400.0 + 1.0 * static_cast<double>(n - 16)));
  }
  EXPECT_NEAR(model.per_token_us(), 1.0, 0.05);
  // Then one size only, on the same line: the slope stays.
  for (int i = 0; i < 100; ++i) model.Add(64, absl::Microseconds(448));
  EXPECT_NEAR(model.per_token_us(), 1.0, 0.05);
  EXPECT_NEAR(PredictUs(model, 64), 448.0, 1.0);
  EXPECT_NEAR(PredictUs(model, 128), 512.0, 5.0);
  // The engine got slower, still one size: the prediction at that size follows.
  for (int i = 0; i < 100; ++i) model.Add(64, absl::Microseconds(900));
  EXPECT_NEAR(PredictUs(model, 64), 900.0, 1.0);
  EXPECT_GE(PredictUs(model, 128), 900.0);
}

// Larger steps that came out faster (noise) do not make a negative slope; a fixed part below
// zero becomes the line through the origin.
TEST(StepCostModelTest, SlopeAndFixedPartStayNonNegative) {
  StepCostModel model;
  for (int i = 0; i < 20; ++i) {
    model.Add(i % 2 == 0 ? 16 : 512, absl::Microseconds(i % 2 == 0 ? 500 : 450));
  }
  EXPECT_GE(model.per_token_us(), 0.0);
  EXPECT_GE(model.fixed_us(), 0.0);
  EXPECT_GT(PredictUs(model, 16), 0.0);
  StepCostModel cpu;  // time proportional to tokens, a little under
  for (int i = 0; i < 20; ++i) {
    const int64_t n = i % 2 == 0 ? 100 : 200;
    cpu.Add(n, absl::Microseconds(n == 100 ? 900 : 2000));
  }
  EXPECT_DOUBLE_EQ(cpu.fixed_us(), 0.0);
  EXPECT_NEAR(PredictUs(cpu, 150), 150.0 * cpu.per_token_us(), 1e-3);
}

// Older steps weigh less: the model follows an engine whose cost changed.
TEST(StepCostModelTest, FollowsAChangeWithinAFewDozenSteps) {
  StepCostModel model(0.9);
  for (int i = 0; i < 50; ++i)
    model.Add(i % 2 == 0 ? 16 : 64, absl::Microseconds(400 + i % 2 * 48));
  EXPECT_NEAR(PredictUs(model, 40), 424.0, 2.0);
  for (int i = 0; i < 60; ++i)
    model.Add(i % 2 == 0 ? 16 : 64, absl::Microseconds(800 + i % 2 * 96));
  EXPECT_NEAR(PredictUs(model, 40), 848.0, 10.0);
}

}  // namespace
}  // namespace moeserve
