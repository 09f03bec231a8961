// The combination suite: every (PrepareAndFinalize, Experts) pair of one backend in the provider
// registry, compatibility decided by core's CheckCompatible on instances the providers build
// (after each provider's Supports); every compatible pair runs through the Engine at R in
// {1, 2, 4, 8, 16} ranks against the single-rank CPU ReferenceExperts, on E = 512 experts, top-8,
// hidden 64, intermediate 32, M in {0, 1, 7, 64, 300} and three routings. CPU (FP32
// activations): relative L2 error <= 1e-5; CUDA pairs (BF16 activations, 1e-2) run where enough
// GPUs exist and skip elsewhere. Incompatible pairs must be refused at construction with a
// reason.
#include <array>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/comm/in_process_communicator.h"
#include "core/engine.h"
#include "core/provider_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using ep_testing::Routing;
using ::testing::HasSubstr;

constexpr double kFp32Tolerance = 1e-5, kBf16Tolerance = 1e-2;
constexpr int kExperts = 512, kTopk = 8;
constexpr int64_t kHidden = 64, kIntermediate = 32;
constexpr uint64_t kWeightSeed = 11;

ModelConfig SuiteModel() {
  ModelConfig c;
  c.name = "ep-suite";
  c.num_layers = 1;
  c.num_experts = kExperts;
  c.topk = kTopk;
  c.hidden = kHidden;
  c.intermediate = kIntermediate;
  return c;
}

EngineOptions Options(const std::string& pf, const std::string& experts, int ranks,
                      const std::string& backend = "cpu") {
  EngineOptions o;
  o.model = SuiteModel();
  o.backend = backend;
  o.prepare_finalize = pf;
  o.experts = experts;
  o.num_ranks = ranks;
  o.seed = kWeightSeed;
  o.num_threads = 2;
  o.max_tokens_per_request = 1024;
  o.collective_timeout_ms = 120000;
  return o;
}

using engine_testing::RunForward;

// The single-rank oracle, shared by the cases of one process.
Engine& ReferenceEngine() {
  static Engine* engine = [] {
    auto e = Engine::Create(Options("no_ep", "reference", 1));
    EXPECT_TRUE(e.ok()) << e.status();
    return e->release();
  }();
  return *engine;
}

// Compatibility as core decides it, from instances the providers build for `ranks` ranks (CPU
// pairs; a GPU pair is decided by its providers' declarations). Returns the reason when
// incompatible (or when the PrepareAndFinalize cannot serve that many ranks).
absl::Status Compatibility(const std::string& pf_type, const std::string& experts_type, int ranks) {
  const ProviderRegistry& registry = ProviderRegistry::Global();
  const PrepareFinalizeProvider* pf = registry.FindPrepareFinalize(pf_type);
  const ExpertsProvider* experts = registry.FindExperts(experts_type);
  if (pf == nullptr || experts == nullptr) return absl::NotFoundError(pf_type + " " + experts_type);
  EnginePlan plan;
  plan.model = SuiteModel();
  plan.backend = pf->backend;
  plan.prepare_finalize = pf->name;
  plan.experts = experts->name;
  plan.local_ranks = plan.world_size = ranks;
  plan.max_tokens_per_rank = 64;
  auto placement = Placement::Contiguous(kExperts, ranks);
  if (!placement.ok()) return placement.status();
  plan.placement = std::make_shared<const Placement>(*placement);
  if (!pf->supports_ep && ranks > 1) {
    return absl::InvalidArgumentError(absl::StrCat(pf->name, " serves a single rank"));
  }
  if (absl::Status s = pf->Supports(plan); !s.ok()) return s;
  if (absl::Status s = experts->Supports(plan); !s.ok()) return s;
  if (pf->backend != Backend::kCpu) return CheckProvidersCompatible(*pf, *experts, plan);
  auto group = InProcessCommGroup::Create(ranks, absl::Seconds(10));
  if (!group.ok()) return group.status();
  RankResources rank;
  rank.comm = (*group)->MakeCommunicator(0);
  auto pf_instance = pf->create(plan, rank);
  if (!pf_instance.ok()) return pf_instance.status();
  auto experts_instance = experts->create(plan, rank);
  if (!experts_instance.ok()) return experts_instance.status();
  return CheckCompatible(**pf_instance, **experts_instance);
}

