// The in-process communicator, the rank threads and placements.
#include <atomic>
#include <chrono>
#include <numeric>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/comm/in_process_communicator.h"
#include "core/comm/rank_threads.h"
#include "core/cpu/all_to_all_prepare_finalize.h"
#include "core/placement.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

// Forwards to a real communicator; an all-gather of `corrupt_bytes` has its entry `index` (int64)
// replaced by `value` on every rank alike, as a broken or mismatched peer would announce it.
class CorruptingCommunicator final : public Communicator {
 public:
  CorruptingCommunicator(std::unique_ptr<Communicator> inner, int64_t corrupt_bytes, int index,
                         int64_t value)
      : inner_(std::move(inner)), bytes_(corrupt_bytes), index_(index), value_(value) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                         absl::Span<const int64_t> send_displs, void* recv,
                         absl::Span<const int64_t> recv_counts,
                         absl::Span<const int64_t> recv_displs) override {
    return inner_->AllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }
  absl::Status AllGather(const void* send, int64_t bytes, void* recv) override {
    absl::Status s = inner_->AllGather(send, bytes, recv);
    if (s.ok() && bytes * world_size() == bytes_) static_cast<int64_t*>(recv)[index_] = value_;
    return s;
  }
  absl::Status Barrier() override { return inner_->Barrier(); }
  void Abort(const absl::Status& cause) override { inner_->Abort(cause); }

 private:
  std::unique_ptr<Communicator> inner_;
  const int64_t bytes_;
  const int index_;
  const int64_t value_;
};

struct Group {
  std::shared_ptr<InProcessCommGroup> group;
  std::vector<std::unique_ptr<Communicator>> comms;
};

Group MakeGroup(int n, absl::Duration timeout = absl::Seconds(30)) {
  Group g;
  g.group = *InProcessCommGroup::Create(n, timeout);
  for (int r = 0; r < n; ++r) g.comms.push_back(g.group->MakeCommunicator(r));
  return g;
}

TEST(InProcessComm, AllToAllVMovesEveryPeersBytes) {
  for (int n : {1, 2, 5, 16}) {
    Group g = MakeGroup(n);
    RankThreads threads(n);
    std::mt19937 rng(n);
    // counts[s][d]: bytes s sends d, byte value = f(s, d, i).
    std::vector<std::vector<int64_t>> counts(n, std::vector<int64_t>(n));
    for (auto& row : counts) {
      for (auto& c : row) c = std::uniform_int_distribution<int>(0, 40)(rng);
    }
    auto value = [](int s, int d, int64_t i) { return static_cast<uint8_t>(s * 31 + d * 7 + i); };
    for (int iter = 0; iter < 3; ++iter) {
      auto statuses = threads.Run([&](int r) -> absl::Status {
        std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
        int64_t so = 0, ro = 0;
        for (int p = 0; p < n; ++p) {
          sc[p] = counts[r][p], sd[p] = so, so += sc[p];
          rc[p] = counts[p][r], rd[p] = ro, ro += rc[p];
        }
        std::vector<uint8_t> send(so), recv(ro, 0xee);
        for (int p = 0; p < n; ++p) {
          for (int64_t i = 0; i < sc[p]; ++i) send[sd[p] + i] = value(r, p, i + iter);
        }
        absl::Status s = g.comms[r]->AllToAllV(send.data(), sc, sd, recv.data(), rc, rd);
        if (!s.ok()) return s;
        for (int p = 0; p < n; ++p) {
          for (int64_t i = 0; i < rc[p]; ++i) {
            if (recv[rd[p] + i] != value(p, r, i + iter)) {
              return absl::InternalError(absl::StrCat("rank ", r, " byte ", i, " from ", p));
            }
          }
        }
        return absl::OkStatus();
      });
      for (const auto& s : statuses) EXPECT_TRUE(s.ok()) << s;
    }
  }
}

