// The host-side EP routing plan (core/ep_plan.h): hand-checked small cases with exact vectors,
// and random routings checked against a plain restatement of the specification.
#include "core/ep_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/placement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

template <typename T>
std::vector<T> Vec(absl::Span<const T> s) {
  return std::vector<T>(s.begin(), s.end());
}

Placement TwoRanksFourExperts() { return *Placement::Contiguous(4, 2); }  // {0,1} | {2,3}

TEST(PlanEpRounds, UnboundedChunksByTokenCount) {
  const Placement p = TwoRanksFourExperts();
  const std::vector<int32_t> ids = {0, 1, 2, 3, 0, 0, 1, 1, 3, 2};  // [5, 2], duplicates allowed
  auto b = PlanEpRounds(ids.data(), 5, 2, p, 2, /*bound_expert_rows=*/false);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(*b, ElementsAre(0, 2, 4, 5));
  b = PlanEpRounds(ids.data(), 4, 2, p, 2, false);
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(0, 2, 4));
  b = PlanEpRounds(ids.data(), 5, 2, p, 8, false);
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(0, 5));
}

TEST(PlanEpRounds, NoTokensIsOneEmptyBoundary) {
  const Placement p = TwoRanksFourExperts();
  for (bool bounded : {false, true}) {
    auto b = PlanEpRounds(nullptr, 0, 2, p, 4, bounded);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_THAT(*b, ElementsAre(0));
  }
}

TEST(PlanEpRounds, BoundedSplitsWhenAnExpertIsFull) {
  const Placement p = TwoRanksFourExperts();
  // cap 3: tokens 0-1 put 3 rows on expert 0; token 2 would make 4, so a round starts at 2.
  const std::vector<int32_t> ids = {0, 0, 0, 1, 0, 2, 1, 2};
  auto b = PlanEpRounds(ids.data(), 4, 2, p, 3, /*bound_expert_rows=*/true);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(*b, ElementsAre(0, 2, 4));
  // Unbounded, only the token count splits.
  b = PlanEpRounds(ids.data(), 4, 2, p, 3, false);
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(0, 3, 4));
  // The token cap still applies: cap 2 with distinct experts splits every 2 tokens.
  const std::vector<int32_t> spread = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1};
  b = PlanEpRounds(spread.data(), 5, 2, p, 2, true);
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(0, 2, 4, 5));
}

TEST(PlanEpRounds, RefusesATokenOverCapOnOneExpert) {
  const Placement p = TwoRanksFourExperts();
  const std::vector<int32_t> ids = {0, 1, 2, 3, 1, 1};
  auto b = PlanEpRounds(ids.data(), 3, 2, p, 1, /*bound_expert_rows=*/true);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(),
              HasSubstr("token 2 routes 2 times to expert 1, more than "
                        "max_num_tokens_per_rank=1 rows per expert and rank"));
  // With room for two rows it is served (in its own round).
  b = PlanEpRounds(ids.data(), 3, 2, p, 2, true);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(*b, ElementsAre(0, 2, 3));
}

TEST(PlanEpRounds, RefusesOutOfRangeIds) {
  const Placement p = TwoRanksFourExperts();
  for (int32_t bad : {4, -1}) {
    const std::vector<int32_t> ids = {0, 1, bad, 3};
    for (bool bounded : {false, true}) {
      auto b = PlanEpRounds(ids.data(), 2, 2, p, 8, bounded);
      EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(b.status().message(),
                  HasSubstr(absl::StrCat("expert id ", bad, " at [1, 0] outside [0, 4)")));
    }
  }
}

TEST(PadEpRounds, AppendsEmptyRounds) {
  std::vector<int64_t> b = {0, 2, 5};
  PadEpRounds(4, &b);
  EXPECT_THAT(b, ElementsAre(0, 2, 5, 5, 5));
  PadEpRounds(2, &b);  // already enough
  EXPECT_THAT(b, ElementsAre(0, 2, 5, 5, 5));
  std::vector<int64_t> empty = {0};
  PadEpRounds(2, &empty);
  EXPECT_THAT(empty, ElementsAre(0, 0, 0));
}

// Tokens: t0 -> experts {3, 0} (ranks 1, 0), t1 -> {1, 0} (rank 0 twice), t2 -> {2, 3} (rank 1).
const std::vector<int32_t> kIds = {3, 0, 1, 0, 2, 3};
const std::vector<float> kWeights = {0.5f, 0.25f, 0.125f, 2.0f, 4.0f, 8.0f};

