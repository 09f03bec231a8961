// Engine-level validation and forward, independent of any transport.
#include "core/engine.h"

#include <random>

#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using engine_testing::TinyOptions;

struct Inputs {
  Tensor x, ids, w;
  ForwardInput View(int layer = 0) const {
    return ForwardInput{layer, x.view(), ids.view(), w.view()};
  }
};

Inputs RandomInputs(const ModelConfig& m, int64_t tokens, DType dtype, std::mt19937& rng) {
  Inputs in;
  Tensor f = testing::RandomNormal({tokens, m.hidden}, rng);
  in.x = Tensor::Empty(dtype, {tokens, m.hidden});
  EXPECT_TRUE(ConvertTensor(f.view(), in.x.view()).ok());
  in.ids = testing::MakeRouting(testing::Routing::kUniform, tokens, m.topk, m.num_experts, rng);
  in.w = testing::RandomTopkWeights(tokens, m.topk, rng);
  return in;
}

void ExpectInvalid(const Engine& e, const ForwardInput& in, absl::string_view field,
                   absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  absl::Status s = ValidateForwardInput(e.info().model, e.info().max_tokens_per_request, in);
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(field), absl::string_view::npos) << s;
}

TEST(EngineTest, ValidationNamesTheField) {
  auto engine = *Engine::Create(TinyOptions("reference"));
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(1);
  Inputs ok = RandomInputs(m, 4, DType::kBF16, rng);
  EXPECT_TRUE(ValidateForwardInput(m, 128, ok.View()).ok());

  ExpectInvalid(*engine, ok.View(/*layer=*/m.num_layers), "layer");
  ExpectInvalid(*engine, ok.View(/*layer=*/-1), "layer");
  ForwardInput in = ok.View();
  in.hidden_states = TensorView(ok.x.data<void>(), DType::kBF16, {4, m.hidden / 2});
  ExpectInvalid(*engine, in, "hidden_states");
  in = ok.View();
  in.hidden_states = TensorView(ok.x.data<void>(), DType::kBF16, {4 * m.hidden});
  ExpectInvalid(*engine, in, "hidden_states");
  in = ok.View();
  in.hidden_states = TensorView(ok.x.data<void>(), DType::kINT32, {4, m.hidden});
  ExpectInvalid(*engine, in, "hidden_states");
  in = ok.View();
  in.topk_ids = TensorView(ok.ids.data<void>(), DType::kINT32, {4, m.topk - 1});
  ExpectInvalid(*engine, in, "topk_ids");
  in = ok.View();
  in.topk_weights = TensorView(ok.w.data<void>(), DType::kFP32, {2, m.topk});
  ExpectInvalid(*engine, in, "topk_weights");
  in = ok.View();
  in.topk_weights = TensorView(ok.w.data<void>(), DType::kBF16, {4, m.topk});
  ExpectInvalid(*engine, in, "topk_weights");

  ok.ids.data<int32_t>()[5] = m.num_experts;
  ExpectInvalid(*engine, ok.View(), "topk_ids");
  // The O(1) shape check leaves values to ValidateForwardInput (which Forward runs).
  EXPECT_TRUE(ValidateForwardShapes(m, 128, ok.View()).ok());
  ok.ids.data<int32_t>()[5] = -1;
  ExpectInvalid(*engine, ok.View(), "topk_ids");
  ok.ids.data<int32_t>()[5] = 0;
  ok.w.data<float>()[3] = NAN;
  ExpectInvalid(*engine, ok.View(), "topk_weights");
  ok.w.data<float>()[3] = INFINITY;
  ExpectInvalid(*engine, ok.View(), "topk_weights");

  Inputs big = RandomInputs(m, 129, DType::kBF16, rng);
  ExpectInvalid(*engine, big.View(), "hidden_states", absl::StatusCode::kResourceExhausted);

  // INT64 ids out of int32 range are caught before narrowing.
  Tensor ids64 = Tensor::Empty(DType::kINT64, {4, m.topk});
  for (int i = 0; i < 4 * m.topk; ++i) ids64.data<int64_t>()[i] = i % m.num_experts;
  ids64.data<int64_t>()[2] = (int64_t{1} << 32) + 1;
  in = ok.View();
  ok.w.data<float>()[3] = 0.5f;
  in.topk_ids = ids64.view();
  ExpectInvalid(*engine, in, "topk_ids");

  // Strided routing (every other column of a wider buffer) is refused, not read as packed rows.
  Tensor wide64 = Tensor::Empty(DType::kINT64, {4, 2 * m.topk});
  for (int i = 0; i < 4 * 2 * m.topk; ++i) wide64.data<int64_t>()[i] = i % m.num_experts;
  in = ok.View();
  in.topk_ids = TensorView(wide64.data<int64_t>(), DType::kINT64, {4, m.topk}, {2 * m.topk, 2});
  ASSERT_FALSE(in.topk_ids.is_contiguous());
  ExpectInvalid(*engine, in, "topk_ids: a strided view is not accepted");
  Tensor wide_w = Tensor::Empty(DType::kFP32, {4, 2 * m.topk});
  for (int i = 0; i < 4 * 2 * m.topk; ++i) wide_w.data<float>()[i] = 0.25f;
  in = ok.View();
  in.topk_weights = TensorView(wide_w.data<float>(), DType::kFP32, {4, m.topk}, {2 * m.topk, 2});
  ExpectInvalid(*engine, in, "topk_weights: a strided view is not accepted");
}

