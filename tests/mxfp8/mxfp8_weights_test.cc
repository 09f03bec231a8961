// MXFP8 expert weights in core: quantizing BF16 layers, loading synthetic weights as MXFP8,
// refusing non-finite weights, and the memory budget.
#include "core/mxfp8_weights.h"

#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <vector>

#include "core/weight_loader.h"
#include "core/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

std::mt19937_64 FreshRng() {
  const uint64_t seed = std::random_device{}();
  std::cout << "[ rng seed ] " << seed << "\n";
  return std::mt19937_64(seed);
}

// A BF16 layer with fresh random values of a weight-like scale.
struct Bf16Layer {
  Tensor w13, w2;
  LayerWeights view;
};

Bf16Layer RandomBf16Layer(std::mt19937_64& rng, int64_t e, int64_t h, int64_t n) {
  Bf16Layer l;
  l.w13 = Tensor::Empty(DType::kBF16, {e, 2 * n, h});
  l.w2 = Tensor::Empty(DType::kBF16, {e, h, n});
  std::normal_distribution<float> d(0.0f, 0.03f);
  for (int64_t i = 0; i < l.w13.numel(); ++i)
    l.w13.data<uint16_t>()[i] = kernels::FloatToBf16(d(rng));
  for (int64_t i = 0; i < l.w2.numel(); ++i)
    l.w2.data<uint16_t>()[i] = kernels::FloatToBf16(d(rng));
  l.view.format = WeightFormat::kBF16;
  l.view.num_local_experts = e;
  l.view.hidden = h;
  l.view.intermediate = n;
  l.view.w13 = l.w13.view();
  l.view.w2 = l.w2.view();
  return l;
}

ModelConfig TinyModel(int num_layers, int64_t hidden = 256, int64_t intermediate = 128) {
  ModelConfig c;
  c.name = "mxfp8-test";
  c.num_layers = num_layers;
  c.num_experts = 16;
  c.topk = 4;
  c.hidden = hidden;
  c.intermediate = intermediate;
  return c;
}

void ExpectSameBytes(const TensorView& a, const TensorView& b) {
  ASSERT_EQ(a.dtype(), b.dtype());
  ASSERT_EQ(a.shape(), b.shape());
  EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0);
}

void ExpectSameLayer(const LayerWeights& a, const LayerWeights& b) {
  EXPECT_EQ(a.format, b.format);
  ExpectSameBytes(a.w13, b.w13);
  ExpectSameBytes(a.w2, b.w2);
  ExpectSameBytes(a.w13_scale, b.w13_scale);
  ExpectSameBytes(a.w2_scale, b.w2_scale);
}