TEST(BuildEpDispatchPlan, PerRankHandChecked) {
  const Placement p = TwoRanksFourExperts();
  auto plan = BuildEpDispatchPlan(kIds.data(), kWeights.data(), 3, 2, p, EpDispatchMode::kPerRank);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_src_tokens, 3);
  EXPECT_EQ(plan->topk, 2);
  EXPECT_THAT(plan->send_count, ElementsAre(2, 2));
  EXPECT_TRUE(plan->recv_count.empty());
  EXPECT_EQ(plan->num_send(), 4);
  // Rank 0's records (t0, t1), then rank 1's (t0, t2).
  EXPECT_THAT(Vec(plan->send_token()), ElementsAre(0, 1, 0, 2));
  EXPECT_THAT(Vec(plan->rec_ids()), ElementsAre(-1, 0, 1, 0, 1, -1, 0, 1));
  EXPECT_THAT(Vec(plan->rec_weights()),
              ElementsAre(0.5f, 0.25f, 0.125f, 2.0f, 0.5f, 0.25f, 4.0f, 8.0f));
  EXPECT_THAT(Vec(plan->comb_offsets()), ElementsAre(0, 2, 3, 4));
  EXPECT_THAT(Vec(plan->comb_slots()), ElementsAre(0, 2, 1, 3));
}

TEST(BuildEpDispatchPlan, PerRouteHandChecked) {
  const Placement p = TwoRanksFourExperts();
  auto plan = BuildEpDispatchPlan(kIds.data(), kWeights.data(), 3, 2, p, EpDispatchMode::kPerRoute);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->send_count, ElementsAre(3, 3));
  EXPECT_THAT(Vec(plan->send_token()), ElementsAre(0, 1, 1, 0, 2, 2));
  EXPECT_THAT(Vec(plan->rec_ids()), ElementsAre(-1, 0, 1, -1, -1, 0, 1, -1, 0, -1, -1, 1));
  EXPECT_THAT(Vec(plan->comb_offsets()), ElementsAre(0, 2, 4, 6));
  EXPECT_THAT(Vec(plan->comb_slots()), ElementsAre(0, 3, 1, 2, 4, 5));
}

TEST(BuildEpDispatchPlan, NoTokens) {
  const Placement p = TwoRanksFourExperts();
  auto plan = BuildEpDispatchPlan(nullptr, nullptr, 0, 2, p, EpDispatchMode::kPerRank);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->send_count, ElementsAre(0, 0));
  EXPECT_EQ(plan->num_send(), 0);
  EXPECT_EQ(plan->layout().words, 1);
  EXPECT_THAT(Vec(plan->comb_offsets()), ElementsAre(0));
}

TEST(BuildEpDispatchPlan, RefusesOutOfRangeIds) {
  const Placement p = TwoRanksFourExperts();
  const std::vector<int32_t> ids = {0, 1, 2, 7};
  const std::vector<float> w(4, 1.0f);
  for (EpDispatchMode mode : {EpDispatchMode::kPerRank, EpDispatchMode::kPerRoute}) {
    auto plan = BuildEpDispatchPlan(ids.data(), w.data(), 2, 2, p, mode);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(plan.status().message(), HasSubstr("expert id 7 at [1, 1] outside [0, 4)"));
  }
}

// The plan restated destination-major, as the specification reads: for each destination rank,
// for each token ascending, its record(s) to that rank.
struct NaivePlan {
  std::vector<int64_t> send_count;
  std::vector<int32_t> send_token, rec_ids, comb_offsets, comb_slots;
  std::vector<float> rec_weights;
};

NaivePlan Naive(const std::vector<int32_t>& ids, const std::vector<float>& w, int64_t m,
                int64_t topk, const Placement& p, EpDispatchMode mode) {
  NaivePlan n;
  n.send_count.assign(p.num_ranks(), 0);
  auto add = [&](int d, int64_t t, auto&& in) {
    ++n.send_count[d];
    n.send_token.push_back(static_cast<int32_t>(t));
    for (int64_t i = 0; i < topk; ++i) {
      const int32_t e = ids[t * topk + i];
      n.rec_ids.push_back(in(i) ? p.local_index(e) : -1);
      n.rec_weights.push_back(w[t * topk + i]);
    }
  };
  for (int d = 0; d < p.num_ranks(); ++d) {
    for (int64_t t = 0; t < m; ++t) {
      auto on_d = [&](int64_t i) { return p.owner(ids[t * topk + i]) == d; };
      if (mode == EpDispatchMode::kPerRank) {
        bool any = false;
        for (int64_t i = 0; i < topk; ++i) any = any || on_d(i);
        if (any) add(d, t, on_d);
      } else {
        for (int64_t j = 0; j < topk; ++j) {
          if (on_d(j)) add(d, t, [&](int64_t i) { return i == j; });
        }
      }
    }
  }
  n.comb_offsets.push_back(0);
  for (int64_t t = 0; t < m; ++t) {
    for (size_t s = 0; s < n.send_token.size(); ++s) {
      if (n.send_token[s] == t) n.comb_slots.push_back(static_cast<int32_t>(s));
    }
    n.comb_offsets.push_back(static_cast<int32_t>(n.comb_slots.size()));
  }
  return n;
}

