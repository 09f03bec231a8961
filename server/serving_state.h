// What the public services (moeserve.v1.MoeService and the KServe v2 GRPCInferenceService)
// share: the engine once its weights have loaded, the batcher in front of it, the worker
// threads that decode and queue calls, the access check (bearer tokens) and the metrics.
//
// The server binds before the weights load (so orchestrators see a live process); until
// Attach() every call that needs the engine is refused with UNAVAILABLE saying what the
// process is doing. Attach() publishes the engine once (release/acquire), so readers need no
// lock.
#ifndef MOESERVE_SERVER_SERVING_STATE_H_
#define MOESERVE_SERVER_SERVING_STATE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "core/forward_batcher.h"
#include "server/buffer_pool.h"
#include "server/metrics.h"
#include "server/security.h"
#include "server/work_queue.h"

namespace moeserve {

class ServingState {
 public:
  // `metrics` may be null and must outlive the state. `auth` (null: no token needed) is what
  // Authorize checks. `describe_startup` (may be empty) says what the process is doing before
  // Attach, e.g. LoadProgress::Describe.
  ServingState(Metrics* metrics, int num_worker_threads, int64_t max_message_bytes,
               std::shared_ptr<const BearerTokens> auth,
               std::function<std::string()> describe_startup);
  // Drain(), then the batcher answers whatever it still holds.
  ~ServingState();

  // Publishes `engine` (must outlive the state) and its batcher. Once.
  void Attach(Engine* engine, std::unique_ptr<ForwardBatcher> batcher);
  // Null until Attach.
  Engine* engine() const { return ready_.load(std::memory_order_acquire) ? engine_ : nullptr; }
  // UNAVAILABLE for `method` before Attach: "<method>: not ready yet (<what it is doing>);
  // retry once health reports SERVING".
  absl::Status NotReady(absl::string_view method) const;

  // The one access check of every public call (moeserve.v1 and KServe v2): the bearer token
  // when one is configured, UNAUTHENTICATED naming `method` otherwise. Thread-safe.
  absl::Status Authorize(const grpc::ServerContextBase& context, absl::string_view method) const;

  Metrics* metrics() const { return metrics_; }
  // The logical message limit (server/limits.h), reported in ModelInfo and enforced on the
  // request's size.
  int64_t max_message_bytes() const { return max_message_bytes_; }
  // Queues `task` on a worker; false once draining.
  bool SubmitWork(std::function<void()> task) { return workers_.Submit(std::move(task)); }
  // Whether a task submitted now would wait behind a whole round of others (as many queued as
  // there are workers): then a request is better decoded on the thread that received it, so that
  // it meets the batcher's admission at once instead of an unbounded backlog.
  bool WorkersBacklogged() const {
    return workers_.queued() >= static_cast<size_t>(workers_.num_threads());
  }
  // A large call is being decoded and gathered: a sleeping scheduling thread starts polling
  // (ForwardBatcher::Prewake). Nothing before the engine is attached.
  void PrewakeSteps() {
    if (ready_.load(std::memory_order_acquire)) batcher_->Prewake();
  }
  // The batcher's counters; zeros before Attach.
  ForwardBatcherStats batcher_stats() const {
    return ready_.load(std::memory_order_acquire) ? batcher_->stats() : ForwardBatcherStats{};
  }
  // Idle workers poll for tasks this long (one at a time) before they sleep (WorkQueue).
  void SetWorkerIdleSpin(absl::Duration spin) { workers_.SetIdleSpin(spin); }
  // Runs every queued task and stops the workers (calls arriving later are refused). Call after
  // grpc::Server::Shutdown and before destroying the server. Idempotent.
  void Drain() { workers_.Drain(); }

  // One forward call of `method`, after its tensors were decoded from a `message_bytes`
  // message: `input`'s views must stay valid until `done` runs (keep their owner in the
  // callback). Checks the shapes (the batcher checks the values) and then the message size
  // against max_message_bytes (RESOURCE_EXHAUSTED naming both limits), sizes the answer, counts
  // the routing for the metrics and queues the call. `done`
  // runs exactly once, on this thread for an early refusal or on the batcher's thread, with the
  // answer buffer ([M, hidden] in hidden_states' dtype) and the engine's timings. With `output`
  // (a shared-memory region, [M, hidden] in hidden_states' dtype, valid until `done`) the engine
  // writes there and the answer has no buffer (output null, bytes 0).
  struct ForwardAnswer {
    std::unique_ptr<PooledBuffer> output;
    Shape shape;
    DType dtype = DType::kBF16;
    size_t bytes = 0;
    ForwardTimings timings;
  };
  using ForwardDone = std::function<void(absl::Status status, ForwardAnswer answer)>;
  void SubmitForward(absl::string_view method, const ForwardInput& input, int64_t message_bytes,
                     absl::Time deadline, std::function<bool()> cancelled, ForwardDone done,
                     std::optional<TensorView> output = std::nullopt, CallSource source = {});

 private:
  Metrics* const metrics_;
  const int64_t max_message_bytes_;
  const std::shared_ptr<const BearerTokens> auth_;
  const std::function<std::string()> describe_startup_;
  WorkQueue workers_;
  std::unique_ptr<ForwardBatcher> batcher_;  // set by Attach, before ready_
  Engine* engine_ = nullptr;                 // set by Attach, before ready_
  std::atomic<bool> ready_{false};
};

// Server-side routing for a call without topk tensors (input->topk_ids empty): the layer's gate
// (Engine::Route) fills INT32 ids and FP32 weights [M, topk] in `*routing`, a recycled buffer
// the caller keeps until the call is answered. INVALID_ARGUMENT for hidden states in device
// memory; Route's refusals (no gate: FAILED_PRECONDITION; bad shapes) as they are.
absl::Status RouteOnServer(Engine& engine, ForwardInput* input,
                           std::unique_ptr<PooledBuffer>* routing);

// The call's deadline; none (gRPC's infinite future) maps to absl::InfiniteFuture().
absl::Time CallDeadline(std::chrono::system_clock::time_point deadline);

// A nonzero key naming where calls come from (a connection's peer, plus e.g. a channel's name),
// for the batcher's company_wait (CallSource::caller).
uint64_t CallerKey(absl::string_view peer, absl::string_view within = "");

}  // namespace moeserve

#endif  // MOESERVE_SERVER_SERVING_STATE_H_
