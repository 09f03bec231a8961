// The per-layer batcher over a CPU engine with ReferenceExperts (every token computed on its
// own, so a batched answer must equal the answer alone bit for bit).
#include "core/forward_batcher.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/background_release.h"
#include "gtest/gtest.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

struct Call {
  Tensor x, ids, w, out;
  int layer = 0;
  ForwardInput input() const { return ForwardInput{layer, x.view(), ids.view(), w.view()}; }
};

Call MakeCall(const ModelConfig& m, int64_t tokens, int layer, DType dtype, std::mt19937& rng) {
  Call c;
  c.layer = layer;
  Tensor f = testing::RandomNormal({tokens, m.hidden}, rng);
  c.x = Tensor::Empty(dtype, {tokens, m.hidden});
  EXPECT_TRUE(ConvertTensor(f.view(), c.x.view()).ok());
  c.ids = testing::MakeRouting(testing::Routing::kUniform, tokens, m.topk, m.num_experts, rng);
  c.w = testing::RandomTopkWeights(tokens, m.topk, rng);
  c.out = Tensor::Empty(dtype, {tokens, m.hidden});
  return c;
}

// Submits and returns a future of (status, timings).
std::future<std::pair<absl::Status, ForwardTimings>> SubmitAsync(
    ForwardBatcher& batcher, const Call& call, absl::Time deadline = absl::InfiniteFuture(),
    std::function<bool()> cancelled = nullptr, CallSource source = {}) {
  auto promise = std::make_shared<std::promise<std::pair<absl::Status, ForwardTimings>>>();
  auto future = promise->get_future();
  batcher.Submit(
      call.input(), call.out.view(), deadline, std::move(cancelled),
      [promise](absl::Status s, const ForwardTimings& t) {
        promise->set_value({std::move(s), t});
      },
      source);
  return future;
}

// steps_in_flight: the engine's lanes (0: its default, one on the CPU).
std::unique_ptr<Engine> ReferenceEngine(int steps_in_flight = 0) {
  EngineOptions o = engine_testing::TinyOptions("reference");
  o.max_tokens_per_request = 512;
  o.steps_in_flight = steps_in_flight;
  return *Engine::Create(o);
}

// Concurrent calls for one layer share steps, each gets exactly its rows (equal to running
// it alone), across dtypes and layers; steps never exceed max_batch_tokens.
TEST(ForwardBatcherTest, MergedCallsGetTheirOwnRowsBitForBit) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(), {.max_batch_tokens = 64, .max_batch_delay = absl::Milliseconds(50)});
  std::mt19937 rng(4);
  std::vector<Call> calls;
  const DType dtypes[] = {DType::kBF16, DType::kFP32};
  for (int i = 0; i < 12; ++i) {
    calls.push_back(MakeCall(m, 1 + i % 5 * 7, i % 2, dtypes[i / 6], rng));
  }
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
  for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
  for (size_t i = 0; i < calls.size(); ++i) {
    auto [status, timings] = futures[i].get();
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_GE(timings.queue_us, 0);
    Tensor alone = Tensor::Empty(calls[i].out.dtype(), calls[i].out.shape());
    ASSERT_TRUE(engine->Forward(calls[i].input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), calls[i].out.data<void>(), alone.nbytes()), 0)
        << "call " << i;
  }
  const ForwardBatcherStats stats = batcher->stats();
  EXPECT_EQ(stats.calls, 12);
  EXPECT_LT(stats.steps, 12);  // a 50 ms delay lets the quickly submitted calls meet
  EXPECT_GE(stats.merged_calls, 2);
  EXPECT_GE(stats.max_step_calls, 2);
  EXPECT_EQ(stats.queued_tokens, 0);
}

// A merged step is one engine call: it never exceeds the engine's max_tokens_per_request, even
// with a larger max_batch_tokens (the server test found 86-token steps against a 64 limit).
TEST(ForwardBatcherTest, StepsRespectTheEnginesTokenLimit) {
  EngineOptions o = engine_testing::TinyOptions("reference");
  o.max_tokens_per_request = 32;
  auto engine = *Engine::Create(o);
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(), {.max_batch_tokens = 4096, .max_batch_delay = absl::Milliseconds(50)});
  std::mt19937 rng(9);
  std::vector<Call> calls;
  for (int i = 0; i < 8; ++i) calls.push_back(MakeCall(m, 20 + i % 3 * 6, 0, DType::kBF16, rng));
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
  for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
  for (auto& f : futures) {
    const absl::Status s = f.get().first;
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(batcher->stats().calls, 8);
  EXPECT_EQ(batcher->stats().steps, 8);  // no two of 20-32 tokens fit in 32
}

// Bad input is refused alone at Submit, before it can join (and fail) a step.
TEST(ForwardBatcherTest, BadInputIsRefusedAloneWithTheEnginesMessage) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(engine.get(), {});
  std::mt19937 rng(5);
  Call bad = MakeCall(m, 3, 0, DType::kBF16, rng);
  bad.ids.data<int32_t>()[4] = static_cast<int32_t>(m.num_experts);
  auto [s, t] = SubmitAsync(*batcher, bad).get();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("topk_ids"), std::string::npos) << s;
  Call good = MakeCall(m, 3, 0, DType::kBF16, rng);
  Tensor wrong_out = Tensor::Empty(DType::kFP32, {3, m.hidden});
  std::promise<absl::Status> p;
  batcher->Submit(good.input(), wrong_out.view(), absl::InfiniteFuture(), nullptr,
                  [&p](absl::Status st, const ForwardTimings&) { p.set_value(st); });
  const absl::Status so = p.get_future().get();
  EXPECT_EQ(so.code(), absl::StatusCode::kInvalidArgument) << so;
  EXPECT_NE(so.message().find("output"), std::string::npos) << so;
  EXPECT_TRUE(SubmitAsync(*batcher, good).get().first.ok());
  EXPECT_EQ(batcher->stats().calls, 1);
}

struct CountingObserver : ForwardBatcherObserver {
  void OnStep(int64_t calls, int64_t tokens, int64_t) override {
    step_calls += calls;
    step_tokens += tokens;
  }
  void OnRefused(absl::StatusCode reason) override {
    if (reason == absl::StatusCode::kResourceExhausted) ++queue_full;
  }
  void OnLeadStep() override { ++lead_steps; }
  void OnCompanyMode(bool merging) override { merging_layers += merging ? 1 : -1; }
  std::atomic<int64_t> step_calls{0}, step_tokens{0}, queue_full{0}, lead_steps{0},
      merging_layers{0};
};

// Beyond max_queued_tokens a call is refused at once, naming the limit; nothing is lost; the
// observer (the server's metrics) sees the steps and the refusals.
TEST(ForwardBatcherTest, FullQueueRefusesWithResourceExhausted) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  CountingObserver observer;
  // A long delay keeps the first calls queued while the others arrive.
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 1000,
                                                        .max_batch_delay = absl::Milliseconds(300),
                                                        .max_queued_tokens = 40,
                                                        .observer = &observer});
  std::mt19937 rng(6);
  std::vector<Call> calls;
  for (int i = 0; i < 6; ++i) calls.push_back(MakeCall(m, 16, 0, DType::kBF16, rng));
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
  for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
  int ok = 0, refused = 0;
  for (auto& f : futures) {
    const absl::Status s = f.get().first;
    if (s.ok()) {
      ++ok;
    } else {
      ++refused;
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("max_queued_tokens=40"), std::string::npos) << s;
    }
  }
  EXPECT_EQ(ok, 2);  // 16 + 16 <= 40 < 48
  EXPECT_EQ(refused, 4);
  EXPECT_EQ(batcher->stats().refused_queue_full, 4);
  batcher.reset();  // the step's observer call has certainly returned
  EXPECT_EQ(observer.queue_full, 4);
  EXPECT_EQ(observer.step_calls, 2);
  EXPECT_EQ(observer.step_tokens, 32);
}

// A call whose deadline passed or that was cancelled while queued does not run.
TEST(ForwardBatcherTest, ExpiredAndCancelledCallsAreDroppedBeforeRunning) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(), {.max_batch_tokens = 1000, .max_batch_delay = absl::Milliseconds(100)});
  std::mt19937 rng(7);
  Call late = MakeCall(m, 4, 0, DType::kBF16, rng);
  Call gone = MakeCall(m, 4, 0, DType::kBF16, rng);
  Call fine = MakeCall(m, 4, 0, DType::kBF16, rng);
  std::atomic<bool> client_left{false};
  auto f_late = SubmitAsync(*batcher, late, absl::Now() + absl::Milliseconds(10));
  auto f_gone =
      SubmitAsync(*batcher, gone, absl::InfiniteFuture(), [&] { return client_left.load(); });
  auto f_fine = SubmitAsync(*batcher, fine);
  client_left = true;
  const absl::Status s_late = f_late.get().first, s_gone = f_gone.get().first;
  EXPECT_EQ(s_late.code(), absl::StatusCode::kDeadlineExceeded) << s_late;
  EXPECT_EQ(s_gone.code(), absl::StatusCode::kCancelled) << s_gone;
  EXPECT_TRUE(f_fine.get().first.ok());
  const ForwardBatcherStats stats = batcher->stats();
  EXPECT_EQ(stats.dropped_deadline, 1);
  EXPECT_EQ(stats.dropped_cancelled, 1);
  EXPECT_EQ(stats.calls, 1);
}

