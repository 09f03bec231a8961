// End to end: an Engine serving a generated Hugging Face checkpoint computes, for fresh random
// inputs, what the plain-loop reference expert MLP computes from the weights the script wrote;
// and refuses to start on a corrupted checkpoint.
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/checkpoint/gate_loader.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/engine.h"
#include "core/router.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/moe_ref.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using moeserve::testing::CheckpointDir;
using moeserve::testing::CheckpointInfo;
using moeserve::testing::ReadReference;
using ::testing::HasSubstr;

struct E2eCase {
  std::string checkpoint;
  WeightFormat format;
  int num_ranks;
  // Relative L2 bound of the BF16 output against the FP32 reference on the script's weights.
  // Weights equal to the reference (BF16, or pre-quantized MXFP8 whose reference is its exact
  // dequantization): only BF16 rounding of the output and summation order, so 1e-2.
  // Float checkpoints quantized to MXFP8 at load: E4M3 rounding of both GEMMs' weights, 2.4-2.9%
  // relative L2 per weight matrix for weight-like data (tests/mxfp8's bound), compounding to
  // about 4% on the MLP output; bounded at 6%.
  double tolerance;
};

void PrintTo(const E2eCase& c, std::ostream* os) {
  *os << c.checkpoint << " " << WeightFormatName(c.format) << " ranks=" << c.num_ranks;
}

std::string CaseName(const ::testing::TestParamInfo<E2eCase>& info) {
  return info.param.checkpoint + "_" + std::string(WeightFormatName(info.param.format)) + "_r" +
         std::to_string(info.param.num_ranks);
}

class EngineCheckpointTest : public ::testing::TestWithParam<E2eCase> {};

TEST_P(EngineCheckpointTest, ForwardMatchesTheReferenceOnTheCheckpointsWeights) {
  const E2eCase& c = GetParam();
  const nlohmann::json info = CheckpointInfo(c.checkpoint);
  EngineOptions options;
  options.model.name = "ignored: the checkpoint's config.json describes the model";
  options.checkpoint_dir = CheckpointDir(c.checkpoint);
  options.weight_format = c.format;
  options.num_ranks = c.num_ranks;
  options.num_threads = 2;
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const ModelConfig& m = (*engine)->info().model;
  ASSERT_EQ(m.hidden, info["hidden"].get<int64_t>());
  ASSERT_EQ(m.intermediate, info["intermediate"].get<int64_t>());
  ASSERT_EQ(m.num_experts, info["num_experts"].get<int>());
  ASSERT_EQ(m.topk, info["topk"].get<int>());
  EXPECT_EQ((*engine)->info().weight_format, c.format);
  const int64_t h = m.hidden, n = m.intermediate, num = m.num_experts;
  const int topk = m.topk;

  std::mt19937 rng(std::random_device{}());
  for (int layer = 0; layer < m.num_layers; ++layer) {
    const int64_t tokens = 37;
    Tensor x32 = moeserve::testing::RandomNormal({tokens, h}, rng);
    Tensor x = Tensor::Empty(DType::kBF16, {tokens, h});
    ASSERT_TRUE(ConvertTensor(x32.view(), x.view()).ok());
    Tensor ids = moeserve::testing::MakeRouting(moeserve::testing::Routing::kUniform, tokens, topk,
                                                static_cast<int>(num), rng);
    Tensor weights = moeserve::testing::RandomTopkWeights(tokens, topk, rng);
    Tensor out = Tensor::Empty(DType::kBF16, {tokens, h});
    ForwardInput in{layer, x.view(), ids.view(), weights.view()};
    const absl::Status s = (*engine)->Forward(in, out.view());
    if (!m.IsMoeLayer(layer)) {
      EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
      EXPECT_THAT(s.message(), HasSubstr("dense layer"));
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;

    // FP32 reference from the script's reference weights (the checkpoint's values in BF16).
    const std::string l = "layer" + std::to_string(layer);
    const auto w13 = ReadReference<uint16_t>(c.checkpoint, l + "_w13.bf16.bin", num * 2 * n * h);
    const auto w2 = ReadReference<uint16_t>(c.checkpoint, l + "_w2.bf16.bin", num * h * n);
    std::vector<float> f13(w13.size()), f2(w2.size());
    kernels::ConvertBf16ToFp32Ref(w13.data(), f13.data(), static_cast<int64_t>(w13.size()));
    kernels::ConvertBf16ToFp32Ref(w2.data(), f2.data(), static_cast<int64_t>(w2.size()));
    std::vector<float> xin(tokens * h), ref(tokens * h, 0.0f), got(tokens * h), y(h),
        scratch(3 * n);
    kernels::ConvertBf16ToFp32Ref(x.data<uint16_t>(), xin.data(), tokens * h);
    kernels::ConvertBf16ToFp32Ref(out.data<uint16_t>(), got.data(), tokens * h);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int k = 0; k < topk; ++k) {
        const int64_t g = ids.data<int32_t>()[t * topk + k];
        kernels::ExpertMlpRowRef(&xin[t * h], &f13[g * 2 * n * h], &f2[g * h * n], h, n, y.data(),
                                 scratch.data());
        const float w = weights.data<float>()[t * topk + k];
        for (int64_t j = 0; j < h; ++j) ref[t * h + j] += w * y[j];
      }
    }
    const double err = moeserve::testing::RelativeL2Error(got.data(), ref.data(), tokens * h);
    std::cout << c.checkpoint << " " << WeightFormatName(c.format) << " ranks=" << c.num_ranks
              << " layer " << layer << ": relative L2 " << err << "\n";
    EXPECT_LT(err, c.tolerance) << "layer " << layer;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoints, EngineCheckpointTest,
    ::testing::Values(E2eCase{"qwen3_bf16_sharded", WeightFormat::kBF16, 1, 1e-2},
                      E2eCase{"deepseek_bf16_sharded", WeightFormat::kBF16, 2, 1e-2},
                      E2eCase{"mixtral_f32_sharded", WeightFormat::kBF16, 1, 1e-2},
                      E2eCase{"qwen3_bf16", WeightFormat::kMXFP8, 1, 6e-2},
                      E2eCase{"mixtral_bf16", WeightFormat::kMXFP8, 2, 6e-2},
                      E2eCase{"qwen3_mxfp8", WeightFormat::kMXFP8, 1, 1e-2},
                      E2eCase{"deepseek_mxfp8_sharded", WeightFormat::kBF16, 1, 1e-2}),
    CaseName);

class EngineCorruptCheckpointTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineCorruptCheckpointTest, RefusesToStart) {
  const nlohmann::json info = CheckpointInfo("corrupt_" + GetParam());
  EngineOptions options;
  options.checkpoint_dir = CheckpointDir("corrupt_" + GetParam());
  options.num_threads = 2;
  auto engine = Engine::Create(options);
  ASSERT_FALSE(engine.ok());
  const std::string tensor = info["error_tensor"];
  if (!tensor.empty()) {
    EXPECT_THAT(engine.status().message(), HasSubstr(tensor));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, EngineCorruptCheckpointTest,
                         ::testing::Values("truncated", "header_past_end", "offsets_past_end",
                                           "unknown_dtype", "missing_expert", "shape_mismatch",
                                           "nan_weight", "f64_weight"));

// ---- the router (server-side routing) on checkpoints ----

// The gates (and biases) loaded for every MoE layer equal what the script wrote, widened to
// FP32 exactly; the config comes from config.json.
class CheckpointRouterTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointRouterTest, GatesEqualTheReference) {
  const std::string name = GetParam();
  const nlohmann::json info = CheckpointInfo(name);
  auto ckpt = checkpoint::HfCheckpoint::Open(CheckpointDir(name));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const ModelConfig& model = (*ckpt)->config();
  ASSERT_TRUE(model.router.has_value()) << model.no_router_reason;
  auto router = checkpoint::LoadCheckpointRouter(**ckpt, model, 1);
  ASSERT_TRUE(router.ok()) << router.status();
  const int64_t e = model.num_experts, h = model.hidden;
  for (int layer : info["moe_layers"].get<std::vector<int>>()) {
    const std::string l = std::to_string(layer);
    const auto gate = ReadReference<float>(name, "layer" + l + "_gate.f32.bin", e * h);
    const TensorView g = (*router)->gate(layer);
    ASSERT_EQ(g.shape(), (Shape{e, h})) << layer;
    EXPECT_EQ(0, std::memcmp(g.raw_data(), gate.data(), gate.size() * 4)) << name << " " << l;
    if ((*router)->config().correction_bias) {
      const auto bias = ReadReference<float>(name, "layer" + l + "_gate_bias.f32.bin", e);
      EXPECT_EQ(0, std::memcmp((*router)->bias(layer).raw_data(), bias.data(), e * 4)) << l;
    } else {
      EXPECT_TRUE((*router)->bias(layer).empty());
    }
  }
  // The suite's DeepSeek checkpoints other than deepseek_router have no bias tensor: the
  // config's correction_bias is cleared (a zero bias), as Hugging Face loads them.
  EXPECT_EQ((*router)->config().correction_bias, name == "deepseek_router");
}

INSTANTIATE_TEST_SUITE_P(Schemes, CheckpointRouterTest,
                         ::testing::Values("qwen3_bf16", "deepseek_bf16_sharded", "deepseek_f32",
                                           "deepseek_f16", "mixtral_bf16", "mixtral_f32_sharded",
                                           "qwen3_mxfp8", "deepseek_router"));

