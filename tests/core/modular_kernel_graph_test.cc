// ModularKernel's graph path (GraphOptions) against fakes that keep CUDA graph semantics on the
// host: "device" work goes to a FakeStream that either runs an op at once or, while capturing,
// records it with its arguments bound by value (addresses baked in, as in a CUDA graph), and a
// replay runs the recorded ops again. So a test fails if ModularKernel replays a graph over
// buffers that moved, forgets to stage fresh inputs, pads wrongly or copies out the wrong rows.
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/modular_kernel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

// The fake device: memory is host memory labelled Cuda(0).
constexpr Device kFakeGpu = Device::Cuda(0);

struct FakeStream {
  std::vector<std::function<void()>>* recording = nullptr;
  // The fake device's clock: the staged copy in adds 1, the experts 10, the copy out 100.
  int64_t ticks = 0;
  void Enqueue(std::function<void()> op) {
    if (recording != nullptr) {
      recording->push_back(std::move(op));
    } else {
      op();
    }
  }
};

class FakeGraph final : public StepGraph {
 public:
  explicit FakeGraph(std::vector<std::function<void()>> ops) : ops_(std::move(ops)) {}
  absl::Status Launch() override {
    for (auto& op : ops_) op();
    return absl::OkStatus();
  }

 private:
  std::vector<std::function<void()>> ops_;
};

// A device timer on the fake stream's clock that marks inside graphs as a CUDA timer does: a
// mark reads the clock when the stream reaches it; a mark in a graph is an op of the graph that
// writes its stage's slot at every replay, and MarkReplayed reads that slot.
class FakeGraphTimer final : public StageTimer {
 public:
  explicit FakeGraphTimer(FakeStream* stream) : stream_(stream) {}
  void Reset() override { marks_.clear(); }
  absl::Status Mark(Stage stage) override { return Record(stage); }
  absl::Status Stop() override {
    if (!marks_.empty() && marks_.back().first == kNumStages) return absl::OkStatus();
    return Record(kNumStages);
  }
  absl::StatusOr<std::array<double, kNumStages>> ElapsedUs() override {
    std::array<double, kNumStages> us{};
    for (size_t i = 0; i + 1 < marks_.size(); ++i) {
      if (marks_[i].first == kNumStages) continue;
      us[marks_[i].first] += static_cast<double>(*marks_[i + 1].second - *marks_[i].second);
    }
    return us;
  }
  bool marks_in_graphs() const override { return true; }
  absl::Status MarkInGraph(Stage stage) override {
    if (stream_->recording == nullptr) return absl::InternalError("MarkInGraph outside a capture");
    int64_t* slot = &graph_slots_[stage];
    FakeStream* stream = stream_;
    stream_->Enqueue([slot, stream] { *slot = stream->ticks; });
    ++in_graph_marks;
    return absl::OkStatus();
  }
  absl::Status MarkReplayed(Stage stage) override {
    marks_.push_back({stage, &graph_slots_[stage]});
    return absl::OkStatus();
  }
  int in_graph_marks = 0;

 private:
  absl::Status Record(int stage) {
    auto clock = std::make_shared<int64_t>(0);
    owned_.push_back(clock);
    FakeStream* stream = stream_;
    stream_->Enqueue([clock, stream] { *clock = stream->ticks; });
    marks_.push_back({stage, clock.get()});
    return absl::OkStatus();
  }
  FakeStream* stream_;
  std::array<int64_t, kNumStages> graph_slots_{};
  std::vector<std::shared_ptr<int64_t>> owned_;
  std::vector<std::pair<int, const int64_t*>> marks_;
};

