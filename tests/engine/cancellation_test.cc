// A forward whose caller gave up stops between its stages (issue 14 item 5: a forward kept
// running after its deadline): on one rank and on four CPU ranks exchanging tokens (every rank
// stops at the same point, no collective is left waiting), through the batcher, and the engine
// serves the next call correctly.
#include "core/cancellation.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <future>
#include <random>
#include <string>

#include "core/forward_batcher.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

// A stop check that gives up (with `code`) from its `n`-th evaluation on, counting them.
StopCheck GiveUpAt(int n, std::atomic<int>* evaluations,
                   absl::StatusCode code = absl::StatusCode::kDeadlineExceeded) {
  return [n, evaluations, code]() {
    return ++*evaluations >= n ? absl::Status(code, "the caller gave up") : absl::OkStatus();
  };
}

struct Inputs {
  Tensor x, ids, w;
  ForwardInput View(int layer = 0) const {
    return ForwardInput{layer, x.view(), ids.view(), w.view()};
  }
};

Inputs RandomInputs(const ModelConfig& m, int64_t tokens, std::mt19937& rng) {
  Inputs in;
  in.x = testing::RandomNormal({tokens, m.hidden}, rng);
  in.ids = testing::MakeRouting(testing::Routing::kUniform, tokens, m.topk, m.num_experts, rng);
  in.w = testing::RandomTopkWeights(tokens, m.topk, rng);
  return in;
}

TEST(CancellationTest, StopLatchGivesEveryRankTheSameVerdict) {
  std::atomic<int> evaluations{0};
  StopLatch latch(GiveUpAt(3, &evaluations));
  EXPECT_TRUE(latch.Check(0, "a").ok());  // evaluated: 1
  EXPECT_TRUE(latch.Check(0, "a").ok());  // a peer at the same point: same verdict
  EXPECT_TRUE(latch.Check(1, "b").ok());  // evaluated: 2
  absl::Status s = latch.Check(2, "c");   // evaluated: 3, stops
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(IsAgreedStepFailure(s));
  EXPECT_TRUE(latch.Check(1, "b").ok());  // a slower peer still passes b, as the first did
  EXPECT_EQ(latch.Check(2, "c").code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(latch.Check(5, "d").code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(evaluations, 3);
  EXPECT_EQ(latch.stopped().message(), "the caller gave up (stopped before c)");
  EXPECT_FALSE(IsAgreedStepFailure(latch.stopped()));
}

TEST(CancellationTest, OneRankStopsAtEachStageAndServesOn) {
  auto engine = *Engine::Create(engine_testing::TinyOptions("blas"));
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(21);
  const Inputs in = RandomInputs(m, 24, rng);
  Tensor want = Tensor::Empty(DType::kFP32, {24, m.hidden});
  ASSERT_TRUE(engine->Forward(in.View(), want.view()).ok());
  // Evaluations: 1 once the engine is free, then before prepare, experts, finalize.
  const char* where[] = {"before the engine ran", "stopped before prepare of round 1/1",
                         "stopped before experts of round 1/1",
                         "stopped before finalize of round 1/1"};
  for (int n = 1; n <= 4; ++n) {
    std::atomic<int> evaluations{0};
    Tensor out = Tensor::Empty(DType::kFP32, {24, m.hidden});
    absl::Status s = engine->Forward(in.View(), out.view(), nullptr, GiveUpAt(n, &evaluations));
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << n;
    EXPECT_THAT(s.message(), HasSubstr(where[n - 1]));
    EXPECT_EQ(evaluations, n);
    EXPECT_TRUE(engine->healthy());
  }
  // Never giving up: the answer is the one without a check.
  std::atomic<int> evaluations{0};
  Tensor out = Tensor::Empty(DType::kFP32, {24, m.hidden});
  ASSERT_TRUE(engine->Forward(in.View(), out.view(), nullptr, GiveUpAt(100, &evaluations)).ok());
  EXPECT_EQ(evaluations, 4);
  EXPECT_EQ(std::memcmp(out.data<void>(), want.data<void>(), want.nbytes()), 0);
}

// Four ranks exchanging tokens in two rounds each: stopping before the experts of round 2 (after
// one full round of collectives) leaves the communicators intact.
TEST(CancellationTest, FourRanksStopTogetherBetweenRoundsAndServeOn) {
  for (const char* pf : {"all2all_contiguous", "all2all_batched"}) {
    SCOPED_TRACE(pf);
    EngineOptions o = engine_testing::SeedMegaMoe(
        4, pf, std::string(pf) == "all2all_batched" ? "batched_blas" : "blas");
    o.max_tokens_per_rank = 8;
    o.collective_timeout_ms = 60000;
    auto engine = Engine::Create(o);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const ModelConfig& m = (*engine)->info().model;
    std::mt19937 rng(5);
    const Inputs in = RandomInputs(m, 64, rng);  // 16 tokens per rank: two rounds of 8
    Tensor want = Tensor::Empty(DType::kFP32, {64, m.hidden});
    ASSERT_TRUE((*engine)->Forward(in.View(), want.view()).ok());
    // 1: engine free; 2-4: round 1's stages; 5: prepare of round 2; 6: experts of round 2.
    std::atomic<int> evaluations{0};
    Tensor out = Tensor::Empty(DType::kFP32, {64, m.hidden});
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = (*engine)->Forward(in.View(), out.view(), nullptr,
                                        GiveUpAt(6, &evaluations, absl::StatusCode::kCancelled));
    // Quickly: no rank waited for a collective timeout.
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30);
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_THAT(s.message(), HasSubstr("stopped before experts of round 2/2"));
    EXPECT_EQ(evaluations, 6);  // once per point, whichever rank came first
    EXPECT_TRUE((*engine)->healthy());
    Tensor again = Tensor::Empty(DType::kFP32, {64, m.hidden});
    ASSERT_TRUE((*engine)->Forward(in.View(), again.view()).ok());
    EXPECT_EQ(std::memcmp(again.data<void>(), want.data<void>(), want.nbytes()), 0);
  }
}

std::future<absl::Status> Submit(ForwardBatcher& batcher, const ForwardInput& in,
                                 const TensorView& out, std::function<bool()> cancelled) {
  auto promise = std::make_shared<std::promise<absl::Status>>();
  auto future = promise->get_future();
  batcher.Submit(in, out, absl::InfiniteFuture(), std::move(cancelled),
                 [promise](absl::Status s, const ForwardTimings&) { promise->set_value(s); });
  return future;
}

// Polls of `cancelled` for one call: before the step, once the engine is free, then before
// each stage. The call is cancelled from poll `n` on.
std::function<bool()> CancelledFrom(int n, std::atomic<int>* polls) {
  return [n, polls] { return ++*polls >= n; };
}

TEST(CancellationTest, BatcherStopsARunningCallItsClientCancelled) {
  auto engine = *Engine::Create(engine_testing::TinyOptions("reference"));
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_delay = absl::ZeroDuration()});
  std::mt19937 rng(8);
  const Inputs in = RandomInputs(m, 16, rng);
  Tensor out = Tensor::Empty(DType::kFP32, {16, m.hidden});
  std::atomic<int> polls{0};
  absl::Status s = Submit(*batcher, in.View(), out.view(), CancelledFrom(4, &polls)).get();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_THAT(s.message(), HasSubstr("stopped before experts of round 1/1"));
  EXPECT_EQ(batcher->stats().stopped, 1);
  // Cancelled while queued: dropped before running, as before.
  polls = 0;
  s = Submit(*batcher, in.View(), out.view(), CancelledFrom(1, &polls)).get();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(s.message(), HasSubstr("before the call ran"));
  EXPECT_EQ(batcher->stats().dropped_cancelled, 1);
  // A deadline that passed while queued is DEADLINE_EXCEEDED.
  auto promise = std::make_shared<std::promise<absl::Status>>();
  batcher->Submit(in.View(), out.view(), absl::Now() - absl::Seconds(1), nullptr,
                  [promise](absl::Status st, const ForwardTimings&) { promise->set_value(st); });
  EXPECT_EQ(promise->get_future().get().code(), absl::StatusCode::kDeadlineExceeded);
  // The engine serves on: the answer equals the engine's alone.
  Tensor want = Tensor::Empty(DType::kFP32, {16, m.hidden});
  ASSERT_TRUE(engine->Forward(in.View(), want.view()).ok());
  ASSERT_TRUE(Submit(*batcher, in.View(), out.view(), nullptr).get().ok());
  EXPECT_EQ(std::memcmp(out.data<void>(), want.data<void>(), want.nbytes()), 0);
}

