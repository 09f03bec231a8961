// The per-layer batcher: concurrent Forward calls for the same MoE layer (attention
// data-parallel ranks, micro-batches) become one engine step, and each caller gets exactly its
// rows back.
//
// A scheduling thread takes the oldest queued call (arrival order across layers, so no
// layer starves), then every queued call of the same layer and hidden dtype in arrival order
// while the step stays within max_batch_tokens, waiting up to max_batch_delay after the oldest
// call's arrival for more to come, or, where the layer's recent steps merged several calls,
// until as many have come (company_wait: callers that shared a step come back together, while
// a lone caller never waits). Calls whose deadline passed or that were cancelled are
// answered (DEADLINE_EXCEEDED / CANCELLED) without running; a running step stops between its
// stages once every call in it has given up (Engine::Forward's `stop`), and each of its calls
// gets its own DEADLINE_EXCEEDED or CANCELLED. The queue is bounded in tokens:
// beyond max_queued_tokens (or, when set, beyond max_queue_wait of estimated work) a call is
// refused at once with RESOURCE_EXHAUSTED naming the limit.
//
// Submitted inputs are validated first (ValidateForwardInput), so a bad call is refused alone
// and never fails the step it would have joined; a failed step fails every call in it.
//
// With an engine that runs several steps at once (Engine::steps_in_flight(), e.g. two lanes on a
// GPU) there are that many scheduling threads, each forming a step and running it, so that one
// step's copies overlap another's experts. A thread forms its step only when it is free to run
// it, so the step merges everything that arrived meanwhile, and no thread hop is added.
//
// Thread-safety: Submit from any thread. The callback runs on the scheduling or a runner thread
// (or on the submitting thread for an immediate answer) and must not block for long.
#ifndef MOESERVE_CORE_FORWARD_BATCHER_H_
#define MOESERVE_CORE_FORWARD_BATCHER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "core/memory_region.h"
#include "core/step_cost_model.h"
#include "core/tensor.h"