// The queue-wait bound: once the batcher knows what a step costs, a call that would wait
// longer than max_queue_wait behind the queue is refused at once (RESOURCE_EXHAUSTED naming
// the bound); the others are answered correctly; calls that fit the next step are taken.
TEST(ForwardBatcherTest, QueueWaitBoundRefusesWhatWouldWaitTooLong) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  // A long batch delay keeps the burst queued however slowly it is submitted (a loaded machine),
  // so every call after the first finds work queued ahead of it.
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 64,
                                                        .max_batch_delay = absl::Seconds(2),
                                                        .max_queue_wait = absl::Microseconds(1)});
  std::mt19937 rng(14);
  Call warm = MakeCall(m, 16, 0, DType::kFP32, rng);
  ASSERT_TRUE(SubmitAsync(*batcher, warm).get().first.ok());  // learns what a step costs
  std::vector<Call> calls;
  for (int i = 0; i < 8; ++i) calls.push_back(MakeCall(m, 16, 1, DType::kFP32, rng));
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
  for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
  int refused = 0, answered = 0;
  for (size_t i = 0; i < calls.size(); ++i) {
    const absl::Status s = futures[i].get().first;
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      EXPECT_NE(s.message().find("max_queue_wait"), std::string::npos) << s;
      ++refused;
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;
    ++answered;
    Tensor alone = Tensor::Empty(calls[i].out.dtype(), calls[i].out.shape());
    ASSERT_TRUE(engine->Forward(calls[i].input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), calls[i].out.data<void>(), alone.nbytes()), 0);
  }
  EXPECT_EQ(answered, 4);  // the first 64 tokens fit the next step; each later call waits a step
  EXPECT_EQ(refused, 4);
  EXPECT_EQ(batcher->stats().refused_queue_full, refused);
}

// A `cancelled` that holds the step of its call (its first evaluation, at the step's start)
// for `hold`, or until `gate` is ready, and never cancels.
std::function<bool()> HoldStep(absl::Duration hold, std::shared_future<void> gate = {}) {
  auto first = std::make_shared<std::atomic<bool>>(true);
  return [first, hold, gate] {
    if (first->exchange(false)) {
      if (gate.valid()) {
        gate.wait();
      } else {
        absl::SleepFor(hold);
      }
    }
    return false;
  };
}

// Teaches `batcher` what a step of 16 tokens costs: three such steps, each held for `hold`.
void LearnHeldSteps(ForwardBatcher& batcher, const ModelConfig& m, absl::Duration hold,
                    std::mt19937& rng) {
  for (int i = 0; i < 3; ++i) {
    Call warm = MakeCall(m, 16, 0, DType::kFP32, rng);
    ASSERT_TRUE(
        SubmitAsync(batcher, warm, absl::InfiniteFuture(), HoldStep(hold)).get().first.ok());
  }
}

// A step of 16 tokens of `layer` that runs, held, until Release(); running once constructed.
struct HeldStep {
  HeldStep(ForwardBatcher& batcher, const ModelConfig& m, int layer, std::mt19937& rng)
      : call(MakeCall(m, 16, layer, DType::kFP32, rng)),
        answer(SubmitAsync(batcher, call, absl::InfiniteFuture(),
                           HoldStep(absl::ZeroDuration(), release.get_future().share()))) {
    while (batcher.stats().running == 0) absl::SleepFor(absl::Microseconds(100));
  }
  std::promise<void> release;
  Call call;
  std::future<std::pair<absl::Status, ForwardTimings>> answer;
};

// `call`'s answer equals the engine's answer to it alone, bit for bit.
void ExpectSameAsAlone(Engine& engine, const Call& call) {
  Tensor alone = Tensor::Empty(call.out.dtype(), call.out.shape());
  ASSERT_TRUE(engine.Forward(call.input(), alone.view()).ok());
  EXPECT_EQ(std::memcmp(alone.data<void>(), call.out.data<void>(), alone.nbytes()), 0);
}

// A fresh batcher knows no step's cost and admits every call until its first step ends;
// Calibrate teaches it before any call: the same burst as above, with no warm-up call, is
// refused past the first step on the calibrated batcher and taken whole on the other.
TEST(ForwardBatcherTest, CalibrateBoundsTheFirstCalls) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  for (const bool calibrate : {false, true}) {
    SCOPED_TRACE(calibrate ? "calibrated" : "fresh");
    auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 64,
                                                          .max_batch_delay = absl::Seconds(2),
                                                          .max_queue_wait = absl::Microseconds(1)});
    if (calibrate) {
      ASSERT_TRUE(batcher->Calibrate({16, 64}, 3).ok());
      const ForwardBatcher::CostLine line = batcher->cost_line();
      EXPECT_EQ(line.steps, 4);  // two of each size learned, the first of each warmed up
      EXPECT_GT(line.fixed_us + line.per_token_us * 64, 0);
      EXPECT_EQ(batcher->stats().steps, 0);  // calibration is not traffic
    } else {
      EXPECT_EQ(batcher->cost_line().steps, 0);
    }
    std::mt19937 rng(16);
    std::vector<Call> calls;
    for (int i = 0; i < 8; ++i) calls.push_back(MakeCall(m, 16, 1, DType::kFP32, rng));
    std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
    for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
    int answered = 0;
    for (size_t i = 0; i < calls.size(); ++i) {
      const absl::Status s = futures[i].get().first;
      if (s.ok()) {
        ++answered;
        ExpectSameAsAlone(*engine, calls[i]);
      } else {
        EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      }
    }
    EXPECT_EQ(answered, calibrate ? 4 : 8);
  }
}

TEST(ForwardBatcherTest, CalibrateRefusesNoSizesAndASingleRound) {
  auto engine = ReferenceEngine();
  auto batcher = *ForwardBatcher::Create(engine.get(), {});
  EXPECT_EQ(batcher->Calibrate({}, 2).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status one = batcher->Calibrate({16}, 1);
  EXPECT_EQ(one.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(one.message().find("rounds >= 2"), std::string::npos) << one;
  // Sizes past the step limit are clamped to it (512 here), not refused.
  EXPECT_TRUE(batcher->Calibrate({0, 100000}, 2).ok());
  EXPECT_EQ(batcher->cost_line().steps, 2);
}

// Calibrate and WarmUp run on MoE layers only (a model whose layer 0 is dense refuses a step
// there), every lane gets each warm-up step, and neither counts as traffic.
TEST(ForwardBatcherTest, CalibrateAndWarmUpRunOnMoeLayers) {
  EngineOptions o = engine_testing::TinyOptions("reference");
  o.model.num_layers = 3;
  o.model.moe_layers = {1, 2};
  o.max_tokens_per_request = 512;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto batcher = *ForwardBatcher::Create(engine->get(), {.max_batch_tokens = 64});
  ASSERT_TRUE(batcher->Calibrate({4, 32}).ok());
  EXPECT_EQ(batcher->cost_line().steps, 2);
  ASSERT_TRUE(batcher->WarmUp({1, 8, 1000}, {1, 2}).ok());
  const absl::Status dense = batcher->WarmUp({8}, {0});
  EXPECT_EQ(dense.code(), absl::StatusCode::kInvalidArgument) << dense;
  EXPECT_EQ(batcher->stats().steps, 0);
  EXPECT_EQ(batcher->cost_line().steps, 2);  // warm-up steps are not learned
}

// The queue-wait bound counts the steps running: with the engine's one lane busy on a step
// that is expected to take about 100 ms, a call is refused even with nothing queued ahead of
// it (max_queue_wait 50 ms), and the same call is taken once the lane is free.
TEST(ForwardBatcherTest, QueueWaitBoundCountsTheStepsRunning) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(),
      {.max_batch_tokens = 64, .max_queue_wait = absl::Milliseconds(50), .inline_max_tokens = 0});
  std::mt19937 rng(15);
  // Steps of 16 tokens held 100 ms each: what the batcher learns a step costs.
  LearnHeldSteps(*batcher, m, absl::Milliseconds(100), rng);
  HeldStep running(*batcher, m, 0, rng);
  Call late = MakeCall(m, 16, 0, DType::kFP32, rng);
  auto late_answer = SubmitAsync(*batcher, late);
  // Refused at once; taken, it would wait for the release (then fail here, not hang).
  const bool answered_at_once =
      late_answer.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  running.release.set_value();
  ASSERT_TRUE(answered_at_once) << "the call was queued behind the running step";
  const absl::Status refused = late_answer.get().first;
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("1 steps running, 0 tokens queued"), std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find("max_queue_wait=50ms"), std::string::npos) << refused;
  ASSERT_TRUE(running.answer.get().first.ok());
  while (batcher->stats().running != 0) absl::SleepFor(absl::Microseconds(100));
  ASSERT_TRUE(SubmitAsync(*batcher, late).get().first.ok());
  ExpectSameAsAlone(*engine, late);
  EXPECT_EQ(batcher->stats().refused_queue_full, 1);
}

