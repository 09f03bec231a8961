// core/router: hand-computed cases for each scoring, groups, bias and scaling; every input dtype;
// random cases against a plain double-precision loop written here; refusals; the Router class,
// synthetic gates and config.json's routing keys.
#include "core/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/checkpoint/hf_checkpoint.h"
#include "core/model_config.h"
#include "core/thread_pool.h"
#include "core/weights.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/testing/test_util.h"

namespace moeserve {
namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Routes FP32 `x` [m, h] with FP32 `gate` [e, h].
absl::StatusOr<Routed> RouteFp32(const RouterConfig& c, const std::vector<float>& x, int64_t m,
                                 const std::vector<float>& gate, int64_t e, int topk,
                                 const std::vector<float>& bias = {}, ThreadPool* pool = nullptr) {
  const int64_t h = static_cast<int64_t>(gate.size()) / e;
  Routed r;
  r.ids.assign(m * topk, -7);
  r.weights.assign(m * topk, -7.0f);
  absl::Status s = Route(c, TensorView(x.data(), DType::kFP32, {m, h}),
                         TensorView(gate.data(), DType::kFP32, {e, h}),
                         bias.empty() ? TensorView() : TensorView(bias.data(), DType::kFP32, {e}),
                         TensorView(r.ids.data(), DType::kINT32, {m, topk}),
                         TensorView(r.weights.data(), DType::kFP32, {m, topk}), pool);
  if (!s.ok()) return s;
  return r;
}

std::vector<float> Identity(int n) {
  std::vector<float> g(n * n, 0.0f);
  for (int i = 0; i < n; ++i) g[i * n + i] = 1.0f;
  return g;
}

float Logit(double p) { return static_cast<float>(std::log(p / (1 - p))); }

TEST(RouterTest, SoftmaxTopkByHand) {
  // Identity gate: the logits are the hidden states.
  const std::vector<float> x = {1.0f,  3.0f,  2.0f, 0.0f,    // token 0
                                -1.0f, -2.0f, 0.5f, 0.25f};  // token 1
  RouterConfig c;                                            // softmax, no renormalization
  auto r = RouteFp32(c, x, 2, Identity(4), 4, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ids, (std::vector<int32_t>{1, 2, 2, 3}));
  const double z0 = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  const double z1 = std::exp(-1.0) + std::exp(-2.0) + std::exp(0.5) + std::exp(0.25);
  EXPECT_NEAR(r->weights[0], std::exp(3.0) / z0, 1e-6);
  EXPECT_NEAR(r->weights[1], std::exp(2.0) / z0, 1e-6);
  EXPECT_NEAR(r->weights[2], std::exp(0.5) / z1, 1e-6);
  EXPECT_NEAR(r->weights[3], std::exp(0.25) / z1, 1e-6);

  // Renormalized (Mixtral / norm_topk_prob): the softmax of the chosen logits.
  c.renormalize = true;
  r = RouteFp32(c, x, 2, Identity(4), 4, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(r->weights[1], 1.0 / (1.0 + std::exp(1.0)), 1e-6);
  EXPECT_NEAR(r->weights[2], 1.0 / (1.0 + std::exp(-0.25)), 1e-6);
  // A scaling factor multiplies after the renormalization.
  c.routed_scaling_factor = 2.5f;
  r = RouteFp32(c, x, 2, Identity(4), 4, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->weights[0] + r->weights[1], 2.5, 1e-5);
}

TEST(RouterTest, TiesGoToTheLowerExpert) {
  const std::vector<float> x = {0.5f, 2.0f, 2.0f, 2.0f};
  RouterConfig c;
  auto r = RouteFp32(c, x, 1, Identity(4), 4, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ids, (std::vector<int32_t>{1, 2}));
}

// DeepSeek-V3: sigmoid scores, choice = score + bias, 4 groups of 2 ranked by their top-2 sum,
// 2 groups kept, top-2 within them, weights from the unbiased scores.
TEST(RouterTest, SigmoidGroupedWithBiasByHand) {
  // Unbiased scores s and the biased choice values we want.
  const std::vector<double> s = {0.80, 0.30, 0.55, 0.50, 0.40, 0.45, 0.20, 0.10};
  const std::vector<double> choice = {0.90, 0.05, 0.62, 0.60, 0.58, 0.57, 0.30, 0.20};
  // Group sums: g0 0.95, g1 1.22, g2 1.15, g3 0.50 -> keep g1 (experts 2, 3) and g2 (4, 5).
  // Expert 0 has the largest choice but its group is dropped. Top-2 among 2..5 by choice: 2, 3.
  std::vector<float> x(8), bias(8);
  for (int e = 0; e < 8; ++e) {
    x[e] = Logit(s[e]);
    bias[e] = static_cast<float>(choice[e] - s[e]);
  }
  RouterConfig c;
  c.scoring = RouterScoring::kSigmoid;
  c.correction_bias = true;
  c.n_group = 4;
  c.topk_group = 2;
  auto r = RouteFp32(c, x, 1, Identity(8), 8, 2, bias);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ids, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(r->weights[0], 0.55, 1e-6);  // unbiased, not renormalized
  EXPECT_NEAR(r->weights[1], 0.50, 1e-6);

  c.renormalize = true;
  c.routed_scaling_factor = 2.5f;
  r = RouteFp32(c, x, 1, Identity(8), 8, 2, bias);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->weights[0], 2.5 * 0.55 / 1.05, 1e-5);
  EXPECT_NEAR(r->weights[1], 2.5 * 0.50 / 1.05, 1e-5);

  // Keeping 3 groups lets g0 in: experts 0 (0.90) and 2 (0.62).
  c.topk_group = 3;
  r = RouteFp32(c, x, 1, Identity(8), 8, 2, bias);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ids, (std::vector<int32_t>{0, 2}));
  EXPECT_NEAR(r->weights[0], 2.5 * 0.80 / 1.35, 1e-5);

