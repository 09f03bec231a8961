#include "core/forward_batcher.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/background_release.h"
#include "core/spin_wait.h"
#include "core/status_macros.h"
#include "core/thread_name.h"

namespace moeserve {

struct ForwardBatcher::Call {
  ForwardInput input;
  TensorView output;
  absl::Time deadline;
  std::function<bool()> cancelled;
  Done done;
  absl::Time enqueued;
  int64_t tokens = 0;
  uint64_t caller = 0;
  // Contiguous views can share a step (their rows are copied into the merged buffers).
  bool mergeable = false;
  bool stage_timings = true;  // CallSource::stage_timings
};

namespace {

double MicrosBetween(absl::Time a, absl::Time b) { return absl::ToDoubleMicroseconds(b - a); }

}  // namespace

absl::StatusOr<std::unique_ptr<ForwardBatcher>> ForwardBatcher::Create(
    Engine* engine, ForwardBatcherOptions options) {
  if (engine == nullptr) return absl::InvalidArgumentError("ForwardBatcher: no engine");
  MOESERVE_RETURN_IF_ERROR(CheckOptions(options));
  return std::unique_ptr<ForwardBatcher>(new ForwardBatcher(engine, std::move(options)));
}

absl::Status ForwardBatcher::CheckOptions(const ForwardBatcherOptions& options) {
  if (options.inline_max_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inline_max_tokens must be >= 0 (0: never run inline), got ", options.inline_max_tokens));
  }
  if (options.max_batch_tokens <= 0 || options.max_queued_tokens <= 0 ||
      options.max_batch_delay < absl::ZeroDuration() ||
      options.company_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch_tokens (", options.max_batch_tokens, ") and max_queued_tokens (",
                     options.max_queued_tokens, ") must be > 0, max_batch_delay (",
                     absl::FormatDuration(options.max_batch_delay), ") and company_wait (",
                     absl::FormatDuration(options.company_wait), ") >= 0"));
  }
  if (options.company_wait_auto && options.company_wait <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "company_wait_auto needs company_wait > 0 (the longest wait for company), got 0");
  }
  if (options.max_queue_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("max_queue_wait must be >= 0 (0: off), got ",
                                                   absl::FormatDuration(options.max_queue_wait)));
  }
  if (options.stage_timing_every < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stage_timing_every must be >= 1 (1: every step), got ", options.stage_timing_every));
  }
  if (options.lane_lead < absl::ZeroDuration() || options.lane_lead > absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat("lane_lead must be in [0, 1s] (0: off), got ",
                                                   absl::FormatDuration(options.lane_lead)));
  }
  if (options.idle_spin < absl::ZeroDuration() || options.idle_spin > absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat("idle_spin must be in [0, 1s] (0: off), got ",
                                                   absl::FormatDuration(options.idle_spin)));
  }
  return absl::OkStatus();
}

ForwardBatcher::ForwardBatcher(Engine* engine, ForwardBatcherOptions options)
    : engine_(engine),
      options_(std::move(options)),
      // A merged step is one engine call: it must respect the engine's per-call limit too.
      step_tokens_(std::min(options.max_batch_tokens, engine->info().max_tokens_per_request)),
      runners_(std::max(1, engine->steps_in_flight())) {
  // Merge buffers for the largest merged step, pinned now rather than while serving.
  size_t merge_bytes = static_cast<size_t>(step_tokens_) *
                       static_cast<size_t>(std::max<int64_t>(engine->info().model.hidden, 1)) *
                       sizeof(float);
  if (merge_bytes > kMaxPinnedMergeBytes) merge_bytes = 0;
  for (int i = 0; i < runners_; ++i) {
    buffers_.push_back(std::make_unique<StepBuffers>(options_.merge_pinner, merge_bytes));
  }
  for (int i = 0; i < runners_; ++i) {
    threads_.emplace_back([this, i, buffers = buffers_[i].get()] {
      SetCurrentThreadName("ms-sched" + std::to_string(i));
      Loop(buffers);
    });
  }
}

ForwardBatcher::~ForwardBatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stopping_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

namespace {

// A synthetic step of `n` tokens for `layer`: random hidden states (BF16 where the engine takes
// it), balanced routing (k of token t to expert (t * topk + k) mod num_experts: distinct in a
// row while topk <= num_experts, which the model guarantees), equal weights, and its output.
struct SyntheticStep {
  Tensor hidden, ids, weights, output;
  ForwardInput input;
};

absl::StatusOr<std::unique_ptr<SyntheticStep>> MakeSyntheticStep(const EngineInfo& info, int64_t n,
                                                                 int layer, std::mt19937& rng) {
  const ModelConfig& model = info.model;
  const auto takes = [](const std::vector<DType>& dtypes, DType d) {
    return dtypes.empty() || std::find(dtypes.begin(), dtypes.end(), d) != dtypes.end();
  };
  const DType hidden_dtype =
      takes(info.hidden_dtypes, DType::kBF16) ? DType::kBF16 : info.hidden_dtypes.front();
  const DType ids_dtype =
      takes(info.topk_ids_dtypes, DType::kINT32) ? DType::kINT32 : DType::kINT64;
  auto step = std::make_unique<SyntheticStep>();
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  MOESERVE_ASSIGN_OR_RETURN(Tensor hidden32, Tensor::Allocate(DType::kFP32, {n, model.hidden}));
  float* h = hidden32.data<float>();
  for (int64_t i = 0; i < n * model.hidden; ++i) h[i] = unit(rng);
  MOESERVE_ASSIGN_OR_RETURN(step->hidden, Tensor::Allocate(hidden_dtype, {n, model.hidden}));
  MOESERVE_RETURN_IF_ERROR(ConvertTensor(hidden32.view(), step->hidden.view()));
  MOESERVE_ASSIGN_OR_RETURN(step->ids, Tensor::Allocate(ids_dtype, {n, model.topk}));
  MOESERVE_ASSIGN_OR_RETURN(step->weights, Tensor::Allocate(DType::kFP32, {n, model.topk}));
  float* w = step->weights.data<float>();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < model.topk; ++k) {
      const int64_t e = (t * model.topk + k) % model.num_experts;
      if (ids_dtype == DType::kINT32) {
        step->ids.data<int32_t>()[t * model.topk + k] = static_cast<int32_t>(e);
      } else {
        step->ids.data<int64_t>()[t * model.topk + k] = e;
      }
      w[t * model.topk + k] = 1.0f / static_cast<float>(model.topk);
    }
  }
  MOESERVE_ASSIGN_OR_RETURN(step->output, Tensor::Allocate(hidden_dtype, {n, model.hidden}));
  step->input.layer = layer;
  step->input.hidden_states = step->hidden.view();
  step->input.topk_ids = step->ids.view();
  step->input.topk_weights = step->weights.view();
  return step;
}

