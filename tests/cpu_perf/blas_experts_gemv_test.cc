// BlasExperts and BatchedBlasExperts on both of their paths (the GEMV on compressed weights for
// experts with few rows, dequantize + sgemm for the rest) and on a mix of the two, with BF16
// and MXFP8 weights, at an odd hidden size. Standard format: against ReferenceExperts through
// the modular kernel. Batched format: against a float64 evaluation of each valid row.
// Tolerance: FP32 activations and accumulation -> relative L2 < 1e-5.
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "core/cpu/batched_experts.h"
#include "core/cpu/cpu_experts.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/modular_kernel.h"
#include "core/mxfp8_weights.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace moeserve {
namespace {

constexpr double kFp32Tolerance = 1e-5;

ModelConfig SmallModel() {
  ModelConfig m;
  m.name = "cpu_perf";
  m.num_layers = 1;
  m.num_experts = 8;
  m.topk = 3;
  m.hidden = 67;        // not a multiple of 8, 16 or 32
  m.intermediate = 45;  // neither
  return m;
}

std::unique_ptr<ExpertWeightStore> MakeStore(const ModelConfig& m, WeightFormat format) {
  std::vector<int> ids(m.num_experts);
  std::iota(ids.begin(), ids.end(), 0);
  if (format == WeightFormat::kMXFP8) return *CreateSyntheticMxfp8(m, ids, /*seed=*/5, 1);
  return *ExpertWeightStore::CreateSynthetic(m, ids, /*seed=*/5, 1);
}

struct Variant {
  WeightFormat format;
  int64_t gemv_max_rows;  // 0: sgemm only; 3: mixed; -1: the default (GEMV for these sizes)
  int threads;
};

std::string Name(const ::testing::TestParamInfo<Variant>& info) {
  const Variant& v = info.param;
  return std::string(v.format == WeightFormat::kMXFP8 ? "Mxfp8" : "Bf16") + "_gemv" +
         (v.gemv_max_rows < 0 ? std::string("Default") : std::to_string(v.gemv_max_rows)) +
         "_threads" + std::to_string(v.threads);
}

const Variant kVariants[] = {{WeightFormat::kBF16, 0, 2},   {WeightFormat::kBF16, 3, 2},
                             {WeightFormat::kBF16, -1, 2},  {WeightFormat::kBF16, -1, 1},
                             {WeightFormat::kMXFP8, 0, 2},  {WeightFormat::kMXFP8, 3, 2},
                             {WeightFormat::kMXFP8, -1, 2}, {WeightFormat::kMXFP8, -1, 3}};

class BlasExpertsPathsTest : public ::testing::TestWithParam<Variant> {};

TEST_P(BlasExpertsPathsTest, StandardMatchesReference) {
  const Variant v = GetParam();
  const ModelConfig model = SmallModel();
  auto store = MakeStore(model, v.format);
  auto ref = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(1 << 20),
                                    std::make_unique<ReferenceExperts>());
  auto blas = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(1 << 20),
                                     std::make_unique<BlasExperts>(v.threads, v.gemv_max_rows));
  std::mt19937 rng(11);
  // 1 token (decode); 5 tokens (some experts over 3 rows, some under); 40 tokens, uniform and
  // all on one hot expert (40 rows on one expert, the rest spread).
  struct Run {
    int64_t m;
    testing::Routing routing;
  };
  for (const Run& run :
       {Run{1, testing::Routing::kUniform}, Run{5, testing::Routing::kUniform},
        Run{40, testing::Routing::kUniform}, Run{40, testing::Routing::kHotExpert}}) {
    SCOPED_TRACE(::testing::Message() << "m=" << run.m);
    Tensor x = testing::RandomNormal({run.m, model.hidden}, rng);
    Tensor ids = testing::MakeRouting(run.routing, run.m, model.topk, model.num_experts, rng);
    Tensor wts = testing::RandomTopkWeights(run.m, model.topk, rng);
    ModularKernelArgs args;
    args.hidden_states = x.view();
    args.topk_ids = ids.view();
    args.topk_weights = wts.view();
    args.weights = store->layer(0);
    args.num_experts = model.num_experts;
    Tensor out_ref = Tensor::Empty(DType::kFP32, {run.m, model.hidden});
    Tensor out = Tensor::Empty(DType::kFP32, {run.m, model.hidden});
    for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] = NAN;  // poison
    ASSERT_TRUE(ref->Forward(args, out_ref.view()).ok());
    const absl::Status s = blas->Forward(args, out.view());
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_LT(testing::RelativeL2Error(out.data<float>(), out_ref.data<float>(), out.numel()),
              kFp32Tolerance);
  }
}

