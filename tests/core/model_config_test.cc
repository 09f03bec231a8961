#include "core/model_config.h"

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

}  // namespace
}  // namespace moeserve