// A layer that carries experts (a model may list its MoE layers; all are, otherwise).
int FirstMoeLayer(const ModelConfig& model) {
  return model.moe_layers.empty() ? 0 : model.moe_layers.front();
}

}  // namespace

absl::Status ForwardBatcher::Calibrate(const std::vector<int64_t>& sizes, int rounds) {
  if (sizes.empty() || rounds < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("Calibrate: need at least one size and rounds >= 2 (the first of each size "
                     "only warms up), got ",
                     sizes.size(), " sizes and rounds=", rounds));
  }
  const ModelConfig& model = engine_->info().model;
  std::mt19937 rng(20261205);
  for (int64_t size : sizes) {
    const int64_t n = std::clamp<int64_t>(size, 1, step_tokens_);
    MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<SyntheticStep> step,
                              MakeSyntheticStep(engine_->info(), n, FirstMoeLayer(model), rng));
    for (int r = 0; r < rounds; ++r) {
      const absl::Time start = absl::Now();
      ForwardTimings timings;
      MOESERVE_RETURN_IF_ERROR(engine_->ForwardValidated(step->input, step->output.view(), &timings,
                                                         nullptr, /*time_stages=*/false));
      const absl::Duration took = absl::Now() - start;
      if (r == 0) continue;  // warm-up
      std::lock_guard<std::mutex> lock(mu_);
      cost_.Add(n, took);
    }
  }
  return absl::OkStatus();
}

absl::Status ForwardBatcher::WarmUp(const std::vector<int64_t>& sizes,
                                    const std::vector<int>& layers) {
  std::mt19937 rng(20261206);
  absl::Status first;
  std::mutex first_mu;
  for (int layer : layers) {
    for (int64_t size : sizes) {
      const int64_t n = std::clamp<int64_t>(size, 1, step_tokens_);
      // One step per lane, started together so that each takes its own lane.
      std::vector<std::unique_ptr<SyntheticStep>> steps;
      for (int i = 0; i < runners_; ++i) {
        MOESERVE_ASSIGN_OR_RETURN(steps.emplace_back(),
                                  MakeSyntheticStep(engine_->info(), n, layer, rng));
      }
      std::vector<std::thread> threads;
      threads.reserve(static_cast<size_t>(runners_));
      for (int i = 0; i < runners_; ++i) {
        threads.emplace_back([&, step = steps[static_cast<size_t>(i)].get()] {
          absl::Status s = engine_->ForwardValidated(step->input, step->output.view(), nullptr,
                                                     nullptr, /*time_stages=*/false);
          std::lock_guard<std::mutex> lock(first_mu);
          if (first.ok() && !s.ok()) first = std::move(s);
        });
      }
      for (std::thread& t : threads) t.join();
      MOESERVE_RETURN_IF_ERROR(first);
    }
  }
  return absl::OkStatus();
}

ForwardBatcher::CostLine ForwardBatcher::cost_line() const {
  std::lock_guard<std::mutex> lock(mu_);
  return CostLine{cost_.fixed_us(), cost_.per_token_us(), cost_.steps()};
}

ForwardBatcherStats ForwardBatcher::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ForwardBatcherStats s = stats_;
  s.running = static_cast<int64_t>(running_steps_.size());
  if (options_.company_wait_auto) {
    for (const auto& [layer, h] : history_) s.merging_layers += h.merging ? 1 : 0;
  }
  return s;
}

ForwardBatcher::Company ForwardBatcher::ExpectedCompanyLocked(int layer) const {
  Company company;
  if (options_.company_wait <= absl::ZeroDuration()) return company;
  const auto it = history_.find(layer);
  if (it == history_.end()) return company;
  company.calls = it->second.expected_calls;
  if (company.calls > 1 && (!options_.company_wait_auto || it->second.merging)) {
    company.wait = std::min(options_.company_wait, 2 * it->second.last_step);
    // The bound on a call's wait for its step (the deployment's latency setting) bounds the
    // wait for company too: the admission estimate does not count it.
    if (options_.max_queue_wait > absl::ZeroDuration()) {
      company.wait = std::min(company.wait, options_.max_queue_wait);
    }
  }
  return company;
}

namespace {
// Whether two counts of a layer's callers are about the same population (within a quarter: an
// open loop's connections seen by the last steps vary; one caller and two differ).
bool SameCallers(int64_t a, int64_t b) { return 4 * std::abs(a - b) <= std::max(a, b); }
}  // namespace

void ForwardBatcher::SetCompanyModeLocked(LayerHistory& h, bool merging) {
  h.merging = merging;
  h.epoch_skip = kModeSkipSteps;
  ++stats_.mode_changes;
  if (options_.observer) options_.observer->OnCompanyMode(merging);
}