TEST(QuantizeLayerToMxfp8, LayoutAndValues) {
  std::mt19937_64 rng = FreshRng();
  // hidden 80 and intermediate 40: both rows end in a partial block (80 = 2*32 + 16, 40 = 32 + 8).
  const int64_t e = 3, h = 80, n = 40;
  Bf16Layer bf16 = RandomBf16Layer(rng, e, h, n);
  const std::vector<int> ids = {4, 9, 11};
  auto q = QuantizeLayerToMxfp8(bf16.view, 5, ids, 2);
  ASSERT_TRUE(q.ok()) << q.status();
  const LayerWeights& w = q->weights;
  EXPECT_EQ(w.format, WeightFormat::kMXFP8);
  EXPECT_EQ(w.num_local_experts, e);
  EXPECT_EQ(w.w13.dtype(), DType::kFP8E4M3);
  EXPECT_EQ(w.w13.shape(), (Shape{e, 2 * n, h}));
  EXPECT_EQ(w.w2.dtype(), DType::kFP8E4M3);
  EXPECT_EQ(w.w2.shape(), (Shape{e, h, n}));
  EXPECT_EQ(w.w13_scale.dtype(), DType::kUINT8);
  EXPECT_EQ(w.w13_scale.shape(), (Shape{e, 2 * n, 3}));
  EXPECT_EQ(w.w2_scale.dtype(), DType::kUINT8);
  EXPECT_EQ(w.w2_scale.shape(), (Shape{e, h, 2}));
  ASSERT_EQ(q->storage.size(), 4u);

  std::vector<float> f13(2 * n * h), f2(h * n);
  for (int64_t x = 0; x < e; ++x) {
    ASSERT_TRUE(DequantizeExpertToFp32(w, x, f13.data(), f2.data()).ok());
    // Same codes as the kernel on this expert's rows, and within the per-element bound.
    std::vector<uint8_t> q13(2 * n * h), s13(2 * n * 3);
    ASSERT_EQ(kernels::QuantizeMxfp8RowsFromBf16Ref(bf16.w13.data<uint16_t>() + x * 2 * n * h,
                                                    2 * n, h, q13.data(), s13.data()),
              kernels::Mxfp8Status::kOk);
    EXPECT_EQ(std::memcmp(q13.data(), w.w13.data<uint8_t>() + x * 2 * n * h, q13.size()), 0);
    EXPECT_EQ(std::memcmp(s13.data(), w.w13_scale.data<uint8_t>() + x * 2 * n * 3, s13.size()), 0);
    for (int64_t i = 0; i < 2 * n * h; ++i) {
      const float ref = kernels::Bf16ToFloat(bf16.w13.data<uint16_t>()[x * 2 * n * h + i]);
      const float s = kernels::E8M0ToFloat(s13[(i / h) * 3 + (i % h) / 32]);
      const double bound =
          std::fabs(ref) / s >= 0x1p-6 ? std::ldexp(1.0, std::ilogb(ref) - 4) : std::ldexp(s, -10);
      ASSERT_LE(std::fabs(ref - f13[i]), bound) << i;
    }
    const uint8_t* s2 = w.w2_scale.data<uint8_t>() + x * h * 2;
    for (int64_t i = 0; i < h * n; ++i) {
      const float ref = kernels::Bf16ToFloat(bf16.w2.data<uint16_t>()[x * h * n + i]);
      const float s = kernels::E8M0ToFloat(s2[(i / n) * 2 + (i % n) / 32]);
      const double bound =
          std::fabs(ref) / s >= 0x1p-6 ? std::ldexp(1.0, std::ilogb(ref) - 4) : std::ldexp(s, -10);
      ASSERT_LE(std::fabs(ref - f2[i]), bound) << i;
    }
  }
}

