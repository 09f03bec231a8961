// Sizes from outside (requests, configs, checkpoints, flags) never overflow or crash: the
// checked helpers, tensors of hostile shapes, allocations that cannot be had, and the limits
// derived from memory (issue 14 item 4).
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "core/checked_math.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "core/tensor.h"

namespace moeserve {
namespace {

constexpr int64_t kBig = int64_t{1} << 62;

TEST(CheckedMathTest, MulAddProduct) {
  EXPECT_EQ(CheckedMul(int64_t{3}, int64_t{5}), 15);
  EXPECT_EQ(CheckedMul(kBig, int64_t{2}), std::nullopt);
  EXPECT_EQ(CheckedMul(INT64_MIN, int64_t{-1}), std::nullopt);
  EXPECT_EQ(CheckedAdd(INT64_MAX, int64_t{1}), std::nullopt);
  EXPECT_EQ(CheckedAdd(int64_t{-4}, int64_t{9}), 5);
  EXPECT_EQ(CheckedProduct({2, 3, 7}), 42);
  EXPECT_EQ(CheckedProduct({}), 1);
  EXPECT_EQ(CheckedProduct({kBig, kBig}), std::nullopt);
  EXPECT_EQ(CheckedProduct({kBig, kBig, 0}), 0);  // zero wins over overflow
  EXPECT_EQ(CheckedProduct({5, -1}), std::nullopt);
  EXPECT_EQ(CheckedMul(int64_t{1} << 31, int64_t{1} << 31, "bytes").value(), int64_t{1} << 62);
  absl::StatusOr<int64_t> bad = CheckedMul(kBig, 4, "w13 bytes");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("w13 bytes"), absl::string_view::npos);
  EXPECT_FALSE(CheckedAdd(-1, 2, "negative").ok());
}

// Issue 14 item 4: UBSan found signed overflow reachable from the wire in the strides of shape
// [0, 2^62, 2^62] (a valid, empty tensor). Nothing here may overflow (run under UBSan in CI).
TEST(SizeLimitsTest, HostileShapesHaveNoOverflow) {
  EXPECT_EQ(NumElements({0, kBig, kBig}), 0);
  EXPECT_EQ(NumElements({kBig, kBig}), -1);
  EXPECT_EQ(NumElements({4, -1}), -1);
  int64_t dummy = 0;
  const TensorView v(&dummy, DType::kBF16, {0, kBig, kBig});
  EXPECT_EQ(v.numel(), 0);
  EXPECT_EQ(v.nbytes(), 0u);
  EXPECT_EQ(v.stride(2), 1);
  EXPECT_EQ(v.stride(1), kBig);
  EXPECT_EQ(v.stride(0), INT64_MAX);  // saturated, never used to address memory
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.Slice(0, 0).numel(), 0);
  const TensorView w(&dummy, DType::kFP32, {kBig, kBig, 0});
  EXPECT_EQ(w.numel(), 0);
  EXPECT_TRUE(w.is_contiguous());
}

TEST(SizeLimitsTest, AllocationsThatCannotBeHadAreErrorsNamingTheSize) {
  absl::StatusOr<Tensor> t = Tensor::Allocate(DType::kFP32, {kBig, 8});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(t.status().message().find("overflows 64 bits"), absl::string_view::npos) << t.status();
  // Over the 4 TiB single-allocation limit: refused before asking the allocator.
  t = Tensor::Allocate(DType::kBF16, {int64_t{1} << 30, int64_t{1} << 12});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("8796093022208"), absl::string_view::npos) << t.status();
  EXPECT_NE(t.status().message().find("bf16[1073741824, 4096]"), absl::string_view::npos)
      << t.status();
  // Negative dims have no size at all.
  EXPECT_FALSE(Tensor::Allocate(DType::kUINT8, {-3}).ok());
  // What can be had is allocated, 64-byte aligned.
  t = Tensor::Allocate(DType::kFP32, {3, 5});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data<float>()) % 64, 0u);
  EXPECT_EQ(t->nbytes(), 60u);

  HostBuffer buffer;
  absl::StatusOr<TensorView> view = buffer.TryGet(DType::kFP32, {kBig, kBig});
  EXPECT_EQ(view.status().code(), absl::StatusCode::kResourceExhausted);
  view = buffer.TryGet(DType::kFP32, {1 << 20, (1 << 20) + 1});  // over the 4 TiB limit
  EXPECT_EQ(view.status().code(), absl::StatusCode::kResourceExhausted);
  view = buffer.TryGet(DType::kFP32, {4, 4});
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(buffer.capacity(), 64u);
}