int VisibleGpus() {
  const BackendProvider* gpu = ProviderRegistry::Global().FindBackend(Backend::kCuda);
  return gpu != nullptr && gpu->visible_devices ? gpu->visible_devices() : 0;
}

using Combo = std::tuple<std::string, std::string, int>;

class CombinationTest : public ::testing::TestWithParam<Combo> {};

TEST_P(CombinationTest, MatchesReferenceOrIsRefused) {
  const auto& [pf_type, experts_type, ranks] = GetParam();
  const ExpertsProvider* provider = ProviderRegistry::Global().FindExperts(experts_type);
  ASSERT_NE(provider, nullptr);
  const bool gpu = provider->backend == Backend::kCuda;
  if (gpu && VisibleGpus() < ranks) GTEST_SKIP() << ranks << " GPUs needed";
  const double tolerance = gpu ? kBf16Tolerance : kFp32Tolerance;
  const absl::Status compat = Compatibility(pf_type, experts_type, ranks);
  auto engine = Engine::Create(
      Options(pf_type, experts_type, ranks, std::string(BackendName(provider->backend))));
  if (!compat.ok()) {
    // Refused at construction, saying why.
    ASSERT_FALSE(engine.ok()) << pf_type << " x " << experts_type
                              << " should be refused: " << compat;
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
    const bool single_rank = absl::StrContains(compat.message(), "serves a single rank");
    EXPECT_THAT(std::string(engine.status().message()),
                HasSubstr(single_rank ? "single rank" : std::string(compat.message())));
    EXPECT_FALSE(compat.message().empty());
    return;
  }
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->info().num_ranks, ranks);
  EXPECT_EQ((*engine)->info().prepare_finalize, pf_type);
  EXPECT_EQ((*engine)->info().experts, experts_type);
  // The hot rank: the last one, so that most routes cross ranks.
  const std::vector<int>& hot = (*engine)->info().rank_experts[ranks - 1];
  std::mt19937 rng(std::hash<std::string>()(absl::StrCat(pf_type, experts_type, ranks)));
  // GPU pairs also take BF16 and FP16 requests (converted on the device; the answer comes back
  // in that dtype), which the BF16 tolerance covers; CPU pairs stay on FP32 at 1e-5.
  int round = 0;
  for (Routing routing : {Routing::kUniform, Routing::kBalancedAffine, Routing::kHotExpert}) {
    for (int64_t m : {0, 1, 7, 64, 300}) {
      const DType dtype =
          gpu ? std::array{DType::kFP32, DType::kBF16, DType::kFP16}[round++ % 3] : DType::kFP32;
      SCOPED_TRACE(absl::StrCat(ep_testing::RoutingName(routing), " M=", m, " ", DTypeName(dtype)));
      const Tensor x32 = ep_testing::RandomNormal({m, kHidden}, rng);
      Tensor x = Tensor::Empty(dtype, {m, kHidden});
      ASSERT_TRUE(ConvertTensor(x32.view(), x.view()).ok());
      const Tensor ids = ep_testing::MakeRouting(routing, m, kTopk, kExperts, hot, rng);
      const Tensor w = ep_testing::RandomTopkWeights(m, kTopk, rng);
      ForwardTimings timings;
      const Tensor got = RunForward(**engine, x, ids, w, &timings);
      const Tensor want = RunForward(ReferenceEngine(), x, ids, w);
      EXPECT_LE(ep_testing::RelativeL2Error(got.data<float>(), want.data<float>(), m * kHidden),
                tolerance);
      if (m > 0 && ranks > 1 && !gpu) {
        // Something really crossed ranks, in both directions.
        EXPECT_GT(timings.stages.transfer.dispatch_bytes_sent, 0);
        EXPECT_EQ(timings.stages.transfer.dispatch_bytes_sent,
                  timings.stages.transfer.dispatch_bytes_received);
        EXPECT_EQ(timings.stages.transfer.combine_bytes_sent,
                  timings.stages.transfer.combine_bytes_received);
      }
    }
  }
}