void ForwardBatcher::UpdateCompanyModeLocked(LayerHistory& h, int64_t calls, absl::Time now) {
  if (h.expected_calls <= 1) {  // a lone caller: no company to wait for, no mode to measure
    if (h.merging) SetCompanyModeLocked(h, false);
    h.epoch_skip = kModeSkipSteps;
    return;
  }
  if (h.epoch_skip > 0) {  // just after a change of mode: the callers regroup
    if (--h.epoch_skip == 0) {
      h.epoch_start = now;
      h.epoch_steps = h.epoch_calls = 0;
    }
    return;
  }
  h.epoch_calls += calls;
  if (++h.epoch_steps < kModeEpochSteps || now - h.epoch_start < kModeEpochTime) return;
  LayerHistory::ModeRecord& mine = h.modes[h.merging ? 1 : 0];
  const LayerHistory::ModeRecord& other = h.modes[h.merging ? 0 : 1];
  const double rate =
      static_cast<double>(h.epoch_calls) / absl::ToDoubleSeconds(now - h.epoch_start);
  // The best epoch since `since`, restarted once that is old or the callers changed.
  if (now - mine.since > kModeRetry || !SameCallers(mine.callers, h.callers_seen)) {
    mine.since = now;
    mine.rate = rate;
  } else {
    mine.rate = std::max(mine.rate, rate);
  }
  mine.measured = now;
  mine.epoch = now - h.epoch_start;
  mine.callers = h.callers_seen;
  ++(h.merging ? stats_.merged_epochs : stats_.split_epochs);
  h.epoch_start = now;
  h.epoch_steps = h.epoch_calls = 0;
  // The other mode is measured again once its rate is old or was for other callers.
  const bool other_known =
      now - other.measured <= std::max(kModeRetry, kModeExploreEvery * other.epoch) &&
      SameCallers(other.callers, h.callers_seen);
  const bool merge = other_known ? h.modes[1].rate > kMergeMargin * h.modes[0].rate : !h.merging;
  if (merge != h.merging) SetCompanyModeLocked(h, merge);
}

void ForwardBatcher::RecordStepLocked(const Step& live, absl::Duration took, bool stopped) {
  static_assert(kCallerSteps <= kHistorySteps);
  LayerHistory& h = history_[live[0]->input.layer];
  h.calls[h.next] = static_cast<int64_t>(live.size());
  h.callers[h.next].clear();
  // The callers' turnaround runs from here (their answers go out next) to their next call.
  if (h.answered.size() > kMaxAnsweredCallers) h.answered.clear();
  const absl::Time now = absl::Now();
  for (const auto& c : live) {
    if (c->caller == 0) continue;
    h.callers[h.next].push_back(c->caller);
    h.answered[c->caller] = now;
  }
  h.next = (h.next + 1) % kHistorySteps;
  if (!stopped) h.last_step = took;
  absl::InlinedVector<uint64_t, 16> callers;
  for (int back = 1; back <= kCallerSteps; ++back) {
    const auto& step = h.callers[(h.next - back + kHistorySteps) % kHistorySteps];
    callers.insert(callers.end(), step.begin(), step.end());
  }
  std::sort(callers.begin(), callers.end());
  h.expected_calls = std::unique(callers.begin(), callers.end()) - callers.begin();
  int64_t most_calls = 0;
  for (const int64_t calls : h.calls) most_calls = std::max(most_calls, calls);
  h.expected_calls = std::max(h.expected_calls, most_calls);
  // The lead's population: every caller of the layer's remembered steps. (Over the last two
  // steps only, callers split into three steps of ~2.7 would expect ~2.7 back and keep splitting.)
  for (int back = kCallerSteps + 1; back <= kHistorySteps; ++back) {
    const auto& step = h.callers[(h.next - back + kHistorySteps) % kHistorySteps];
    callers.insert(callers.end(), step.begin(), step.end());
  }
  std::sort(callers.begin(), callers.end());
  h.callers_seen = std::unique(callers.begin(), callers.end()) - callers.begin();
  h.callers_seen = std::max(h.callers_seen, most_calls);
  if (options_.company_wait_auto) {
    UpdateCompanyModeLocked(h, static_cast<int64_t>(live.size()), now);
  }
}

std::optional<absl::Duration> ForwardBatcher::NoteReturnLocked(int layer, uint64_t caller,
                                                               absl::Time now) {
  const auto it = history_.find(layer);
  if (it == history_.end()) return std::nullopt;
  LayerHistory& h = it->second;
  const auto answered = h.answered.find(caller);
  if (answered == h.answered.end()) return std::nullopt;
  const absl::Duration sample = std::max(now - answered->second, absl::ZeroDuration());
  h.answered.erase(answered);
  h.turnaround = h.turnaround_samples == 0 ? sample : (3 * h.turnaround + sample) / 4;
  ++h.turnaround_samples;
  return sample;
}

bool ForwardBatcher::LeadReadyLocked(int layer, int64_t calls, int64_t tokens) const {
  const auto it = history_.find(layer);
  if (it == history_.end()) return true;  // no history: no cohort to wait for
  const LayerHistory& h = it->second;
  int64_t cohort = h.callers_seen;
  for (const RunningStep& s : running_steps_) {
    if (s.layer == layer) cohort -= s.calls;
  }
  if (calls < cohort) return false;
  if (h.turnaround_samples == 0 || cost_.steps() == 0) return true;
  return h.turnaround + options_.lane_lead <= cost_.Predict(tokens);
}

bool ForwardBatcher::Joins(const Call& head, const Call& c) {
  return c.mergeable && head.mergeable && c.input.layer == head.input.layer &&
         c.input.hidden_states.dtype() == head.input.hidden_states.dtype();
}

