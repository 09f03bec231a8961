#include "core/model_config.h"

#include <cstdint>
#include <functional>
#include <string>

#include "core/tensor.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

TEST(ModelConfigTest, Presets) {
  for (const std::string& name : ModelPresetNames()) {
    auto c = ModelPreset(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_TRUE(c->Validate().ok()) << name;
  }
  auto q = ModelPreset("qwen3-30b-a3b");
  EXPECT_EQ(q->num_experts, 128);
  EXPECT_EQ(q->topk, 8);
  EXPECT_EQ(q->hidden, 2048);
  EXPECT_EQ(q->intermediate, 768);
  EXPECT_EQ(q->num_layers, 48);
  auto d = ModelPreset("deepseek-v3");
  EXPECT_EQ(d->num_experts, 256);
  EXPECT_EQ(d->hidden, 7168);
  EXPECT_EQ(d->intermediate, 2048);
  EXPECT_EQ(d->num_layers, 58);
  auto s = ModelPreset("seed-megamoe");
  EXPECT_EQ(s->num_experts, 512);
  EXPECT_EQ(s->intermediate, 5120);
  EXPECT_EQ(ModelPreset("gpt-5").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ModelConfigTest, OverridesAndValidation) {
  ModelOverrides o;
  o.num_layers = 1;
  o.hidden = 64;
  auto c = ApplyOverrides(*ModelPreset("qwen3-30b-a3b"), o);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->num_layers, 1);
  EXPECT_EQ(c->hidden, 64);
  EXPECT_EQ(c->intermediate, 768);
  ModelOverrides bad;
  bad.topk = 200;
  EXPECT_EQ(ApplyOverrides(*ModelPreset("tiny"), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ModelConfigTest, DenseLayers) {
  ModelConfig c = *ModelPreset("tiny");
  c.num_layers = 4;
  c.moe_layers = {1, 3};
  ASSERT_TRUE(c.Validate().ok());
  EXPECT_FALSE(c.IsMoeLayer(0));
  EXPECT_TRUE(c.IsMoeLayer(3));
  EXPECT_FALSE(c.IsMoeLayer(4));
  EXPECT_EQ(c.num_moe_layers(), 2);
  c.moe_layers = {3, 1};
  EXPECT_FALSE(c.Validate().ok());
}

TEST(ModelConfigTest, WeightBytesAndMemoryBudget) {
  ModelConfig c = *ModelPreset("deepseek-v3");
  // 256 experts x 3 x 7168 x 2048 x 2 bytes per layer.
  EXPECT_EQ(c.LayerWeightBytes(256, WeightFormat::kBF16), int64_t{256} * 3 * 7168 * 2048 * 2);
  // MXFP8: one byte per value plus one scale byte per 32 values.
  EXPECT_EQ(c.LayerWeightBytes(1, WeightFormat::kMXFP8),
            int64_t{3} * 7168 * 2048 + 2 * 2048 * (7168 / 32) + 7168 * (2048 / 32));
  const int64_t all = c.LayerWeightBytes(256, WeightFormat::kBF16) * c.num_layers;
  absl::Status s = CheckMemoryBudget(c, all, int64_t{24} << 30);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("GiB"), absl::string_view::npos);
  EXPECT_NE(s.message().find("--num_layers"), absl::string_view::npos);
  EXPECT_TRUE(CheckMemoryBudget(c, 1 << 20, int64_t{24} << 30).ok());
  EXPECT_GT(AvailableHostMemoryBytes(), 0);
}

// Sizes that would overflow the size arithmetic (issue 14: hidden = intermediate = 2^30
// crashed the server; hidden = 2^63 - 1 started serving) are refused, naming the field; the
// largest accepted model still has every size product well inside int64.
TEST(ModelConfigTest, RefusesSizesBeyondTheLimits) {
  ModelConfig ok = *ModelPreset("tiny");
  ASSERT_TRUE(ok.Validate().ok());
  struct Bad {
    const char* field;
    std::function<void(ModelConfig&)> set;
  };
  const Bad cases[] = {
      {"hidden", [](ModelConfig& c) { c.hidden = int64_t{1} << 30; }},
      {"hidden", [](ModelConfig& c) { c.hidden = INT64_MAX; }},
      {"intermediate", [](ModelConfig& c) { c.intermediate = int64_t{1} << 30; }},
      {"num_experts", [](ModelConfig& c) { c.num_experts = ModelConfig::kMaxExperts + 1; }},
      {"num_layers", [](ModelConfig& c) { c.num_layers = ModelConfig::kMaxLayers + 1; }},
  };
  for (const Bad& b : cases) {
    ModelConfig c = ok;
    b.set(c);
    const absl::Status s = c.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << b.field;
    EXPECT_NE(s.message().find(b.field), std::string::npos) << s;
  }
  ModelConfig big = ok;
  big.num_layers = ModelConfig::kMaxLayers;
  big.num_experts = ModelConfig::kMaxExperts;
  big.hidden = big.intermediate = ModelConfig::kMaxHidden;
  ASSERT_TRUE(big.Validate().ok());
  const int64_t layer_bytes = big.LayerWeightBytes(big.num_experts, WeightFormat::kBF16);
  EXPECT_GT(layer_bytes, 0);
  EXPECT_LT(layer_bytes, INT64_MAX / big.num_layers);
}

// Element counts never overflow: a zero dim gives 0 whatever follows, a negative dim or an
// overflowing product gives -1 (so byte-length checks fail instead of wrapping).
TEST(NumElementsTest, ZeroNegativeAndOverflow) {
  const int64_t big = int64_t{1} << 62;
  EXPECT_EQ(NumElements({}), 1);
  EXPECT_EQ(NumElements({3, 4}), 12);
  EXPECT_EQ(NumElements({0, big, big}), 0);
  EXPECT_EQ(NumElements({big, big, 0}), 0);
  EXPECT_EQ(NumElements({big, 4}), -1);
  EXPECT_EQ(NumElements({2, -3}), -1);
  EXPECT_EQ(NumElements({INT64_MAX, 1}), INT64_MAX);
}

}  // namespace
}  // namespace moeserve
