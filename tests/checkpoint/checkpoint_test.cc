// Hugging Face checkpoints: config.json parsing, loading every scheme (sharded or not, BF16 /
// F32 / pre-quantized MXFP8) against the reference weights the generating script wrote, and
// every corruption refused with an error naming the file and the tensor.
#include <algorithm>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "core/checkpoint/expert_loader.h"
#include "core/checkpoint/hf_checkpoint.h"
#include "core/weight_loader.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/mxfp8.h"
#include "tests/checkpoint/checkpoint_test_util.h"

namespace moeserve {
namespace {

using checkpoint::ModelConfigFromHfConfigJson;
using moeserve::testing::CheckpointDir;
using moeserve::testing::CheckpointInfo;
using moeserve::testing::ReadReference;
using ::testing::AllOf;
using ::testing::HasSubstr;

absl::StatusOr<ModelConfig> Parse(const std::string& json) {
  return ModelConfigFromHfConfigJson(json, "/ckpt/config.json", "m");
}

TEST(HfConfig, Qwen3MoeDenseLayersFromMlpOnlyLayersAndSparseStep) {
  auto c = Parse(R"({"model_type":"qwen3_moe","num_experts":128,"num_experts_per_tok":8,
                     "hidden_size":2048,"moe_intermediate_size":768,"intermediate_size":6144,
                     "num_hidden_layers":8,"decoder_sparse_step":2,"mlp_only_layers":[5]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->topk, 8);
  EXPECT_EQ(c->hidden, 2048);
  EXPECT_EQ(c->intermediate, 768);  // moe_intermediate_size wins over intermediate_size
  EXPECT_EQ(c->num_layers, 8);
  // (l + 1) % 2 == 0 -> 1, 3, 5, 7; 5 is in mlp_only_layers.
  EXPECT_EQ(c->moe_layers, (std::vector<int>{1, 3, 7}));
  EXPECT_EQ(c->name, "m");
}

TEST(HfConfig, DeepSeekFirstKDenseReplace) {
  auto c = Parse(R"({"model_type":"deepseek_v3","n_routed_experts":256,"num_experts_per_tok":8,
                     "hidden_size":7168,"moe_intermediate_size":2048,"intermediate_size":18432,
                     "num_hidden_layers":6,"first_k_dense_replace":3,"moe_layer_freq":1,
                     "n_shared_experts":1})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->moe_layers, (std::vector<int>{3, 4, 5}));
  EXPECT_FALSE(c->IsMoeLayer(2));
  auto freq = Parse(R"({"n_routed_experts":4,"num_experts_per_tok":2,"hidden_size":8,
                        "moe_intermediate_size":4,"num_hidden_layers":7,
                        "first_k_dense_replace":1,"moe_layer_freq":2})");
  ASSERT_TRUE(freq.ok()) << freq.status();
  EXPECT_EQ(freq->moe_layers, (std::vector<int>{2, 4, 6}));
}