// Grow-only buffers that really move when they grow (a new allocation; the old one kept until
// ReleaseSuperseded, as the CUDA allocator keeps it).
class FakeAllocator final : public WorkspaceAllocator {
 public:
  explicit FakeAllocator(FakeStream* stream, bool graph_timer = false)
      : stream_(stream), graph_timer_(graph_timer) {}
  Device device() const override { return kFakeGpu; }
  absl::StatusOr<TensorView> Get(Slot slot, DType dtype, const Shape& shape) override {
    const size_t bytes = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
    auto& b = buffers_[slot];
    if (b == nullptr || b->size() < bytes) {
      if (b != nullptr) superseded_.push_back(std::move(b));
      b = std::make_unique<std::vector<uint8_t>>(bytes);
    }
    return TensorView(b->data(), dtype, shape, kFakeGpu);
  }
  void ReleaseSuperseded() override {
    ++release_calls;
    superseded_.clear();
  }
  size_t superseded() const { return superseded_.size(); }
  int release_calls = 0;
  std::unique_ptr<StageTimer> MakeStageTimer() const override {
    if (graph_timer_) return std::make_unique<FakeGraphTimer>(stream_);
    return MakeHostStageTimer();
  }
  absl::StatusOr<std::unique_ptr<StepGraph>> Capture(
      const std::function<absl::Status()>& enqueue) override {
    std::vector<std::function<void()>> ops;
    stream_->recording = &ops;
    const absl::Status s = enqueue();
    stream_->recording = nullptr;
    if (!s.ok()) return s;
    if (fail_captures) return absl::InternalError("capture refused by the test");
    return std::make_unique<FakeGraph>(std::move(ops));
  }
  bool fail_captures = false;

 private:
  FakeStream* stream_;
  const bool graph_timer_;
  std::unique_ptr<std::vector<uint8_t>> buffers_[kNumSlots];
  std::vector<std::unique_ptr<std::vector<uint8_t>>> superseded_;
};

// FP32 in and out. Prepare copies x, ids and weights to the "device"; the experts compute
// out[t] = sum_j w[t, j] * (id[t, j] + 1) * x[t] (a route with id -1 adds nothing), already
// reduced (NoOp); Finalize copies out back.
class FakePrepareFinalize final : public PrepareAndFinalize {
 public:
  explicit FakePrepareFinalize(FakeStream* stream) : stream_(stream) {}
  absl::string_view name() const override { return "FakePrepareFinalize"; }
  ActivationFormat activation_format() const override { return ActivationFormat::kStandard; }
  int64_t max_num_tokens_per_rank() const override { return 1 << 20; }
  int num_dispatchers() const override { return 1; }
  const QuantConfig& quant_config() const override { return quant_; }

  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override {
    const int64_t m = args.hidden_states.dim(0), k = args.hidden_states.dim(1);
    const int64_t topk = args.topk_ids.dim(1);
    eager_x_.assign(args.hidden_states.data<float>(), args.hidden_states.data<float>() + m * k);
    eager_ids_.assign(args.topk_ids.data<int32_t>(), args.topk_ids.data<int32_t>() + m * topk);
    eager_w_.assign(args.topk_weights.data<float>(), args.topk_weights.data<float>() + m * topk);
    Fill(out, eager_x_.data(), eager_ids_.data(), eager_w_.data(), m, k, topk, args);
    return absl::OkStatus();
  }
  absl::Status Finalize(const TensorView& output, const TensorView& fused,
                        const PreparedActivations&, const TopKWeightAndReduce&) override {
    std::memcpy(output.raw_data(), fused.raw_data(), output.nbytes());
    return absl::OkStatus();
  }