TEST(SizeLimitsTest, ModelSizesAreChecked) {
  ModelConfig c;
  c.name = "unchecked";
  c.num_layers = 1;
  c.num_experts = 1 << 30;
  c.topk = 1;
  c.hidden = int64_t{1} << 30;
  c.intermediate = int64_t{1} << 30;
  EXPECT_FALSE(c.Validate().ok());
  // A config that skipped Validate still gets no wrapped size.
  EXPECT_EQ(c.LayerWeightBytes(c.num_experts, WeightFormat::kBF16), -1);
  EXPECT_EQ(c.LayerWeightBytes(c.num_experts, WeightFormat::kMXFP8), -1);
  absl::Status s = CheckMemoryBudget(c, c.LayerWeightBytes(c.num_experts, WeightFormat::kBF16),
                                     int64_t{1} << 40);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("overflows"), absl::string_view::npos) << s;

  ModelConfig d = ModelPreset("deepseek-v3").value();
  // 8192 tokens x topk 8 x hidden 7168 x 4 bytes, plus the smaller buffers.
  const int64_t fused = int64_t{8192} * 8 * 7168 * 4;
  EXPECT_GT(d.ActivationBytes(8192), fused);
  EXPECT_LT(d.ActivationBytes(8192), 2 * fused);
  EXPECT_EQ(d.ActivationBytes(int64_t{1} << 62), -1);
  EXPECT_TRUE(CheckActivationBudget(d, 8192, int64_t{64} << 30).ok());
  s = CheckActivationBudget(d, 8192, int64_t{2} << 30);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("max_tokens_per_request=8192"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("GiB"), absl::string_view::npos) << s;
  s = CheckActivationBudget(d, int64_t{1} << 62, int64_t{64} << 30);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("more than 2^63"), absl::string_view::npos) << s;
  // Each engine lane (steps in flight) has its own step buffers.
  const int64_t three_steps = 3 * d.ActivationBytes(8192);  // half of it fits one step, not two
  EXPECT_TRUE(CheckActivationBudget(d, 8192, three_steps, 1).ok());
  s = CheckActivationBudget(d, 8192, three_steps, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("2 step(s) in flight"), absl::string_view::npos) << s;
}

// Issue 14 item 7: finite router weights like 3e38 overflowed the sums to Inf; weights are
// bounded by kMaxAbsTopkWeight.
TEST(SizeLimitsTest, HugeFiniteRouterWeightsAreRefused) {
  ModelConfig m = ModelPreset("tiny").value();
  Tensor x = Tensor::Zeros(DType::kFP32, {2, m.hidden});
  Tensor ids = Tensor::Empty(DType::kINT32, {2, m.topk});
  Tensor w = Tensor::Empty(DType::kFP32, {2, m.topk});
  for (int i = 0; i < 2 * m.topk; ++i) {
    ids.data<int32_t>()[i] = i % m.num_experts;
    w.data<float>()[i] = 0.25f;
  }
  const ForwardInput in{0, x.view(), ids.view(), w.view()};
  EXPECT_TRUE(ValidateForwardInput(m, 8, in).ok());
  for (float bad : {3e38f, -3e38f, kMaxAbsTopkWeight * 1.0001f, -2e4f}) {
    w.data<float>()[5] = bad;
    absl::Status s = ValidateForwardInput(m, 8, in);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("topk_weights"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("[1, 1]"), absl::string_view::npos) << s;
  }
  for (float fine : {kMaxAbsTopkWeight, -kMaxAbsTopkWeight, 2.5f, 0.0f}) {
    w.data<float>()[5] = fine;
    EXPECT_TRUE(ValidateForwardInput(m, 8, in).ok()) << fine;
  }
}

}  // namespace
}  // namespace moeserve