  // Without the bias the choice is the score: groups g0 1.10, g1 1.05, g2 0.85 -> g0, g1.
  c.correction_bias = false;
  c.topk_group = 2;
  r = RouteFp32(c, x, 1, Identity(8), 8, 2);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ids, (std::vector<int32_t>{0, 2}));
}

// A plain double-precision implementation of the semantics in router.h, independent of the
// code under test (full sorts, no partial sorts or group bookkeeping shared).
Routed NaiveRoute(const RouterConfig& c, const std::vector<float>& x, int64_t m, int64_t h,
                  const std::vector<float>& gate, int64_t e, int topk,
                  const std::vector<float>& bias) {
  Routed out;
  for (int64_t t = 0; t < m; ++t) {
    std::vector<double> logit(e), score(e), choice(e);
    for (int64_t j = 0; j < e; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < h; ++k) acc += double{x[t * h + k]} * gate[j * h + k];
      logit[j] = acc;
    }
    if (c.scoring == RouterScoring::kSoftmax) {
      const double mx = *std::max_element(logit.begin(), logit.end());
      double z = 0;
      for (int64_t j = 0; j < e; ++j) z += std::exp(logit[j] - mx);
      for (int64_t j = 0; j < e; ++j) score[j] = std::exp(logit[j] - mx) / z;
    } else {
      for (int64_t j = 0; j < e; ++j) score[j] = 1 / (1 + std::exp(-logit[j]));
    }
    for (int64_t j = 0; j < e; ++j) choice[j] = score[j] + (c.correction_bias ? bias[j] : 0.0);
    std::vector<bool> allowed(e, true);
    if (c.n_group > 1) {
      const int64_t per = e / c.n_group;
      std::vector<std::pair<double, int>> groups;
      for (int g = 0; g < c.n_group; ++g) {
        std::vector<double> v(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        groups.push_back({-(v[0] + v[1]), g});
      }
      std::sort(groups.begin(), groups.end());
      std::set<int> kept;
      for (int i = 0; i < c.topk_group; ++i) kept.insert(groups[i].second);
      for (int64_t j = 0; j < e; ++j) allowed[j] = kept.count(static_cast<int>(j / per)) > 0;
    }
    std::vector<std::pair<double, int>> ranked;
    for (int64_t j = 0; j < e; ++j) {
      if (allowed[j]) ranked.push_back({-choice[j], static_cast<int>(j)});
    }
    std::sort(ranked.begin(), ranked.end());
    double sum = 0;
    for (int k = 0; k < topk; ++k) sum += score[ranked[k].second];
    for (int k = 0; k < topk; ++k) {
      const int id = ranked[k].second;
      out.ids.push_back(id);
      double w = score[id];
      if (c.renormalize) w /= sum;
      out.weights.push_back(static_cast<float>(w * c.routed_scaling_factor));
    }
  }
  return out;
}