namespace moeserve {

// Where a merged step's time went, from its first call's arrival to its last call's answer
// (ForwardBatcherObserver::OnMergedStep): the spread of its calls' arrivals (first to last),
// the last arrival to the step's start (waiting for a lane, or a scheduling thread's wake-up),
// the merge (its calls' rows gathered into one step), the engine, and the answers (the engine's
// end to the last call's answer handed on: copied out of the merged step and sent).
struct MergedStepTimes {
  int64_t calls = 0;
  absl::Duration arrivals, take, merge, engine, answers;
};

// Told what the batcher does, e.g. for metrics. Must outlive the batcher; thread-safe.
class ForwardBatcherObserver {
 public:
  virtual ~ForwardBatcherObserver() = default;
  // A step ran `calls` calls of `tokens` tokens in all; `queued_tokens` are still waiting.
  // Scheduling thread.
  virtual void OnStep(int64_t calls, int64_t tokens, int64_t queued_tokens) = 0;
  // A call was answered without running, or its step stopped part-way: RESOURCE_EXHAUSTED
  // (queue full, on the submitting thread), DEADLINE_EXCEEDED or CANCELLED (scheduling thread).
  virtual void OnRefused(absl::StatusCode reason) = 0;
  // A small step started beside running ones because they were due to end within lane_lead
  // (it would have waited for them otherwise). Scheduling thread, before the step runs.
  virtual void OnLeadStep() {}
  // company_wait_auto: a layer's mode changed (merging: it now waits for company). Scheduling
  // thread.
  virtual void OnCompanyMode(bool merging) {}
  // A merged step's last call was answered. The thread that answered it (a scheduling thread
  // or answer_executor's).
  virtual void OnMergedStep(const MergedStepTimes& times) {}
  // A caller (CallSource::caller) called a layer again this long after its last step of that
  // layer ended: its answer, its own work and its request's way in (what company_wait and
  // lane_lead expect of it). Submitting thread.
  virtual void OnTurnaround(absl::Duration turnaround) {}
};

struct ForwardBatcherOptions {
  // Most tokens in one engine step (a single larger call still runs, alone); never more than
  // the engine's max_tokens_per_request.
  int64_t max_batch_tokens = 1024;
  // How long the oldest queued call may wait for others to join its step. 0: never wait (merge
  // only what is already queued).
  absl::Duration max_batch_delay = absl::Microseconds(200);
  // How long the oldest queued call of a layer may wait for company that is likely to come.
  // The company expected is the most calls one of the layer's last kHistorySteps steps merged,
  // or, where calls name their caller, the distinct callers of its last kCallerSteps steps
  // (closed-loop callers that split into two groups, one step each, merge again). While fewer
  // are queued, the oldest waits until they are (or the step is full), at most this long after
  // its arrival and never longer than twice the layer's last step (the cost of the step a late
  // caller would wait for). A lone caller's layer never waits. 0: off (the default: it pays
  // where a step's time barely grows with its tokens, e.g. BF16 decode, and costs where it
  // grows, e.g. MXFP8 decode; tests/benchmarks/serving/RESULTS.md).
  absl::Duration company_wait = absl::ZeroDuration();
  // With company_wait > 0 (then the longest wait): wait for company only while that serves
  // the layer more calls per second. Closed-loop callers split into cohorts keep the lanes busy
  // but each cohort's step reads every weight; merged, one step reads them once, and the device
  // idles while the callers come back. Which wins depends on the step's fixed cost against the
  // callers' turnaround, so the batcher measures it: per layer, epochs (kModeEpochSteps steps and
  // kModeEpochTime) with and without the wait, each mode's best epoch of the last kModeRetry
  // compared (a host's pause only lowers an epoch's rate), the better kept, the other measured
  // again once its measurement is older than kModeRetry and kModeExploreEvery of its epochs (so
  // exploring costs at most about 1/kModeExploreEvery of the time), or the callers changed.
  bool company_wait_auto = false;
  // Most tokens queued and not yet running; beyond it calls are refused.
  int64_t max_queued_tokens = 16384;
  // Refuse a call that would wait longer than this for its step to start: the steps running
  // and the queue ahead of it, timed by a line fitted to the engine's recent steps (a step's
  // fixed cost plus a cost per token, StepCostModel), each step on the engine lane free first
  // (lane_lead not credited: an early step's device work still waits for the running ones).
  // A call that finds a lane idle and nothing queued is always taken. Bounds the latency of
  // the answered calls under overload. 0: no bound but max_queued_tokens.
  absl::Duration max_queue_wait = absl::ZeroDuration();
  // With an engine of several lanes: a step smaller than half of max_batch_tokens starts while
  // another runs once that one is expected (StepCostModel) to end within lane_lead, so that its
  // host staging and launch overlap the running step's device work instead of following it --
  // but only once its cohort is in: as many calls of its layer queued as the callers of its last
  // kHistorySteps steps (or its largest of them) number, less the calls of its running steps,
  // and only where its callers come back within the step's expected time less the lead.
  // Started earlier, a lead step splits the closed-loop callers that come back while it is
  // formed into more, smaller steps (one H100 host: 8 callers 10-30% fewer calls/s).
  // 0: such a step waits for the running ones to end (the calls that come meanwhile join it).
  absl::Duration lane_lead = absl::ZeroDuration();
  // A call of at most this many tokens that finds the queue empty, no step running and
  // max_batch_delay == 0 runs its step on the submitting thread: no hand-off to a scheduling
  // thread (a wake-up costs more than a decode step's own host work). So does a call of any
  // size that cannot be merged (device tensors) and finds the queue empty and no step
  // running. 0: never.
  int64_t inline_max_tokens = 64;
  // Steps that run their stage timers: every call that asks (CallSource::stage_timings) has its
  // step timed, and of the others one step in this many (what metrics then sample). A GPU
  // step's timers record device events: about 9 us of a one-token graphed step on an H200. 1: all.
  int64_t stage_timing_every = 1;
  // How long an idle scheduling thread polls the queue before it sleeps (one thread at a
  // time; the others sleep). A sleeping thread's wake-up costs a call tens of us on a server
  // host; polling costs a core while calls keep coming within this window. 0: never poll.
  absl::Duration idle_spin = absl::ZeroDuration();
  ForwardBatcherObserver* observer = nullptr;  // optional
  // Page-locks the buffers a merged step's hidden states and answer are gathered in (e.g.
  // CudaHostPinner() for a GPU engine, whose staging then moves them by DMA instead of copying
  // them again into its own page-locked staging). They are sized for the largest merged step
  // (max_batch_tokens of FP32 rows) and pinned when the batcher is created, up to
  // kMaxPinnedMergeBytes each (else plain memory): never while serving, where pinning and above
  // all unpinning (which waits for the device to drain) stall every thread's device work
  // (scripts/gpu/alloc_wait_probe.cu). Null: plain host memory.
  HostMemoryPinner* merge_pinner = nullptr;
  // Where the answers of a merged step run, all but the last (which runs on the step's
  // thread): e.g. a worker pool, so that a step's callers are answered at once rather than one
  // after another (answering a gRPC call sends it, tens of us each). Returns false when it
  // cannot take the task, which then runs on the step's thread. Null: all on the step's thread.
  std::function<bool(std::function<void()>)> answer_executor = nullptr;
};

// Where a call comes from, for scheduling it.
struct CallSource {
  // Names the caller (a connection, a stream, a channel; 0: unknown), for company_wait.
  uint64_t caller = 0;
  // Whether the call's step may run on the submitting thread (inline_max_tokens). A thread that
  // polls for its next call (a forward channel's) should take it; a gRPC thread should hand it
  // off: on an H200 host a single gRPC caller's round trip was shorter with the step on a
  // scheduling thread (tests/benchmarks/serving/RESULTS.md, 2026-12-02 18:34).
  bool may_run_inline = true;
  // Whether the caller reads its step's stage timings (e.g. a request's return_timings); such
  // a call's step always runs its stage timers (see stage_timing_every).
  bool stage_timings = true;
};

// Counters since creation (a snapshot).
struct ForwardBatcherStats {
  int64_t steps = 0;           // engine steps run
  int64_t calls = 0;           // calls answered by a step (ok or its error)
  int64_t merged_calls = 0;    // calls that shared their step with at least one other
  int64_t max_step_calls = 0;  // most calls in one step
  int64_t refused_queue_full = 0;
  int64_t dropped_deadline = 0;
  int64_t dropped_cancelled = 0;
  int64_t stopped = 0;        // calls of steps stopped between stages (every caller gave up)
  int64_t queued_tokens = 0;  // now
  int64_t inline_steps = 0;   // steps run on the submitting thread (inline_max_tokens)
  int64_t company_waits = 0;  // steps whose head waited for expected company (company_wait)
  int64_t running = 0;        // steps running now (ended before their calls are answered)
  int64_t spin_takes = 0;     // times a polling thread (idle_spin) found a call queued
  int64_t timed_steps = 0;    // steps that ran their stage timers (stage_timing_every)
  // Steps whose end woke the scheduling threads: only those that left calls queued (a thread
  // may wait for the lane, or for company); a lone caller's steps wake nobody.
  int64_t step_end_wakes = 0;
  // Merged steps whose hidden states and answer were in page-locked buffers (merge_pinner).
  int64_t pinned_merges = 0;
  // Small steps started beside running ones within lane_lead of their expected end.
  int64_t lead_steps = 0;
  // Times a small step that lane_lead would have started was held back because the callers
  // its layer expects (its recent callers not in a running step) were not all queued yet.
  int64_t lead_waits = 0;
  // company_wait_auto: measurement epochs that ended waiting for company (merged) and not
  // (split), and changes of a layer's mode.
  int64_t merged_epochs = 0;
  int64_t split_epochs = 0;
  int64_t mode_changes = 0;
  int64_t merging_layers = 0;  // layers waiting for company now
};

class ForwardBatcher {
 public:
  struct Call;  // one queued call (forward_batcher.cc)
  // Steps of a layer remembered for company_wait and lane_lead: their call counts, and their
  // callers.
  static constexpr int kHistorySteps = 4;
  static constexpr int kCallerSteps = 2;
  // company_wait_auto: a measurement epoch's least steps and time, the steps after a change of
  // mode that it skips (the callers regroup), how long a mode's measured rate decides before it
  // is measured again, and how much more the merged mode must serve to be kept (else the
  // callers' calls need not wait).
  static constexpr int kModeEpochSteps = 8;
  static constexpr absl::Duration kModeEpochTime = absl::Milliseconds(25);
  static constexpr int kModeSkipSteps = 2;
  static constexpr absl::Duration kModeRetry = absl::Seconds(1);
  static constexpr int kModeExploreEvery = 16;
  static constexpr double kMergeMargin = 1.03;
  // The largest merge buffer merge_pinner pins (larger ones stay plain host memory).
  static constexpr size_t kMaxPinnedMergeBytes = size_t{256} << 20;
  using Done = std::function<void(absl::Status status, const ForwardTimings& timings)>;