// Every pair of providers of one backend, from the registry.
std::vector<Combo> AllCombos() {
  const ProviderRegistry& registry = ProviderRegistry::Global();
  std::vector<Combo> combos;
  for (const PrepareFinalizeProvider* pf : registry.prepare_finalizes()) {
    for (const ExpertsProvider* ex : registry.experts()) {
      if (ex->backend != pf->backend) continue;
      for (int r : {1, 2, 4, 8, 16}) combos.emplace_back(pf->name, ex->name, r);
    }
  }
  return combos;
}

INSTANTIATE_TEST_SUITE_P(AllPairs, CombinationTest, ::testing::ValuesIn(AllCombos()),
                         [](const ::testing::TestParamInfo<Combo>& info) {
                           return absl::StrCat(std::get<0>(info.param), "_x_",
                                               std::get<1>(info.param), "_R",
                                               std::get<2>(info.param));
                         });

// The expected compatibility table, so a change in declared formats is noticed.
TEST(CompatibilityTable, FormatsDecide) {
  const std::map<std::string, std::vector<std::string>> compatible = {
      {"NoEpPrepareAndFinalize", {"ReferenceExperts", "BlasExperts"}},
      {"AllToAllContiguous", {"ReferenceExperts", "BlasExperts"}},
      {"AllToAllBatched", {"BatchedReferenceExperts", "BatchedBlasExperts"}}};
  for (const PrepareFinalizeProvider* pf_provider :
       ProviderRegistry::Global().prepare_finalizes()) {
    if (pf_provider->backend != Backend::kCpu) continue;
    for (const ExpertsProvider* ex_provider : ProviderRegistry::Global().experts()) {
      if (ex_provider->backend != Backend::kCpu) continue;
      const std::string& pf = pf_provider->name;
      const std::string& ex = ex_provider->name;
      const auto& ok = compatible.at(pf);
      const bool want = std::find(ok.begin(), ok.end(), ex) != ok.end();
      EXPECT_EQ(Compatibility(pf, ex, 1).ok(), want) << pf << " x " << ex;
    }
  }
  const absl::Status s = Compatibility("AllToAllBatched", "BlasExperts", 2);
  EXPECT_THAT(s.message(), HasSubstr("AllToAllBatched produces BatchedExperts activations but "
                                     "BlasExperts expects Standard"));
  const absl::Status no_ep = Compatibility("NoEpPrepareAndFinalize", "BlasExperts", 4);
  EXPECT_EQ(no_ep.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_ep.message(), HasSubstr("single rank"));
}

// An Experts that cannot take remote (-1) routes must be refused under EP, saying why.
class NoExpertMapExperts final : public Experts {
 public:
  absl::string_view name() const override { return "NoExpertMapExperts"; }
  ActivationFormats activation_formats() const override {
    return {ActivationFormat::kStandard, ActivationFormat::kStandard};
  }
  bool supports_expert_map() const override { return false; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return DType::kFP32; }
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem&) const override { return {}; }
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind::kNoOp);
  }
  absl::Status Apply(const ExpertsApplyArgs&) override { return absl::OkStatus(); }
};

TEST(CompatibilityTable, ExpertMapRequiredUnderEp) {
  auto group = InProcessCommGroup::Create(2, absl::Seconds(1));
  ASSERT_TRUE(group.ok());
  EnginePlan plan;
  plan.world_size = 2;
  plan.max_tokens_per_rank = 64;
  plan.placement = std::make_shared<const Placement>(*Placement::Contiguous(kExperts, 2));
  RankResources rank;
  rank.comm = (*group)->MakeCommunicator(0);
  auto pf =
      ProviderRegistry::Global().FindPrepareFinalize("AllToAllContiguous")->create(plan, rank);
  ASSERT_TRUE(pf.ok());
  auto mk = ModularKernel::Create(std::move(*pf), std::make_unique<NoExpertMapExperts>());
  ASSERT_FALSE(mk.ok());
  EXPECT_EQ(mk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mk.status().message(), HasSubstr("does not support an expert map"));
}

