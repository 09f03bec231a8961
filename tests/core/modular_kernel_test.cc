#include "core/modular_kernel.h"

#include <random>

#include "core/cpu/cpu_experts.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace moeserve {
namespace {

// An Experts that only declares capabilities, for compatibility checks.
class FakeExperts final : public Experts {
 public:
  FakeExperts(ActivationFormat format, bool expert_map, DType dtype)
      : format_(format), expert_map_(expert_map), dtype_(dtype) {}
  absl::string_view name() const override { return "FakeExperts"; }
  ActivationFormats activation_formats() const override { return {format_, format_}; }
  bool supports_expert_map() const override { return expert_map_; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return dtype_; }
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem&) const override { return {}; }
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind::kNoOp);
  }
  absl::Status Apply(const ExpertsApplyArgs&) override { return absl::OkStatus(); }

 private:
  ActivationFormat format_;
  bool expert_map_;
  DType dtype_;
};

// A PrepareAndFinalize that claims several dispatchers.
class FakeEpPrepareFinalize final : public PrepareAndFinalize {
 public:
  absl::string_view name() const override { return "FakeEp"; }
  ActivationFormat activation_format() const override { return ActivationFormat::kStandard; }
  int64_t max_num_tokens_per_rank() const override { return 8; }
  int num_dispatchers() const override { return 4; }
  const QuantConfig& quant_config() const override { return quant_; }
  absl::Status Prepare(const PrepareArgs&, PreparedActivations*) override {
    return absl::OkStatus();
  }
  absl::Status Finalize(const TensorView&, const TensorView&, const PreparedActivations&,
                        const TopKWeightAndReduce&) override {
    return absl::OkStatus();
  }

 private:
  QuantConfig quant_;
};

TEST(ModularKernelTest, RefusesIncompatiblePairsSayingWhy) {
  auto batched = ModularKernel::Create(
      std::make_unique<NoEpPrepareAndFinalize>(16),
      std::make_unique<FakeExperts>(ActivationFormat::kBatchedExperts, true, DType::kFP32));
  ASSERT_EQ(batched.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(batched.status().message().find("Standard"), absl::string_view::npos);
  EXPECT_NE(batched.status().message().find("BatchedExperts"), absl::string_view::npos);

  auto no_map = ModularKernel::Create(
      std::make_unique<FakeEpPrepareFinalize>(),
      std::make_unique<FakeExperts>(ActivationFormat::kStandard, false, DType::kFP32));
  ASSERT_EQ(no_map.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_map.status().message().find("expert map"), absl::string_view::npos);

  auto dtype = ModularKernel::Create(
      std::make_unique<NoEpPrepareAndFinalize>(16),
      std::make_unique<FakeExperts>(ActivationFormat::kStandard, true, DType::kBF16));
  ASSERT_EQ(dtype.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dtype.status().message().find("bf16"), absl::string_view::npos);

  EXPECT_FALSE(ModularKernel::Create(nullptr, std::make_unique<ReferenceExperts>()).ok());
}

TEST(ModularKernelTest, ReduceInApplyAndReduceInFinalizeAgree) {
  // ReferenceExperts reduces inside Apply (NoOp); BlasExperts delegates to Finalize.
  EXPECT_EQ(ReferenceExperts().FinalizeWeightAndReduceImpl()->kind(),
            TopKWeightAndReduce::Kind::kNoOp);
  EXPECT_EQ(BlasExperts(1).FinalizeWeightAndReduceImpl()->kind(),
            TopKWeightAndReduce::Kind::kDelegate);
  ModelConfig model{
      .name = "t", .num_layers = 1, .num_experts = 6, .topk = 3, .hidden = 20, .intermediate = 12};
  auto store = *ExpertWeightStore::CreateSynthetic(model, {0, 1, 2, 3, 4, 5}, 9, 1);
  auto ref = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(64),
                                    std::make_unique<ReferenceExperts>());
  auto blas = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(64),
                                     std::make_unique<BlasExperts>(2));
  std::mt19937 rng(5);
  Tensor x = testing::RandomNormal({33, 20}, rng);
  Tensor ids = testing::MakeRouting(testing::Routing::kUniform, 33, 3, 6, rng);
  Tensor w = testing::RandomTopkWeights(33, 3, rng);
  ModularKernelArgs args{.hidden_states = x.view(),
                         .topk_ids = ids.view(),
                         .topk_weights = w.view(),
                         .weights = store->layer(0),
                         .num_experts = 6};
  Tensor a = Tensor::Empty(DType::kFP32, {33, 20}), b = Tensor::Empty(DType::kFP32, {33, 20});
  StageTimings t;
  ASSERT_TRUE(ref->Forward(args, a.view(), &t).ok());
  EXPECT_GT(t.experts_us, 0);
  ASSERT_TRUE(blas->Forward(args, b.view()).ok());
  EXPECT_LT(testing::RelativeL2Error(b.data<float>(), a.data<float>(), a.numel()), 1e-5);
  // Over the prepare/finalize's token capacity: refused, not truncated.
  auto small = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(8),
                                      std::make_unique<ReferenceExperts>());
  EXPECT_EQ(small->Forward(args, a.view()).code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace moeserve