  bool supports_graphs() const override { return true; }
  absl::StatusOr<bool> StageInputs(const PrepareArgs& args, int64_t padded,
                                   int64_t capacity) override {
    ++staged_calls;
    if (refuse_staging) return false;
    const int64_t m = args.hidden_states.dim(0), k = args.hidden_states.dim(1);
    const int64_t topk = args.topk_ids.dim(1);
    if (pin_x_.empty()) {  // sized once: the staging never moves
      pin_x_.assign(capacity * k, 0);
      pin_ids_.assign(capacity * topk, 0);
      pin_w_.assign(capacity * topk, 0);
      dev_x_.assign(capacity * k, 0);
      dev_ids_.assign(capacity * topk, 0);
      dev_w_.assign(capacity * topk, 0);
      pin_out_.assign(capacity * k, 0);
    }
    last_padded = padded;
    std::copy_n(args.hidden_states.data<float>(), m * k, pin_x_.begin());
    std::copy_n(args.topk_ids.data<int32_t>(), m * topk, pin_ids_.begin());
    std::copy_n(args.topk_weights.data<float>(), m * topk, pin_w_.begin());
    // Padding: garbage rows (never read: their routes go nowhere), routes -1, weights 0.
    std::fill(pin_x_.begin() + m * k, pin_x_.begin() + padded * k, 1e30f);
    std::fill(pin_ids_.begin() + m * topk, pin_ids_.begin() + padded * topk, -1);
    std::fill(pin_w_.begin() + m * topk, pin_w_.begin() + padded * topk, 0.0f);
    rows_ = m;
    return true;
  }
  absl::Status PrepareStaged(const PrepareArgs& args, int64_t padded,
                             PreparedActivations* out) override {
    const int64_t k = args.hidden_states.dim(1), topk = args.topk_ids.dim(1);
    float *px = pin_x_.data(), *dx = dev_x_.data(), *pw = pin_w_.data(), *dw = dev_w_.data();
    int32_t *pi = pin_ids_.data(), *di = dev_ids_.data();
    FakeStream* stream = stream_;
    stream_->Enqueue([=] {
      stream->ticks += 1;
      std::copy_n(px, padded * k, dx);
      std::copy_n(pi, padded * topk, di);
      std::copy_n(pw, padded * topk, dw);
    });
    Fill(out, dx, di, dw, padded, k, topk, args);
    return absl::OkStatus();
  }
  absl::Status FinalizeStaged(DType dtype, Device, const TensorView& fused,
                              const PreparedActivations& p, const TopKWeightAndReduce&) override {
    if (dtype != DType::kFP32) return absl::InvalidArgumentError("fp32 only");
    const float* src = fused.data<float>();
    float* dst = pin_out_.data();
    const int64_t n = p.problem.num_tokens * p.problem.hidden;
    FakeStream* stream = stream_;
    stream_->Enqueue([=] {
      stream->ticks += 100;
      std::copy_n(src, n, dst);
    });
    return absl::OkStatus();
  }
  absl::Status CollectOutput(const TensorView& output, StageTimer*) override {
    if (output.dim(0) != rows_) return absl::InternalError("rows differ from the staged ones");
    std::memcpy(output.raw_data(), pin_out_.data(), output.nbytes());
    return absl::OkStatus();
  }

  bool refuse_staging = false;
  int64_t staged_calls = 0;
  int64_t last_padded = 0;

 private:
  static void Fill(PreparedActivations* out, float* x, int32_t* ids, float* w, int64_t m, int64_t k,
                   int64_t topk, const PrepareArgs& args) {
    out->format = ActivationFormat::kStandard;
    out->a1q = TensorView(x, DType::kFP32, {m, k}, kFakeGpu);
    out->topk_ids = TensorView(ids, DType::kINT32, {m, topk}, kFakeGpu);
    out->topk_weights = TensorView(w, DType::kFP32, {m, topk}, kFakeGpu);
    out->problem = NoEpProblem(args, m, k, topk);
  }
  FakeStream* stream_;
  QuantConfig quant_;
  std::vector<float> eager_x_, eager_w_, pin_x_, pin_w_, dev_x_, dev_w_, pin_out_;
  std::vector<int32_t> eager_ids_, pin_ids_, dev_ids_;
  int64_t rows_ = 0;
};