TEST(InProcessComm, AllGatherAndBarrier) {
  const int n = 7;
  Group g = MakeGroup(n);
  RankThreads threads(n);
  auto statuses = threads.Run([&](int r) -> absl::Status {
    const std::vector<int64_t> mine = {r, 10 * r};
    std::vector<int64_t> all;
    if (auto s = AllGatherCounts(*g.comms[r], mine, &all); !s.ok()) return s;
    for (int p = 0; p < n; ++p) {
      if (all[2 * p] != p || all[2 * p + 1] != 10 * p) return absl::InternalError("allgather");
    }
    return g.comms[r]->Barrier();
  });
  for (const auto& s : statuses) EXPECT_TRUE(s.ok()) << s;
}

TEST(InProcessComm, MissingPeerTimesOutOnEveryRank) {
  const int n = 3;
  Group g = MakeGroup(n, absl::Milliseconds(200));
  RankThreads threads(n);
  const auto t0 = std::chrono::steady_clock::now();
  auto statuses = threads.Run([&](int r) -> absl::Status {
    if (r == 2) return absl::OkStatus();  // never joins
    return g.comms[r]->Barrier();
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDeadlineExceeded) << statuses[r];
  }
  // Failed until reset, then usable again.
  EXPECT_FALSE(g.group->status().ok());
  g.group->Reset();
  statuses = threads.Run([&](int r) { return g.comms[r]->Barrier(); });
  for (const auto& st : statuses) EXPECT_TRUE(st.ok()) << st;
}

TEST(InProcessComm, ErrorOnOneRankAbortsTheCollectiveForAll) {
  const int n = 4;
  Group g = MakeGroup(n, absl::Seconds(60));
  RankThreads threads(n);
  const auto t0 = std::chrono::steady_clock::now();
  auto statuses = threads.Run([&](int r) -> absl::Status {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      absl::Status cause = absl::InvalidArgumentError("rank 1 exploded");
      g.comms[r]->Abort(cause);
      return cause;
    }
    std::vector<int64_t> all;
    return AllGatherCounts(*g.comms[r], std::vector<int64_t>{r}, &all);
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kAborted) << statuses[r];
    EXPECT_THAT(statuses[r].message(), HasSubstr("rank 1 exploded"));
  }
}

TEST(InProcessComm, MismatchedCountsAreInternalErrors) {
  const int n = 2;
  Group g = MakeGroup(n, absl::Seconds(60));
  RankThreads threads(n);
  auto statuses = threads.Run([&](int r) -> absl::Status {
    std::vector<uint8_t> send(8), recv(8);
    const std::vector<int64_t> sc = {4, 4}, d = {0, 4};
    const std::vector<int64_t> rc = r == 0 ? std::vector<int64_t>{4, 3} : sc;  // wrong
    return g.comms[r]->AllToAllV(send.data(), sc, d, recv.data(), rc, d);
  });
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kInternal) << statuses[0];
  EXPECT_FALSE(statuses[1].ok());
  g.group->Reset();
  // Mismatched collectives are caught too.
  statuses = threads.Run([&](int r) -> absl::Status {
    if (r == 0) return g.comms[r]->Barrier();
    int64_t x = 1, all[2];
    return g.comms[r]->AllGather(&x, sizeof(x), all);
  });
  for (const auto& s : statuses) EXPECT_FALSE(s.ok());
  EXPECT_THAT(g.group->status().message(), HasSubstr("collective mismatch"));
}

// A rank that finds a bad count returns at once; a slower peer still copying from every rank's
// send buffer must not read the failed rank's, freed by then (large enough that the allocator
// returns it to the system: a read after the free faults without a sanitizer too).
TEST(InProcessComm, AFailingRankKeepsItsBuffersUntilPeersStopReading) {
  const int n = 3;
  const int64_t big = int64_t{48} << 20, small = int64_t{40} << 20;  // over glibc's mmap bar
  Group g = MakeGroup(n, absl::Seconds(60));
  RankThreads threads(n);
  for (int round = 0; round < 3; ++round) {
    auto statuses = threads.Run([&](int r) -> absl::Status {
      // Ranks 0 and 1 send `big` to rank 1 (which copies them first), rank 2 sends `small`.
      std::vector<int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
      sc[1] = r == 2 ? small : big;
      std::vector<uint8_t> send(static_cast<size_t>(sc[1]), static_cast<uint8_t>(r + 1));
      std::vector<uint8_t> recv;
      if (r == 1) {
        rc = {big, big, small};
        rd = {0, big, 2 * big};
        recv.resize(static_cast<size_t>(2 * big + small));
      }
      if (r == 2) rc[0] = 1;  // rank 0 sends it nothing: rank 2 fails on its first peer
      absl::Status s = g.comms[r]->AllToAllV(send.data(), sc, sd, recv.data(), rc, rd);
      if (r == 1 && recv.back() != 3) return absl::DataLossError("rank 2's bytes did not arrive");
      return s;
    });
    EXPECT_EQ(statuses[2].code(), absl::StatusCode::kInternal) << statuses[2];
    EXPECT_THAT(statuses[2].message(), HasSubstr("which expects 1"));
    EXPECT_EQ(statuses[1].code(), absl::StatusCode::kAborted) << statuses[1];
    g.group->Reset();
  }
}