TEST(HfConfig, MixtralEveryLayerAndIntermediateSize) {
  auto c = Parse(R"({"model_type":"mixtral","num_local_experts":8,"num_experts_per_tok":2,
                     "hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->intermediate, 14336);
  EXPECT_TRUE(c->moe_layers.empty());  // empty: every layer
  EXPECT_EQ(c->num_moe_layers(), 32);
}

TEST(HfConfig, BadConfigsNameTheFileAndTheKey) {
  struct Case {
    std::string json, expect;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"num_experts_per_tok":2,"hidden_size":8,"intermediate_size":4,
                "num_hidden_layers":2})",
            "n_routed_experts, num_experts, num_local_experts"},
           {R"({"num_experts":4,"hidden_size":8,"intermediate_size":4,"num_hidden_layers":2})",
            "num_experts_per_tok"},
           {R"({"num_experts":4,"num_experts_per_tok":2,"intermediate_size":4,
                "num_hidden_layers":2})",
            "hidden_size"},
           {R"({"num_experts":4,"num_experts_per_tok":2,"hidden_size":8,
                "num_hidden_layers":2})",
            "moe_intermediate_size, intermediate_size"},
           {R"({"num_experts":4,"num_experts_per_tok":2,"hidden_size":"8",
                "intermediate_size":4,"num_hidden_layers":2})",
            "'hidden_size' is \"8\""},
           {R"({"num_experts":4,"num_experts_per_tok":2,"hidden_size":-8,
                "intermediate_size":4,"num_hidden_layers":2})",
            "'hidden_size' is -8"},
           {R"({"num_experts":4,"num_experts_per_tok":9,"hidden_size":8,
                "intermediate_size":4,"num_hidden_layers":2})",
            "topk"},
           {R"({"num_experts":4,"num_experts_per_tok":2,"hidden_size":8,
                "intermediate_size":4,"num_hidden_layers":2,"mlp_only_layers":[0,1]})",
            "no layer has experts"},
           {R"({"num_experts":4,"num_experts_per_tok":2,"hidden_size":8,
                "intermediate_size":4,"num_hidden_layers":2,"mlp_only_layers":"0"})",
            "mlp_only_layers"},
           // Found by fuzz_hf_config: 2 GiB of layer ids before Validate saw the count.
           {R"({"num_experts":4,"num_experts_per_tok":2,"hidden_size":8,
                "intermediate_size":4,"num_hidden_layers":555555553,"mlp_only_layers":[5]})",
            "'num_hidden_layers' is 555555553; expected an integer in [1, 1024]"},
           {R"({"num_experts":4,"num_experts_per_tok":2,"hidden_size":8,
                "intermediate_size":4,"num_hidden_layers":1025})",
            "'num_hidden_layers' is 1025"},
           {R"({"num_experts":4,)", "not well-formed JSON"},
           {R"([1])", "not a JSON object"}}) {
    auto r = Parse(c.json);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
    EXPECT_THAT(r.status().message(), AllOf(HasSubstr("/ckpt/config.json"), HasSubstr(c.expect)));
  }
}

TEST(HfCheckpoint, MissingDirectoryAndFiles) {
  WeightSource source;
  source.checkpoint_dir = ::testing::TempDir() + "/no_such_checkpoint";
  auto c = ResolveModelConfig(source, ModelConfig{});
  EXPECT_TRUE(absl::IsNotFound(c.status()));
  EXPECT_THAT(c.status().message(), HasSubstr("no_such_checkpoint"));
  // A directory with a config.json but no weights.
  const std::string dir = ::testing::TempDir() + "/config_only_checkpoint";
  ASSERT_EQ(system(("mkdir -p " + dir + " && cp " + CheckpointDir("qwen3_bf16") + "/config.json " +
                    dir + "/")
                       .c_str()),
            0);
  auto open = checkpoint::HfCheckpoint::Open(dir);
  EXPECT_TRUE(absl::IsNotFound(open.status()));
  EXPECT_THAT(open.status().message(),
              AllOf(HasSubstr(dir), HasSubstr("model.safetensors.index.json")));
}

// Issue 14 item 7: a NUL inside a weight_map value was cut by the file system call, so
// "<shard>\0anything" opened (and served) <shard>. It is refused, naming the entry.
TEST(HfCheckpoint, NulInAWeightMapFileNameIsRefused) {
  const std::string src = CheckpointDir("qwen3_bf16_sharded");
  const std::string dir = ::testing::TempDir() + "/nul_weight_map_checkpoint";
  ASSERT_EQ(system(("rm -rf " + dir + " && cp -r " + src + " " + dir).c_str()), 0);
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::ifstream in(index_path);
  nlohmann::json index = nlohmann::json::parse(in);
  in.close();
  ASSERT_TRUE(index["weight_map"].is_object());
  auto& first = *index["weight_map"].begin();
  first = first.get<std::string>() + std::string("\0.evil", 6);
  std::ofstream(index_path) << index.dump();
  auto open = checkpoint::HfCheckpoint::Open(dir);
  ASSERT_FALSE(open.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(open.status())) << open.status();
  EXPECT_THAT(open.status().message(),
              AllOf(HasSubstr(index_path), HasSubstr("NUL"), HasSubstr(".evil")))
      << open.status();
}

// ---- Loading the generated checkpoints ----

struct Loaded {
  std::unique_ptr<ExpertWeightStore> store;
  ModelConfig model;
};

absl::StatusOr<Loaded> Load(const std::string& name, WeightFormat format,
                            std::vector<int> expert_ids = {}) {
  WeightSource source;
  source.checkpoint_dir = CheckpointDir(name);
  source.format = format;
  source.num_threads = 2;
  Loaded out;
  auto model = ResolveModelConfig(source, ModelConfig{});
  if (!model.ok()) return model.status();
  out.model = *model;
  if (expert_ids.empty()) {
    for (int e = 0; e < out.model.num_experts; ++e) expert_ids.push_back(e);
  }
  auto store = LoadExpertWeights(source, out.model, std::move(expert_ids));
  if (!store.ok()) return store.status();
  out.store = *std::move(store);
  return out;
}

class SuiteCheckpointTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SuiteCheckpointTest, ConfigMatchesWhatTheScriptWrote) {
  const nlohmann::json info = CheckpointInfo(GetParam());
  auto ckpt = checkpoint::HfCheckpoint::Open(CheckpointDir(GetParam()));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const ModelConfig& c = (*ckpt)->config();
  EXPECT_EQ(c.num_layers, info["num_layers"].get<int>());
  EXPECT_EQ(c.num_experts, info["num_experts"].get<int>());
  EXPECT_EQ(c.topk, info["topk"].get<int>());
  EXPECT_EQ(c.hidden, info["hidden"].get<int64_t>());
  EXPECT_EQ(c.intermediate, info["intermediate"].get<int64_t>());
  std::vector<int> moe;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.IsMoeLayer(l)) moe.push_back(l);
  }
  EXPECT_EQ(moe, info["moe_layers"].get<std::vector<int>>());
  EXPECT_EQ((*ckpt)->naming(), info["scheme"] == "mixtral" ? checkpoint::ExpertNaming::kMixtral
                                                           : checkpoint::ExpertNaming::kMlpExperts);
  EXPECT_EQ(static_cast<int>((*ckpt)->files().size()), info["shards"].get<int>());
}

// Every local expert of every MoE layer equals the script's reference, bit for bit.
void ExpectBf16EqualsReference(const std::string& name, const Loaded& loaded,
                               const std::vector<int>& expert_ids) {
  const ModelConfig& m = loaded.model;
  const int64_t h = m.hidden, n = m.intermediate, num = m.num_experts;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    const LayerWeights* lw = loaded.store->layer(layer);
    if (!m.IsMoeLayer(layer)) {
      EXPECT_EQ(lw, nullptr) << "dense layer " << layer;
      continue;
    }
    ASSERT_NE(lw, nullptr) << layer;
    ASSERT_EQ(lw->format, WeightFormat::kBF16);
    const std::string l = std::to_string(layer);
    const auto w13 = ReadReference<uint16_t>(name, "layer" + l + "_w13.bf16.bin", num * 2 * n * h);
    const auto w2 = ReadReference<uint16_t>(name, "layer" + l + "_w2.bf16.bin", num * h * n);
    for (size_t e = 0; e < expert_ids.size(); ++e) {
      const int g = expert_ids[e];
      EXPECT_EQ(0, std::memcmp(lw->w13.data<uint16_t>() + e * 2 * n * h, &w13[g * 2 * n * h],
                               2 * n * h * 2))
          << name << " layer " << layer << " expert " << g << " w13";
      EXPECT_EQ(0, std::memcmp(lw->w2.data<uint16_t>() + e * h * n, &w2[g * h * n], h * n * 2))
          << name << " layer " << layer << " expert " << g << " w2";
    }
  }
}

TEST_P(SuiteCheckpointTest, LoadsBf16EqualToTheReference) {
  auto loaded = Load(GetParam(), WeightFormat::kBF16);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::vector<int> all(loaded->model.num_experts);
  for (int e = 0; e < loaded->model.num_experts; ++e) all[e] = e;
  ExpectBf16EqualsReference(GetParam(), *loaded, all);
}

TEST_P(SuiteCheckpointTest, EachRankLoadsOnlyItsExperts) {
  const std::vector<int> mine = {5, 2, 7};  // any order: local index order
  auto loaded = Load(GetParam(), WeightFormat::kBF16, mine);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->store->expert_ids(), mine);
  EXPECT_EQ(loaded->store->total_bytes(), loaded->model.LayerWeightBytes(3, WeightFormat::kBF16) *
                                              loaded->model.num_moe_layers());
  ExpectBf16EqualsReference(GetParam(), *loaded, mine);
}