// A call larger than a step runs as a step of its own: on an idle batcher it is taken whatever
// the bound (the estimate once priced its tokens past the first step as full steps queued
// ahead of it, and refused every such call). (Behind a running step the wait depends on the
// step costs learned, which the large step itself changes: not asserted, it is timing.)
TEST(ForwardBatcherTest, QueueWaitBoundTakesALargeCallOnAnIdleBatcher) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(),
      {.max_batch_tokens = 64, .max_queue_wait = absl::Milliseconds(150), .inline_max_tokens = 0});
  std::mt19937 rng(19);
  // Steps of 16 tokens held 100 ms: a step of n tokens is priced at about 6 x n ms.
  LearnHeldSteps(*batcher, m, absl::Milliseconds(100), rng);
  Call large = MakeCall(m, 128, 0, DType::kFP32, rng);
  const absl::Status taken = SubmitAsync(*batcher, large).get().first;
  ASSERT_TRUE(taken.ok()) << taken;
  ExpectSameAsAlone(*engine, large);
  EXPECT_EQ(batcher->stats().refused_queue_full, 0);
}

// Calls of different layers never share a step: the queue-wait bound counts each layer's
// queued calls as a step ahead (the old estimate merged them all into one).
TEST(ForwardBatcherTest, QueueWaitBoundCountsAStepPerLayerQueued) {
  EngineOptions o = engine_testing::TinyOptions("reference");
  o.model.num_layers = 4;
  // Small layers: the held 100 ms, not the plain-loop experts (slow under sanitizers), is what
  // a step costs.
  o.model.hidden = 64;
  o.model.intermediate = 32;
  auto engine = *Engine::Create(o);
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(),
      {.max_batch_tokens = 64, .max_queue_wait = absl::Milliseconds(250), .inline_max_tokens = 0});
  std::mt19937 rng(17);
  // A step of 16 tokens takes a little over 100 ms; one of layer 3 runs (held) while the others
  // queue behind it.
  LearnHeldSteps(*batcher, m, absl::Milliseconds(100), rng);
  HeldStep running(*batcher, m, 3, rng);
  // Layers 0 and 1 would start after ~100 and ~200 ms: taken; layer 2 after ~300: refused at
  // once; another call of layer 0 joins that layer's step (layer 1's at most ahead): taken.
  std::vector<Call> calls;
  for (int layer : {0, 1, 2, 0}) calls.push_back(MakeCall(m, 16, layer, DType::kFP32, rng));
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> answers;
  for (const Call& c : calls) answers.push_back(SubmitAsync(*batcher, c));
  const bool refused_at_once =
      answers[2].wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  running.release.set_value();
  ASSERT_TRUE(refused_at_once);
  ASSERT_TRUE(running.answer.get().first.ok());
  for (size_t i = 0; i < calls.size(); ++i) {
    const absl::Status s = answers[i].get().first;
    if (i == 2) {
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      continue;
    }
    ASSERT_TRUE(s.ok()) << "call " << i << ": " << s;
    ExpectSameAsAlone(*engine, calls[i]);
  }
  EXPECT_EQ(batcher->stats().refused_queue_full, 1);
}

// lane_lead: on an engine of two lanes, a small call waits for the running step to end, unless
// that step is due to end within lane_lead (then the call's step starts beside it).
TEST(ForwardBatcherTest, LaneLeadStartsASmallStepBesideOneDueToEnd) {
  auto engine = ReferenceEngine(/*steps_in_flight=*/2);
  const ModelConfig& m = engine->info().model;
  for (const absl::Duration lead : {absl::ZeroDuration(), absl::Milliseconds(90)}) {
    SCOPED_TRACE(absl::StrCat("lane_lead ", absl::FormatDuration(lead)));
    CountingObserver observer;
    auto batcher = *ForwardBatcher::Create(
        engine.get(),
        {.max_batch_tokens = 64, .lane_lead = lead, .inline_max_tokens = 0, .observer = &observer});
    std::mt19937 rng(16);
    LearnHeldSteps(*batcher, m, absl::Milliseconds(100), rng);  // steps of 16 tokens: 100 ms
    HeldStep running(*batcher, m, 0, rng);
    Call small = MakeCall(m, 16, 0, DType::kFP32, rng);
    auto small_answer = SubmitAsync(*batcher, small);
    // The running step is held until released: only a step beside it can answer meanwhile.
    const bool beside = small_answer.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
    running.release.set_value();
    EXPECT_EQ(beside, lead > absl::ZeroDuration());
    ASSERT_TRUE(running.answer.get().first.ok());
    ASSERT_TRUE(small_answer.get().first.ok());
    ExpectSameAsAlone(*engine, small);
    // The lead step counted, in the stats and by the observer (the server's metrics).
    EXPECT_EQ(batcher->stats().lead_steps, lead > absl::ZeroDuration() ? 1 : 0);
    EXPECT_EQ(observer.lead_steps, batcher->stats().lead_steps);
  }
  EXPECT_EQ(ForwardBatcher::Create(engine.get(), {.lane_lead = absl::Seconds(2)}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A lead step waits for its cohort: with callers 1-3 in the layer's last two steps and caller
// 1's step running, caller 2 alone does not start beside it when the lead is due (one of the
// two expected back is missing); once caller 3 comes, both start beside the running step.
TEST(ForwardBatcherTest, LaneLeadWaitsForTheCohortItExpects) {
  auto engine = ReferenceEngine(/*steps_in_flight=*/2);
  const ModelConfig& m = engine->info().model;
  CountingObserver observer;
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 64,
                                                        .lane_lead = absl::Milliseconds(60),
                                                        .inline_max_tokens = 0,
                                                        .observer = &observer});
  std::mt19937 rng(21);
  LearnHeldSteps(*batcher, m, absl::Milliseconds(200), rng);  // steps of 16 tokens: 200 ms
  const absl::Duration hold = absl::Milliseconds(200);
  auto call_of = [&](uint64_t caller, std::function<bool()> cancelled, Call& c) {
    return SubmitAsync(*batcher, c, absl::InfiniteFuture(), std::move(cancelled),
                       CallSource{.caller = caller});
  };
  // History: caller 1's step held until released; callers 2 and 3 share a step beside it (the
  // layer expects one call so far, the running step holds it: nothing more to wait for).
  {
    std::promise<void> release;
    Call c1 = MakeCall(m, 16, 0, DType::kFP32, rng);
    auto a1 = call_of(1, HoldStep(absl::ZeroDuration(), release.get_future().share()), c1);
    while (batcher->stats().running == 0) absl::SleepFor(absl::Microseconds(100));
    Call c2 = MakeCall(m, 8, 0, DType::kFP32, rng), c3 = MakeCall(m, 8, 0, DType::kFP32, rng);
    auto a2 = call_of(2, HoldStep(hold), c2);
    auto a3 = call_of(3, nullptr, c3);
    ASSERT_EQ(a2.wait_for(std::chrono::seconds(5)), std::future_status::ready);
    ASSERT_TRUE(a2.get().first.ok());
    ASSERT_TRUE(a3.get().first.ok());
    release.set_value();
    ASSERT_TRUE(a1.get().first.ok());
    ASSERT_EQ(batcher->stats().lead_steps, 1);
    ASSERT_EQ(batcher->stats().max_step_calls, 2);
  }
  // Caller 1's step again; caller 2 comes back alone and waits past the lead's due time.
  std::promise<void> release;
  Call c1 = MakeCall(m, 16, 0, DType::kFP32, rng);
  auto a1 = call_of(1, HoldStep(absl::ZeroDuration(), release.get_future().share()), c1);
  while (batcher->stats().running == 0) absl::SleepFor(absl::Microseconds(100));
  Call c2 = MakeCall(m, 8, 0, DType::kFP32, rng), c3 = MakeCall(m, 8, 0, DType::kFP32, rng);
  auto a2 = call_of(2, nullptr, c2);
  // Due about 140-200 ms after the held step began (200-260 ms expected by the decayed fit,
  // 60 ms lead): once due, the scheduler holds caller 2 back (lead_waits) instead of starting
  // it. The callers' turnaround (caller 2 a few ms, caller 3 a few hundred: a moving average
  // under 100 ms) plus the lead still fits in a step, so the lead pays once the cohort is in.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (batcher->stats().lead_waits == 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(batcher->stats().lead_waits, 1);
  EXPECT_EQ(a2.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "caller 2 started beside the running step without caller 3";
  auto a3 = call_of(3, nullptr, c3);
  const bool beside = a2.wait_for(std::chrono::seconds(5)) == std::future_status::ready &&
                      a3.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  release.set_value();
  EXPECT_TRUE(beside) << "the cohort was in: its step should have started beside";
  ASSERT_TRUE(a1.get().first.ok());
  ASSERT_TRUE(a2.get().first.ok());
  ASSERT_TRUE(a3.get().first.ok());
  ExpectSameAsAlone(*engine, c2);
  ExpectSameAsAlone(*engine, c3);
  EXPECT_EQ(batcher->stats().lead_steps, 2);
  EXPECT_EQ(observer.lead_steps, 2);
}

// A lead step must pay: where a caller comes back later than the step's expected time less the
// lead (here 250 ms against 100 - 60 ms), a step started early would end before the other
// callers are back, so the small call waits for the running step as without a lead.
TEST(ForwardBatcherTest, LaneLeadIsOffWhileCallersComeBackLate) {
  auto engine = ReferenceEngine(/*steps_in_flight=*/2);
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(),
      {.max_batch_tokens = 64, .lane_lead = absl::Milliseconds(60), .inline_max_tokens = 0});
  std::mt19937 rng(23);
  LearnHeldSteps(*batcher, m, absl::Milliseconds(100), rng);  // steps of 16 tokens: 100 ms
  Call first = MakeCall(m, 16, 0, DType::kFP32, rng);
  ASSERT_TRUE(SubmitAsync(*batcher, first, absl::InfiniteFuture(),
                          HoldStep(absl::Milliseconds(100)), CallSource{.caller = 2})
                  .get()
                  .first.ok());
  absl::SleepFor(absl::Milliseconds(250));  // caller 2's turnaround
  std::promise<void> release;
  Call held = MakeCall(m, 16, 0, DType::kFP32, rng);
  auto held_answer = SubmitAsync(*batcher, held, absl::InfiniteFuture(),
                                 HoldStep(absl::ZeroDuration(), release.get_future().share()),
                                 CallSource{.caller = 1});
  while (batcher->stats().running == 0) absl::SleepFor(absl::Microseconds(100));
  Call again = MakeCall(m, 16, 0, DType::kFP32, rng);
  auto again_answer =
      SubmitAsync(*batcher, again, absl::InfiniteFuture(), nullptr, CallSource{.caller = 2});
  const bool beside =
      again_answer.wait_for(std::chrono::milliseconds(400)) == std::future_status::ready;
  release.set_value();
  EXPECT_FALSE(beside) << "a lead step started although caller 2 came back 250 ms after its answer";
  ASSERT_TRUE(held_answer.get().first.ok());
  ASSERT_TRUE(again_answer.get().first.ok());
  ExpectSameAsAlone(*engine, again);
  EXPECT_EQ(batcher->stats().lead_steps, 0);
  EXPECT_GE(batcher->stats().lead_waits, 1);
}

// The queue-wait bound does not credit lane_lead: a small call behind a running step whose end
// is ~100 ms away is refused by a 50 ms bound although a 90 ms lead would start its step within
// ~10 ms (its device work would still wait for the running step); with the lane free it is taken.
TEST(ForwardBatcherTest, QueueWaitBoundDoesNotCreditTheLaneLead) {
  auto engine = ReferenceEngine(/*steps_in_flight=*/2);
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 64,
                                                        .max_queue_wait = absl::Milliseconds(50),
                                                        .lane_lead = absl::Milliseconds(90),
                                                        .inline_max_tokens = 0});
  std::mt19937 rng(18);
  LearnHeldSteps(*batcher, m, absl::Milliseconds(100), rng);  // steps of 16 tokens: 100 ms
  HeldStep running(*batcher, m, 0, rng);
  Call small = MakeCall(m, 16, 0, DType::kFP32, rng);
  auto small_answer = SubmitAsync(*batcher, small);
  // Refused at once; taken (the lead credited), it would run beside the held step and answer
  // while that one is held: ok, not RESOURCE_EXHAUSTED.
  const bool answered_at_once =
      small_answer.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
  running.release.set_value();
  ASSERT_TRUE(answered_at_once);
  const absl::Status refused = small_answer.get().first;
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("1 steps running"), std::string::npos) << refused;
  ASSERT_TRUE(running.answer.get().first.ok());
  const absl::Status taken = SubmitAsync(*batcher, small).get().first;
  ASSERT_TRUE(taken.ok()) << taken;
  ExpectSameAsAlone(*engine, small);
  EXPECT_EQ(batcher->stats().refused_queue_full, 1);
}