  // `engine` must outlive the batcher. INVALID_ARGUMENT for non-positive limits (CheckOptions).
  static absl::StatusOr<std::unique_ptr<ForwardBatcher>> Create(Engine* engine,
                                                                ForwardBatcherOptions options);
  // The checks of `options` that need no engine: INVALID_ARGUMENT naming the option, so that a
  // server refuses bad settings before it loads any weights.
  static absl::Status CheckOptions(const ForwardBatcherOptions& options);
  // Answers every queued call with UNAVAILABLE, then joins the scheduling threads (a step that
  // is running finishes first).
  ~ForwardBatcher();

  // Queues one call (or runs it at once, see inline_max_tokens and CallSource). `input` and
  // `output` (as Engine::Forward: output [M, hidden] in the hidden dtype, host memory or, where the
  // engine takes them, CUDA device memory; such calls run alone) must stay valid until `done` runs;
  // `done` runs exactly once. `cancelled` (may be null) is polled before the call runs and between
  // the stages of its step. timings.queue_us is the time from Submit to the start of its step.
  void Submit(const ForwardInput& input, const TensorView& output, absl::Time deadline,
              std::function<bool()> cancelled, Done done, CallSource source = {});

  // A call is on its way that will take a while to prepare (a large request being gathered):
  // with idle_spin, a sleeping scheduling thread starts polling now, so that its wake-up
  // overlaps the preparation instead of following the Submit. Cheap when a thread polls
  // already or idle_spin is 0 (nothing happens). Thread-safe.
  void Prewake();