struct RandomCase {
  const char* name;
  RouterConfig config;
  int64_t e;
  int topk;
};

std::vector<RandomCase> RandomCases() {
  RouterConfig mixtral;
  mixtral.renormalize = true;
  RouterConfig qwen2;  // softmax, norm_topk_prob false
  RouterConfig v3;
  v3.scoring = RouterScoring::kSigmoid;
  v3.correction_bias = true;
  v3.n_group = 8;
  v3.topk_group = 4;
  v3.renormalize = true;
  v3.routed_scaling_factor = 2.5f;
  return {{"mixtral", mixtral, 8, 2}, {"qwen2", qwen2, 60, 4}, {"deepseek_v3", v3, 64, 8}};
}

TEST(RouterTest, RandomCasesMatchAPlainLoop) {
  std::mt19937 rng(1234);
  ThreadPool pool(3);
  for (const RandomCase& rc : RandomCases()) {
    for (int64_t m : {1, 5, 67}) {
      const int64_t h = 96;
      Tensor xt = testing::RandomNormal({m, h}, rng);
      Tensor gt = testing::RandomNormal({rc.e, h}, rng, 1.0f / std::sqrt(96.0f));
      Tensor bt = testing::RandomNormal({rc.e}, rng, 0.1f);
      std::vector<float> x(xt.data<float>(), xt.data<float>() + xt.numel());
      std::vector<float> g(gt.data<float>(), gt.data<float>() + gt.numel());
      std::vector<float> b(bt.data<float>(), bt.data<float>() + bt.numel());
      const Routed want = NaiveRoute(rc.config, x, m, h, g, rc.e, rc.topk, b);
      for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
        auto got = RouteFp32(rc.config, x, m, g, rc.e, rc.topk, b, p);
        ASSERT_TRUE(got.ok()) << rc.name << ": " << got.status();
        EXPECT_EQ(got->ids, want.ids) << rc.name << " m=" << m << " pool=" << (p != nullptr);
        // FP32 GEMM and scores against double: relative L2 1e-5.
        EXPECT_LT(testing::RelativeL2Error(got->weights, want.weights), 1e-5) << rc.name;
      }
    }
  }
}

TEST(RouterTest, EveryHiddenAndGateDTypeGivesTheSameRouting) {
  std::mt19937 rng(7);
  const int64_t m = 9, h = 64, e = 16;
  const int topk = 4;
  // Values exact in BF16 (and so in FP16 at this range): conversions change nothing.
  Tensor x = testing::RandomNormal({m, h}, rng);
  Tensor g = testing::RandomNormal({e, h}, rng, 0.125f);
  Tensor xb = testing::ToBf16(x), gb = testing::ToBf16(g);
  std::vector<float> xs = testing::Bf16ToFloats(xb), gs = testing::Bf16ToFloats(gb);
  RouterConfig c;
  c.renormalize = true;
  auto want = RouteFp32(c, xs, m, gs, e, topk);
  ASSERT_TRUE(want.ok());
  Tensor xh = Tensor::Empty(DType::kFP16, {m, h});
  for (int64_t i = 0; i < m * h; ++i) xh.data<uint16_t>()[i] = kernels::FloatToFp16(xs[i]);
  for (const Tensor* hidden : {&xb, &xh}) {
    for (bool bf16_gate : {false, true}) {
      Routed r;
      r.ids.resize(m * topk);
      r.weights.resize(m * topk);
      const TensorView gate = bf16_gate ? gb.view() : TensorView(gs.data(), DType::kFP32, {e, h});
      ASSERT_TRUE(Route(c, hidden->view(), gate, TensorView(),
                        TensorView(r.ids.data(), DType::kINT32, {m, topk}),
                        TensorView(r.weights.data(), DType::kFP32, {m, topk}))
                      .ok());
      EXPECT_EQ(r.ids, want->ids) << DTypeName(hidden->dtype()) << " bf16_gate=" << bf16_gate;
      EXPECT_EQ(r.weights, want->weights);
    }
  }
}