TEST(QuantizeLayerToMxfp8, RefusesNonFiniteNamingLayerExpertTensor) {
  std::mt19937_64 rng = FreshRng();
  const int64_t e = 3, h = 64, n = 48;
  {
    Bf16Layer bf16 = RandomBf16Layer(rng, e, h, n);
    // w2 of local expert 2 (global 12), row 5, column 7.
    bf16.w2.data<uint16_t>()[2 * h * n + 5 * n + 7] =
        kernels::FloatToBf16(std::numeric_limits<float>::quiet_NaN());
    auto q = QuantizeLayerToMxfp8(bf16.view, 7, std::vector<int>{3, 8, 12}, 2);
    ASSERT_FALSE(q.ok());
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(q.status().message(), HasSubstr("layer 7"));
    EXPECT_THAT(q.status().message(), HasSubstr("expert 12 (local 2)"));
    EXPECT_THAT(q.status().message(), HasSubstr("w2"));
    EXPECT_THAT(q.status().message(), HasSubstr("[5, 7]"));
    EXPECT_THAT(q.status().message(), HasSubstr("not finite"));
  }
  {
    Bf16Layer bf16 = RandomBf16Layer(rng, e, h, n);
    // -Inf in w13 of local expert 0, row 2n-1 (the last up row), column 63.
    bf16.w13.data<uint16_t>()[(2 * n - 1) * h + 63] =
        kernels::FloatToBf16(-std::numeric_limits<float>::infinity());
    auto q = QuantizeLayerToMxfp8(bf16.view, 0, {}, 1);
    ASSERT_FALSE(q.ok());
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(q.status().message(), HasSubstr("layer 0, local expert 0, w13"));
    EXPECT_THAT(q.status().message(), HasSubstr("-inf at [95, 63]"));
  }
  {
    Bf16Layer bf16 = RandomBf16Layer(rng, e, h, n);
    LayerWeights not_bf16 = bf16.view;
    not_bf16.format = WeightFormat::kMXFP8;
    EXPECT_EQ(QuantizeLayerToMxfp8(not_bf16, 0, {}, 1).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(QuantizeLayerToMxfp8(bf16.view, 0, std::vector<int>{1, 2}, 1).status().code(),
              absl::StatusCode::kInvalidArgument);  // 2 ids for 3 experts
  }
}

// Loading as MXFP8 gives exactly the BF16 synthetic weights quantized, for every layer, with a
// subset of experts and dense layers in between.
TEST(LoadExpertWeightsMxfp8, EqualsQuantizedBf16Weights) {
  ModelConfig config = TinyModel(5, 96, 72);
  config.moe_layers = {1, 2, 4};
  const uint64_t seed = std::random_device{}();
  const std::vector<int> ids = {3, 9, 12, 15};
  WeightSource source;
  source.seed = seed;
  source.num_threads = 2;
  source.format = WeightFormat::kBF16;
  auto bf16 = LoadExpertWeights(source, config, ids);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  source.format = WeightFormat::kMXFP8;
  auto mx = LoadExpertWeights(source, config, ids);
  ASSERT_TRUE(mx.ok()) << mx.status();
  EXPECT_EQ((*mx)->format(), WeightFormat::kMXFP8);
  EXPECT_EQ((*mx)->expert_ids(), ids);
  EXPECT_EQ((*mx)->total_bytes(), config.LayerWeightBytes(4, WeightFormat::kMXFP8) * 3);
  EXPECT_EQ((*bf16)->total_bytes(), config.LayerWeightBytes(4, WeightFormat::kBF16) * 3);
  for (int layer = 0; layer < config.num_layers; ++layer) {
    const LayerWeights* b = (*bf16)->layer(layer);
    const LayerWeights* m = (*mx)->layer(layer);
    ASSERT_EQ(b == nullptr, m == nullptr) << layer;
    if (b == nullptr) continue;
    auto q = QuantizeLayerToMxfp8(*b, layer, ids, 1);
    ASSERT_TRUE(q.ok()) << q.status();
    ExpectSameLayer(*m, q->weights);
  }
  auto copy = QuantizeStoreToMxfp8(**bf16, 2);
  ASSERT_TRUE(copy.ok()) << copy.status();
  for (int layer : config.moe_layers) ExpectSameLayer(*(*copy)->layer(layer), *(*mx)->layer(layer));
}

TEST(LoadExpertWeightsMxfp8, MemoryBudgetCountsMxfp8Bytes) {
  const ModelConfig config = TinyModel(8);
  std::vector<int> ids(16);
  for (int i = 0; i < 16; ++i) ids[i] = i;
  const int64_t peak = Mxfp8LoadPeakBytes(config, 16);
  EXPECT_EQ(peak, 8 * config.LayerWeightBytes(16, WeightFormat::kMXFP8) +
                      config.LayerWeightBytes(16, WeightFormat::kBF16));
  // Fits MXFP8 (peak within the 85% usable share) but not the whole model in BF16.
  const int64_t budget = static_cast<int64_t>(peak / 0.85) + 4096;
  ASSERT_GT(8 * config.LayerWeightBytes(16, WeightFormat::kBF16), 0.85 * budget);
  WeightSource source;
  source.seed = 1;
  source.num_threads = 2;
  source.memory_budget_bytes = budget;
  source.format = WeightFormat::kMXFP8;
  auto mx = LoadExpertWeights(source, config, ids);
  ASSERT_TRUE(mx.ok()) << mx.status();
  EXPECT_LE((*mx)->total_bytes(), peak);
  source.format = WeightFormat::kBF16;
  EXPECT_EQ(LoadExpertWeights(source, config, ids).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Just below the MXFP8 peak: refused before anything is allocated.
  source.format = WeightFormat::kMXFP8;
  source.memory_budget_bytes = static_cast<int64_t>(peak / 0.85) - 4096;
  auto refused = LoadExpertWeights(source, config, ids);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("GiB"));
}

}  // namespace
}  // namespace moeserve