// Served as MXFP8: pre-quantized checkpoints keep their codes; float ones are quantized from
// their BF16 values by the MXFP8 reference quantizer.
TEST_P(SuiteCheckpointTest, LoadsMxfp8) {
  const nlohmann::json info = CheckpointInfo(GetParam());
  const bool prequantized = info["dtype"] == "mxfp8";
  auto loaded = Load(GetParam(), WeightFormat::kMXFP8);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const ModelConfig& m = loaded->model;
  const int64_t h = m.hidden, n = m.intermediate, num = m.num_experts;
  const int64_t bh = kernels::Mxfp8ScaleBlocks(h), bn = kernels::Mxfp8ScaleBlocks(n);
  EXPECT_EQ(loaded->store->total_bytes(),
            m.LayerWeightBytes(num, WeightFormat::kMXFP8) * m.num_moe_layers());
  for (int layer : info["moe_layers"].get<std::vector<int>>()) {
    const LayerWeights* lw = loaded->store->layer(layer);
    ASSERT_NE(lw, nullptr);
    ASSERT_EQ(lw->format, WeightFormat::kMXFP8);
    const std::string l = "layer" + std::to_string(layer);
    std::vector<uint8_t> q13, s13, q2, s2;
    if (prequantized) {
      q13 = ReadReference<uint8_t>(GetParam(), l + "_w13.q.bin", num * 2 * n * h);
      s13 = ReadReference<uint8_t>(GetParam(), l + "_w13.scale.bin", num * 2 * n * bh);
      q2 = ReadReference<uint8_t>(GetParam(), l + "_w2.q.bin", num * h * n);
      s2 = ReadReference<uint8_t>(GetParam(), l + "_w2.scale.bin", num * h * bn);
    } else {
      const auto w13 = ReadReference<uint16_t>(GetParam(), l + "_w13.bf16.bin", num * 2 * n * h);
      const auto w2 = ReadReference<uint16_t>(GetParam(), l + "_w2.bf16.bin", num * h * n);
      q13.resize(w13.size()), s13.resize(num * 2 * n * bh), q2.resize(w2.size()),
          s2.resize(num * h * bn);
      ASSERT_EQ(
          kernels::QuantizeMxfp8RowsFromBf16Ref(w13.data(), num * 2 * n, h, q13.data(), s13.data()),
          kernels::Mxfp8Status::kOk);
      ASSERT_EQ(kernels::QuantizeMxfp8RowsFromBf16Ref(w2.data(), num * h, n, q2.data(), s2.data()),
                kernels::Mxfp8Status::kOk);
    }
    EXPECT_EQ(0, std::memcmp(lw->w13.raw_data(), q13.data(), q13.size())) << l;
    EXPECT_EQ(0, std::memcmp(lw->w13_scale.raw_data(), s13.data(), s13.size())) << l;
    EXPECT_EQ(0, std::memcmp(lw->w2.raw_data(), q2.data(), q2.size())) << l;
    EXPECT_EQ(0, std::memcmp(lw->w2_scale.raw_data(), s2.data(), s2.size())) << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Schemes, SuiteCheckpointTest,
                         ::testing::Values("qwen3_bf16", "qwen3_bf16_sharded",
                                           "deepseek_bf16_sharded", "deepseek_f32", "deepseek_f16",
                                           "mixtral_bf16", "mixtral_f32_sharded", "qwen3_mxfp8",
                                           "deepseek_mxfp8_sharded"));

TEST(HfCheckpoint, MemoryBudgetIsCheckedBeforeLoading) {
  WeightSource source;
  source.checkpoint_dir = CheckpointDir("qwen3_bf16");
  source.memory_budget_bytes = 4096;
  auto model = ResolveModelConfig(source, ModelConfig{});
  ASSERT_TRUE(model.ok()) << model.status();
  auto store = LoadExpertWeights(source, *model, {0, 1, 2});
  EXPECT_TRUE(absl::IsResourceExhausted(store.status())) << store.status();
  EXPECT_THAT(store.status().message(), HasSubstr("GiB"));
}

TEST(HfCheckpoint, RefusesAModelThatIsNotTheCheckpoints) {
  auto ckpt = checkpoint::HfCheckpoint::Open(CheckpointDir("qwen3_bf16"));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ModelConfig other = (*ckpt)->config();
  other.hidden += 1;
  auto store = checkpoint::LoadCheckpointExperts(**ckpt, other, {0}, {});
  EXPECT_TRUE(absl::IsInvalidArgument(store.status()));
  EXPECT_THAT(store.status().message(), HasSubstr("does not match"));
  auto bad_id = checkpoint::LoadCheckpointExperts(**ckpt, (*ckpt)->config(), {0, 8}, {});
  EXPECT_THAT(bad_id.status().message(), HasSubstr("expert id 8"));
}

// ---- Corruptions ----

class CorruptCheckpointTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CorruptCheckpointTest, RefusedNamingFileAndTensor) {
  const std::string name = "corrupt_" + GetParam();
  const nlohmann::json info = CheckpointInfo(name);
  ASSERT_EQ(info["corrupt"], GetParam());
  auto loaded = Load(name, WeightFormat::kBF16, {0, 1, 2});
  ASSERT_FALSE(loaded.ok());
  const std::string msg(loaded.status().message());
  const std::string tensor = info["error_tensor"];
  if (!tensor.empty()) {
    EXPECT_THAT(msg, HasSubstr("'" + tensor + "'"));
  }
  if (GetParam() == "missing_expert") {
    // Absent from the index, so there is no file to name: the checkpoint is named instead.
    EXPECT_THAT(msg, AllOf(HasSubstr(CheckpointDir(name)), HasSubstr("layer 0 expert 1 up")));
  } else {
    EXPECT_THAT(msg, HasSubstr(info["victim_file"].get<std::string>()));
  }
  static const std::map<std::string, std::string> kExpect = {
      {"truncated", "past the end of the data section"},
      {"header_past_end", "header length"},
      {"offsets_past_end", "past the end of the data section"},
      {"unknown_dtype", "unknown dtype 'Q7'"},
      {"missing_expert", "is missing"},
      {"shape_mismatch", "has shape [80, 48] but config.json implies [48, 80]"},
      {"nan_weight", "at [2, 3]; refusing to serve non-finite weights"},
      {"f64_weight", "dtype F64, which is not supported"},
  };
  EXPECT_THAT(msg, HasSubstr(kExpect.at(GetParam())));
  std::cout << GetParam() << ": " << loaded.status() << "\n";
}