// Destroying the batcher answers what is still queued (UNAVAILABLE), never drops it; M = 0 is
// answered at once; bad limits are refused.
TEST(ForwardBatcherTest, ShutdownAnswersQueuedCallsAndLimitsAreChecked) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  EXPECT_EQ(ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ForwardBatcher::Create(nullptr, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::mt19937 rng(8);
  Call empty = MakeCall(m, 0, 0, DType::kBF16, rng);
  std::vector<Call> calls;
  for (int i = 0; i < 3; ++i) calls.push_back(MakeCall(m, 8, i % 2, DType::kBF16, rng));
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
  {
    auto batcher = *ForwardBatcher::Create(
        engine.get(), {.max_batch_tokens = 1000, .max_batch_delay = absl::Seconds(30)});
    EXPECT_TRUE(SubmitAsync(*batcher, empty).get().first.ok());
    for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
  }
  for (auto& f : futures) {
    EXPECT_EQ(f.get().first.code(), absl::StatusCode::kUnavailable);
  }
}

// Two steps in flight (an engine with two lanes): the scheduler hands steps to two runners while
// it forms the next. Many concurrent callers, mixed layers, dtypes and sizes: every call gets
// exactly its rows, and some steps ran at the same time.
TEST(ForwardBatcherTest, TwoStepsInFlightKeepEveryCallsRows) {
  auto engine = ReferenceEngine(/*steps_in_flight=*/2);
  ASSERT_EQ(engine->steps_in_flight(), 2);
  auto oracle = ReferenceEngine();  // one lane, same weights
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(
      engine.get(), {.max_batch_tokens = 48, .max_batch_delay = absl::ZeroDuration()});
  std::mt19937 rng(12);
  const DType dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
  std::vector<Call> calls;
  for (int i = 0; i < 60; ++i) {
    calls.push_back(MakeCall(m, 1 + (i * 13) % 40, i % m.num_layers, dtypes[i % 3], rng));
  }
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures(calls.size());
  std::vector<std::thread> submitters;
  for (int t = 0; t < 4; ++t) {
    submitters.emplace_back([&, t] {
      for (size_t i = t; i < calls.size(); i += 4) futures[i] = SubmitAsync(*batcher, calls[i]);
    });
  }
  for (std::thread& t : submitters) t.join();
  for (size_t i = 0; i < calls.size(); ++i) {
    auto [status, timings] = futures[i].get();
    ASSERT_TRUE(status.ok()) << status;
    Tensor alone = Tensor::Empty(calls[i].out.dtype(), calls[i].out.shape());
    ASSERT_TRUE(oracle->Forward(calls[i].input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), calls[i].out.data<void>(), alone.nbytes()), 0)
        << "call " << i;
  }
  EXPECT_EQ(batcher->stats().calls, static_cast<int64_t>(calls.size()));
}

// An idle batcher without a batch delay runs a small call on the submitting thread (no
// hand-off); a larger call, a batch delay, inline_max_tokens = 0 or a source that may not run
// inline (a gRPC thread) go through a scheduling thread. Both answer exactly what the engine alone
// answers.
TEST(ForwardBatcherTest, IdleSmallCallsRunOnTheSubmittingThread) {
  auto engine = ReferenceEngine();
  auto oracle = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(14);
  struct Case {
    int64_t tokens;
    ForwardBatcherOptions options;
    bool inline_expected;
    bool may_run_inline = true;  // CallSource: false for a gRPC thread
  };
  const Case cases[] = {
      {4, {.max_batch_delay = absl::ZeroDuration(), .inline_max_tokens = 8}, true},
      {9, {.max_batch_delay = absl::ZeroDuration(), .inline_max_tokens = 8}, false},
      {4, {.max_batch_delay = absl::Microseconds(10), .inline_max_tokens = 8}, false},
      {4, {.max_batch_delay = absl::ZeroDuration(), .inline_max_tokens = 0}, false},
      {4, {.max_batch_delay = absl::ZeroDuration(), .inline_max_tokens = 8}, false, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.tokens, " tokens, inline_max_tokens ", c.options.inline_max_tokens,
                              ", delay ", absl::FormatDuration(c.options.max_batch_delay),
                              ", may_run_inline ", c.may_run_inline));
    auto batcher = *ForwardBatcher::Create(engine.get(), c.options);
    Call call = MakeCall(m, c.tokens, 1, DType::kBF16, rng);
    std::promise<std::thread::id> answered_on;
    batcher->Submit(
        call.input(), call.out.view(), absl::InfiniteFuture(), nullptr,
        [&](absl::Status s, const ForwardTimings&) {
          EXPECT_TRUE(s.ok()) << s;
          answered_on.set_value(std::this_thread::get_id());
        },
        CallSource{.may_run_inline = c.may_run_inline});
    const std::thread::id id = answered_on.get_future().get();
    EXPECT_EQ(id == std::this_thread::get_id(), c.inline_expected);
    EXPECT_EQ(batcher->stats().inline_steps, c.inline_expected ? 1 : 0);
    Tensor alone = Tensor::Empty(call.out.dtype(), call.out.shape());
    ASSERT_TRUE(oracle->Forward(call.input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), call.out.data<void>(), alone.nbytes()), 0);
  }
}