  // Teaches the queue-wait estimate (max_queue_wait, lane_lead) the engine's step times before
  // any call comes: `rounds` engine steps of each size in `sizes` (tokens, each clamped to
  // [1, max_batch_tokens]) on the first MoE layer, random hidden states (BF16 where the engine
  // takes it) and balanced routing. The first step of each size warms up (a cold GPU's first steps
  // load modules and capture graphs) and is not learned. Without it a fresh batcher admits every
  // call until its first step ends, and prices a step by its tokens alone until its steps
  // differ in size. Runs on the calling thread beside any traffic (not counted in stats or
  // the observer); blocks for the steps. INVALID_ARGUMENT for no sizes or rounds < 2; the
  // engine's error if a step fails.
  absl::Status Calibrate(const std::vector<int64_t>& sizes, int rounds = 2);
  // Runs a step of each size in `sizes` (tokens, clamped to [1, max_batch_tokens]) for each of
  // `layers` (MoE layers) once on every engine lane (one thread per lane, started together):
  // a GPU engine captures a CUDA graph per layer and padded size on its first use, an eager
  // step plus a capture (ms) that would otherwise stall the first calls of every size, and
  // under overload admit a queue that the estimate does not expect to wait. Not learned by the
  // cost model and not counted; blocks. The first failing step's error.
  absl::Status WarmUp(const std::vector<int64_t>& sizes, const std::vector<int>& layers);
  // The queue-wait estimate's line t(n) = fixed_us + per_token_us * n and the steps it has
  // learned (StepCostModel), for logs and tests. Thread-safe.
  struct CostLine {
    double fixed_us = 0, per_token_us = 0;
    int64_t steps = 0;
  };
  CostLine cost_line() const;

  ForwardBatcherStats stats() const;
  const ForwardBatcherOptions& options() const { return options_; }

 private:
  // A grow-only host buffer, page-locked by a pinner where one is given (merge_pinner).
  class MergeBuffer {
   public:
    // With a pinner: `pinned_bytes` allocated and pinned now (a failed pin leaves it plain).
    MergeBuffer(HostMemoryPinner* pinner, size_t pinned_bytes);
    ~MergeBuffer();
    MergeBuffer(const MergeBuffer&) = delete;
    MergeBuffer& operator=(const MergeBuffer&) = delete;
    // A contiguous view of `shape` (contents unspecified) on Device::PinnedHost() when the
    // buffer is page-locked, else Device::Host(); RESOURCE_EXHAUSTED when it cannot grow.
    absl::StatusOr<TensorView> TryGet(DType dtype, const Shape& shape);
    bool pinned() const { return pinned_; }