TEST(GatheredCounts, RefusesCountsOutsideTheBound) {
  const std::vector<int64_t> ok = {0, 3, 8, 1};
  EXPECT_TRUE(CheckGatheredCounts(ok, 2, 8, "t").ok());
  absl::Status s = CheckGatheredCounts({0, 3, 9, 1}, 2, 8, "t");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("rank 1 announced 9 in its count 0, expected 0 to 8"));
  s = CheckGatheredCounts({0, -1, 2, 1}, 2, 8, "t");
  EXPECT_THAT(s.message(), HasSubstr("rank 0 announced -1 in its count 1"));
  EXPECT_EQ(CheckGatheredCounts({0, 1, 2}, 2, 8, "t").code(), absl::StatusCode::kInternal);
}

// One small forward (3 tokens, top-2 of 4 experts, every token on both of 2 ranks) through
// AllToAllContiguous on in-process ranks whose all-gathers of `corrupt_bytes` carry `value` at
// int64 entry `index` (CorruptingCommunicator). Each rank's PlanChunks, then, with `prepare`,
// the Prepare of its one round; the ranks' statuses.
constexpr int kCorruptRanks = 2, kCorruptTokens = 3;
std::vector<absl::Status> RunCorruptedAllToAll(int64_t corrupt_bytes, int index, int64_t value,
                                               const AllToAllOptions& options, bool prepare) {
  constexpr int kTopk = 2, kExperts = 4, kHidden = 8;
  auto group = *InProcessCommGroup::Create(kCorruptRanks, absl::Seconds(30));
  auto placement =
      std::make_shared<const Placement>(*Placement::Contiguous(kExperts, kCorruptRanks));
  std::vector<std::unique_ptr<AllToAllContiguousPrepareAndFinalize>> pf;
  for (int r = 0; r < kCorruptRanks; ++r) {
    auto comm = std::make_shared<CorruptingCommunicator>(group->MakeCommunicator(r), corrupt_bytes,
                                                         index, value);
    pf.push_back(std::make_unique<AllToAllContiguousPrepareAndFinalize>(comm, placement, options));
  }
  RankThreads threads(kCorruptRanks);
  return threads.Run([&](int r) -> absl::Status {
    std::vector<float> x(kCorruptTokens * kHidden, 0.25f * (r + 1));
    std::vector<int32_t> ids = {0, 2, 1, 3, 2, 0};  // every token on both ranks
    std::vector<float> w(kCorruptTokens * kTopk, 0.5f);
    PrepareArgs args;
    args.hidden_states = TensorView(x.data(), DType::kFP32, {kCorruptTokens, kHidden});
    args.topk_ids = TensorView(ids.data(), DType::kINT32, {kCorruptTokens, kTopk});
    args.topk_weights = TensorView(w.data(), DType::kFP32, {kCorruptTokens, kTopk});
    args.num_experts = kExperts;
    args.num_local_experts = kExperts / kCorruptRanks;
    args.intermediate = 16;
    MOESERVE_ASSIGN_OR_RETURN(std::vector<int64_t> bounds, pf[r]->PlanChunks(args));
    if (!prepare) return absl::OkStatus();
    if (bounds.size() != 2) return absl::InternalError("expected one round");
    PreparedActivations prepared;
    return pf[r]->Prepare(args, &prepared);
  });
}