// A call that cannot be merged (here strided hidden states; on a GPU, device tensors) runs on
// the submitting thread whatever its size or the batch delay, when the batcher is idle: no
// step could take anything else with it. (The CPU engine refuses strided hidden states; the
// batcher hands on the engine's own verdict.)
TEST(ForwardBatcherTest, IdleUnmergeableCallsRunOnTheSubmittingThread) {
  auto engine = ReferenceEngine();
  auto oracle = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(15);
  for (const ForwardBatcherOptions& options :
       {ForwardBatcherOptions{.max_batch_delay = absl::ZeroDuration(), .inline_max_tokens = 8},
        ForwardBatcherOptions{.max_batch_delay = absl::Microseconds(100),
        .inline_max_tokens = 8}}) {
    auto batcher = *ForwardBatcher::Create(engine.get(), options);
    const int64_t tokens = 20;  // > inline_max_tokens
    Call call = MakeCall(m, tokens, 1, DType::kFP32, rng);
    // Every other row of a [2 * tokens, hidden] buffer.
    Tensor wide = Tensor::Empty(DType::kFP32, {2 * tokens, m.hidden});
    const TensorView strided(wide.data<float>(), DType::kFP32, {tokens, m.hidden},
                             {2 * m.hidden, 1});
    ASSERT_FALSE(strided.is_contiguous());
    const ForwardInput input{call.layer, strided, call.ids.view(), call.w.view()};
    std::promise<std::pair<std::thread::id, absl::Status>> answered;
    batcher->Submit(input, call.out.view(), absl::InfiniteFuture(), nullptr,
                    [&](absl::Status s, const ForwardTimings&) {
                      answered.set_value({std::this_thread::get_id(), s});
                    });
    const auto [id, status] = answered.get_future().get();
    EXPECT_EQ(id, std::this_thread::get_id());
    EXPECT_EQ(batcher->stats().inline_steps, 1);
    EXPECT_EQ(batcher->stats().steps, 1);
    EXPECT_EQ(status, oracle->Forward(input, call.out.view()));
  }
}

// Closed-loop callers that shared a step come back a little apart. The first one back waits
// (company_wait) until as many calls of its layer are queued as its layer's recent steps merged
// or, for calls that name their caller, as the distinct callers of its last two steps (callers
// that split into two groups merge again). A layer without such history never waits (its call
// runs inline), and the expectation ages out after kHistorySteps steps of one call.
TEST(ForwardBatcherTest, CompanyWaitKeepsCallersThatSharedAStepTogether) {
  auto engine = ReferenceEngine();
  auto oracle = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 512,
                                                        .max_batch_delay = absl::ZeroDuration(),
                                                        .company_wait = absl::Seconds(20),
                                                        .inline_max_tokens = 64});
  std::mt19937 rng(16);
  auto check = [&](const Call& c) {
    Tensor alone = Tensor::Empty(c.out.dtype(), c.out.shape());
    ASSERT_TRUE(oracle->Forward(c.input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), c.out.data<void>(), alone.nbytes()), 0);
  };
  using Result = std::pair<absl::Status, ForwardTimings>;
  auto submit = [&](const Call& c, uint64_t caller, std::function<bool()> cancelled = nullptr) {
    auto promise = std::make_shared<std::promise<Result>>();
    auto future = promise->get_future();
    batcher->Submit(
        c.input(), c.out.view(), absl::InfiniteFuture(), std::move(cancelled),
        [promise](absl::Status s, const ForwardTimings& t) {
          promise->set_value({s, t});
        },
        CallSource{.caller = caller});
    return future;
  };

  // Round 1: caller 1's call runs inline and is held in its step (its first cancellation
  // check waits); callers 2, 3, 4 queue behind it and share the next step, which is made to
  // take about 2 s (its first call's cancellation check sleeps) so that the later waits' cap
  // (twice the last step) is long.
  Call x = MakeCall(m, 4, 0, DType::kBF16, rng);
  std::promise<void> release_x;
  std::shared_future<void> x_released = release_x.get_future().share();
  std::promise<void> x_running;
  std::atomic<bool> x_held{false};
  std::thread tx([&] {
    batcher->Submit(
        x.input(), x.out.view(), absl::InfiniteFuture(),
        [&] {
          if (!x_held.exchange(true)) {
            x_running.set_value();
            x_released.wait();
          }
          return false;
        },
        [&](absl::Status s, const ForwardTimings&) { EXPECT_TRUE(s.ok()) << s; },
        CallSource{.caller = 1});
  });
  x_running.get_future().wait();
  std::vector<Call> round1;
  for (int i = 0; i < 3; ++i) round1.push_back(MakeCall(m, 2 + i, 0, DType::kBF16, rng));
  std::atomic<bool> slept{false};
  std::vector<std::future<Result>> f1;
  f1.push_back(submit(round1[0], 2, [&slept] {
    if (!slept.exchange(true)) absl::SleepFor(absl::Seconds(2));
    return false;
  }));
  for (int i = 1; i < 3; ++i) f1.push_back(submit(round1[i], 2 + i));
  release_x.set_value();
  tx.join();
  for (auto& f : f1) ASSERT_TRUE(f.get().first.ok());
  ForwardBatcherStats stats = batcher->stats();
  ASSERT_EQ(stats.steps, 2) << "the three queued calls should have shared one step";
  EXPECT_EQ(stats.max_step_calls, 3);
  EXPECT_EQ(stats.company_waits, 0);  // the layer had only a one-call step before

  // Round 2: callers 1-4 come back 100 ms apart. At most 3 calls shared a step, but 4 callers
  // served the last two: one step of 4, whose first call waited about 300 ms.
  std::vector<Call> round2;
  for (int i = 0; i < 4; ++i) round2.push_back(MakeCall(m, 1 + 2 * i, 0, DType::kBF16, rng));
  std::vector<std::future<Result>> f2;
  for (int i = 0; i < 4; ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(100));
    f2.push_back(submit(round2[i], 1 + i));
  }
  std::vector<ForwardTimings> t2;
  for (auto& f : f2) {
    auto [status, timings] = f.get();
    ASSERT_TRUE(status.ok()) << status;
    t2.push_back(timings);
  }
  for (const Call& c : round2) check(c);
  stats = batcher->stats();
  EXPECT_EQ(stats.steps, 3) << "the round should have been one step";
  EXPECT_EQ(stats.max_step_calls, 4);
  EXPECT_EQ(stats.company_waits, 1);
  EXPECT_GE(t2[0].queue_us, 290e3);
  EXPECT_LT(t2[0].queue_us, 3e6);  // not the whole cap: it went once the company came

  // A layer without history: inline, no wait.
  Call lone = MakeCall(m, 3, 1, DType::kBF16, rng);
  const int64_t inline_before = stats.inline_steps;
  auto [ls, lt] = submit(lone, 1).get();
  ASSERT_TRUE(ls.ok()) << ls;
  check(lone);
  EXPECT_EQ(batcher->stats().inline_steps, inline_before + 1);

  // Layer 0 now called by caller 1 alone: each call waits at most twice the layer's last step
  // (round 2's, short), never company_wait; after kHistorySteps lone steps the layer expects no
  // company and its calls run inline again.
  for (int i = 0; i < ForwardBatcher::kHistorySteps + 1; ++i) {
    Call c = MakeCall(m, 2, 0, DType::kBF16, rng);
    // A step ends before its calls are answered: the batcher is idle again.
    ASSERT_EQ(batcher->stats().running, 0) << "call " << i;
    const int64_t inline_now = batcher->stats().inline_steps;
    auto [s, t] = submit(c, 1).get();
    ASSERT_TRUE(s.ok()) << s;
    check(c);
    EXPECT_LT(t.queue_us, 3e6) << "call " << i;
    EXPECT_EQ(batcher->stats().inline_steps, inline_now + (i == ForwardBatcher::kHistorySteps))
        << "call " << i;
  }
  // (Those waits are short: on a loaded machine the scheduling thread may wake after them.)
  EXPECT_LE(batcher->stats().company_waits, 1 + ForwardBatcher::kHistorySteps);

  auto bad = ForwardBatcher::Create(engine.get(), {.company_wait = absl::Microseconds(-1)});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("company_wait"), absl::string_view::npos) << bad.status();
}

// The queue-wait bound (the deployment's latency setting) bounds the wait for company too: the
// admission estimate does not count that wait (emulated overload: answered p99 48.8-52.0 ms
// with the auto wait against 43.5 with it bounded and 34.8-41.1 without a wait).
TEST(ForwardBatcherTest, CompanyWaitIsBoundedByTheQueueWaitBound) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_delay = absl::ZeroDuration(),
                                                        .company_wait = absl::Seconds(2),
                                                        .max_queue_wait = absl::Milliseconds(50),
                                                        .inline_max_tokens = 0});
  std::mt19937 rng(47);
  // History: caller 1's step, then callers 2 and 3 merged in a step of 200 ms (so twice the last
  // step, 400 ms, would bound the wait without the queue-wait bound).
  Call c1 = MakeCall(m, 2, 0, DType::kFP32, rng), c2 = MakeCall(m, 2, 0, DType::kFP32, rng),
       c3 = MakeCall(m, 2, 0, DType::kFP32, rng);
  auto a1 = SubmitAsync(*batcher, c1, absl::InfiniteFuture(), HoldStep(absl::Milliseconds(30)),
                        CallSource{.caller = 1});
  while (batcher->stats().running == 0) absl::SleepFor(absl::Microseconds(100));
  auto a2 = SubmitAsync(*batcher, c2, absl::InfiniteFuture(), HoldStep(absl::Milliseconds(200)),
                        CallSource{.caller = 2});
  auto a3 = SubmitAsync(*batcher, c3, absl::InfiniteFuture(), nullptr, CallSource{.caller = 3});
  ASSERT_TRUE(a1.get().first.ok());
  ASSERT_TRUE(a2.get().first.ok());
  ASSERT_TRUE(a3.get().first.ok());
  ASSERT_EQ(batcher->stats().max_step_calls, 2);
  // Caller 1 alone: the layer expects three callers; it waits for them at most 50 ms.
  Call again = MakeCall(m, 2, 0, DType::kFP32, rng);
  auto [status, timings] =
      SubmitAsync(*batcher, again, absl::InfiniteFuture(), nullptr, CallSource{.caller = 1}).get();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_GE(timings.queue_us, 45e3);
  EXPECT_LT(timings.queue_us, 200e3) << "waited for company past max_queue_wait";
  EXPECT_EQ(batcher->stats().company_waits, 1);
  ExpectSameAsAlone(*engine, again);
}