// The corruption in experts that this rank does not host is still caught when it breaks the
// file (every file is validated), but a missing or non-finite foreign expert is not this rank's
// business.
TEST(CorruptCheckpoint, OtherRanksExpertsAreNotRead) {
  EXPECT_TRUE(Load("corrupt_missing_expert", WeightFormat::kBF16, {0, 2}).ok());
  EXPECT_TRUE(Load("corrupt_nan_weight", WeightFormat::kBF16, {3}).ok());
  EXPECT_FALSE(Load("corrupt_truncated", WeightFormat::kBF16, {3}).ok());
}

// Weights that are finite in the checkpoint but Inf once dequantized from MXFP8 (FP32 tops out
// below 2^128): refused as non-finite in that format, as the loader promises for every format.
TEST(CorruptCheckpoint, Mxfp8ValuesThatDequantizeToInfAreRefused) {
  // A BF16 value of 0x7F7F (3.39e38) loads as bf16 and rounds to 2^128 as MXFP8.
  EXPECT_TRUE(Load("corrupt_huge_weight", WeightFormat::kBF16, {1}).ok());
  auto huge = Load("corrupt_huge_weight", WeightFormat::kMXFP8, {1});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("value x scale overflows FP32 (Inf) at [2, 3]"));
  EXPECT_THAT(huge.status().message(), HasSubstr("up_proj"));
  // A pre-quantized 1.75 in a block of scale 2^127: Inf in FP32, refused in either format.
  for (WeightFormat format : {WeightFormat::kMXFP8, WeightFormat::kBF16}) {
    auto overflow = Load("corrupt_mxfp8_overflow", format, {1});
    ASSERT_FALSE(overflow.ok());
    EXPECT_EQ(overflow.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(overflow.status().message(), HasSubstr("at [2, 3]")) << overflow.status();
    EXPECT_THAT(overflow.status().message(), HasSubstr("refusing to serve non-finite weights"));
  }
  // Other experts of those checkpoints load.
  EXPECT_TRUE(Load("corrupt_mxfp8_overflow", WeightFormat::kMXFP8, {0, 2}).ok());
  EXPECT_TRUE(Load("corrupt_huge_weight", WeightFormat::kMXFP8, {0, 2}).ok());
}

INSTANTIATE_TEST_SUITE_P(Kinds, CorruptCheckpointTest,
                         ::testing::Values("truncated", "header_past_end", "offsets_past_end",
                                           "unknown_dtype", "missing_expert", "shape_mismatch",
                                           "nan_weight", "f64_weight"));

}  // namespace
}  // namespace moeserve