TEST(EngineTest, ForwardMatchesReferenceInEveryDtype) {
  auto ref = *Engine::Create(TinyOptions("reference"));
  auto blas = *Engine::Create(TinyOptions("blas"));
  const ModelConfig& m = ref->info().model;
  std::mt19937 rng(2);
  // BF16/FP16 outputs are rounded once: relative L2 well under 1e-2. FP32: 1e-5.
  for (auto [dtype, tol] : {std::pair{DType::kBF16, 1e-2}, std::pair{DType::kFP16, 1e-2},
                            std::pair{DType::kFP32, 1e-5}}) {
    Inputs in = RandomInputs(m, 37, dtype, rng);
    Tensor a = Tensor::Empty(dtype, {37, m.hidden}), b = Tensor::Empty(dtype, {37, m.hidden});
    ForwardTimings t;
    ASSERT_TRUE(ref->Forward(in.View(1), a.view(), &t).ok());
    ASSERT_TRUE(blas->Forward(in.View(1), b.view()).ok());
    Tensor af = Tensor::Empty(DType::kFP32, {37, m.hidden});
    Tensor bf = Tensor::Empty(DType::kFP32, {37, m.hidden});
    ASSERT_TRUE(ConvertTensor(a.view(), af.view()).ok());
    ASSERT_TRUE(ConvertTensor(b.view(), bf.view()).ok());
    EXPECT_LT(testing::RelativeL2Error(bf.data<float>(), af.data<float>(), af.numel()), tol)
        << DTypeName(dtype);
    double norm = 0;
    for (int64_t i = 0; i < af.numel(); ++i) norm += std::abs(af.data<float>()[i]);
    EXPECT_GT(norm, 0);
  }
  // Layers differ: the same input through layer 0 and 1 gives different answers.
  Inputs in = RandomInputs(m, 3, DType::kFP32, rng);
  Tensor l0 = Tensor::Empty(DType::kFP32, {3, m.hidden}),
         l1 = Tensor::Empty(DType::kFP32, {3, m.hidden});
  ASSERT_TRUE(ref->Forward(in.View(0), l0.view()).ok());
  ASSERT_TRUE(ref->Forward(in.View(1), l1.view()).ok());
  EXPECT_GT(testing::RelativeL2Error(l0.data<float>(), l1.data<float>(), l0.numel()), 0.1);
}

TEST(EngineTest, ZeroTokensAndNanHiddenStates) {
  auto engine = *Engine::Create(TinyOptions("blas"));
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(3);
  Inputs empty = RandomInputs(m, 0, DType::kBF16, rng);
  Tensor out0 = Tensor::Empty(DType::kBF16, {0, m.hidden});
  EXPECT_TRUE(engine->Forward(empty.View(), out0.view()).ok());
  // NaN in one token's hidden state stays in that token's output.
  Inputs in = RandomInputs(m, 4, DType::kFP32, rng);
  in.x.data<float>()[2 * m.hidden + 5] = NAN;
  Tensor out = Tensor::Empty(DType::kFP32, {4, m.hidden});
  ASSERT_TRUE(engine->Forward(in.View(), out.view()).ok());
  for (int64_t t = 0; t < 4; ++t) {
    bool any_nan = false;
    for (int64_t h = 0; h < m.hidden; ++h)
      any_nan |= std::isnan(out.data<float>()[t * m.hidden + h]);
    EXPECT_EQ(any_nan, t == 2) << "token " << t;
  }
}

TEST(EngineTest, RefusesModelsThatDoNotFit) {
  EngineOptions o = TinyOptions("blas");
  o.model = *ModelPreset("deepseek-v3");
  o.memory_budget_bytes = int64_t{24} << 30;
  auto e = Engine::Create(o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(e.status().message().find("deepseek-v3"), absl::string_view::npos);
}

TEST(EngineTest, ExpertWeightsAreDeterministicAndPlacementIndependent) {
  auto a = *Engine::Create(TinyOptions("blas"));
  const ModelConfig& m = a->info().model;
  std::vector<uint16_t> w13(2 * m.intermediate * m.hidden), w2(m.hidden * m.intermediate);
  ASSERT_TRUE(a->GetExpertWeightsBf16(1, 3, w13.data(), w2.data()).ok());
  EXPECT_EQ(w13[7], kernels::FloatToBf16(SyntheticWeight(0, 1, 3, 0, 7, m.hidden)));
  EXPECT_EQ(w2[11], kernels::FloatToBf16(SyntheticWeight(0, 1, 3, 1, 11, m.intermediate)));
  EXPECT_EQ(a->GetExpertWeightsBf16(1, m.num_experts, w13.data(), w2.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->GetExpertWeightsBf16(m.num_layers, 0, w13.data(), w2.data()).code(),
            absl::StatusCode::kInvalidArgument);
  // Realistic scale: std about 1/sqrt(hidden).
  double ss = 0;
  for (uint16_t v : w13) ss += std::pow(kernels::Bf16ToFloat(v), 2);
  const double stddev = std::sqrt(ss / w13.size());
  EXPECT_NEAR(stddev, 1.0 / std::sqrt(double(m.hidden)), 0.1 / std::sqrt(double(m.hidden)));
}

}  // namespace
}  // namespace moeserve