// company_wait_auto with two closed-loop callers on one lane, every step held `hold`: caller 1
// calls again 1 ms after its answer, caller 2 `late` after its. Once the batcher has measured
// both modes (an epoch of each), returns the layer's mode and its calls per step over the next
// `window`.
struct AutoCompanyOutcome {
  int64_t merging_layers = 0;
  double calls_per_step = 0;
  ForwardBatcherStats stats;
};
AutoCompanyOutcome RunAutoCompanyCallers(absl::Duration hold, absl::Duration late,
                                         absl::Duration window) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  CountingObserver observer;
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 512,
                                                        .max_batch_delay = absl::ZeroDuration(),
                                                        .company_wait = absl::Seconds(1),
                                                        .company_wait_auto = true,
                                                        .inline_max_tokens = 0,
                                                        .observer = &observer});
  std::atomic<bool> stop{false};
  // Each step is held once, whatever its calls (as a GPU decode step reads every weight): the
  // first check of a step (one lane: numbered by the steps ended before it) sleeps.
  std::atomic<int64_t> held_step{-1};
  auto hold_once = [&]() -> std::function<bool()> {
    return [&] {
      const int64_t step = batcher->stats().steps;
      if (held_step.exchange(step) != step) absl::SleepFor(hold);
      return false;
    };
  };
  auto caller = [&](uint64_t id, absl::Duration think, uint32_t seed) {
    std::mt19937 rng(seed);
    while (!stop.load()) {
      Call c = MakeCall(m, 2, 0, DType::kFP32, rng);
      auto answer =
          SubmitAsync(*batcher, c, absl::InfiniteFuture(), hold_once(), CallSource{.caller = id});
      EXPECT_TRUE(answer.get().first.ok());
      absl::SleepFor(think);
    }
  };
  std::thread c1(caller, 1, absl::Milliseconds(1), 41), c2(caller, 2, late, 42);
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (absl::Now() < give_up) {
    const ForwardBatcherStats s = batcher->stats();
    if (s.merged_epochs >= 1 && s.split_epochs >= 1 && s.mode_changes >= 1) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  const ForwardBatcherStats before = batcher->stats();
  absl::SleepFor(window);
  AutoCompanyOutcome out;
  out.stats = batcher->stats();
  out.merging_layers = out.stats.merging_layers;
  stop = true;
  c1.join();
  c2.join();
  EXPECT_EQ(observer.merging_layers, batcher->stats().merging_layers)
      << "the observer (metrics) disagrees";
  const int64_t steps = out.stats.steps - before.steps;
  out.calls_per_step = steps > 0 ? static_cast<double>(out.stats.calls - before.calls) / steps : 0;
  return out;
}

// Caller 2 comes back 20 ms after its answer, within a 30 ms step: apart, the two callers' steps
// alternate (a call per step, ~33 calls/s); merged, two calls every ~50 ms (~40/s). The batcher
// measures both and keeps merging them.
TEST(ForwardBatcherTest, AutoCompanyWaitMergesWhereItServesMore) {
  const AutoCompanyOutcome o = RunAutoCompanyCallers(absl::Milliseconds(30), absl::Milliseconds(20),
                                                     absl::Milliseconds(600));
  EXPECT_EQ(o.merging_layers, 1) << "epochs: merged " << o.stats.merged_epochs << ", split "
                                 << o.stats.split_epochs;
  EXPECT_GT(o.calls_per_step, 1.7);
}

// Caller 2 comes back 80 ms after its answer: merged, two calls every ~110 ms (~18/s); apart,
// caller 1 alone every ~31 ms and caller 2 in between (~40/s). The batcher measures both and
// lets the calls run as they come.
TEST(ForwardBatcherTest, AutoCompanyWaitSplitsWhereMergingServesLess) {
  const AutoCompanyOutcome o = RunAutoCompanyCallers(absl::Milliseconds(30), absl::Milliseconds(80),
                                                     absl::Milliseconds(600));
  EXPECT_EQ(o.merging_layers, 0) << "epochs: merged " << o.stats.merged_epochs << ", split "
                                 << o.stats.split_epochs;
  EXPECT_LT(o.calls_per_step, 1.5);
}

// A lone caller's layer has no company to wait for: no epochs are measured and its mode stays
// split (the merging_layers metric does not flip with every epoch), and its calls still run
// inline.
TEST(ForwardBatcherTest, AutoCompanyWaitLeavesALoneCallerAlone) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  CountingObserver observer;
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_delay = absl::ZeroDuration(),
                                                        .company_wait = absl::Seconds(1),
                                                        .company_wait_auto = true,
                                                        .observer = &observer});
  std::mt19937 rng(43);
  for (int i = 0; i < 40; ++i) {  // 80+ ms: epochs (8 steps, 25 ms) would have ended
    Call c = MakeCall(m, 2, 0, DType::kFP32, rng);
    ASSERT_TRUE(SubmitAsync(*batcher, c, absl::InfiniteFuture(), HoldStep(absl::Milliseconds(2)),
                            CallSource{.caller = 1})
                    .get()
                    .first.ok());
  }
  const ForwardBatcherStats s = batcher->stats();
  EXPECT_EQ(s.merged_epochs + s.split_epochs, 0);
  EXPECT_EQ(s.mode_changes, 0);
  EXPECT_EQ(s.merging_layers, 0);
  EXPECT_EQ(observer.merging_layers, 0);
  EXPECT_EQ(s.inline_steps, 40);
}

TEST(ForwardBatcherTest, AutoCompanyWaitNeedsALongestWait) {
  auto engine = ReferenceEngine();
  auto bad = ForwardBatcher::Create(engine.get(), {.company_wait_auto = true});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("company_wait_auto"), absl::string_view::npos)
      << bad.status();
}

// A merged step's answers but the last go to answer_executor (the server's workers), so its
// callers hear back at once; a task the executor does not take is answered on the step's
// thread. Every call gets its rows either way.
TEST(ForwardBatcherTest, AnswerExecutorTakesAllButTheLastAnswerOfAStep) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  for (const bool take : {true, false}) {
    SCOPED_TRACE(take ? "executor takes the tasks" : "executor refuses the tasks");
    std::mutex mu;
    std::vector<std::thread> threads;
    int offered = 0;
    auto batcher =
        *ForwardBatcher::Create(engine.get(), {.max_batch_tokens = 256,
                                               .max_batch_delay = absl::Milliseconds(50),
                                               .company_wait = absl::ZeroDuration(),
                                               .answer_executor = [&](std::function<void()> task) {
                                                 std::lock_guard<std::mutex> lock(mu);
                                                 ++offered;
                                                 if (!take) return false;
                                                 threads.emplace_back(std::move(task));
                                                 return true;
                                               }});
    std::mt19937 rng(17);
    std::vector<Call> calls;
    for (int i = 0; i < 6; ++i) calls.push_back(MakeCall(m, 1 + 3 * i, 0, DType::kBF16, rng));
    std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
    for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
    for (size_t i = 0; i < calls.size(); ++i) {
      const absl::Status s = futures[i].get().first;
      ASSERT_TRUE(s.ok()) << s;
      Tensor alone = Tensor::Empty(calls[i].out.dtype(), calls[i].out.shape());
      ASSERT_TRUE(engine->Forward(calls[i].input(), alone.view()).ok());
      EXPECT_EQ(std::memcmp(alone.data<void>(), calls[i].out.data<void>(), alone.nbytes()), 0)
          << "call " << i;
    }
    const ForwardBatcherStats stats = batcher->stats();
    EXPECT_GE(stats.max_step_calls, 2);  // a 50 ms delay lets the quickly submitted calls meet
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(offered, stats.calls - stats.steps);
    for (std::thread& t : threads) t.join();
  }
}