// A merged step stops only when every one of its calls gave up; then each hears its own reason.
TEST(CancellationTest, MergedStepStopsOnlyWhenAllCallsGaveUp) {
  auto engine = *Engine::Create(engine_testing::TinyOptions("reference"));
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(), {.max_batch_tokens = 64, .max_batch_delay = absl::Milliseconds(200)});
  std::mt19937 rng(9);
  const Inputs a = RandomInputs(m, 8, rng), b = RandomInputs(m, 8, rng);
  Tensor out_a = Tensor::Empty(DType::kFP32, {8, m.hidden});
  Tensor out_b = Tensor::Empty(DType::kFP32, {8, m.hidden});
  // One call gives up early, the other never: the step runs to the end and both are answered.
  std::atomic<int> polls_a{0};
  auto fa = Submit(*batcher, a.View(), out_a.view(), CancelledFrom(2, &polls_a));
  auto fb = Submit(*batcher, b.View(), out_b.view(), nullptr);
  ASSERT_TRUE(fb.get().ok());
  EXPECT_TRUE(fa.get().ok());
  Tensor want_b = Tensor::Empty(DType::kFP32, {8, m.hidden});
  ASSERT_TRUE(engine->Forward(b.View(), want_b.view()).ok());
  EXPECT_EQ(std::memcmp(out_b.data<void>(), want_b.data<void>(), want_b.nbytes()), 0);
  // Both give up once running: the step stops, each call hears CANCELLED.
  std::atomic<int> pa{0}, pb{0};
  fa = Submit(*batcher, a.View(), out_a.view(), CancelledFrom(2, &pa));
  fb = Submit(*batcher, b.View(), out_b.view(), CancelledFrom(2, &pb));
  const absl::Status sa = fa.get(), sb = fb.get();
  EXPECT_EQ(sa.code(), absl::StatusCode::kCancelled) << sa;
  EXPECT_EQ(sb.code(), absl::StatusCode::kCancelled) << sb;
  EXPECT_THAT(sa.message(), HasSubstr("gave up"));
  EXPECT_GE(batcher->stats().merged_calls, 4);
}

}  // namespace
}  // namespace moeserve