// A peer announcing more rows than it can send (a broken or mismatched rank) fails the forward
// on every rank with DATA_LOSS before any buffer is sized from the count (it used to size the
// receive buffer from it: a 2^40-row count ended the process).
TEST(GatheredCounts, AllToAllRefusesAnImpossiblePeerCountOnEveryRank) {
  constexpr int kTopk = 2;
  AllToAllOptions options;
  options.max_num_tokens_per_rank = kCorruptTokens;
  for (int64_t bad : {int64_t{1} << 40, int64_t{-5}, int64_t{kCorruptTokens * kTopk + 1}}) {
    // The count exchange gathers ranks x ranks int64: rank 1's count for rank 0 is `bad`.
    const std::vector<absl::Status> statuses = RunCorruptedAllToAll(
        kCorruptRanks * kCorruptRanks * 8, kCorruptRanks, bad, options, /*prepare=*/true);
    for (int r = 0; r < kCorruptRanks; ++r) {
      EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDataLoss) << bad << ": " << statuses[r];
      EXPECT_THAT(statuses[r].message(), HasSubstr(absl::StrCat("rank 1 announced ", bad)));
    }
  }
}

// The same for the round counts PlanChunks gathers (a round carries at least one token, so at
// most the forward's tokens): a 2^40-round count used to pad the plan to 2^40 rounds (bad_alloc).
TEST(GatheredCounts, AllToAllRefusesAnImpossibleRoundCountOnEveryRank) {
  AllToAllOptions options;
  options.max_num_tokens_per_rank = kCorruptTokens;
  options.max_rounds = kCorruptTokens;
  // The round exchange gathers one int64 per rank: rank 1's is 2^40.
  const std::vector<absl::Status> statuses =
      RunCorruptedAllToAll(kCorruptRanks * 8, 1, int64_t{1} << 40, options, /*prepare=*/false);
  for (int r = 0; r < kCorruptRanks; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDataLoss) << statuses[r];
    EXPECT_THAT(
        statuses[r].message(),
        HasSubstr("rounds: rank 1 announced 1099511627776 in its count 0, expected 0 to 3"));
  }
}

TEST(Placement, ContiguousRoundRobinAndExpertMap) {
  auto c = Placement::Contiguous(512, 16);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->name(), "contiguous");
  EXPECT_EQ(c->rank_experts(3).front(), 96);
  EXPECT_EQ(c->rank_experts(3).back(), 127);
  EXPECT_EQ(c->owner(100), 3);
  EXPECT_EQ(c->local_index(100), 4);
  const std::vector<int32_t> map = c->ExpertMap(3);
  EXPECT_EQ(map[100], 4);
  EXPECT_EQ(map[0], -1);
  EXPECT_EQ(std::count(map.begin(), map.end(), -1), 512 - 32);

  auto rr = Placement::RoundRobin(512, 16);
  ASSERT_TRUE(rr.ok());
  EXPECT_EQ(rr->owner(100), 100 % 16);
  EXPECT_EQ(rr->local_index(100), 100 / 16);
  EXPECT_EQ(rr->ExpertMap(4)[100], 6);

  EXPECT_FALSE(Placement::Contiguous(512, 3).ok());
  EXPECT_FALSE(Placement::ByName("random", 8, 2).ok());
}

TEST(Placement, ExplicitListsAreChecked) {
  auto p = Placement::FromRankExperts(4, {{3, 0}, {1, 2}});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->owner(0), 0);
  EXPECT_EQ(p->local_index(0), 1);
  EXPECT_EQ(p->name(), "custom");
  EXPECT_THAT(Placement::FromRankExperts(4, {{0, 1}, {1, 2, 3}}).status().message(),
              HasSubstr("expert 1 is listed by rank 0 and rank 1"));
  EXPECT_THAT(Placement::FromRankExperts(4, {{0, 1}, {2}}).status().message(),
              HasSubstr("expert 3 is hosted by no rank"));
  EXPECT_THAT(Placement::FromRankExperts(4, {{0, 1, 2, 7}, {3}}).status().message(),
              HasSubstr("outside [0, 4)"));
  EXPECT_FALSE(Placement::FromRankExperts(4, {{0, 1, 2, 3}, {}}).ok());
}

}  // namespace
}  // namespace moeserve