void ForwardBatcher::Submit(const ForwardInput& input, const TensorView& output,
                            absl::Time deadline, std::function<bool()> cancelled, Done done,
                            CallSource source) {
  const ForwardTimings no_timings;
  const EngineInfo& info = engine_->info();
  if (absl::Status s = ValidateForwardInput(info.model, info.max_tokens_per_request, input);
      !s.ok()) {
    return done(s, no_timings);
  }
  // An engine that cannot serve refuses at once (UNAVAILABLE), even an empty call.
  if (absl::Status h = engine_->health(); !h.ok()) return done(h, no_timings);
  const int64_t m = input.hidden_states.dim(0);
  if (output.dtype() != input.hidden_states.dtype() ||
      output.shape() != input.hidden_states.shape() || !output.is_contiguous() ||
      (!output.device().is_host() && !info.device_tensors)) {
    return done(absl::InvalidArgumentError(absl::StrCat(
                    "output must be contiguous host ", DTypeName(input.hidden_states.dtype()),
                    ShapeToString(input.hidden_states.shape()), ", got ", output.DebugString())),
                no_timings);
  }
  if (m == 0) return done(absl::OkStatus(), no_timings);
  auto call = std::make_unique<Call>();
  call->input = input;
  call->output = output;
  call->deadline = deadline;
  call->cancelled = std::move(cancelled);
  call->done = std::move(done);
  call->enqueued = absl::Now();
  call->tokens = m;
  call->caller = source.caller;
  call->stage_timings = source.stage_timings;
  // Device tensors (a CUDA region) run alone: the merged buffers are host memory.
  call->mergeable = input.hidden_states.is_contiguous() && input.topk_ids.is_contiguous() &&
                    input.topk_weights.is_contiguous() && input.hidden_states.device().is_host() &&
                    input.topk_ids.device().is_host() && input.topk_weights.device().is_host() &&
                    output.device().is_host();
  bool wake = true;
  uint64_t step_id = 0;
  std::optional<absl::Duration> turnaround;
  absl::Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (call->caller != 0) turnaround = NoteReturnLocked(input.layer, call->caller, call->enqueued);
    if (stop_) {
      refused = absl::UnavailableError("Forward: the server is shutting down");
    } else if (stats_.queued_tokens + m > options_.max_queued_tokens) {
      ++stats_.refused_queue_full;
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "Forward: the queue is full (", stats_.queued_tokens, " tokens queued + ", m,
          " > max_queued_tokens=", options_.max_queued_tokens, "); retry later or elsewhere"));
    } else if (options_.max_queue_wait > absl::ZeroDuration()) {
      const absl::Duration wait = EstimatedWaitLocked(*call, call->enqueued);
      if (wait > options_.max_queue_wait) {
        ++stats_.refused_queue_full;
        refused = absl::ResourceExhaustedError(absl::StrCat(
            "Forward: the call would wait ",
            wait == absl::InfiniteDuration()
                ? "longer than max_queue_wait"
                : absl::StrCat("about ", absl::ToInt64Microseconds(wait), " us"),
            " for its step (", running_steps_.size(), " steps running, ", stats_.queued_tokens,
            " tokens queued ahead; a step of n tokens takes about ",
            static_cast<int64_t>(cost_.fixed_us()), " + ", cost_.per_token_us(),
            " x n us) > max_queue_wait=", absl::FormatDuration(options_.max_queue_wait),
            "; retry later or elsewhere"));
      }
    }
    // A call that cannot share a step (device tensors) gains nothing from waiting or from a
    // scheduling thread, whatever its size.
    // Nor does a small call whose layer has no company to expect.
    // A refused call is answered below, without the lock.
    const bool run_here =
        refused.ok() && source.may_run_inline && options_.inline_max_tokens > 0 && queue_.empty() &&
        running_steps_.empty() &&
        (!call->mergeable ||
         (m <= options_.inline_max_tokens && options_.max_batch_delay == absl::ZeroDuration() &&
          ExpectedCompanyLocked(input.layer).wait == absl::ZeroDuration()));
    if (run_here) {
      // Nothing running and nothing to merge with: run here. Calls arriving meanwhile queue
      // and merge as usual (a second step only with half a step of work, see Loop).
      step_id = BeginStepLocked(input.layer, 1, m);
      ++stats_.inline_steps;
    } else if (refused.ok()) {
      CountQueuedLocked(*call, +1);
      queue_.push_back(std::move(call));
      queued_calls_.store(static_cast<int64_t>(queue_.size()), std::memory_order_release);
      call = nullptr;
      // A polling thread takes it: no wake-up (the other threads sleep on, as they would after
      // a notify that the poller answers first).
      wake = !spinning_;
    }
  }
  if (call == nullptr && wake) cv_.notify_all();
  if (options_.observer && turnaround.has_value()) options_.observer->OnTurnaround(*turnaround);
  if (call == nullptr) return;
  if (!refused.ok()) {
    if (options_.observer && refused.code() == absl::StatusCode::kResourceExhausted) {
      options_.observer->OnRefused(refused.code());
    }
    return call->done(refused, no_timings);
  }
  Step step;
  step.push_back(std::move(call));
  RunStep(std::move(step), nullptr, step_id);
}

