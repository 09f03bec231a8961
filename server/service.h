// moeserve.v1.MoeService on gRPC's callback API.
//
// Forward is served raw: the request's tensors are read straight out of gRPC's slices and the
// answer is written by the engine into a buffer that the reply's slice then owns, so tensor
// bytes are never copied by protobuf (the wire format is still moeserve.v1's).
// A small Forward is decoded and handed to the batcher on gRPC's callback thread (nothing there
// blocks: the batcher refuses at once when full); large ones and GetExpertWeights run on the
// service's own worker threads (a WorkQueue). Answers are Finished from the batcher's thread.
// GetModelInfo answers inline. The engine, batcher, workers and metrics are the ServingState's,
// shared with the KServe v2 service; until the engine is attached (weights still loading) every
// call is refused with UNAVAILABLE saying how far the load is.
//
// Access (docs/security.md): every MoeService call passes ServingState::Authorize() first (the
// bearer token, when one is configured); the expert-weight RPCs also need ServiceOptions::
// enable_get_expert_weights and are checked (layer, expert, size) before anything is allocated.
//
// Bounds (server/call_limits.h): a Forward call -- unary, or one message of a ForwardStream --
// holds its request's bytes from arrival and its answer's from decoding until gRPC is done with
// it (unary: the call is over; stream: its answer is written); beyond max_held_bytes in all it
// is refused at once with RESOURCE_EXHAUSTED (a stream message as its per-message error). An
// answer the client does not take within max_answer_hold is cancelled (the client sees
// CANCELLED; a stream is cancelled as a whole), releasing what it held.
// Calls are counted by the server's interceptor (server/call_accounting.h), not here, except
// each message of a ForwardStream: method "ForwardStream.call", with its own code.
#ifndef MOESERVE_SERVER_SERVICE_H_
#define MOESERVE_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "core/memory_region.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/call_limits.h"
#include "server/forward_channel.h"
#include "server/metrics.h"
#include "server/serving_state.h"

namespace moeserve {

// Worker threads, the message limit and the bearer tokens are the ServingState's.
struct ServiceOptions {
  // Request + answer bytes all Forward calls in progress may hold; <= 0: unbounded.
  int64_t max_held_bytes = int64_t{512} << 20;
  // How long a finished answer may wait for the client to take it; <= 0: forever.
  std::chrono::milliseconds max_answer_hold{10000};
  // GetExpertWeights / StreamExpertWeights hand out the model's weights: off unless set.
  bool enable_get_expert_weights = false;
  // Shared-memory regions (the four *SharedMemory* RPCs, Tensor.region, output_region); off:
  // they are refused with FAILED_PRECONDITION naming --enable_shared_memory.
  bool enable_shared_memory = false;
  int max_shared_memory_regions = 256;
  // Forward channels (server/forward_channel.h; needs enable_shared_memory): how many may be
  // registered, and how long each one's poller spins after a call before it sleeps.
  int max_forward_channels = 16;
  absl::Duration forward_channel_spin = absl::Milliseconds(2);
  // Expert-weight calls in flight at once (each holds a whole expert, 88 MiB for DeepSeek-V3,
  // until its client has read it); more are RESOURCE_EXHAUSTED.
  int max_expert_weight_calls = 4;
  // A GPU engine that reads hidden_states in device memory gets those of at least this many
  // bytes (given as gRPC bytes, with client-side routing) uploaded while they are gathered,
  // the gather of a chunk overlapping the copy of the one before (core/device_upload.h);
  // smaller ones are gathered into page-locked memory and copied in the engine's step. 0: never.
  int64_t upload_min_bytes = int64_t{4} << 20;
  // Forward requests up to this many bytes are decoded, gathered and queued on gRPC's callback
  // thread that received them, larger ones on a worker (a thread hop: a sleeping worker's
  // wake-up put 45-110 us into every large call on the H200 host). Negative: every request on
  // gRPC's thread; 0: every one on a worker. A call decoded on a worker runs its step on that
  // worker when the batcher would run it inline (ForwardBatcherOptions::inline_max_tokens);
  // with any value >= 0 so do ForwardStream's and ModelInfer's calls (always decoded on a
  // worker). The server may change it when the engine is attached
  // (MoeServiceImpl::SetInlineRequestBytes).
  int64_t inline_request_bytes = -1;
};

// Whether a gRPC peer (ServerContext::peer(): "unix:...", "ipv4:127.0.0.1:5000",
// "ipv6:[::1]:5000", brackets possibly percent-encoded) is on this host: shared-memory regions
// are served to those only (PERMISSION_DENIED otherwise), since they name this host's memory.
bool IsSameHostPeer(absl::string_view peer);

// The shared-memory RPCs (server/shared_memory_service.cc).
using MoeServiceSharedMemoryBase = v1::MoeService::WithCallbackMethod_RegisterSystemSharedMemory<
    v1::MoeService::WithCallbackMethod_RegisterCudaSharedMemory<
        v1::MoeService::WithCallbackMethod_UnregisterSharedMemory<
            v1::MoeService::WithCallbackMethod_SharedMemoryStatus<
                v1::MoeService::WithCallbackMethod_RegisterForwardChannel<
                    v1::MoeService::WithCallbackMethod_UnregisterForwardChannel<
                        v1::MoeService::Service>>>>>>;

using MoeServiceBase = v1::MoeService::WithRawCallbackMethod_Forward<
    v1::MoeService::WithRawCallbackMethod_ForwardStream<
        v1::MoeService::WithCallbackMethod_GetModelInfo<
            v1::MoeService::WithCallbackMethod_GetExpertWeights<
                v1::MoeService::WithCallbackMethod_StreamExpertWeights<
                    MoeServiceSharedMemoryBase>>>>>;

// Default and floor of StreamExpertWeights' chunk size, and the room left under
// max_message_bytes for a message's framing.
inline constexpr int64_t kDefaultExpertChunkBytes = int64_t{1} << 20;
inline constexpr int64_t kExpertMessageFramingBytes = 1024;

class MoeServiceImpl final : public MoeServiceBase {
 public:
  // `state` (engine once attached, batcher, workers, metrics, tokens) must outlive the service.
  MoeServiceImpl(ServingState* state, const ServiceOptions& options);
  ~MoeServiceImpl() override;