TEST(RouterTest, NonFiniteTokenGetsDistinctIdsAndZeroWeights) {
  std::mt19937 rng(3);
  const int64_t m = 3, h = 8, e = 8;
  Tensor xt = testing::RandomNormal({m, h}, rng);
  std::vector<float> x(xt.data<float>(), xt.data<float>() + xt.numel());
  x[1 * h + 2] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x_inf = x;
  x_inf[1 * h + 2] = std::numeric_limits<float>::infinity();
  Tensor gt = testing::RandomNormal({e, h}, rng);
  std::vector<float> g(gt.data<float>(), gt.data<float>() + gt.numel());
  for (RouterScoring scoring : {RouterScoring::kSoftmax, RouterScoring::kSigmoid}) {
    for (const auto* input : {&x, &x_inf}) {
      RouterConfig c;
      c.scoring = scoring;
      c.renormalize = true;
      auto r = RouteFp32(c, *input, m, g, e, 3);
      ASSERT_TRUE(r.ok());
      std::set<int32_t> ids(r->ids.begin() + 3, r->ids.begin() + 6);
      EXPECT_EQ(ids.size(), 3u);
      for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < e);
      // Weight 0 on each, as the contract says (sigmoid once gave an Inf logit 1/3 each).
      for (int k = 3; k < 6; ++k) EXPECT_EQ(r->weights[k], 0.0f) << k;
      // Tokens 0 and 2 route as usual (their weights sum to 1).
      EXPECT_NEAR(r->weights[0] + r->weights[1] + r->weights[2], 1.0, 1e-5);
      EXPECT_NEAR(r->weights[6] + r->weights[7] + r->weights[8], 1.0, 1e-5);
    }
  }
}

TEST(RouterTest, ConfigValidation) {
  RouterConfig c;
  c.n_group = 3;
  EXPECT_EQ(c.Validate(16, 2).code(), absl::StatusCode::kInvalidArgument);  // 3 does not divide
  c.n_group = 16;
  EXPECT_NE(c.Validate(16, 2).message().find("top-2"), absl::string_view::npos);
  c.n_group = 4;
  c.topk_group = 5;
  EXPECT_NE(c.Validate(16, 2).message().find("topk_group"), absl::string_view::npos);
  c.topk_group = 1;  // one group of 4 cannot hold 8
  EXPECT_NE(c.Validate(16, 8).message().find("fewer than topk"), absl::string_view::npos);
  c.topk_group = 2;
  EXPECT_TRUE(c.Validate(16, 8).ok());
  // A scaling factor past the largest weight a Forward takes would refuse every routed call.
  c.routed_scaling_factor = 1e4f;
  EXPECT_TRUE(c.Validate(16, 8).ok());
  c.routed_scaling_factor = 1e5f;
  EXPECT_NE(c.Validate(16, 8).message().find("at most 10000"), absl::string_view::npos)
      << c.Validate(16, 8);
  c.routed_scaling_factor = 2.5f;
  c.routed_scaling_factor = 0;
  EXPECT_NE(c.Validate(16, 8).message().find("routed_scaling_factor"), absl::string_view::npos);
  EXPECT_EQ(RouterConfig().Validate(4, 5).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RouterConfig().Describe(), "softmax_topk()");
  c.routed_scaling_factor = 2.5f;
  c.correction_bias = true;
  c.renormalize = true;
  c.scoring = RouterScoring::kSigmoid;
  EXPECT_EQ(c.Describe(),
            "sigmoid_grouped_topk(n_group=4, topk_group=2, e_score_correction_bias, renormalize, "
            "routed_scaling_factor=2.5)");
}