class FakeExperts final : public Experts {
 public:
  explicit FakeExperts(FakeStream* stream) : stream_(stream) {}
  absl::string_view name() const override { return "FakeExperts"; }
  ActivationFormats activation_formats() const override {
    return {ActivationFormat::kStandard, ActivationFormat::kStandard};
  }
  bool supports_expert_map() const override { return true; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return DType::kFP32; }
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem& p) const override {
    WorkspaceShapes s;
    s.workspace13 = {p.num_tokens, p.hidden};
    s.workspace2 = {p.num_tokens};
    s.output = {p.num_tokens, p.hidden};
    return s;
  }
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind::kNoOp);
  }
  bool supports_graphs() const override { return true; }
  absl::Status Apply(const ExpertsApplyArgs& args) override {
    const PreparedActivations& p = *args.prepared;
    const int64_t m = p.problem.num_tokens, k = p.problem.hidden, topk = p.problem.topk;
    const float* x = p.a1q.data<float>();
    const int32_t* ids = p.topk_ids.data<int32_t>();
    const float* w = p.topk_weights.data<float>();
    float* out = args.output.data<float>();
    FakeStream* stream = stream_;
    stream_->Enqueue([=] {
      stream->ticks += 10;
      for (int64_t t = 0; t < m; ++t) {
        float scale = 0;
        for (int64_t j = 0; j < topk; ++j) {
          if (ids[t * topk + j] >= 0) scale += w[t * topk + j] * (ids[t * topk + j] + 1);
        }
        for (int64_t c = 0; c < k; ++c) out[t * k + c] = scale == 0 ? 0 : scale * x[t * k + c];
      }
    });
    return absl::OkStatus();
  }

 private:
  FakeStream* stream_;
};

struct Fixture {
  FakeStream stream;
  FakePrepareFinalize* pf = nullptr;
  FakeAllocator* allocator = nullptr;
  std::unique_ptr<ModularKernel> kernel;
  LayerWeights weights;
};

// graph_timer: the kernel's stage timer marks inside graphs (FakeGraphTimer).
std::unique_ptr<Fixture> MakeFixture(bool graph_timer = false) {
  auto f = std::make_unique<Fixture>();
  auto pf = std::make_unique<FakePrepareFinalize>(&f->stream);
  auto allocator = std::make_unique<FakeAllocator>(&f->stream, graph_timer);
  f->pf = pf.get();
  f->allocator = allocator.get();
  auto kernel = ModularKernel::Create(std::move(pf), std::make_unique<FakeExperts>(&f->stream),
                                      std::move(allocator));
  EXPECT_TRUE(kernel.ok()) << kernel.status();
  f->kernel = std::move(*kernel);
  f->weights.num_local_experts = 8;
  f->weights.hidden = 16;
  f->weights.intermediate = 4;
  return f;
}

constexpr int64_t kHidden = 16, kTopk = 2, kExperts = 8;

// One forward of m fresh random tokens on `layer`, checked against the formula.
// `timings`, when given, receives the forward's stage timings; `timed` false runs it without
// the stage timers.
void ForwardAndCheck(Fixture& f, int layer, int64_t m, std::mt19937& rng,
                     StageTimings* timings_out = nullptr, bool timed = true) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int32_t> expert(0, kExperts - 1);
  std::vector<float> x(m * kHidden), w(m * kTopk), out(m * kHidden, -7.0f);
  std::vector<int32_t> ids(m * kTopk);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = std::abs(normal(rng)) + 0.1f;
  for (int32_t& v : ids) v = expert(rng);
  ModularKernelArgs args;
  args.hidden_states = TensorView(x.data(), DType::kFP32, {m, kHidden});
  args.topk_ids = TensorView(ids.data(), DType::kINT32, {m, kTopk});
  args.topk_weights = TensorView(w.data(), DType::kFP32, {m, kTopk});
  args.layer = layer;
  args.weights = &f.weights;
  args.num_experts = kExperts;
  StageTimings timings;
  ASSERT_TRUE(f.kernel
                  ->Forward(args, TensorView(out.data(), DType::kFP32, {m, kHidden}),
                            timed ? &timings : nullptr)
                  .ok());
  for (int64_t t = 0; t < m; ++t) {
    float scale = 0;
    for (int64_t j = 0; j < kTopk; ++j) scale += w[t * kTopk + j] * (ids[t * kTopk + j] + 1);
    for (int64_t c = 0; c < kHidden; ++c) {
      ASSERT_FLOAT_EQ(out[t * kHidden + c], scale * x[t * kHidden + c])
          << "m=" << m << " token " << t << " column " << c;
    }
  }
  if (timings_out != nullptr) *timings_out = timings;
}