// The observer hears where a merged step's time went: its calls' arrivals spread over the
// gaps between them, the rest of the head's batch delay before the step starts, the engine
// (held 30 ms), and the answers up to the last one handed on -- counted when an executor's
// answer is done (each held 40 ms here), not when it is handed over. A caller known by name
// also reports its turnaround: from its step's end to its next call.
TEST(ForwardBatcherTest, ObserverHearsWhereAMergedStepsTimeWent) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  struct PhaseObserver : CountingObserver {
    void OnMergedStep(const MergedStepTimes& t) override {
      std::lock_guard<std::mutex> lock(mu);
      merged.push_back(t);
    }
    void OnTurnaround(absl::Duration t) override {
      std::lock_guard<std::mutex> lock(mu);
      turnarounds.push_back(t);
    }
    std::mutex mu;
    std::vector<MergedStepTimes> merged;
    std::vector<absl::Duration> turnarounds;
  } observer;
  std::mutex mu;
  std::vector<std::thread> threads;
  auto batcher = *ForwardBatcher::Create(
      engine.get(), {.max_batch_tokens = 256,
                     .max_batch_delay = absl::Milliseconds(100),
                     .company_wait = absl::Milliseconds(1),  // keeps the callers' history
                     .observer = &observer,
                     .answer_executor = [&](std::function<void()> task) {
                       std::lock_guard<std::mutex> lock(mu);
                       threads.emplace_back([task = std::move(task)] {
                         absl::SleepFor(absl::Milliseconds(40));
                         task();
                       });
                       return true;
                     }});
  std::mt19937 rng(23);
  std::vector<Call> calls;
  for (int i = 0; i < 3; ++i) calls.push_back(MakeCall(m, 4, 0, DType::kBF16, rng));
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
  // The first poll is RunStep's, before the merge; the next ones come between engine stages.
  auto polls = std::make_shared<std::atomic<int>>(0);
  std::function<bool()> hold_engine = [polls] {
    if (polls->fetch_add(1) == 1) absl::SleepFor(absl::Milliseconds(30));
    return false;
  };
  const absl::Time first = absl::Now();
  for (int i = 0; i < 3; ++i) {
    if (i > 0) absl::SleepFor(absl::Milliseconds(10));
    futures.push_back(SubmitAsync(*batcher, calls[i], absl::InfiniteFuture(),
                                  i == 0 ? hold_engine : nullptr,
                                  CallSource{.caller = static_cast<uint64_t>(i + 1)}));
  }
  for (auto& f : futures) ASSERT_TRUE(f.get().first.ok());
  const absl::Duration whole = absl::Now() - first;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (std::thread& t : threads) t.join();
    threads.clear();
  }
  ASSERT_EQ(batcher->stats().steps, 1);
  {
    std::lock_guard<std::mutex> lock(observer.mu);
    ASSERT_EQ(observer.merged.size(), 1u);
    const MergedStepTimes& t = observer.merged[0];
    EXPECT_EQ(t.calls, 3);
    EXPECT_GE(t.arrivals, absl::Milliseconds(20));
    EXPECT_GE(t.arrivals + t.take, absl::Milliseconds(99));  // the head's batch delay
    EXPECT_GE(t.merge, absl::ZeroDuration());
    EXPECT_GE(t.engine, absl::Milliseconds(30));
    EXPECT_GE(t.answers, absl::Milliseconds(40));
    EXPECT_LE(t.arrivals + t.take + t.merge + t.engine + t.answers, whole);
    EXPECT_TRUE(observer.turnarounds.empty());  // no caller has called twice yet
  }
  // Caller 2 calls again 25 ms after its answer: its turnaround includes that (and its
  // answer's 40 ms on the executor).
  absl::SleepFor(absl::Milliseconds(25));
  Call again = MakeCall(m, 4, 0, DType::kBF16, rng);
  ASSERT_TRUE(SubmitAsync(*batcher, again, absl::InfiniteFuture(), nullptr, CallSource{.caller = 2})
                  .get()
                  .first.ok());
  std::lock_guard<std::mutex> lock(observer.mu);
  ASSERT_EQ(observer.turnarounds.size(), 1u);
  EXPECT_GE(observer.turnarounds[0], absl::Milliseconds(65));
  EXPECT_EQ(observer.merged.size(), 1u);  // a lone call's step is not a merged one
}

// A negative inline_max_tokens is refused, naming the option.
// idle_spin: a caller that calls again soon after its answer finds a polling scheduling thread
// (no wake-up), answers stay exact, concurrent callers still merge, and the destructor ends a
// thread that is polling. Bad settings are refused.
TEST(ForwardBatcherTest, IdleSpinTakesCallsWithoutAWakeUp) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(21);
  {
    auto batcher = *ForwardBatcher::Create(
        engine.get(), {.inline_max_tokens = 0, .idle_spin = absl::Milliseconds(500)});
    for (int i = 0; i < 20; ++i) {
      Call c = MakeCall(m, 1 + i % 3, i % 2, i % 2 ? DType::kBF16 : DType::kFP32, rng);
      // An answer is delivered before its thread is back polling: a call sent at once races
      // it (fresh-clone CI on the 2-core machine: 4 of 19 taken by the poller).
      absl::SleepFor(absl::Milliseconds(2));
      auto [status, timings] = SubmitAsync(*batcher, c).get();
      ASSERT_TRUE(status.ok()) << status;
      Tensor alone = Tensor::Empty(c.out.dtype(), c.out.shape());
      ASSERT_TRUE(engine->Forward(c.input(), alone.view()).ok());
      EXPECT_EQ(std::memcmp(alone.data<void>(), c.out.data<void>(), alone.nbytes()), 0) << i;
    }
    // The first call may find the thread asleep; later ones come within the window (a busy
    // 2-core machine may deschedule the poller now and then, hence not all 19).
    EXPECT_GE(batcher->stats().spin_takes, 10);
    EXPECT_EQ(batcher->stats().steps, 20);
    // Concurrent calls still share steps while a thread polls.
    std::vector<Call> calls;
    for (int i = 0; i < 8; ++i) calls.push_back(MakeCall(m, 3, 1, DType::kBF16, rng));
    std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> futures;
    for (const Call& c : calls) futures.push_back(SubmitAsync(*batcher, c));
    for (auto& f : futures) EXPECT_TRUE(f.get().first.ok());
  }  // destroyed while its thread polls: must not hang
  {
    auto off = *ForwardBatcher::Create(engine.get(), {.inline_max_tokens = 0});
    Call c = MakeCall(m, 2, 0, DType::kBF16, rng);
    ASSERT_TRUE(SubmitAsync(*off, c).get().first.ok());
    EXPECT_EQ(off->stats().spin_takes, 0);
  }
  for (absl::Duration bad : {absl::Microseconds(-1), absl::Seconds(2)}) {
    auto refused = ForwardBatcher::Create(engine.get(), {.idle_spin = bad});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("idle_spin"), std::string::npos);
  }
}

// Runs a step of 300 BF16 tokens (*held, more than half a step: no second lane beside it) held
// at its start (its call's cancellation check blocks once) while `calls` queue behind it, then
// lets it end; every call answers OK.
void RunBehindAHeldStep(ForwardBatcher& batcher, const ModelConfig& m,
                        const std::vector<Call>& calls, std::mt19937& rng, Call* held) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> checks{0};
  *held = MakeCall(m, 300, 0, DType::kBF16, rng);
  auto held_answer = SubmitAsync(
      batcher, *held, absl::InfiniteFuture(),
      [&] {
        if (checks.fetch_add(1) == 0) {
          entered.set_value();
          released.wait();
        }
        return false;
      },
      CallSource{.may_run_inline = false});
  entered.get_future().wait();
  std::vector<std::future<std::pair<absl::Status, ForwardTimings>>> answers;
  for (const Call& c : calls) answers.push_back(SubmitAsync(batcher, c));
  release.set_value();
  ASSERT_TRUE(held_answer.get().first.ok());
  for (auto& a : answers) {
    const absl::Status s = a.get().first;
    ASSERT_TRUE(s.ok()) << s;
  }
}

// A step's end wakes the scheduling threads only when calls are queued (they may be waiting
// for its lane): a lone caller's steps, inline or on a scheduling thread of a two-lane engine,
// wake nobody (each wake-up is a futex syscall on the answering thread, and the woken threads
// find nothing to do); a call queued behind a running step is woken for and answered exactly.
TEST(ForwardBatcherTest, StepEndsWakeTheSchedulersOnlyForQueuedCalls) {
  auto engine = ReferenceEngine(/*steps_in_flight=*/2);
  auto oracle = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(31);
  auto batcher = *ForwardBatcher::Create(engine.get(), {.max_batch_delay = absl::ZeroDuration()});
  for (int i = 0; i < 12; ++i) {
    Call c = MakeCall(m, 1 + i % 4, i % 2, DType::kBF16, rng);
    // Half inline, half through a scheduling thread (a gRPC thread's call).
    auto [status, timings] = SubmitAsync(*batcher, c, absl::InfiniteFuture(), nullptr,
                                         CallSource{.may_run_inline = i % 2 == 0})
                                 .get();
    ASSERT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(batcher->stats().steps, 12);
  EXPECT_GE(batcher->stats().inline_steps, 1);
  EXPECT_EQ(batcher->stats().step_end_wakes, 0);

  // A step held at its start while a second call queues behind it: the step's end wakes a
  // scheduling thread for it.
  Call held;
  std::vector<Call> queued;
  queued.push_back(MakeCall(m, 200, 0, DType::kBF16, rng));
  RunBehindAHeldStep(*batcher, m, queued, rng, &held);
  EXPECT_GE(batcher->stats().step_end_wakes, 1);
  const Call* checked[] = {&held, &queued[0]};
  for (const Call* c : checked) {
    Tensor alone = Tensor::Empty(c->out.dtype(), c->out.shape());
    ASSERT_TRUE(oracle->Forward(c->input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), c->out.data<void>(), alone.nbytes()), 0);
  }
}

// Records what the batcher page-locks (merge_pinner); refuses every pin when told to.
class RecordingPinner final : public HostMemoryPinner {
 public:
  explicit RecordingPinner(bool refuse = false) : refuse_(refuse) {}
  absl::Status Pin(void* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++pins_;
    if (refuse_) return absl::InternalError("no page-locking here");
    EXPECT_EQ(reinterpret_cast<uintptr_t>(data) % 4096, 0u);
    EXPECT_GT(bytes, 0u);
    live_.insert(data);
    return absl::OkStatus();
  }
  void Unpin(void* data) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(live_.erase(data), 1u) << "unpinned what was not pinned";
    ++unpins_;
  }
  int pins() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pins_;
  }
  int unpins() const {
    std::lock_guard<std::mutex> lock(mu_);
    return unpins_;
  }
  size_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }

 private:
  const bool refuse_;
  mutable std::mutex mu_;
  std::set<void*> live_;
  int pins_ = 0, unpins_ = 0;
};