void ForwardBatcher::Loop(StepBuffers* buffers) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (queue_.empty() && !stop_ && !spinning_ && options_.idle_spin > absl::ZeroDuration()) {
      spinning_ = true;
      lock.unlock();
      const bool found = PollForCall();
      lock.lock();
      spinning_ = false;
      if (found && !queue_.empty()) ++stats_.spin_takes;
    }
    cv_.wait(lock, [this] { return stop_ || !queue_.empty() || prewake_; });
    if (stop_) break;
    if (prewake_) {
      prewake_ = false;
      if (queue_.empty()) continue;  // poll for the call on its way (the loop's top)
    }
    // Wait for company until the head's delay is spent or its step is full. Another scheduling
    // thread may take the head meanwhile: look again after every wait.
    bool take = false, waited_for_company = false, lead_step = false, counted_lead_wait = false;
    while (!stop_ && !queue_.empty()) {
      const Call& head = *queue_.front();
      absl::Time ready_at = head.enqueued + options_.max_batch_delay;
      int64_t tokens = 0, calls = 0;
      for (const auto& c : queue_) {
        if (c.get() == &head || Joins(head, *c)) {
          tokens += c->tokens;
          ++calls;
        }
      }
      if (head.mergeable) {
        // Callers that shared the layer's recent steps are likely on their way back.
        const Company company = ExpectedCompanyLocked(head.input.layer);
        if (calls < company.calls && head.enqueued + company.wait > ready_at) {
          ready_at = head.enqueued + company.wait;
          waited_for_company = waited_for_company || absl::Now() < ready_at;
        }
      }
      // While another step runs, a second one starts only with at least half a step of work:
      // decode steps are bound by reading the weights, so one merged step beats two small
      // concurrent ones; large calls still overlap one another's copies. With lane_lead, it
      // also starts once the running steps are due to end within it (its staging and launch
      // then overlap their device work).
      const absl::Time now = absl::Now();
      const absl::Time due = LaneDueLocked();
      // A step this small beside running ones starts only through the lead, and only with its
      // cohort (the callers its layer expects back) queued.
      const bool small_beside = !running_steps_.empty() && tokens * 2 < step_tokens_;
      const bool cohort_in = !small_beside || now < due || !head.mergeable ||
                             LeadReadyLocked(head.input.layer, calls, tokens);
      const bool lane_worth_it = !small_beside || (now >= due && cohort_in);
      if (lane_worth_it && (tokens >= step_tokens_ || now >= ready_at)) {
        take = true;
        lead_step = small_beside;
        break;
      }
      if (!cohort_in && !counted_lead_wait) {
        counted_lead_wait = true;
        ++stats_.lead_waits;
      }
      if (!lane_worth_it && now >= ready_at) {
        // Until a step ends, more calls come, or the running steps are due (once due, only
        // a step's end or a call can change the answer).
        if (due == absl::InfiniteFuture() || now >= due) {
          cv_.wait(lock);
        } else {
          cv_.wait_for(lock, std::chrono::microseconds(
                                 std::max<int64_t>(1, absl::ToInt64Microseconds(due - now))));
        }
      } else {
        cv_.wait_for(lock, std::chrono::microseconds(std::max<int64_t>(
                               1, absl::ToInt64Microseconds(ready_at - absl::Now()))));
      }
    }
    if (stop_) break;
    if (!take) continue;
    // The head, then every call that joins it in arrival order while the step fits.
    Step step;
    int64_t tokens = 0;
    for (auto it = queue_.begin(); it != queue_.end();) {
      Call& c = **it;
      const bool first = step.empty();
      if (first || (Joins(*step.front(), c) && tokens + c.tokens <= step_tokens_)) {
        tokens += c.tokens;
        CountQueuedLocked(c, -1);
        step.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
    queued_calls_.store(static_cast<int64_t>(queue_.size()), std::memory_order_release);
    if (waited_for_company) ++stats_.company_waits;
    if (lead_step) ++stats_.lead_steps;
    const uint64_t step_id =
        BeginStepLocked(step.front()->input.layer, static_cast<int64_t>(step.size()), tokens);
    lock.unlock();
    if (lead_step && options_.observer != nullptr) options_.observer->OnLeadStep();
    RunStep(std::move(step), buffers, step_id);
    lock.lock();
  }
  // Shutting down: whatever is still queued is answered, not dropped (by the first thread out).
  std::deque<std::unique_ptr<Call>> left;
  left.swap(queue_);
  stats_.queued_tokens = 0;
  group_tokens_.clear();
  alone_calls_ = alone_tokens_ = 0;
  queued_calls_.store(0, std::memory_order_release);
  lock.unlock();
  for (auto& c : left) {
    c->done(absl::UnavailableError("Forward: the server is shutting down"), ForwardTimings());
  }
}

void ForwardBatcher::Prewake() {
  if (options_.idle_spin <= absl::ZeroDuration()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (spinning_ || prewake_ || stop_ || !queue_.empty()) return;
    prewake_ = true;
  }
  cv_.notify_one();
}

bool ForwardBatcher::PollForCall() const {
  return PollFor(
      options_.idle_spin, [this] { return queued_calls_.load(std::memory_order_acquire) > 0; },
      [this] { return stopping_.load(std::memory_order_acquire); });
}