// A timer that marks inside graphs gets each stage of a graphed step measured on the device's
// clock, on the eager first run and on every replay: prepare = the staged copy in, experts =
// the experts, finalize = the copy out (1, 10 and 100 ticks). Timed and untimed steps replay
// graphs of their own (the untimed one has no marks).
TEST(ModularKernelGraphs, TimedStepsMarkTheirStagesInsideTheGraph) {
  auto f = MakeFixture(/*graph_timer=*/true);
  ASSERT_TRUE(f->kernel->EnableGraphs({.max_tokens = 32}).ok());
  std::mt19937 rng(21);
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const bool timed = step % 3 != 2;  // steps 2 and 5 untimed
    StageTimings t;
    ForwardAndCheck(*f, 0, 5, rng, &t, timed);
    if (timed) {
      EXPECT_EQ(t.prepare_us, 1);
      EXPECT_EQ(t.experts_us, 10);
      EXPECT_EQ(t.finalize_us, 100);
    }
  }
  const GraphStats stats = f->kernel->graph_stats();
  EXPECT_EQ(stats.captures, 2);  // the timed graph (step 0) and the untimed one (step 2)
  EXPECT_EQ(stats.replays, 4);
  EXPECT_EQ(stats.eager, 0);
}

TEST(ModularKernelGraphs, DefaultSizesPadAtMostAQuarterAboveEight) {
  const std::vector<int64_t> sizes = DefaultGraphSizes(256);
  EXPECT_EQ(sizes.front(), 1);
  EXPECT_EQ(sizes.back(), 256);
  EXPECT_TRUE(std::is_sorted(sizes.begin(), sizes.end()));
  for (int64_t m = 1; m <= 256; ++m) {
    const int64_t p = *std::lower_bound(sizes.begin(), sizes.end(), m);
    if (m > 8) {
      EXPECT_LE(p, m + m / 4 + 1) << m;
    }
  }
  EXPECT_EQ(DefaultGraphSizes(5), (std::vector<int64_t>{1, 2, 4, 5}));
  EXPECT_TRUE(DefaultGraphSizes(0).empty());
}

TEST(ModularKernelGraphs, ReplaysMatchEagerOverFreshInputs) {
  auto f = MakeFixture();
  ASSERT_TRUE(f->kernel->EnableGraphs({.max_tokens = 32}).ok());
  std::mt19937 rng(3);
  // Sizes that share a padded size (3 -> 4, 9 and 10 -> 10, 17 -> 20) and two layers.
  for (int pass = 0; pass < 3; ++pass) {
    for (int64_t m : {1, 3, 4, 9, 10, 17, 32}) {
      for (int layer : {0, 1}) ForwardAndCheck(*f, layer, m, rng);
    }
  }
  const GraphStats s = f->kernel->graph_stats();
  // Padded sizes 1, 4, 10, 20, 32 on two layers: 10 graphs, each captured once.
  EXPECT_EQ(s.captures, 10);
  EXPECT_EQ(s.graphs, 10);
  EXPECT_EQ(s.replays, 3 * 7 * 2 - 10);
  EXPECT_EQ(s.eager, 0);
}

TEST(ModularKernelGraphs, LargerStepsRunEagerlyAndMovedWorkspacesAreRecaptured) {
  auto f = MakeFixture();
  ASSERT_TRUE(f->kernel->EnableGraphs({.max_tokens = 8}).ok());
  std::mt19937 rng(4);
  ForwardAndCheck(*f, 0, 8, rng);  // capture at 8
  StageTimings replayed, eager;
  ForwardAndCheck(*f, 0, 8, rng, &replayed);  // replay
  EXPECT_EQ(f->kernel->graph_stats().replays, 1);
  // A graphed step reports its host clock (staging, launch, collection, timer); an eager one
  // none.
  EXPECT_GT(replayed.host_stage_us, 0);
  EXPECT_GT(replayed.host_launch_us, 0);
  EXPECT_GT(replayed.host_collect_us, 0);
  EXPECT_GT(replayed.host_timer_us, 0);
  // Its device work is one graph, timed as a whole (two marks): experts is the graph, prepare
  // the host staging, finalize nothing.
  EXPECT_GT(replayed.experts_us, 0);
  EXPECT_EQ(replayed.prepare_us, replayed.host_stage_us);
  EXPECT_EQ(replayed.finalize_us, 0);
  ForwardAndCheck(*f, 0, 100, rng, &eager);  // eager; grows (moves) every workspace
  EXPECT_EQ(f->kernel->graph_stats().eager, 1);
  EXPECT_EQ(
      eager.host_stage_us + eager.host_launch_us + eager.host_collect_us + eager.host_timer_us, 0);
  // An eager step (though graphs are on) marks its three stages.
  EXPECT_GT(eager.prepare_us, 0);
  EXPECT_GT(eager.experts_us, 0);
  EXPECT_GT(eager.finalize_us, 0);
  ForwardAndCheck(*f, 0, 7, rng);  // the graph at 8 holds stale addresses: captured again
  ForwardAndCheck(*f, 0, 6, rng);
  const GraphStats s = f->kernel->graph_stats();
  EXPECT_EQ(s.captures, 2);
  EXPECT_EQ(s.replays, 2);
  EXPECT_EQ(f->pf->last_padded, 8);
}