// merge_pinner: the merge buffers are pinned when the batcher is created, sized for its largest
// merged step (never pinned or unpinned while serving: both stall a device's other work), a
// merged step gathers its hidden states and answer in them (the engine sees
// Device::PinnedHost() views) and each caller still gets exactly its rows; the batcher's end
// unpins them on the background thread. A pinner that refuses leaves plain buffers that work
// the same.
TEST(ForwardBatcherTest, MergedStepsGatherInPageLockedBuffers) {
  auto engine = ReferenceEngine();
  auto oracle = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(41);
  for (bool refuse : {false, true}) {
    SCOPED_TRACE(refuse ? "the pinner refuses" : "the pinner pins");
    RecordingPinner pinner(refuse);
    {
      auto batcher = *ForwardBatcher::Create(
          engine.get(), {.max_batch_delay = absl::ZeroDuration(), .merge_pinner = &pinner});
      EXPECT_EQ(pinner.pins(), 2);  // hidden and answer of its one runner, at creation
      for (int64_t tokens : {5, 60}) {
        std::vector<Call> calls;
        for (int i = 0; i < 3; ++i) calls.push_back(MakeCall(m, tokens + i, 0, DType::kFP32, rng));
        Call held;
        RunBehindAHeldStep(*batcher, m, calls, rng, &held);
        for (const Call& c : calls) {
          Tensor alone = Tensor::Empty(c.out.dtype(), c.out.shape());
          ASSERT_TRUE(oracle->Forward(c.input(), alone.view()).ok());
          EXPECT_EQ(std::memcmp(alone.data<void>(), c.out.data<void>(), alone.nbytes()), 0);
        }
      }
      const ForwardBatcherStats stats = batcher->stats();
      EXPECT_GE(stats.merged_calls, 6);
      EXPECT_EQ(stats.pinned_merges, refuse ? 0 : 2);
      FlushBackgroundReleases();
      EXPECT_EQ(pinner.pins(), 2);  // none while serving
      EXPECT_EQ(pinner.unpins(), 0);
      EXPECT_EQ(pinner.live(), refuse ? 0u : 2u);
    }
    FlushBackgroundReleases();
    EXPECT_EQ(pinner.live(), 0u);
    EXPECT_EQ(pinner.unpins(), refuse ? 0 : 2);
  }
}

// Prewake: a call announced while the scheduling thread sleeps finds it polling (no wake-up
// after the Submit); unannounced, the same call after the same idle time wakes it. Without
// idle_spin, Prewake does nothing (and calls still answer).
TEST(ForwardBatcherTest, PrewakeMakesASleepingThreadPoll) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(22);
  constexpr absl::Duration kSpin = absl::Milliseconds(200);
  auto batcher =
      *ForwardBatcher::Create(engine.get(), {.inline_max_tokens = 0, .idle_spin = kSpin});
  auto call = [&] {
    Call c = MakeCall(m, 2, 1, DType::kBF16, rng);
    auto [status, timings] = SubmitAsync(*batcher, c).get();
    ASSERT_TRUE(status.ok()) << status;
    Tensor alone = Tensor::Empty(c.out.dtype(), c.out.shape());
    ASSERT_TRUE(engine->Forward(c.input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), c.out.data<void>(), alone.nbytes()), 0);
  };
  absl::SleepFor(kSpin + absl::Milliseconds(150));  // the thread's first poll is over: asleep
  const int64_t takes0 = batcher->stats().spin_takes;
  call();  // unannounced: a wake-up
  EXPECT_EQ(batcher->stats().spin_takes, takes0);
  absl::SleepFor(kSpin + absl::Milliseconds(150));
  batcher->Prewake();
  batcher->Prewake();  // twice: still one poll
  absl::SleepFor(absl::Milliseconds(5));
  call();
  EXPECT_EQ(batcher->stats().spin_takes, takes0 + 1);
  // Announced, but nothing comes: the poll ends, and a later call is still answered.
  absl::SleepFor(kSpin + absl::Milliseconds(150));
  batcher->Prewake();
  absl::SleepFor(kSpin + absl::Milliseconds(150));
  call();
  EXPECT_EQ(batcher->stats().spin_takes, takes0 + 1);

  auto off = *ForwardBatcher::Create(engine.get(), {.inline_max_tokens = 0});
  off->Prewake();
  Call c = MakeCall(m, 1, 0, DType::kFP32, rng);
  EXPECT_TRUE(SubmitAsync(*off, c).get().first.ok());
  EXPECT_EQ(off->stats().spin_takes, 0);
}

// stage_timing_every: calls that do not read their stages have one step in N timed (the
// others report host-clock timings only, stages zero and stages_timed false); a call that asks
// always has its step timed. Answers are the same either way.
TEST(ForwardBatcherTest, StageTimersRunOnSampledStepsAndWhereAsked) {
  auto engine = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(22);
  auto batcher =
      *ForwardBatcher::Create(engine.get(), {.inline_max_tokens = 0, .stage_timing_every = 4});
  const CallSource quiet{.stage_timings = false}, asking{.stage_timings = true};
  std::vector<bool> timed;
  for (int i = 0; i < 8; ++i) {
    Call c = MakeCall(m, 2, 0, DType::kBF16, rng);
    auto [status, t] = SubmitAsync(*batcher, c, absl::InfiniteFuture(), nullptr, quiet).get();
    ASSERT_TRUE(status.ok()) << status;
    timed.push_back(t.stages_timed);
    EXPECT_GT(t.engine_us, 0);  // host clock, always
    if (t.stages_timed) {
      EXPECT_GT(t.stages.experts_us, 0);
    } else {
      EXPECT_EQ(t.stages.experts_us, 0);
      EXPECT_TRUE(t.rank_stages.empty());
    }
    Tensor alone = Tensor::Empty(c.out.dtype(), c.out.shape());
    ASSERT_TRUE(engine->Forward(c.input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), c.out.data<void>(), alone.nbytes()), 0) << i;
  }
  EXPECT_EQ(timed, (std::vector<bool>{false, false, false, true, false, false, false, true}));
  for (int i = 0; i < 3; ++i) {
    Call c = MakeCall(m, 1, 0, DType::kFP32, rng);
    auto [status, t] = SubmitAsync(*batcher, c, absl::InfiniteFuture(), nullptr, asking).get();
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_TRUE(t.stages_timed) << i;
    EXPECT_GT(t.stages.experts_us, 0);
  }
  EXPECT_EQ(batcher->stats().timed_steps, 5);
  auto refused = ForwardBatcher::Create(engine.get(), {.stage_timing_every = 0});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("stage_timing_every"), std::string::npos);
}

TEST(ForwardBatcherTest, NegativeInlineMaxTokensIsRefused) {
  auto engine = ReferenceEngine();
  auto b = ForwardBatcher::Create(engine.get(), {.inline_max_tokens = -1});
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("inline_max_tokens"), absl::string_view::npos) << b.status();
}

// The engine's lanes: concurrent Forward calls beyond the lane count wait, none is lost, each
// is correct; more lanes than the plan allows are refused with a reason.
TEST(ForwardBatcherTest, EngineLanesRunConcurrentForwards) {
  EngineOptions o = engine_testing::TinyOptions("reference");
  o.steps_in_flight = 3;
  auto engine = *Engine::Create(o);
  auto oracle = ReferenceEngine();
  const ModelConfig& m = engine->info().model;
  std::mt19937 rng(13);
  std::vector<Call> calls;
  for (int i = 0; i < 24; ++i)
    calls.push_back(MakeCall(m, 3 + i, i % m.num_layers, DType::kBF16, rng));
  std::vector<std::thread> threads;
  std::vector<absl::Status> statuses(calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    threads.emplace_back(
        [&, i] { statuses[i] = engine->Forward(calls[i].input(), calls[i].out.view()); });
  }
  for (std::thread& t : threads) t.join();
  for (size_t i = 0; i < calls.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i];
    Tensor alone = Tensor::Empty(calls[i].out.dtype(), calls[i].out.shape());
    ASSERT_TRUE(oracle->Forward(calls[i].input(), alone.view()).ok());
    EXPECT_EQ(std::memcmp(alone.data<void>(), calls[i].out.data<void>(), alone.nbytes()), 0)
        << "call " << i;
  }
  o.steps_in_flight = 9;
  EXPECT_EQ(Engine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.steps_in_flight = -1;
  EXPECT_EQ(Engine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  // Collectives between ranks must run in one order: one step at a time.
  EngineOptions ep = engine_testing::SeedMegaMoe(2, "all2all_contiguous", "reference");
  ep.steps_in_flight = 2;
  absl::Status refused = Engine::Create(ep).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("steps_in_flight"), std::string::npos) << refused;
  ep.steps_in_flight = 0;  // auto: one
  EXPECT_EQ((*Engine::Create(ep))->steps_in_flight(), 1);
}

}  // namespace
}  // namespace moeserve