// float64 SiLU-gated MLP of local expert e on one row.
std::vector<double> Float64Mlp(const LayerWeights& w, int64_t e, const float* x) {
  const int64_t k = w.hidden, n = w.intermediate;
  std::vector<float> w13(2 * n * k), w2(k * n);
  EXPECT_TRUE(DequantizeExpertToFp32(w, e, w13.data(), w2.data()).ok());
  std::vector<double> act(n), y(k, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < k; ++h) {
      g += double{w13[i * k + h]} * x[h];
      u += double{w13[(n + i) * k + h]} * x[h];
    }
    act[i] = g / (1 + std::exp(-g)) * u;
  }
  for (int64_t h = 0; h < k; ++h) {
    for (int64_t i = 0; i < n; ++i) y[h] += double{w2[h * n + i]} * act[i];
  }
  return y;
}

TEST_P(BlasExpertsPathsTest, BatchedMatchesFloat64) {
  const Variant v = GetParam();
  const ModelConfig model = SmallModel();
  auto store = MakeStore(model, v.format);
  const LayerWeights& w = *store->layer(0);
  const int64_t e_local = model.num_experts, k = model.hidden, cap = 9;
  BatchedBlasExperts experts(v.threads, v.gemv_max_rows);
  std::mt19937 rng(13);
  Tensor a1q = testing::RandomNormal({e_local, cap, k}, rng);
  Tensor counts = Tensor::Empty(DType::kINT32, {e_local});
  // Empty, one-row, few-row and full experts.
  const int32_t n_rows[] = {0, 1, 2, 3, 4, 7, 9, 0};
  for (int64_t e = 0; e < e_local; ++e) counts.data<int32_t>()[e] = n_rows[e];
  PreparedActivations p;
  p.format = ActivationFormat::kBatchedExperts;
  p.a1q = a1q.view();
  p.expert_num_tokens = counts.view();
  p.problem = {.num_tokens = 26,
               .hidden = k,
               .intermediate = model.intermediate,
               .topk = model.topk,
               .num_experts = model.num_experts,
               .num_local_experts = e_local,
               .max_num_tokens = cap};
  const WorkspaceShapes shapes = experts.GetWorkspaceShapes(p.problem);
  Tensor ws13 = Tensor::Empty(DType::kFP32, shapes.workspace13);
  Tensor ws2 = Tensor::Empty(DType::kFP32, shapes.workspace2);
  Tensor out = Tensor::Empty(DType::kFP32, shapes.output);
  ExpertsApplyArgs args{.output = out.view(),
                        .prepared = &p,
                        .weights = &w,
                        .workspace13 = ws13.view(),
                        .workspace2 = ws2.view()};
  const absl::Status s = experts.Apply(args);
  ASSERT_TRUE(s.ok()) << s;
  std::vector<float> got, expected;
  for (int64_t e = 0; e < e_local; ++e) {
    for (int64_t r = 0; r < n_rows[e]; ++r) {
      const std::vector<double> y = Float64Mlp(w, e, a1q.data<float>() + (e * cap + r) * k);
      for (int64_t h = 0; h < k; ++h) {
        expected.push_back(static_cast<float>(y[h]));
        got.push_back(out.data<float>()[(e * cap + r) * k + h]);
      }
    }
  }
  EXPECT_LT(testing::RelativeL2Error(got.data(), expected.data(), got.size()), kFp32Tolerance);
}

INSTANTIATE_TEST_SUITE_P(Paths, BlasExpertsPathsTest, ::testing::ValuesIn(kVariants), Name);

// Workspaces: no FP32 weight copy when no expert can reach the sgemm path.
TEST(BlasExpertsWorkspace, NoFp32WeightCopyAtDecodeSizes) {
  const MoeProblem decode{.num_tokens = 4,
                          .hidden = 2048,
                          .intermediate = 768,
                          .topk = 8,
                          .num_experts = 128,
                          .num_local_experts = 128,
                          .max_num_tokens = 32};
  EXPECT_EQ(NumElements(BlasExperts(2).GetWorkspaceShapes(decode).workspace2), 0);
  EXPECT_EQ(NumElements(BatchedBlasExperts(2).GetWorkspaceShapes(decode).workspace2), 0);
  EXPECT_GT(NumElements(BlasExperts(2, 0).GetWorkspaceShapes(decode).workspace2), 0);
  EXPECT_GT(NumElements(BatchedBlasExperts(2, 0).GetWorkspaceShapes(decode).workspace2), 0);
}

}  // namespace
}  // namespace moeserve