// A workspace that grows keeps the buffer it replaces until the next forward begins (work of
// the step may still use it; a CUDA free would wait for the whole device), then it goes.
TEST(ModularKernelGraphs, ReplacedWorkspacesGoAtTheNextForwardsStart) {
  auto f = MakeFixture();
  std::mt19937 rng(8);
  ForwardAndCheck(*f, 0, 4, rng);
  EXPECT_EQ(f->allocator->release_calls, 1);
  EXPECT_EQ(f->allocator->superseded(), 0u);
  ForwardAndCheck(*f, 0, 64, rng);  // grows all three slots inside the step
  EXPECT_EQ(f->allocator->release_calls, 2);
  EXPECT_EQ(f->allocator->superseded(), 3u);  // kept through the step's end
  ForwardAndCheck(*f, 0, 5, rng);
  EXPECT_EQ(f->allocator->release_calls, 3);
  EXPECT_EQ(f->allocator->superseded(), 0u);
}

TEST(ModularKernelGraphs, UnstageableInputsRunEagerly) {
  auto f = MakeFixture();
  ASSERT_TRUE(f->kernel->EnableGraphs({.max_tokens = 8}).ok());
  f->pf->refuse_staging = true;
  std::mt19937 rng(5);
  ForwardAndCheck(*f, 0, 3, rng);
  const GraphStats s = f->kernel->graph_stats();
  EXPECT_EQ(s.eager, 1);
  EXPECT_EQ(s.captures, 0);
  EXPECT_EQ(f->pf->staged_calls, 1);
}

TEST(ModularKernelGraphs, AFailedCaptureTurnsGraphsOffAndKeepsTheAnswer) {
  auto f = MakeFixture();
  ASSERT_TRUE(f->kernel->EnableGraphs({.max_tokens = 8}).ok());
  f->allocator->fail_captures = true;
  std::mt19937 rng(6);
  ForwardAndCheck(*f, 0, 3, rng);  // answered by the eager run before the capture
  ForwardAndCheck(*f, 0, 3, rng);
  const GraphStats s = f->kernel->graph_stats();
  EXPECT_THAT(s.disabled_reason, HasSubstr("capture refused by the test"));
  EXPECT_EQ(f->kernel->graph_max_tokens(), 0);
  EXPECT_EQ(f->pf->staged_calls, 1);
}

TEST(ModularKernelGraphs, EnableGraphsRefusesWithReason) {
  auto f = MakeFixture();
  EXPECT_EQ(f->kernel->EnableGraphs({.max_tokens = 8, .sizes = {4, 2}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f->kernel->EnableGraphs({.max_tokens = 8, .sizes = {1, 4}}).code(),
            absl::StatusCode::kInvalidArgument);
  // CPU components cannot be captured.
  auto host = ModularKernel::Create(std::make_unique<FakePrepareFinalize>(&f->stream),
                                    std::make_unique<FakeExperts>(&f->stream));
  ASSERT_TRUE(host.ok());
  const absl::Status s = (*host)->EnableGraphs({.max_tokens = 8});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("host memory"));
}

}  // namespace
}  // namespace moeserve