   private:
    // Whole pages of at least `bytes` into data_ / capacity_ (false, both empty, if none).
    bool Allocate(size_t bytes);
    void Release();
    HostMemoryPinner* const pinner_;
    void* data_ = nullptr;
    size_t capacity_ = 0;
    bool pinned_ = false;
  };
  // A merged step's buffers, reused across steps by one thread.
  struct StepBuffers {
    StepBuffers(HostMemoryPinner* pinner, size_t pinned_bytes)
        : hidden(pinner, pinned_bytes), output(pinner, pinned_bytes) {}
    MergeBuffer hidden, output;
    HostBuffer ids, weights;
  };
  using Step = std::vector<std::unique_ptr<Call>>;
  // A layer's last steps: how many calls each merged, their known callers (not 0), how long
  // the last one took, and the company that history expects (updated once per step).
  struct LayerHistory {
    int64_t calls[kHistorySteps] = {};
    absl::InlinedVector<uint64_t, 8> callers[kHistorySteps];
    int next = 0;
    absl::Duration last_step;
    int64_t expected_calls = 1;  // most calls of a step, or distinct callers of kCallerSteps
    int64_t callers_seen = 1;    // most calls of a step, or distinct callers of kHistorySteps
    // When each caller of the layer's last steps was answered (until it calls again), and the
    // callers' turnaround from an answer to their next call (moving average of 4).
    absl::flat_hash_map<uint64_t, absl::Time> answered;
    absl::Duration turnaround;
    int64_t turnaround_samples = 0;
    // company_wait_auto: whether the layer waits for company now, what each mode (0: split,
    // 1: merged) measured, and the epoch being measured.
    struct ModeRecord {
      double rate = 0;                             // the best epoch's calls/s since `since`
      absl::Time since = absl::InfinitePast();     // when that best-of run began
      absl::Time measured = absl::InfinitePast();  // the last epoch's end
      absl::Duration epoch;                        // the last epoch's length
      int64_t callers = 0;                         // callers_seen then
    };
    bool merging = false;
    ModeRecord modes[2];
    int epoch_skip = kModeSkipSteps;
    int64_t epoch_steps = 0, epoch_calls = 0;
    absl::Time epoch_start;
  };
  static constexpr size_t kMaxAnsweredCallers = 1024;
  // Records a step of `live` calls that took `took` (`stopped`: ran only part of its work),
  // and when its callers were answered (their turnaround). With company_wait or lane_lead.
  void RecordStepLocked(const Step& live, absl::Duration took, bool stopped);
  // The company the oldest queued call of `layer` should wait for: the most calls of its last
  // steps, and how long after arrival it may wait for them (zero: do not wait). Under mu_.
  struct Company {
    int64_t calls = 1;
    absl::Duration wait;
  };
  Company ExpectedCompanyLocked(int layer) const;
  // company_wait_auto: counts a step of `calls` calls of the layer of `h` that ended at `now`
  // into its epoch; at the epoch's end records the mode's rate and picks the next mode. Under
  // mu_.
  void UpdateCompanyModeLocked(LayerHistory& h, int64_t calls, absl::Time now);
  // Switches the layer of `h` to `merging` (a change: counted, the observer told, the next
  // kModeSkipSteps steps skipped). Under mu_.
  void SetCompanyModeLocked(LayerHistory& h, bool merging);
  // A call of `caller` for `layer` arrived at `now`: its turnaround since its last answer
  // (returned; none where the caller's last step is not remembered). Under mu_.
  std::optional<absl::Duration> NoteReturnLocked(int layer, uint64_t caller, absl::Time now);
  // Whether a lead step (lane_lead) of `calls` queued calls of `layer`, `tokens` in all, may
  // start: its cohort is in -- as many calls as the callers of the layer's remembered steps
  // (LayerHistory::callers_seen) less the calls of its running steps -- and it pays: its
  // callers' turnaround plus lane_lead fits in the step's expected time. Otherwise the step
  // started early ends before the other callers are back, the lanes go idle, and the first
  // caller back runs alone (emulated device, a turnaround as long as a step: the lead cost
  // 13-20%). True without history; the turnaround check passes without samples. Under mu_.
  bool LeadReadyLocked(int layer, int64_t calls, int64_t tokens) const;
  ForwardBatcher(Engine* engine, ForwardBatcherOptions options);
  // Whether `c` may share `head`'s step.
  static bool Joins(const Call& head, const Call& c);
  // One scheduling thread: forms steps and runs them with `buffers`.
  void Loop(StepBuffers* buffers);
  // idle_spin: polls (without mu_) until a call is queued, the batcher stops or idle_spin has
  // passed. True when a call is queued.
  bool PollForCall() const;
  // Runs the calls of one step (same layer and dtype) begun with BeginStepLocked, ends it
  // (under mu_) once the engine is done, then answers the calls. `buffers` (for a merged step) may
  // be null for a single call.
  void RunStep(Step calls, StepBuffers* buffers, uint64_t step_id);
  // A step of `calls` calls of `layer`, `tokens` in all, begins or ends: the running steps
  // (running_steps_) that the lane rule, EstimatedWaitLocked and LeadReadyLocked count.
  // Under mu_.
  uint64_t BeginStepLocked(int layer, int64_t calls, int64_t tokens);
  void EndStepLocked(uint64_t step_id);
  // Whether a step's end must notify cv_ (calls are queued); counts it. Under mu_.
  bool WakeForStepEndLocked();
  // How long `call`, queued now, would wait for its step to start (max_queue_wait);
  // InfiniteDuration once that is past max_queue_wait. Under mu_.
  absl::Duration EstimatedWaitLocked(const Call& call, absl::Time now) const;
  // A call joins (sign +1) or leaves (-1) the queue: queued_tokens and the per-group counts.
  // Under mu_.
  void CountQueuedLocked(const Call& c, int64_t sign);
  // When a small step may start beside the running ones (lane_lead before the last is expected
  // to end); InfiniteFuture without lane_lead, a running step or a cost model. Under mu_.
  absl::Time LaneDueLocked() const;
  // Several calls as one engine step through `buffers` (the merged input and output).
  // On success *merged_output holds the calls' answers one after another (in `buffers`, copied
  // to each call's output by RunStep once the step has ended: the next step need not wait for
  // those copies). *engine_start: when the rows were merged and the engine began.
  absl::Status MergeAndRun(const Step& live, StepBuffers* buffers, ForwardTimings* timings,
                           const StopCheck& stop, bool time_stages, TensorView* merged_output,
                           absl::Time* engine_start);
  // Whether the step of `live` runs its stage timers (stage_timing_every); counts it.
  bool TimeStages(const Step& live);

