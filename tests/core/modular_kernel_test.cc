#include "core/modular_kernel.h"

#include <chrono>
#include <random>
#include <thread>

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

// The answer in the caller's dtype: a host PrepareAndFinalize writes FP32 and ModularKernel
// converts once; BF16 / FP16 answers match the FP32 one to their rounding (rel. L2 < 1e-2, the
// BF16 tolerance). Outputs that are not host FP32/BF16/FP16 [M, K] are refused.
TEST(ModularKernelTest, WritesTheCallersDtype) {
  ModelConfig model{
      .name = "t", .num_layers = 1, .num_experts = 6, .topk = 3, .hidden = 20, .intermediate = 12};
  auto store = *ExpertWeightStore::CreateSynthetic(model, {0, 1, 2, 3, 4, 5}, 4, 1);
  auto mk = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(64),
                                   std::make_unique<BlasExperts>(1));
  std::mt19937 rng(8);
  Tensor x = testing::RandomNormal({17, 20}, rng);
  Tensor ids = testing::MakeRouting(testing::Routing::kUniform, 17, 3, 6, rng);
  Tensor w = testing::RandomTopkWeights(17, 3, rng);
  ModularKernelArgs args{.hidden_states = x.view(),
                         .topk_ids = ids.view(),
                         .topk_weights = w.view(),
                         .weights = store->layer(0),
                         .num_experts = 6};
  Tensor want = Tensor::Empty(DType::kFP32, {17, 20});
  ASSERT_TRUE(mk->Forward(args, want.view()).ok());
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    Tensor got = Tensor::Empty(dtype, {17, 20});
    Tensor got32 = Tensor::Empty(DType::kFP32, {17, 20});
    ASSERT_TRUE(mk->Forward(args, got.view()).ok());
    ASSERT_TRUE(ConvertTensor(got.view(), got32.view()).ok());
    EXPECT_LT(testing::RelativeL2Error(got32.data<float>(), want.data<float>(), want.numel()), 1e-2)
        << DTypeName(dtype);
  }
  Tensor wrong_shape = Tensor::Empty(DType::kFP32, {16, 20});
  Tensor wrong_dtype = Tensor::Empty(DType::kINT32, {17, 20});
  const TensorView on_gpu(want.data<float>(), DType::kFP32, {17, 20}, Device::Cuda(0));
  for (const TensorView& bad : {wrong_shape.view(), wrong_dtype.view(), on_gpu}) {
    const absl::Status s = mk->Forward(args, bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.DebugString();
    EXPECT_NE(s.message().find("[17, 20]"), std::string::npos) << s;
  }
}

// A PrepareAndFinalize that puts a1q on a device the allocator does not serve is a wiring error:
// FAILED_PRECONDITION naming both devices, before Experts::Apply touches anything.
class DevicePrepareAndFinalize final : public PrepareAndFinalize {
 public:
  absl::string_view name() const override { return "DevicePF"; }
  ActivationFormat activation_format() const override { return ActivationFormat::kStandard; }
  int64_t max_num_tokens_per_rank() const override { return 64; }
  int num_dispatchers() const override { return 1; }
  const QuantConfig& quant_config() const override { return quant_; }
  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override {
    out->a1q = TensorView(static_cast<void*>(nullptr), DType::kFP32,
                          {args.hidden_states.dim(0), args.hidden_states.dim(1)}, Device::Cuda(0));
    return absl::OkStatus();
  }
  absl::Status Finalize(const TensorView&, const TensorView&, const PreparedActivations&,
                        const TopKWeightAndReduce&) override {
    return absl::InternalError("not reached");
  }

 private:
  QuantConfig quant_;
};

TEST(ModularKernelTest, RefusesWorkspacesOnAnotherDeviceThanA1q) {
  ModelConfig model{
      .name = "t", .num_layers = 1, .num_experts = 4, .topk = 2, .hidden = 8, .intermediate = 4};
  auto store = *ExpertWeightStore::CreateSynthetic(model, {0, 1, 2, 3}, 4, 1);
  auto mk = *ModularKernel::Create(std::make_unique<DevicePrepareAndFinalize>(),
                                   std::make_unique<ReferenceExperts>());
  std::mt19937 rng(2);
  Tensor x = testing::RandomNormal({3, 8}, rng);
  Tensor ids = testing::MakeRouting(testing::Routing::kUniform, 3, 2, 4, rng);
  Tensor w = testing::RandomTopkWeights(3, 2, rng);
  Tensor out = Tensor::Empty(DType::kFP32, {3, 8});
  const absl::Status s = mk->Forward({.hidden_states = x.view(),
                                      .topk_ids = ids.view(),
                                      .topk_weights = w.view(),
                                      .weights = store->layer(0),
                                      .num_experts = 4},
                                     out.view());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("cuda:0"), std::string::npos) << s;
  EXPECT_NE(s.message().find("host"), std::string::npos) << s;
}

// Boundary marks: a stage's time runs from its mark to the next mark (or Stop), a repeated mark
// of the running stage changes nothing, and time after Stop counts nowhere. Only lower bounds
// and a wide gap are asserted, so a loaded machine cannot make it flaky.
TEST(StageTimerTest, HostMarksSumIntervalsPerStage) {
  auto timer = MakeHostStageTimer();
  auto sleep_ms = [](int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); };
  timer->Reset();
  ASSERT_TRUE(timer->Mark(StageTimer::kPrepare).ok());
  sleep_ms(5);
  ASSERT_TRUE(timer->Mark(StageTimer::kPrepare).ok());  // still Prepare
  sleep_ms(5);
  ASSERT_TRUE(timer->Mark(StageTimer::kFinalize).ok());
  sleep_ms(5);
  ASSERT_TRUE(timer->Stop().ok());
  sleep_ms(200);  // counts toward no stage
  const auto us = *timer->ElapsedUs();
  EXPECT_GE(us[StageTimer::kPrepare], 10000);
  EXPECT_EQ(us[StageTimer::kExperts], 0);
  EXPECT_GE(us[StageTimer::kFinalize], 5000);
  EXPECT_LT(us[StageTimer::kFinalize], 150000);
  timer->Reset();
  EXPECT_EQ((*timer->ElapsedUs())[StageTimer::kPrepare], 0);
}

}  // namespace
}  // namespace moeserve
