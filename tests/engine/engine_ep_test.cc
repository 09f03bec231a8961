// Engine-level expert parallelism: 16 ranks serving a seed-megamoe-shaped model (512 experts,
// top-8; small hidden/intermediate) against the single-rank reference engine with BF16 input
// (relative L2 error < 1e-2), placement reporting, per-rank weight access, and failure handling.
#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using ep_testing::Routing;
using ::testing::HasSubstr;

constexpr double kBf16Tolerance = 1e-2;

using engine_testing::SeedMegaMoe;

using ep_testing::Bf16ToFloats;
using ep_testing::ToBf16;

TEST(EngineEp, SixteenRanksMatchSingleRankReference) {
  auto reference = Engine::Create(SeedMegaMoe(1, "no_ep", "reference"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  const ModelConfig& model = (*reference)->info().model;
  ASSERT_EQ(model.num_experts, 512);
  ASSERT_EQ(model.topk, 8);
  for (const auto& [pf, ex] : std::vector<std::pair<std::string, std::string>>{
           {"auto", "blas"}, {"all2all_batched", "batched_blas"}}) {
    auto engine = Engine::Create(SeedMegaMoe(16, pf, ex));
    ASSERT_TRUE(engine.ok()) << engine.status();
    const EngineInfo& info = (*engine)->info();
    EXPECT_EQ(info.num_ranks, 16);
    EXPECT_EQ(info.placement, "contiguous");
    ASSERT_EQ(info.rank_experts.size(), 16u);
    EXPECT_EQ(info.rank_experts[15].front(), 480);
    EXPECT_EQ(info.threads_per_rank, 1);
    std::mt19937 rng(99);
    for (Routing routing : {Routing::kUniform, Routing::kBalancedAffine, Routing::kHotExpert}) {
      SCOPED_TRACE(absl::StrCat(info.prepare_finalize, " ", ep_testing::RoutingName(routing)));
      const int64_t m = 64;
      const Tensor x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
      const Tensor ids = ep_testing::MakeRouting(routing, m, model.topk, model.num_experts,
                                                 info.rank_experts[7], rng);
      const Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
      ForwardInput in{
          .layer = 0, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
      Tensor got = Tensor::Empty(DType::kBF16, {m, model.hidden});
      Tensor want = Tensor::Empty(DType::kBF16, {m, model.hidden});
      ForwardTimings timings;
      ASSERT_TRUE((*engine)->Forward(in, got.view(), &timings).ok());
      ASSERT_TRUE((*reference)->Forward(in, want.view()).ok());
      const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
      EXPECT_LT(ep_testing::RelativeL2Error(g.data(), r.data(), g.size()), kBf16Tolerance);
      EXPECT_EQ(timings.rank_stages.size(), 16u);
      EXPECT_GT(timings.stages.transfer.dispatch_bytes_sent, 0);
    }
  }
}

TEST(EngineEp, ExpertWeightsAreServedByTheirOwnerRank) {
  auto one = Engine::Create(SeedMegaMoe(1, "auto", "blas"));
  EngineOptions o = SeedMegaMoe(8, "auto", "blas");
  o.placement = "round_robin";
  auto eight = Engine::Create(o);
  ASSERT_TRUE(one.ok() && eight.ok());
  EXPECT_EQ((*eight)->info().placement, "round_robin");
  EXPECT_EQ((*eight)->info().rank_experts[3][2], 3 + 2 * 8);
  const int64_t h = 128, n = 64;
  for (int expert : {0, 77, 511}) {
    std::vector<uint16_t> a13(2 * n * h), a2(h * n), b13(2 * n * h), b2(h * n);
    ASSERT_TRUE((*one)->GetExpertWeightsBf16(0, expert, a13.data(), a2.data()).ok());
    ASSERT_TRUE((*eight)->GetExpertWeightsBf16(0, expert, b13.data(), b2.data()).ok());
    EXPECT_EQ(a13, b13);
    EXPECT_EQ(a2, b2);
  }
}

TEST(EngineEp, BadOptionsAreRefused) {
  EngineOptions o = SeedMegaMoe(3, "auto", "blas");
  EXPECT_THAT(Engine::Create(o).status().message(), HasSubstr("must be >= 1 and divide"));
  o = SeedMegaMoe(4, "no_ep", "blas");
  EXPECT_THAT(Engine::Create(o).status().message(), HasSubstr("single rank"));
  o = SeedMegaMoe(4, "auto", "blas");
  o.placement = "zigzag";
  EXPECT_THAT(Engine::Create(o).status().message(), HasSubstr("placement"));
  o = SeedMegaMoe(4, "all2all_batched", "blas");
  auto s = Engine::Create(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("BatchedExperts activations but BlasExperts expects"));
}

// A rank that fails outside a collective must not leave its peers waiting; the root cause is
// returned and the next forward works.
TEST(EngineEp, OneRankFailingAbortsAllAndRecovers) {
  EngineOptions o = SeedMegaMoe(4, "all2all_batched", "batched_reference");
  o.max_tokens_per_rank = 1;
  o.collective_timeout_ms = 60000;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::mt19937 rng(1);
  const int64_t m = 8, hidden = 128;
  const Tensor x = ep_testing::RandomNormal({m, hidden}, rng);
  Tensor ids = ep_testing::MakeRouting(Routing::kUniform, m, 8, 512, {}, rng);
  // Token 5 (rank 2's source slice) routes twice to one expert: more rows than a capacity of
  // one row per rank and expert allows, so rank 2 refuses before its first collective.
  ids.data<int32_t>()[5 * 8 + 1] = ids.data<int32_t>()[5 * 8];
  const Tensor w = ep_testing::RandomTopkWeights(m, 8, rng);
  Tensor out = Tensor::Empty(DType::kFP32, {m, hidden});
  ForwardInput in{
      .layer = 0, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = (*engine)->Forward(in, out.view());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 2"));
  ids.data<int32_t>()[5 * 8 + 1] = (ids.data<int32_t>()[5 * 8] + 1) % 512;
  for (int k = 2; k < 8; ++k) {
    if (ids.data<int32_t>()[5 * 8 + k] == ids.data<int32_t>()[5 * 8 + 1]) {
      ids.data<int32_t>()[5 * 8 + k] = (ids.data<int32_t>()[5 * 8 + k] + 7) % 512;
    }
  }
  s = (*engine)->Forward(in, out.view());
  EXPECT_TRUE(s.ok()) << s;
}

TEST(EngineEp, LateRankTimesOutAsUnavailableThenServesAgain) {
  EngineOptions o = SeedMegaMoe(4, "all2all_contiguous", "blas");
  o.collective_timeout_ms = 200;
  std::atomic<bool> late{false};
  o.fault_injection_for_testing = [&late](int rank) {
    if (rank == 3 && late) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    return absl::OkStatus();
  };
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::mt19937 rng(2);
  const int64_t m = 16, hidden = 128;
  const Tensor x = ep_testing::RandomNormal({m, hidden}, rng);
  const Tensor ids = ep_testing::MakeRouting(Routing::kUniform, m, 8, 512, {}, rng);
  const Tensor w = ep_testing::RandomTopkWeights(m, 8, rng);
  Tensor out = Tensor::Empty(DType::kFP32, {m, hidden});
  ForwardInput in{
      .layer = 0, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
  late = true;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = (*engine)->Forward(in, out.view());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  // The server's failure, not the client's deadline: UNAVAILABLE with the cause kept.
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("DEADLINE_EXCEEDED"));
  late = false;
  s = (*engine)->Forward(in, out.view());
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace moeserve