  Engine* const engine_;
  const ForwardBatcherOptions options_;
  const int64_t step_tokens_;  // max_batch_tokens, at most the engine's max_tokens_per_request
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Call>> queue_;
  bool stop_ = false;
  // idle_spin: queue_.size() and stop_ as a polling thread reads them without mu_ (written
  // under it), and whether a thread polls now (guarded by mu_; Submit need not wake anyone).
  std::atomic<int64_t> queued_calls_{0};
  std::atomic<bool> stopping_{false};
  bool spinning_ = false;
  bool prewake_ = false;     // Prewake asked a sleeping thread to poll (guarded by mu_)
  int64_t untimed_run_ = 0;  // steps since the last timed one (guarded by mu_)
  ForwardBatcherStats stats_;
  const int runners_;  // scheduling threads = engine steps in flight
  struct RunningStep {
    uint64_t id = 0;
    absl::Time start;
    int layer = 0;
    int64_t calls = 0;
    int64_t tokens = 0;
  };
  // Steps running now, in start order (guarded by mu_).
  absl::InlinedVector<RunningStep, 4> running_steps_;
  uint64_t next_step_id_ = 0;  // guarded by mu_
  // Queued tokens by the step they can share (layer, hidden dtype), and the calls that run
  // alone (device tensors), for EstimatedWaitLocked (guarded by mu_).
  using GroupKey = std::pair<int, int>;
  absl::flat_hash_map<GroupKey, int64_t> group_tokens_;
  int64_t alone_calls_ = 0, alone_tokens_ = 0;
  StepCostModel cost_;  // the engine's recent steps, for max_queue_wait (guarded by mu_)
  absl::flat_hash_map<int, LayerHistory> history_;     // by layer (guarded by mu_)
  std::vector<std::unique_ptr<StepBuffers>> buffers_;  // one per scheduling thread
  std::vector<std::thread> threads_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_FORWARD_BATCHER_H_