TEST(RouterTest, BadTensorsRefused) {
  std::vector<float> x(2 * 8, 0.5f), g(4 * 8, 0.25f), w(4);
  std::vector<int32_t> ids(4);
  std::vector<int64_t> ids64(4);
  const TensorView xv(x.data(), DType::kFP32, {2, 8}), gv(g.data(), DType::kFP32, {4, 8});
  const TensorView iv(ids.data(), DType::kINT32, {2, 2}), wv(w.data(), DType::kFP32, {2, 2});
  RouterConfig c;
  auto expect = [](absl::Status s, absl::string_view what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(what), absl::string_view::npos) << s;
  };
  EXPECT_TRUE(Route(c, xv, gv, {}, iv, wv).ok());
  expect(Route(c, TensorView(x.data(), DType::kFP32, {4, 4}), gv, {}, iv, wv), "hidden_states");
  expect(Route(c, xv, TensorView(g.data(), DType::kFP32, {32}), {}, iv, wv), "gate weight");
  expect(Route(c, xv, TensorView(g.data(), DType::kINT32, {4, 8}), {}, iv, wv), "gate weight");
  expect(Route(c, xv, gv, {}, TensorView(ids64.data(), DType::kINT64, {2, 2}), wv), "topk_ids");
  expect(Route(c, xv, gv, {}, iv, TensorView(w.data(), DType::kFP32, {1, 2})), "topk_weights");
  c.correction_bias = true;
  expect(Route(c, xv, gv, {}, iv, wv), "e_score_correction_bias");
  c.correction_bias = false;
  c.n_group = 3;
  expect(Route(c, xv, gv, {}, iv, wv), "n_group");
}

ModelConfig SmallModel() {
  ModelConfig m = *ModelPreset("tiny");
  m.num_layers = 3;
  m.moe_layers = {1, 2};
  m.hidden = 32;
  m.num_experts = 16;
  m.topk = 4;
  return m;
}

TEST(RouterTest, RouterPerLayerAndSyntheticGates) {
  ModelConfig model = SmallModel();
  ASSERT_TRUE(model.router.has_value());
  auto router = CreateSyntheticRouter(model, /*seed=*/5, /*num_threads=*/2);
  ASSERT_TRUE(router.ok()) << router.status();
  EXPECT_TRUE((*router)->gate(0).empty());
  const TensorView g1 = (*router)->gate(1);
  ASSERT_EQ(g1.shape(), (Shape{16, 32}));
  EXPECT_EQ(g1.data<float>()[3 * 32 + 7], SyntheticWeight(5, 1, 3, 2, 7, 32));
  EXPECT_NE(g1.data<float>()[0], (*router)->gate(2).data<float>()[0]);

  std::mt19937 rng(11);
  Tensor x = testing::RandomNormal({5, 32}, rng);
  std::vector<int32_t> ids(20);
  std::vector<float> w(20);
  const TensorView iv(ids.data(), DType::kINT32, {5, 4}), wv(w.data(), DType::kFP32, {5, 4});
  EXPECT_EQ((*router)->Route(0, x.view(), iv, wv).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*router)->Route(2, x.view(), iv, wv).ok());
  std::vector<float> xs(x.data<float>(), x.data<float>() + x.numel());
  const TensorView g2 = (*router)->gate(2);
  std::vector<float> gs(g2.data<float>(), g2.data<float>() + g2.numel());
  auto want = RouteFp32(*model.router, xs, 5, gs, 16, 4);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(ids, want->ids);

  // DeepSeek-V3's preset: sigmoid with bias and groups; smaller sizes fall back to ungrouped.
  ModelConfig v3 = *ModelPreset("deepseek-v3");
  ASSERT_TRUE(v3.router.has_value());
  EXPECT_EQ(v3.router->n_group, 8);
  EXPECT_TRUE(v3.router->correction_bias);
  ModelOverrides o;
  o.num_experts = 12;
  o.hidden = 16;
  o.num_layers = 1;
  auto small = ApplyOverrides(v3, o);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->router->n_group, 1);
  EXPECT_EQ(small->router->scoring, RouterScoring::kSigmoid);
  auto sr = CreateSyntheticRouter(*small, 1, 1);
  ASSERT_TRUE(sr.ok());
  EXPECT_FALSE((*sr)->bias(0).empty());
  EXPECT_EQ((*sr)->bias(0).data<float>()[4], SyntheticWeight(1, 0, 4, 3, 0, 100));
}