// Round-robin and an explicit uneven placement (the EPLB seam) give the same answer.
TEST(Placements, RoundRobinAndExplicitMatchReference) {
  std::vector<EngineOptions> configs;
  for (const char* pf : {"all2all_contiguous", "all2all_batched"}) {
    EngineOptions o =
        Options(pf, std::string(pf) == "all2all_batched" ? "batched_blas" : "blas", 4);
    o.placement = "round_robin";
    configs.push_back(o);
    EngineOptions u =
        Options(pf, std::string(pf) == "all2all_batched" ? "batched_blas" : "blas", 3);
    u.rank_experts.resize(3);
    for (int e = 0; e < kExperts; ++e)
      u.rank_experts[e < 40 ? 0 : (e < 300 ? 1 : 2)].push_back(kExperts - 1 - e);
    configs.push_back(u);
  }
  std::mt19937 rng(5);
  for (const EngineOptions& o : configs) {
    auto engine = Engine::Create(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    SCOPED_TRACE(
        absl::StrCat((*engine)->info().prepare_finalize, " ", (*engine)->info().placement));
    for (Routing routing : {Routing::kUniform, Routing::kHotExpert}) {
      const int64_t m = 97;
      const Tensor x = ep_testing::RandomNormal({m, kHidden}, rng);
      const Tensor ids = ep_testing::MakeRouting(routing, m, kTopk, kExperts,
                                                 (*engine)->info().rank_experts[1], rng);
      const Tensor w = ep_testing::RandomTopkWeights(m, kTopk, rng);
      const Tensor got = RunForward(**engine, x, ids, w);
      const Tensor want = RunForward(ReferenceEngine(), x, ids, w);
      EXPECT_LE(ep_testing::RelativeL2Error(got.data<float>(), want.data<float>(), m * kHidden),
                kFp32Tolerance);
    }
  }
}

// No route is lost under hot-expert load: every token goes to one expert, with a capacity far
// below the load; the batch runs in rounds and still matches the reference.
TEST(Capacity, HotExpertOverCapacityIsChunkedNotTruncated) {
  for (const auto& [pf, ex] :
       std::vector<std::pair<std::string, std::string>>{{"all2all_batched", "batched_blas"},
                                                        {"all2all_batched", "batched_reference"},
                                                        {"all2all_contiguous", "blas"}}) {
    SCOPED_TRACE(pf + " x " + ex);
    EngineOptions o = Options(pf, ex, 4);
    o.max_tokens_per_rank = 4;  // batched: 16 rows per expert; the hot expert gets 300
    auto engine = Engine::Create(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::mt19937 rng(17);
    const int64_t m = 300;
    const Tensor x = ep_testing::RandomNormal({m, kHidden}, rng);
    Tensor ids = ep_testing::MakeRouting(Routing::kUniform, m, kTopk, kExperts, {}, rng);
    for (int64_t t = 0; t < m; ++t) {
      int32_t* row = ids.data<int32_t>() + t * kTopk;
      for (int k = 1; k < kTopk; ++k) {
        if (row[k] == 5) row[k] = row[0];
      }
      row[0] = 5;  // every token, one expert
    }
    const Tensor w = ep_testing::RandomTopkWeights(m, kTopk, rng);
    ForwardTimings timings;
    const Tensor got = RunForward(**engine, x, ids, w, &timings);
    const Tensor want = RunForward(ReferenceEngine(), x, ids, w);
    EXPECT_LE(ep_testing::RelativeL2Error(got.data<float>(), want.data<float>(), m * kHidden),
              kFp32Tolerance);
    EXPECT_GE(timings.stages.num_chunks, 75 / 4);  // 75 source tokens per rank, 4 a round
  }
}

// Duplicate expert ids within a token (two routes to one expert) are served, not dropped.
TEST(Capacity, DuplicateRoutesToOneExpert) {
  auto engine = Engine::Create(Options("all2all_batched", "batched_blas", 2));
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::mt19937 rng(3);
  const int64_t m = 40;
  const Tensor x = ep_testing::RandomNormal({m, kHidden}, rng);
  Tensor ids = ep_testing::MakeRouting(Routing::kUniform, m, kTopk, kExperts, {}, rng);
  for (int64_t t = 0; t < m; ++t)
    ids.data<int32_t>()[t * kTopk + 1] = ids.data<int32_t>()[t * kTopk];
  const Tensor w = ep_testing::RandomTopkWeights(m, kTopk, rng);
  const Tensor got = RunForward(**engine, x, ids, w);
  const Tensor want = RunForward(ReferenceEngine(), x, ids, w);
  EXPECT_LE(ep_testing::RelativeL2Error(got.data<float>(), want.data<float>(), m * kHidden),
            kFp32Tolerance);
}

}  // namespace
}  // namespace moeserve