namespace {

// A merged step's answers counted down as they are handed on (on whichever thread): the last
// tells the observer where the step's time went.
class AnswerClock {
 public:
  AnswerClock(ForwardBatcherObserver* observer, const MergedStepTimes& times, absl::Time engine_end,
              size_t calls)
      : observer_(observer), times_(times), engine_end_(engine_end), left_(calls) {}
  void Answered() {
    if (left_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    times_.answers = absl::Now() - engine_end_;  // after every other answer's count
    observer_->OnMergedStep(times_);
  }

 private:
  ForwardBatcherObserver* const observer_;
  MergedStepTimes times_;
  const absl::Time engine_end_;
  std::atomic<size_t> left_;
};

// Whether `c`'s caller gave up by `now`: DEADLINE_EXCEEDED or CANCELLED (`when` says at what
// point), else OK.
absl::Status GaveUp(const ForwardBatcher::Call& c, absl::Time now, absl::string_view when) {
  if (c.deadline <= now) {
    return absl::DeadlineExceededError(absl::StrCat("Forward: the deadline passed after ",
                                                    MicrosBetween(c.enqueued, now), " us ", when));
  }
  if (c.cancelled && c.cancelled()) {
    return absl::CancelledError(absl::StrCat("Forward: cancelled by the client ", when));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t ForwardBatcher::BeginStepLocked(int layer, int64_t calls, int64_t tokens) {
  running_steps_.push_back(RunningStep{++next_step_id_, absl::Now(), layer, calls, tokens});
  return next_step_id_;
}

void ForwardBatcher::EndStepLocked(uint64_t step_id) {
  for (auto it = running_steps_.begin(); it != running_steps_.end(); ++it) {
    if (it->id == step_id) {
      running_steps_.erase(it);
      return;
    }
  }
}

bool ForwardBatcher::WakeForStepEndLocked() {
  // Every wait that a step's end can end is one for a queued call (a lane for it, or its
  // company); with nothing queued, a notify would only wake the idle threads (a futex wake
  // each, microseconds on the answering thread) to sleep again.
  if (queue_.empty()) return false;
  ++stats_.step_end_wakes;
  return true;
}

void ForwardBatcher::CountQueuedLocked(const Call& c, int64_t sign) {
  stats_.queued_tokens += sign * c.tokens;
  if (!c.mergeable) {
    alone_calls_ += sign;
    alone_tokens_ += sign * c.tokens;
    return;
  }
  const GroupKey key{c.input.layer, static_cast<int>(c.input.hidden_states.dtype())};
  int64_t& tokens = group_tokens_[key];
  tokens += sign * c.tokens;
  if (tokens == 0) group_tokens_.erase(key);
}

absl::Duration ForwardBatcher::EstimatedWaitLocked(const Call& call, absl::Time now) const {
  if (cost_.steps() == 0) return absl::ZeroDuration();  // nothing learned yet
  // When each engine lane is free: the running steps, in start order, each on the lane free
  // first (more steps than lanes wait for one inside the engine); a step past its expected
  // end is taken to end now.
  absl::InlinedVector<absl::Time, 8> free_at(static_cast<size_t>(runners_), absl::InfinitePast());
  for (const RunningStep& s : running_steps_) {
    absl::Time& lane = *std::min_element(free_at.begin(), free_at.end());
    lane = std::max(lane, s.start) + cost_.Predict(s.tokens);
  }
  for (absl::Time& t : free_at) t = std::max(t, now);
  // Places a step of `n` tokens on the lane free first and returns its start; one of less than
  // half a step's tokens waits until no step runs (Loop's lane rule). lane_lead is not
  // credited: a step started early by it stages and launches beside the running ones, but its
  // device work still waits for them, and counting the lead admitted more calls than the lanes
  // served in time (issue 12's overload with a 120 us lead: p99 2-3.5x the lead-free run's).
  const auto place = [&](int64_t n) {
    auto lane = std::min_element(free_at.begin(), free_at.end());
    const absl::Time start =
        n * 2 < step_tokens_ ? *std::max_element(free_at.begin(), free_at.end()) : *lane;
    *lane = std::max(*lane, start) + cost_.Predict(n);
    return start;
  };
  // Ahead of this call: the steps of every other layer and dtype queued (taken as all older
  // than this call's: the queue serves the oldest call first), the calls that run alone, then
  // the full steps of its own group. Stops once the wait passes the bound.
  int64_t mine = call.tokens;
  const auto steps_of = [&](int64_t tokens) -> bool {
    for (; tokens > 0; tokens -= step_tokens_) {
      place(std::min(tokens, step_tokens_));
      if (*std::min_element(free_at.begin(), free_at.end()) - now > options_.max_queue_wait) {
        return false;
      }
    }
    return true;
  };
  const GroupKey key{call.input.layer, static_cast<int>(call.input.hidden_states.dtype())};
  for (const auto& [group, tokens] : group_tokens_) {
    if (call.mergeable && group == key) {
      mine += tokens;
    } else if (!steps_of(tokens)) {
      return absl::InfiniteDuration();
    }
  }
  for (int64_t i = 0; i < alone_calls_; ++i) {
    if (!steps_of(std::max<int64_t>(1, alone_tokens_ / alone_calls_))) {
      return absl::InfiniteDuration();
    }
  }
  if (call.tokens > step_tokens_) {
    // A call larger than a step joins no other: Loop runs it as a step of its own once its
    // group's queued calls (all older) have run.
    if (mine > call.tokens && !steps_of(mine - call.tokens)) return absl::InfiniteDuration();
    return place(call.tokens) - now;
  }
  if (mine > step_tokens_ && !steps_of((mine - 1) / step_tokens_ * step_tokens_)) {
    return absl::InfiniteDuration();
  }
  return place(mine - (mine - 1) / step_tokens_ * step_tokens_) - now;
}

absl::Time ForwardBatcher::LaneDueLocked() const {
  if (options_.lane_lead <= absl::ZeroDuration() || running_steps_.empty() || cost_.steps() == 0) {
    return absl::InfiniteFuture();
  }
  absl::Time last_end = absl::InfinitePast();
  for (const RunningStep& s : running_steps_) {
    last_end = std::max(last_end, s.start + cost_.Predict(s.tokens));
  }
  return last_end - options_.lane_lead;
}

void ForwardBatcher::RunStep(Step calls, StepBuffers* buffers, uint64_t step_id) {
  const absl::Time start = absl::Now();
  std::vector<std::unique_ptr<Call>> live;
  std::vector<std::pair<std::unique_ptr<Call>, absl::Status>> dropped;
  int64_t deadline_drops = 0, cancel_drops = 0;
  bool wake = false;
  for (auto& c : calls) {
    absl::Status gave_up = GaveUp(*c, start, "in the queue, before the call ran");
    if (gave_up.ok()) {
      live.push_back(std::move(c));
      continue;
    }
    ++(gave_up.code() == absl::StatusCode::kDeadlineExceeded ? deadline_drops : cancel_drops);
    dropped.emplace_back(std::move(c), std::move(gave_up));
  }
  // Counted before they are answered: a caller that reads the stats then sees its own call.
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.dropped_deadline += deadline_drops;
    stats_.dropped_cancelled += cancel_drops;
    if (live.empty()) EndStepLocked(step_id);  // no step after all
    wake = live.empty() && WakeForStepEndLocked();
  }
  if (wake) cv_.notify_all();
  for (auto& [c, status] : dropped) {
    if (options_.observer) options_.observer->OnRefused(status.code());
    c->done(std::move(status), ForwardTimings());
  }
  if (live.empty()) return;

  // The step stops between stages once every caller in it has given up (a merged step still
  // serves the others).
  StopCheck stop = [&live]() -> absl::Status {
    const absl::Time now = absl::Now();
    absl::Status first;
    for (const auto& c : live) {
      absl::Status s = GaveUp(*c, now, "while the call ran");
      if (s.ok()) return s;
      if (first.ok()) first = std::move(s);
    }
    if (live.size() == 1) return first;
    return absl::Status(first.code(), absl::StrCat("Forward: all ", live.size(),
                                                   " calls of a merged step gave up"));
  };
  ForwardTimings timings;
  absl::Status status;
  TensorView merged_output;
  absl::Time engine_start = start;
  const bool time_stages = TimeStages(live);
  if (live.size() == 1) {
    // Alone: straight from and into the caller's buffers.
    status =
        engine_->ForwardValidated(live[0]->input, live[0]->output, &timings, stop, time_stages);
  } else {
    status = MergeAndRun(live, buffers, &timings, stop, time_stages, &merged_output, &engine_start);
  }
  const absl::Time engine_end = absl::Now();
  const absl::Duration took = engine_end - start;
  const bool stopped = status.code() == absl::StatusCode::kDeadlineExceeded ||
                       status.code() == absl::StatusCode::kCancelled;
  int64_t step_tokens = 0, queued_tokens = 0;
  for (const auto& c : live) step_tokens += c->tokens;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The step's time, for the queue-wait admission, learned before the step's callers hear
    // back (a stopped step ran only part of its work: not learned).
    if (!stopped && step_tokens > 0) cost_.Add(step_tokens, took);
    if ((options_.company_wait > absl::ZeroDuration() ||
         options_.lane_lead > absl::ZeroDuration()) &&
        live[0]->mergeable) {
      RecordStepLocked(live, took, stopped);
    }
    ++stats_.steps;
    stats_.calls += static_cast<int64_t>(live.size());
    if (live.size() > 1) {
      stats_.merged_calls += static_cast<int64_t>(live.size());
      if (buffers->hidden.pinned() && buffers->output.pinned()) ++stats_.pinned_merges;
    }
    stats_.max_step_calls = std::max<int64_t>(stats_.max_step_calls, live.size());
    if (stopped) stats_.stopped += static_cast<int64_t>(live.size());
    queued_tokens = stats_.queued_tokens;
    // The engine is done with the step: the next one may start (on another scheduling
    // thread) while this thread answers, which costs tens of us per gRPC call.
    EndStepLocked(step_id);
    wake = WakeForStepEndLocked();
  }
  if (wake) cv_.notify_all();
  // A merged step's answers are copied out after the step has ended (a step waiting for the
  // lane starts meanwhile: its host staging is the device's idle time between steps), each
  // call's rows just before its answer is handed on, so that the first callers hear back
  // without waiting for every copy.
  const bool scatter = status.ok() && live.size() > 1;
  const size_t row_bytes =
      scatter ? static_cast<size_t>(merged_output.dim(1)) * DTypeSize(merged_output.dtype()) : 0;
  int64_t scatter_at = 0;
  if (options_.observer) {
    options_.observer->OnStep(static_cast<int64_t>(live.size()), step_tokens, queued_tokens);
  }
  const absl::Time end = absl::Now();
  std::shared_ptr<AnswerClock> clock;
  if (options_.observer != nullptr && status.ok() && live.size() > 1) {
    MergedStepTimes times;
    times.calls = static_cast<int64_t>(live.size());
    absl::Time first = absl::InfiniteFuture(), last = absl::InfinitePast();
    for (const auto& c : live) {
      first = std::min(first, c->enqueued);
      last = std::max(last, c->enqueued);
    }
    times.arrivals = last - first;
    times.take = start - last;
    times.merge = engine_start - start;
    times.engine = engine_end - engine_start;
    clock = std::make_shared<AnswerClock>(options_.observer, times, engine_end, live.size());
  }
  for (size_t i = 0; i < live.size(); ++i) {
    std::unique_ptr<Call>& c = live[i];
    ForwardTimings mine = timings;
    mine.queue_us += MicrosBetween(c->enqueued, start);
    absl::Status mine_status = status;
    if (stopped && live.size() > 1) {
      // Each caller hears its own reason (deadline or cancellation), and where the step stopped.
      absl::Status own = GaveUp(*c, end, "while the call ran");
      if (!own.ok()) {
        mine_status = absl::Status(own.code(), absl::StrCat(own.message(), "; ", status.message()));
      }
    }
    if (stopped && options_.observer) options_.observer->OnRefused(mine_status.code());
    if (scatter) {
      std::memcpy(c->output.raw_data(), merged_output.data<std::byte>() + scatter_at * row_bytes,
                  static_cast<size_t>(c->tokens) * row_bytes);
      scatter_at += c->tokens;
    }
    if (i + 1 < live.size() && options_.answer_executor) {
      // The executor gets a copy: a task it does not take is answered here.
      std::function<void()> answer = [call = std::shared_ptr<Call>(std::move(c)), mine_status, mine,
                                      clock] {
        call->done(mine_status, mine);
        if (clock) clock->Answered();
      };
      if (!options_.answer_executor(answer)) answer();
      continue;
    }
    c->done(mine_status, mine);
    if (clock) clock->Answered();
  }
}

bool ForwardBatcher::TimeStages(const Step& live) {
  const bool asked =
      std::any_of(live.begin(), live.end(), [](const auto& c) { return c->stage_timings; });
  std::lock_guard<std::mutex> lock(mu_);
  // A step a caller asked for counts as the sample (the next one is due `every` steps later).
  const bool timed = asked || ++untimed_run_ >= options_.stage_timing_every;
  if (timed) {
    untimed_run_ = 0;
    ++stats_.timed_steps;
  }
  return timed;
}

ForwardBatcher::MergeBuffer::MergeBuffer(HostMemoryPinner* pinner, size_t pinned_bytes)
    : pinner_(pinner) {
  if (pinner_ == nullptr || pinned_bytes == 0) return;
  if (!Allocate(pinned_bytes)) return;  // TryGet allocates plain memory then
  pinned_ = pinner_->Pin(data_, capacity_).ok();
}

bool ForwardBatcher::MergeBuffer::Allocate(size_t bytes) {
  constexpr size_t kPage = 4096;  // whole pages: what page-locking works in
  const size_t rounded = std::max<size_t>((bytes + kPage - 1) / kPage * kPage, kPage);
  data_ = std::aligned_alloc(kPage, rounded);
  capacity_ = data_ != nullptr ? rounded : 0;
  return data_ != nullptr;
}

ForwardBatcher::MergeBuffer::~MergeBuffer() { Release(); }

void ForwardBatcher::MergeBuffer::Release() {
  if (data_ == nullptr) return;
  void* data = data_;
  data_ = nullptr;
  capacity_ = 0;
  if (pinned_) {
    pinned_ = false;
    // Unpinning waits for the whole device: never on a serving thread.
    ReleaseInBackground([pinner = pinner_, data] {
      pinner->Unpin(data);
      std::free(data);
    });
  } else {
    std::free(data);
  }
}

absl::StatusOr<TensorView> ForwardBatcher::MergeBuffer::TryGet(DType dtype, const Shape& shape) {
  MOESERVE_ASSIGN_OR_RETURN(const int64_t bytes, BufferBytes(dtype, shape));
  if (static_cast<size_t>(bytes) > capacity_) {
    // Beyond what was pinned at creation (or nothing was): plain memory, doubling. Never pinned
    // here: pinning and unpinning while serving stall the device's other work.
    const size_t want = std::max(static_cast<size_t>(bytes), 2 * capacity_);
    Release();
    if (!Allocate(want)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", want, " bytes for a merged step"));
    }
  }
  return TensorView(data_, dtype, shape, pinned_ ? Device::PinnedHost() : Device::Host());
}

absl::Status ForwardBatcher::MergeAndRun(const Step& live, StepBuffers* buffers,
                                         ForwardTimings* timings, const StopCheck& stop,
                                         bool time_stages, TensorView* merged_output,
                                         absl::Time* engine_start) {
  const ForwardInput& first = live[0]->input;
  const int64_t hidden = first.hidden_states.dim(1), topk = first.topk_ids.dim(1);
  const DType dtype = first.hidden_states.dtype();
  const size_t row = static_cast<size_t>(hidden) * DTypeSize(dtype);
  int64_t m = 0;
  for (const auto& c : live) m += c->tokens;  // at most step_tokens_
  ForwardInput merged;
  merged.layer = first.layer;
  MOESERVE_ASSIGN_OR_RETURN(merged.hidden_states, buffers->hidden.TryGet(dtype, {m, hidden}));
  MOESERVE_ASSIGN_OR_RETURN(merged.topk_ids, buffers->ids.TryGet(DType::kINT32, {m, topk}));
  MOESERVE_ASSIGN_OR_RETURN(merged.topk_weights, buffers->weights.TryGet(DType::kFP32, {m, topk}));
  MOESERVE_ASSIGN_OR_RETURN(const TensorView output, buffers->output.TryGet(dtype, {m, hidden}));
  int64_t at = 0;
  for (const auto& c : live) {
    const ForwardInput& in = c->input;
    const int64_t n = c->tokens;
    std::memcpy(merged.hidden_states.data<std::byte>() + at * row, in.hidden_states.raw_data(),
                n * row);
    int32_t* ids = merged.topk_ids.data<int32_t>() + at * topk;
    if (in.topk_ids.dtype() == DType::kINT32) {
      std::memcpy(ids, in.topk_ids.raw_data(), n * topk * sizeof(int32_t));
    } else {  // INT64, range-checked by ValidateForwardInput
      for (int64_t i = 0; i < n * topk; ++i) {
        ids[i] = static_cast<int32_t>(in.topk_ids.data<int64_t>()[i]);
      }
    }
    std::memcpy(merged.topk_weights.data<float>() + at * topk, in.topk_weights.raw_data(),
                n * topk * sizeof(float));
    at += n;
  }
  *engine_start = absl::Now();
  MOESERVE_RETURN_IF_ERROR(engine_->ForwardValidated(merged, output, timings, stop, time_stages));
  *merged_output = output;
  return absl::OkStatus();
}

}  // namespace moeserve