// The engine routes each layer with that layer's gate: Engine::Route equals core's Route on
// the reference gate and bias, with DeepSeek-V3's groups, bias and scaling from config.json.
TEST(EngineRouterTest, RoutesWithTheCheckpointsGatePerLayer) {
  const std::string name = "deepseek_router";
  const nlohmann::json info = CheckpointInfo(name);
  EngineOptions options;
  options.checkpoint_dir = CheckpointDir(name);
  options.num_threads = 2;
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)->has_router());
  EXPECT_EQ((*engine)->info().router,
            "sigmoid_grouped_topk(n_group=4, topk_group=2, e_score_correction_bias, "
            "renormalize, routed_scaling_factor=2.5)");
  const ModelConfig& model = (*engine)->info().model;
  const int64_t e = model.num_experts, h = model.hidden, m = 37;
  const int k = model.topk;
  std::mt19937 rng(17);
  Tensor x = testing::RandomNormal({m, h}, rng);
  for (int layer : info["moe_layers"].get<std::vector<int>>()) {
    const std::string l = std::to_string(layer);
    auto gate = ReadReference<float>(name, "layer" + l + "_gate.f32.bin", e * h);
    auto bias = ReadReference<float>(name, "layer" + l + "_gate_bias.f32.bin", e);
    std::vector<int32_t> ids(m * k), want_ids(m * k);
    std::vector<float> w(m * k), want_w(m * k);
    ASSERT_TRUE((*engine)
                    ->Route(layer, x.view(), TensorView(ids.data(), DType::kINT32, {m, k}),
                            TensorView(w.data(), DType::kFP32, {m, k}))
                    .ok());
    ASSERT_TRUE(Route(*model.router, x.view(), TensorView(gate.data(), DType::kFP32, {e, h}),
                      TensorView(bias.data(), DType::kFP32, {e}),
                      TensorView(want_ids.data(), DType::kINT32, {m, k}),
                      TensorView(want_w.data(), DType::kFP32, {m, k}))
                    .ok());
    EXPECT_EQ(ids, want_ids) << layer;
    // The engine's router splits the gate GEMM over threads: only the summation order differs.
    EXPECT_LT(testing::RelativeL2Error(w, want_w), 1e-6) << layer;
    for (int t = 0; t < m; ++t) {  // renormalized, times 2.5
      float sum = 0;
      for (int j = 0; j < k; ++j) sum += w[t * k + j];
      EXPECT_NEAR(sum, 2.5f, 1e-5f);
    }
  }
  std::vector<int32_t> ids(k);
  std::vector<float> w(k);
  absl::Status dense =
      (*engine)->Route(0, x.view().Slice(0, 1), TensorView(ids.data(), DType::kINT32, {1, k}),
                       TensorView(w.data(), DType::kFP32, {1, k}));
  EXPECT_EQ(dense.code(), absl::StatusCode::kInvalidArgument) << dense;
  EXPECT_THAT(dense.message(), HasSubstr("dense"));
}

TEST(EngineRouterTest, BrokenGatesRefuseToStartAndMissingGatesServeWithoutARouter) {
  EngineOptions options;
  options.num_threads = 1;
  options.checkpoint_dir = CheckpointDir("router_nan_gate");
  auto nan_gate = Engine::Create(options);
  ASSERT_FALSE(nan_gate.ok());
  EXPECT_EQ(nan_gate.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nan_gate.status().message(),
              HasSubstr("model.layers.0.block_sparse_moe.gate.weight"));
  EXPECT_THAT(nan_gate.status().message(), HasSubstr("non-finite"));

  options.checkpoint_dir = CheckpointDir("router_missing_gate");
  auto missing = Engine::Create(options);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("model.layers.0.mlp.gate.weight"));
  EXPECT_THAT(missing.status().message(), HasSubstr("is missing"));

  options.checkpoint_dir = CheckpointDir("router_no_gates");
  auto none = Engine::Create(options);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE((*none)->has_router());
  EXPECT_TRUE((*none)->info().router.empty());
  EXPECT_THAT((*none)->info().no_router_reason, HasSubstr("no router gates"));
  const int64_t h = (*none)->info().model.hidden;
  const int k = (*none)->info().model.topk;
  std::vector<float> x(h, 0.5f), w(k);
  std::vector<int32_t> ids(k);
  absl::Status s = (*none)->Route(0, TensorView(x.data(), DType::kFP32, {1, h}),
                                  TensorView(ids.data(), DType::kINT32, {1, k}),
                                  TensorView(w.data(), DType::kFP32, {1, k}));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

}  // namespace
}  // namespace moeserve