  // Called once with the loaded engine before ServingState::Attach publishes it (creates the
  // shared-memory registry for its backend). Not thread-safe against calls: none reach the
  // engine before Attach.
  void PrepareForEngine(const Engine& engine);

  // ServiceOptions::inline_request_bytes now (thread-safe). Set by the server when it attaches
  // the engine (a value by backend), before calls reach the engine; < -1 reads as -1.
  void SetInlineRequestBytes(int64_t bytes) {
    inline_request_bytes_.store(std::max<int64_t>(-1, bytes), std::memory_order_relaxed);
  }
  int64_t inline_request_bytes() const {
    return inline_request_bytes_.load(std::memory_order_relaxed);
  }
  // Whether workers decode requests (inline_request_bytes() >= 0): they then poll while idle,
  // and a call decoded on one (Forward, ForwardStream, ModelInfer) may run its step there.
  bool WorkersDecodeRequests() const { return inline_request_bytes() >= 0; }

  // `request` and `response` are serialized moeserve.v1 ForwardRequest / ForwardResponse.
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  // Layer calls on one stream: each request message runs as Forward does (through the batcher,
  // up to kMaxStreamCallsInFlight at once), answers are written in request order, and a failed
  // call answers with error_code/error_message without ending the stream.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ForwardStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetExpertWeights(grpc::CallbackServerContext* context,
                                             const v1::GetExpertWeightsRequest* request,
                                             v1::GetExpertWeightsResponse* response) override;
  grpc::ServerWriteReactor<v1::ExpertWeightsChunk>* StreamExpertWeights(
      grpc::CallbackServerContext* context, const v1::StreamExpertWeightsRequest* request) override;

  // Calls of one stream decoded, queued or answered but not yet written; the stream stops
  // reading beyond it (flow control reaches the client).
  static constexpr int kMaxStreamCallsInFlight = 64;
  // Forward requests from this size take long enough to gather (tens of us and more) that a
  // sleeping scheduling thread is woken when they arrive, not when they are queued.
  static constexpr size_t kPrewakeRequestBytes = 256 << 10;