Placement RandomPlacement(std::mt19937& rng, int experts, int ranks) {
  switch (rng() % 3) {
    case 0:
      return *Placement::Contiguous(experts, ranks);
    case 1:
      return *Placement::RoundRobin(experts, ranks);
    default: {
      std::vector<int> perm(experts);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<std::vector<int>> lists(ranks);
      for (int i = 0; i < experts; ++i) lists[i < ranks ? i : rng() % ranks].push_back(perm[i]);
      return *Placement::FromRankExperts(experts, lists);
    }
  }
}

TEST(BuildEpDispatchPlan, RandomRoutingsMatchTheSpecification) {
  std::mt19937 rng(20261201);
  for (int iter = 0; iter < 200; ++iter) {
    const int ranks = 1 + rng() % 5;
    const int experts = ranks * (1 + rng() % 4);
    const Placement p = RandomPlacement(rng, experts, ranks);
    const int64_t m = rng() % 40, topk = 1 + rng() % 6;
    std::vector<int32_t> ids(m * topk);
    for (auto& e : ids) e = static_cast<int32_t>(rng() % experts);  // duplicates included
    std::vector<float> w(m * topk);
    for (auto& x : w) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    for (EpDispatchMode mode : {EpDispatchMode::kPerRank, EpDispatchMode::kPerRoute}) {
      SCOPED_TRACE(absl::StrCat("iter ", iter, " mode ", static_cast<int>(mode)));
      auto plan = BuildEpDispatchPlan(ids.data(), w.data(), m, topk, p, mode);
      ASSERT_TRUE(plan.ok()) << plan.status();
      const NaivePlan want = Naive(ids, w, m, topk, p, mode);
      EXPECT_THAT(plan->send_count, ElementsAreArray(want.send_count));
      EXPECT_THAT(Vec(plan->send_token()), ElementsAreArray(want.send_token));
      EXPECT_THAT(Vec(plan->rec_ids()), ElementsAreArray(want.rec_ids));
      EXPECT_THAT(Vec(plan->rec_weights()), ElementsAreArray(want.rec_weights));
      EXPECT_THAT(Vec(plan->comb_offsets()), ElementsAreArray(want.comb_offsets));
      EXPECT_THAT(Vec(plan->comb_slots()), ElementsAreArray(want.comb_slots));
      // The block is the device layout, and a caller's block gets the same plan.
      const EpPlanLayout l = plan->layout();
      EXPECT_EQ(l.words, 2 * plan->num_send() * (1 + topk) + m + 1);
      EXPECT_EQ(plan->block(), static_cast<const void*>(plan->send_token().data()));
      auto routing = RouteEpTokens(ids.data(), m, topk, p, mode);
      ASSERT_TRUE(routing.ok());
      EXPECT_EQ(routing->send_count, plan->send_count);
      std::vector<int32_t> block(l.words + 1, 12345);  // one guard word
      const EpDispatchPlan outside =
          FillEpDispatchPlan(*routing, ids.data(), w.data(), p, block.data());
      EXPECT_EQ(outside.block(), static_cast<const void*>(block.data()));
      EXPECT_EQ(0, std::memcmp(block.data(), plan->block(), l.words * 4));
      EXPECT_EQ(block[l.words], 12345);
    }
  }
}

