#include <random>

#include "core/modular_kernel.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace moeserve {
namespace {

using Kind = TopKWeightAndReduce::Kind;

// out[t] = sum_k w[t,k] * in_route(t,k) over routes with id >= 0, in double.
std::vector<double> Expected(const std::vector<std::vector<float>>& route_rows, const float* w,
                             const int32_t* ids, int64_t m, int64_t topk, int64_t k) {
  std::vector<double> out(m * k, 0.0);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t j = 0; j < topk; ++j)
      if (ids[t * topk + j] >= 0)
        for (int64_t h = 0; h < k; ++h)
          out[t * k + h] += double{w[t * topk + j]} * route_rows[t * topk + j][h];
  return out;
}

class TopKWeightAndReduceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_.seed(42);
    ids_ = Tensor::Empty(DType::kINT32, {m_, topk_});
    std::uniform_int_distribution<int> e(-1, num_experts_ - 1);  // -1: remote route
    for (int64_t i = 0; i < m_ * topk_; ++i) ids_.data<int32_t>()[i] = e(rng_);
    weights_ = testing::RandomTopkWeights(m_, topk_, rng_);
    rows_.resize(m_ * topk_);
    std::normal_distribution<float> d;
    for (auto& r : rows_) {
      r.resize(k_);
      for (float& x : r) x = d(rng_);
    }
  }
  std::mt19937 rng_;
  const int64_t m_ = 13, topk_ = 3, k_ = 9;
  const int num_experts_ = 4;
  Tensor ids_, weights_;
  std::vector<std::vector<float>> rows_;
};

TEST_F(TopKWeightAndReduceTest, Contiguous) {
  Tensor in = Tensor::Empty(DType::kFP32, {m_, topk_, k_});
  for (int64_t r = 0; r < m_ * topk_; ++r)
    std::copy(rows_[r].begin(), rows_[r].end(), in.data<float>() + r * k_);
  Tensor out = Tensor::Empty(DType::kFP32, {m_, k_});
  auto war = MakeTopKWeightAndReduce(Kind::kContiguous);
  EXPECT_EQ(war->name(), "TopKWeightAndReduceContiguous");
  ASSERT_TRUE(war->Apply(out.view(), in.view(), weights_.view(), ids_.view()).ok());
  auto exp = Expected(rows_, weights_.data<float>(), ids_.data<int32_t>(), m_, topk_, k_);
  for (int64_t i = 0; i < m_ * k_; ++i) EXPECT_NEAR(out.data<float>()[i], exp[i], 1e-5);
  // Wrong input shape is refused.
  Tensor wrong = Tensor::Empty(DType::kFP32, {m_, k_});
  EXPECT_FALSE(war->Apply(out.view(), wrong.view(), weights_.view(), ids_.view()).ok());
}

TEST_F(TopKWeightAndReduceTest, NaiveBatched) {
  // Lay each expert's routes out in (t, k) order, as a batched dispatch does.
  const int64_t max_tokens = m_ * topk_;
  Tensor in = Tensor::Empty(DType::kFP32, {num_experts_, max_tokens, k_});
  std::vector<int64_t> next(num_experts_, 0);
  for (int64_t r = 0; r < m_ * topk_; ++r) {
    const int e = ids_.data<int32_t>()[r];
    if (e < 0) continue;
    std::copy(rows_[r].begin(), rows_[r].end(),
              in.data<float>() + (e * max_tokens + next[e]++) * k_);
  }
  Tensor out = Tensor::Empty(DType::kFP32, {m_, k_});
  auto war = MakeTopKWeightAndReduce(Kind::kNaiveBatched);
  ASSERT_TRUE(war->Apply(out.view(), in.view(), weights_.view(), ids_.view()).ok());
  auto exp = Expected(rows_, weights_.data<float>(), ids_.data<int32_t>(), m_, topk_, k_);
  for (int64_t i = 0; i < m_ * k_; ++i) EXPECT_NEAR(out.data<float>()[i], exp[i], 1e-5);
  // A batch too small for the routes is an error, never a dropped route.
  Tensor small = Tensor::Empty(DType::kFP32, {num_experts_, 1, k_});
  EXPECT_EQ(war->Apply(out.view(), small.view(), weights_.view(), ids_.view()).code(),
            absl::StatusCode::kInternal);
}

TEST_F(TopKWeightAndReduceTest, NoOpCopiesAndDelegateRefuses) {
  Tensor in = testing::RandomNormal({m_, k_}, rng_);
  Tensor out = Tensor::Zeros(DType::kFP32, {m_, k_});
  auto noop = MakeTopKWeightAndReduce(Kind::kNoOp);
  ASSERT_TRUE(noop->Apply(out.view(), in.view(), weights_.view(), ids_.view()).ok());
  for (int64_t i = 0; i < m_ * k_; ++i) EXPECT_EQ(out.data<float>()[i], in.data<float>()[i]);
  ASSERT_TRUE(noop->Apply(out.view(), out.view(), weights_.view(), ids_.view()).ok());
  auto delegate = MakeTopKWeightAndReduce(Kind::kDelegate);
  EXPECT_EQ(delegate->Apply(out.view(), in.view(), weights_.view(), ids_.view()).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace moeserve