  // Shared memory (server/shared_memory_service.cc): FAILED_PRECONDITION unless
  // ServiceOptions::enable_shared_memory.
  grpc::ServerUnaryReactor* RegisterSystemSharedMemory(
      grpc::CallbackServerContext* context, const v1::RegisterSystemSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* RegisterCudaSharedMemory(
      grpc::CallbackServerContext* context, const v1::RegisterCudaSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* SharedMemoryStatus(grpc::CallbackServerContext* context,
                                               const v1::SharedMemoryStatusRequest* request,
                                               v1::SharedMemoryStatusResponse* response) override;
  // The forward channel (server/forward_channel.h), under the same checks as the region RPCs.
  grpc::ServerUnaryReactor* RegisterForwardChannel(
      grpc::CallbackServerContext* context, const v1::RegisterForwardChannelRequest* request,
      v1::RegisterForwardChannelResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterForwardChannel(
      grpc::CallbackServerContext* context, const v1::UnregisterForwardChannelRequest* request,
      v1::UnregisterForwardChannelResponse* response) override;
  // Forward channels registered now (0 while shared memory is off).
  int forward_channels() const;
  // Stops every channel's poller (server shutdown, before the batcher drains): no new calls;
  // those in flight are still answered into their slots.
  void CloseForwardChannels();

  // Bytes Forward calls hold now; answers cancelled so far for not being taken.
  int64_t held_bytes() const { return held_bytes_.used(); }
  int64_t answers_cancelled() const { return answer_watch_.cancelled(); }

  // What the KServe v2 service (server/inference_service.h) shares with this one, so that both
  // protocols run under one set of limits and one region registry.
  // The max_queued_bytes budget and the answer-hold watch (max_answer_hold) of every call.
  ByteBudget* held_budget() { return &held_bytes_; }
  AnswerHoldWatch* answer_watch() { return &answer_watch_; }
  // The refusal of `bytes` more (`what`: "this request", "its answer") by `method` at
  // max_queued_bytes, for a call that holds `call_held` bytes already; counts it in the
  // metrics. A call that alone passes the limit is told so (no retry will pass).
  absl::Status HoldRefused(absl::string_view method, int64_t bytes, absl::string_view what,
                           int64_t call_held);
  // The region registry; null while shared memory is off. Read only after
  // ServingState::engine() returned non-null (it is set before the engine is published).
  const RegionRegistry* regions() const { return regions_.get(); }
  RegionRegistry* mutable_regions() { return regions_.get(); }
  // Runs `fn` (returning the call's status) on a worker and finishes `context`'s call with it,
  // after the checks every shared-memory RPC passes: Authorize, the flag (FAILED_PRECONDITION
  // naming --enable_shared_memory), the engine (UNAVAILABLE while loading) and the peer
  // (PERMISSION_DENIED unless same-host). `fn` may use regions() (non-null then).
  grpc::ServerUnaryReactor* RunSharedMemoryCall(grpc::CallbackServerContext* context,
                                                const char* method,
                                                std::function<absl::Status()> fn);
  // OK when `peer` (ServerContext::peer()) is on this host (IsSameHostPeer); PERMISSION_DENIED
  // naming `what` and the peer otherwise.
  static absl::Status CheckSharedMemoryPeer(const std::string& peer, absl::string_view what);

 private:
  class StreamReactor;
  // The answer to one Forward: OK with the encoded ForwardResponse and its token count, or the
  // failure; `request_id` as decoded (empty when the request could not be read). Runs once, on a
  // worker or the batcher's thread.
  using AnswerFn = std::function<void(const absl::Status& status, grpc::ByteBuffer encoded,
                                      int64_t tokens, const std::string& request_id)>;
  // Decodes, validates and submits one serialized ForwardRequest to the batcher. `raw_request`
  // is read before this returns (the decoded call keeps its slices). Worker threads.
  // `peer`: the client (ServerContext::peer()), for the shared-memory check; `source`: for the
  // batcher (who calls, and whether the step may run on this thread).
  // `hold` (may be null: unbounded) takes the answer's bytes once its size is known, or refuses
  // (RESOURCE_EXHAUSTED, see HoldRefused), which is then the call's answer.
  using HoldFn = std::function<absl::Status(int64_t bytes, absl::string_view what)>;
  void RunForward(const grpc::ByteBuffer& raw_request, absl::Time deadline,
                  std::function<bool()> cancelled, std::chrono::steady_clock::time_point start,
                  const std::string& peer, CallSource source, const HoldFn& hold, AnswerFn answer);
  // The one access check of every MoeService call (ServingState::Authorize: UNAUTHENTICATED
  // naming `method`).
  absl::Status Authorize(const grpc::CallbackServerContext& context,
                         absl::string_view method) const {
    return state_->Authorize(context, method);
  }
  // Authorize, then the expert-weight checks that come before any allocation: the flag
  // (FAILED_PRECONDITION naming it), the engine (UNAVAILABLE while loading), then layer and
  // expert (INVALID_ARGUMENT).
  absl::Status AdmitExpertWeights(const grpc::CallbackServerContext& context,
                                  absl::string_view method, int layer, int expert) const;
  // Takes one of max_expert_weight_calls slots (RESOURCE_EXHAUSTED when none is free); the
  // caller gives it back with expert_calls_.fetch_sub(1) once its answer is gone.
  absl::Status TakeExpertCallSlot(absl::string_view method);
  // What channel `name` (registered by `peer`) runs for each call: RunForward with the answer
  // bounded by the slot.
  ChannelCallFn MakeChannelCall(std::string peer, std::string name);

  ServingState* const state_;
  Metrics* const metrics_;  // state_->metrics(), may be null
  const ServiceOptions options_;
  std::atomic<int64_t> inline_request_bytes_;
  ByteBudget held_bytes_;
  AnswerHoldWatch answer_watch_;
  // Set by PrepareForEngine; read only after ServingState::engine() is non-null (the release /
  // acquire there orders it). MoeServer drains the state before destroying the service, so it
  // outlives every call that holds a region.
  std::unique_ptr<RegionRegistry> regions_;  // null: shared memory off
  // Forward requests from kPrewakeRequestBytes up to this size prewake the batcher (those
  // uploaded to the device as they are gathered do not; set before calls come).
  int64_t prewake_below_bytes_ = INT64_MAX;
  std::atomic<int> expert_calls_{0};  // expert-weight calls holding a slot
  // Set with regions_. Last, so destroyed first: its pollers call into everything above.
  std::unique_ptr<ForwardChannelRegistry> channels_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_SERVICE_H_