TEST(PlanEpRounds, RandomRoutingsAreGreedyAndWithinCapacity) {
  std::mt19937 rng(777);
  for (int iter = 0; iter < 300; ++iter) {
    const int experts = 2 + rng() % 12;
    const Placement p = *Placement::RoundRobin(experts, 1 + (rng() % 2) * (experts % 2 == 0));
    const int64_t m = rng() % 60, topk = 1 + rng() % 4, cap = 1 + rng() % 6;
    std::vector<int32_t> ids(m * topk);
    for (auto& e : ids) e = static_cast<int32_t>(rng() % experts);
    SCOPED_TRACE(absl::StrCat("iter ", iter, " m ", m, " topk ", topk, " cap ", cap));
    // rows(b, e): routes of tokens [b, e) per expert; fits: a valid round.
    auto fits = [&](int64_t b, int64_t e) {
      if (e - b > cap) return false;
      std::vector<int64_t> rows(experts, 0);
      for (int64_t i = b * topk; i < e * topk; ++i) {
        if (++rows[ids[i]] > cap) return false;
      }
      return true;
    };
    bool over = false;
    for (int64_t t = 0; t < m; ++t) over = over || !fits(t, t + 1);
    auto b = PlanEpRounds(ids.data(), m, topk, p, cap, /*bound_expert_rows=*/true);
    if (over) {
      EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
      continue;
    }
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(b->front(), 0);
    ASSERT_EQ(b->back(), m);
    for (size_t r = 0; r + 1 < b->size(); ++r) {
      EXPECT_LT((*b)[r], (*b)[r + 1]);
      EXPECT_TRUE(fits((*b)[r], (*b)[r + 1])) << "round " << r;
      // Greedy: the next token would not have fit.
      if (r + 2 < b->size()) {
        EXPECT_FALSE(fits((*b)[r], (*b)[r + 1] + 1)) << "round " << r;
      }
    }
  }
}

TEST(ValidateEpPrepareArgs, ChecksShapesAndPlacement) {
  const Placement p = TwoRanksFourExperts();
  std::vector<float> x(3 * 8, 0.0f);
  std::vector<int32_t> ids = kIds;
  std::vector<float> w = kWeights;
  std::vector<int32_t> map = p.ExpertMap(1);
  PrepareArgs a;
  a.hidden_states = TensorView(x.data(), DType::kFP32, {3, 8});
  a.topk_ids = TensorView(ids.data(), DType::kINT32, {3, 2});
  a.topk_weights = TensorView(w.data(), DType::kFP32, {3, 2});
  a.num_experts = 4;
  a.num_local_experts = 2;
  a.expert_map = TensorView(map.data(), DType::kINT32, {4});
  EXPECT_TRUE(ValidateEpPrepareArgs("PF", a, p, 1).ok());
  // Rank 0's map on rank 1.
  std::vector<int32_t> other = p.ExpertMap(0);
  PrepareArgs bad = a;
  bad.expert_map = TensorView(other.data(), DType::kINT32, {4});
  absl::Status s = ValidateEpPrepareArgs("PF", bad, p, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("PF on rank 1: expert_map disagrees with the placement"));
  bad = a;
  bad.topk_weights = TensorView(ids.data(), DType::kINT32, {3, 2});
  s = ValidateEpPrepareArgs("PF", bad, p, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("PF: expected hidden_states [M, K]"));
  bad = a;
  bad.topk_ids = TensorView(ids.data(), DType::kINT32, {3, 1}, {2, 1});  // strided
  bad.topk_weights = TensorView(w.data(), DType::kFP32, {3, 1});
  EXPECT_EQ(ValidateEpPrepareArgs("PF", bad, p, 1).code(), absl::StatusCode::kInvalidArgument);
  bad = a;
  bad.num_experts = 8;
  s = ValidateEpPrepareArgs("PF", bad, p, 1);
  EXPECT_THAT(s.message(), HasSubstr("placement has 4 experts, 2 local; forward has 8 and 2"));
}

TEST(EpAllToAllVBytes, PacksInRankOrderAndCountsPeers) {
  const std::vector<int64_t> send = {2, 0, 3}, recv = {1, 4, 0};
  const EpAllToAllVBytes b(send, recv, 10);
  EXPECT_THAT(b.send_counts, ElementsAre(20, 0, 30));
  EXPECT_THAT(b.send_displs, ElementsAre(0, 20, 20));
  EXPECT_THAT(b.recv_counts, ElementsAre(10, 40, 0));
  EXPECT_THAT(b.recv_displs, ElementsAre(0, 10, 50));
  int64_t sent = 0, received = 0;
  b.CountPeerBytes(1, &sent, &received);
  EXPECT_EQ(sent, 50);
  EXPECT_EQ(received, 10);
}

}  // namespace
}  // namespace moeserve