TEST(RouterTest, CreateRefusesMismatchedGates) {
  ModelConfig model = SmallModel();
  std::vector<Tensor> one;
  one.push_back(Tensor::Zeros(DType::kFP32, {16, 32}));
  EXPECT_EQ(Router::Create(*model.router, model, std::move(one), {}, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<Tensor> wrong;
  wrong.push_back(Tensor::Zeros(DType::kFP32, {16, 32}));
  wrong.push_back(Tensor::Zeros(DType::kFP32, {16, 31}));
  EXPECT_EQ(Router::Create(*model.router, model, std::move(wrong), {}, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// config.json -> RouterConfig, per model_type.
TEST(RouterTest, HfConfigRouting) {
  const std::string sizes =
      R"("hidden_size": 64, "num_hidden_layers": 2, "moe_intermediate_size": 32,
         "intermediate_size": 96, "num_experts_per_tok": 4, )";
  auto parse = [&](const std::string& rest) {
    return checkpoint::ModelConfigFromHfConfigJson("{" + sizes + rest + "}", "config.json", "m");
  };
  auto mixtral = parse(R"("model_type": "mixtral", "num_local_experts": 8)");
  ASSERT_TRUE(mixtral.ok()) << mixtral.status();
  ASSERT_TRUE(mixtral->router.has_value());
  EXPECT_EQ(mixtral->router->scoring, RouterScoring::kSoftmax);
  EXPECT_TRUE(mixtral->router->renormalize);

  auto qwen3 = parse(R"("model_type": "qwen3_moe", "num_experts": 16, "norm_topk_prob": true)");
  ASSERT_TRUE(qwen3.ok());
  EXPECT_TRUE(qwen3->router->renormalize);
  auto qwen2 = parse(R"("model_type": "qwen2_moe", "num_experts": 16)");
  ASSERT_TRUE(qwen2.ok());
  EXPECT_FALSE(qwen2->router->renormalize);

  auto v3 = parse(R"("model_type": "deepseek_v3", "n_routed_experts": 32, "n_group": 4,
                     "topk_group": 2, "routed_scaling_factor": 1.5, "first_k_dense_replace": 1)");
  ASSERT_TRUE(v3.ok()) << v3.status();
  ASSERT_TRUE(v3->router.has_value());
  EXPECT_EQ(v3->router->scoring, RouterScoring::kSigmoid);
  EXPECT_EQ(v3->router->n_group, 4);
  EXPECT_EQ(v3->router->topk_group, 2);
  EXPECT_TRUE(v3->router->correction_bias);
  EXPECT_TRUE(v3->router->renormalize);
  EXPECT_FLOAT_EQ(v3->router->routed_scaling_factor, 1.5f);

  // Groups that do not fit, unknown methods and model types: no router, with the reason.
  auto bad_groups = parse(R"("model_type": "deepseek_v3", "n_routed_experts": 32, "n_group": 5)");
  ASSERT_TRUE(bad_groups.ok());
  EXPECT_FALSE(bad_groups->router.has_value());
  EXPECT_NE(bad_groups->no_router_reason.find("n_group"), std::string::npos);
  auto v2 = parse(R"("model_type": "deepseek_v2", "n_routed_experts": 32,
                     "topk_method": "group_limited_greedy")");
  ASSERT_TRUE(v2.ok());
  EXPECT_FALSE(v2->router.has_value());
  EXPECT_NE(v2->no_router_reason.find("group_limited_greedy"), std::string::npos);
  auto other = parse(R"("model_type": "granitemoe", "num_local_experts": 8)");
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->router.has_value());
  EXPECT_NE(other->no_router_reason.find("granitemoe"), std::string::npos);
  // Keys of the wrong type are errors.
  EXPECT_EQ(parse(R"("model_type": "qwen3_moe", "num_experts": 16, "norm_topk_prob": "yes")")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moeserve
