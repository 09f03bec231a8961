#include "server/service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/provider_registry.h"
#include "core/status_macros.h"
#include "moeserve/v1/forward_wire.h"
#include "server/buffer_pool.h"
#include "server/convert.h"
#include "server/status.h"

namespace moeserve {

namespace {

using Clock = std::chrono::steady_clock;

// Bytes of one expert's BF16 w13 [2I, H] and w2 [H, I] (sizes are bounded by
// ModelConfig::kMaxHidden, so this cannot overflow).
int64_t ExpertWeightsBytes(const ModelConfig& model) {
  return 3 * model.intermediate * model.hidden * static_cast<int64_t>(sizeof(uint16_t));
}

// The call's deadline; none (gRPC's infinite future) maps to absl::InfiniteFuture().
absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  return CallDeadline(context.deadline());
}

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

}  // namespace

MoeServiceImpl::MoeServiceImpl(ServingState* state, const ServiceOptions& options)
    : state_(state),
      metrics_(state->metrics()),
      options_(options),
      inline_request_bytes_(std::max<int64_t>(-1, options.inline_request_bytes)),
      held_bytes_(options.max_held_bytes),
      answer_watch_(options.max_answer_hold, [metrics = state->metrics()] {
        if (metrics) metrics->OnAnswerCancelled();
      }) {}

MoeServiceImpl::~MoeServiceImpl() = default;

void MoeServiceImpl::PrepareForEngine(const Engine& engine) {
  if (engine.info().backend == "cuda") {
    // Request gathers and answers in page-locked memory: the GPU reads and writes them by DMA.
    const BackendProvider* cuda = ProviderRegistry::Global().FindBackend(Backend::kCuda);
    if (cuda != nullptr && cuda->register_host_memory && cuda->unregister_host_memory) {
      PooledBuffer::InstallHostPinner(
          [pin = cuda->register_host_memory](void* data, size_t bytes) {
            return pin(data, bytes).ok();
          },
          cuda->unregister_host_memory);
    }
  }
  if (engine.info().backend == "cuda" && engine.info().device_tensors &&
      options_.upload_min_bytes > 0) {
    const BackendProvider* cuda = ProviderRegistry::Global().FindBackend(Backend::kCuda);
    // Device 0: the single-process GPU engine's first rank (EngineInfo::device_tensors).
    if (cuda != nullptr && cuda->upload_host_pieces) {
      InstallDeviceUpload(cuda->upload_host_pieces, 0, options_.upload_min_bytes);
      // A polling scheduling thread slowed the upload of 14.7 MB by 250-440 us on the H200
      // host (serving/RESULTS.md 20:10), more than the wake-up it saves.
      prewake_below_bytes_ = options_.upload_min_bytes;
    }
  }
  if (options_.enable_shared_memory && regions_ == nullptr) {
    RegionRegistryOptions regions;
    regions.backend = engine.info().backend == "cuda" ? Backend::kCuda : Backend::kCpu;
    regions.max_regions = options_.max_shared_memory_regions;
    regions_ = std::make_unique<RegionRegistry>(regions);
    channels_ = std::make_unique<ForwardChannelRegistry>(options_.max_forward_channels,
                                                         options_.forward_channel_spin);
  }
}

void MoeServiceImpl::RunForward(const grpc::ByteBuffer& raw_request, absl::Time deadline,
                                std::function<bool()> cancelled, Clock::time_point start,
                                const std::string& peer, CallSource source, const HoldFn& hold,
                                AnswerFn answer) {
  const double server_queue_us = MicrosSince(start);
  if (deadline <= absl::Now()) {
    return answer(absl::DeadlineExceededError(
                      absl::StrCat("Forward: the deadline passed after ", server_queue_us,
                                   " us waiting for a worker, before it ran")),
                  {}, 0, "");
  }
  if (cancelled && cancelled()) {
    return answer(absl::CancelledError("Forward: cancelled by the client before it ran"), {}, 0,
                  "");
  }
  Engine* const engine = state_->engine();  // acquire: regions_ is set before it
  if (engine == nullptr) return answer(state_->NotReady("Forward"), {}, 0, "");
  const int64_t message_bytes = static_cast<int64_t>(raw_request.Length());
  const Clock::time_point input_start = Clock::now();
  absl::StatusOr<v1wire::ForwardRequestView> request = v1wire::DecodeForwardRequest(raw_request);
  if (!request.ok()) {
    return answer(absl::InvalidArgumentError(absl::StrCat("Forward: ", request.status().message())),
                  {}, 0, "");
  }
  std::string request_id = request->header.request_id();
  // A caller that reads its timings gets its step's stages measured; others are sampled.
  source.stage_timings = request->header.return_timings();
  GatheredBytes gathered;
  // Tensors in shared-memory regions hold their regions until the answer is ready; released
  // before the call is answered, so the client may unregister as soon as it has the answer.
  ForwardRegions regions;
  auto fail = [&regions, &answer, &request_id](const absl::Status& status) {
    regions.Release();
    answer(status, {}, 0, request_id);
  };
  // Regions name this host's memory: same-host clients only. (With shared memory off, the
  // conversion refuses naming the field and the flag.)
  if (regions_ != nullptr &&
      (request->header.has_output_region() || request->hidden_states.header.has_region() ||
       request->topk_ids.header.has_region() || request->topk_weights.header.has_region())) {
    if (absl::Status s = CheckSharedMemoryPeer(peer, "Forward"); !s.ok()) return fail(s);
  }
  // A CUDA region's bytes are read and written in place where the engine takes device memory.
  const EngineInfo& info = engine->info();
  absl::StatusOr<ForwardInput> input = ForwardInputFromWire(
      *request, &gathered, regions_.get(), info.device_tensors, &regions, info.device_routing);
  if (!input.ok()) return fail(input.status());
  const double input_us = MicrosSince(input_start);
  // No topk tensors: the server routes with the layer's gate, into a recycled buffer that
  // lives as long as the call (ids INT32 [M, topk], then weights FP32 [M, topk]).
  std::unique_ptr<PooledBuffer> routing;
  double route_us = 0;
  if (input->topk_ids.empty()) {
    const Clock::time_point route_start = Clock::now();
    if (absl::Status s = RouteOnServer(*engine, &*input, &routing); !s.ok()) return fail(s);
    route_us = MicrosSince(route_start);
  }
  // Shapes before sizing the output (it comes from hidden_states); Forward checks the values.
  if (absl::Status s = ValidateForwardShapes(info.model, info.max_tokens_per_request, *input);
      !s.ok()) {
    return fail(s);
  }
  const int64_t m = input->hidden_states.dim(0);
  const DType dtype = input->hidden_states.dtype();
  const Shape out_shape = {m, info.model.hidden};
  if (absl::Status s = ResolveOutputRegion(request->header, regions_.get(), dtype, out_shape,
                                           info.device_tensors, &regions);
      !s.ok()) {
    return fail(s);
  }
  // The answer's bytes count against max_queued_bytes from here (an output region: none).
  if (hold && !regions.output.has_value()) {
    const int64_t out_bytes = NumElements(out_shape) * static_cast<int64_t>(DTypeSize(dtype));
    if (out_bytes > 0) {
      if (absl::Status s = hold(out_bytes, "its answer"); !s.ok()) return fail(s);
    }
  }
  // What the call needs until the batcher answers it: the request's slices (its tensors may
  // be views into them), the gathered bytes, the regions and the routing buffer. The answer
  // buffer (ServingState::SubmitForward) is written by the engine and the reply's slice then
  // owns it (no copy) -- or the engine writes the output region.
  struct Pending {
    v1wire::ForwardRequestView request;
    GatheredBytes gathered;
    ForwardRegions regions;
    ForwardInput input;
    std::unique_ptr<PooledBuffer> routing;  // server-side routing only
  };
  auto pending = std::make_shared<Pending>(Pending{std::move(*request), std::move(gathered),
                                                   std::move(regions), *input, std::move(routing)});
  std::optional<TensorView> region_output;
  if (pending->regions.output.has_value()) region_output = pending->regions.output->view();
  Metrics* const metrics = metrics_;
  auto done = [pending, metrics, start, server_queue_us, route_us, input_us,
               answer = std::move(answer)](absl::Status status,
                                           ServingState::ForwardAnswer result) {
    const std::string& id = pending->request.header.request_id();
    if (status.ok() && pending->regions.output.has_value()) {
      status = pending->regions.output->Flush();
    }
    v1::ForwardResponse header;
    // The routing may be a view into a region: read before the regions go (once released, an
    // Unregister may unmap them).
    if (status.ok() && pending->request.header.return_routing()) {
      RoutingToProto(pending->input, header.mutable_topk_ids(), header.mutable_topk_weights());
    }
    pending->regions.Release();
    if (!status.ok()) return answer(status, {}, 0, id);
    header.mutable_output()->set_dtype(DTypeToProto(result.dtype));
    for (int64_t d : result.shape) header.mutable_output()->add_shape(d);
    header.set_request_id(id);
    if (metrics) {
      metrics->RecordStages(server_queue_us + result.timings.queue_us, result.timings);
    }
    if (pending->request.header.return_timings() || pending->request.header.return_host_timings()) {
      ForwardTimingsToProto(result.timings, server_queue_us, MicrosSince(start),
                            header.mutable_timings());
      header.mutable_timings()->set_route_us(route_us);
      header.mutable_timings()->set_input_us(input_us);
    }
    // With an output region the answer is there already: the reply has dtype and shape only.
    grpc::Slice data;
    if (result.output != nullptr) {
      void* out_data = result.output->data();
      data = v1wire::SliceOwning(out_data, result.bytes, std::move(result.output));
    }
    absl::StatusOr<grpc::ByteBuffer> encoded = v1wire::EncodeForwardResponse(header, data);
    if (!encoded.ok()) return answer(absl::InternalError(encoded.status().message()), {}, 0, id);
    answer(absl::OkStatus(), *encoded, result.shape[0], id);  // (copies refcount the slices)
  };
  // The same admission as ModelInfer: shapes, the message size, routing counts, the batcher.
  state_->SubmitForward("Forward", pending->input, message_bytes, deadline, std::move(cancelled),
                        std::move(done), region_output, source);
}

absl::Status MoeServiceImpl::HoldRefused(absl::string_view method, int64_t bytes,
                                         absl::string_view what, int64_t call_held) {
  if (metrics_) metrics_->OnRefusedForMemory();
  if (bytes > held_bytes_.limit() - call_held) {
    return absl::ResourceExhaustedError(absl::StrCat(
        method, ": this call alone holds ", call_held + bytes, " bytes of request and answer (",
        what, ": ", bytes, "), more than max_queued_bytes=", held_bytes_.limit(),
        " allows however idle the server is; send fewer tokens per call, or start the server "
        "with a larger --max_queued_bytes"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      method, ": the server holds ", held_bytes_.used(), " bytes of requests and answers; ", what,
      " of ", bytes, " bytes would pass max_queued_bytes=", held_bytes_.limit(),
      "; retry later or elsewhere"));
}

grpc::ServerUnaryReactor* MoeServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* raw_request,
                                                  grpc::ByteBuffer* response) {
  const Clock::time_point start = Clock::now();
  if (metrics_) metrics_->IncrementInflight();
  // Holds the call's bytes until gRPC is done with it, and watches its answer being taken.
  auto* reactor = new HeldUnaryReactor(context, &answer_watch_, &held_bytes_, [this] {
    if (metrics_) metrics_->SetHeldBytes(held_bytes_.used());
  });
  const int64_t received = static_cast<int64_t>(raw_request->Length());
  // Answers; `tokens` counts only on success (the call itself is counted by the interceptor).
  auto finish = [this, reactor, received, response](const absl::Status& status, int64_t tokens) {
    if (metrics_) {
      if (status.ok()) metrics_->AddTokens(tokens);
      metrics_->AddBytes("Forward", received,
                         status.ok() ? static_cast<int64_t>(response->Length()) : 0);
      metrics_->DecrementInflight();
    }
    reactor->FinishAndHold(ToGrpcStatus(status));
  };
  // Admission: refused at once when the bytes calls hold would pass the limit.
  auto hold = [this, reactor](int64_t bytes, absl::string_view what) {
    if (!reactor->Hold(bytes)) return HoldRefused("Forward", bytes, what, reactor->held_bytes());
    if (metrics_) metrics_->SetHeldBytes(held_bytes_.used());
    return absl::OkStatus();
  };
  if (absl::Status s = Authorize(*context, "Forward"); !s.ok()) {
    finish(s, 0);
    return reactor;
  }
  if (absl::Status s = hold(static_cast<int64_t>(raw_request->Length()), "this request"); !s.ok()) {
    finish(s, 0);
    return reactor;
  }
  // on_worker: a worker thread runs the task, which, unlike gRPC's thread, may run the call's
  // step itself (CallSource::may_run_inline): it polls for its next task as a channel's thread
  // does, and its caches hold the decode and the engine, which gRPC's thread finds cold.
  auto task = [this, context, raw_request, response, start, finish, hold](bool on_worker) {
    const std::string peer = context->peer();
    RunForward(
        *raw_request, DeadlineOf(*context), [context] { return context->IsCancelled(); }, start,
        peer, CallSource{.caller = CallerKey(peer), .may_run_inline = on_worker}, hold,
        [response, finish](const absl::Status& status, grpc::ByteBuffer encoded, int64_t tokens,
                           const std::string&) {
          if (status.ok()) response->Swap(&encoded);
          finish(status, tokens);
        });
  };
  // A large request takes a while to gather: a sleeping scheduling thread wakes meanwhile.
  if (raw_request->Length() >= kPrewakeRequestBytes &&
      static_cast<int64_t>(raw_request->Length()) < prewake_below_bytes_) {
    state_->PrewakeSteps();
  }
  // A small request is decoded and queued right here (a thread hop costs more than the work);
  // one over inline_request_bytes on a worker, unless the workers are backlogged: a queue of
  // requests in front of the batcher is outside its admission (max_queue_wait), and under an
  // overload it grew without bound on an H100 host (2 workers decoding every call and sending
  // answers: answered p50 2.5 s, serving/RESULTS.md 2026-12-06 04:31).
  const int64_t inline_bytes = inline_request_bytes();
  if (inline_bytes < 0 || static_cast<int64_t>(raw_request->Length()) <= inline_bytes ||
      state_->WorkersBacklogged()) {
    task(/*on_worker=*/false);
  } else if (!state_->SubmitWork([task = std::move(task)] { task(/*on_worker=*/true); })) {
    finish(absl::UnavailableError("Forward: the server is shutting down"), 0);
  }
  return reactor;
}

// One ForwardStream. Lives until gRPC is done with it (OnDone) and every call it submitted
// has answered: refs_ counts both. Calls never touch the CallbackServerContext (it dies at
// OnDone); they poll stop_ instead.
class MoeServiceImpl::StreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(MoeServiceImpl* service, grpc::CallbackServerContext* context)
      : service_(service),
        context_(context),
        deadline_(DeadlineOf(*context)),
        peer_(context->peer()) {
    std::lock_guard<std::mutex> lock(mu_);
    StartReadingLocked();
  }

  ~StreamReactor() override {
    // What calls that were never written still hold (the stream ended first).
    int64_t held = 0;
    for (const Slot& slot : slots_) held += slot.held;
    Release(held);
  }

  void OnReadDone(bool ok) override {
    std::unique_lock<std::mutex> lock(mu_);
    reading_ = false;
    if (!ok || finished_) {  // the client half-closed (or the stream broke or was finished)
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    auto request = std::make_shared<grpc::ByteBuffer>();
    request->Swap(&read_buffer_);
    const int64_t request_bytes = static_cast<int64_t>(request->Length());
    const uint64_t seq = front_seq_ + slots_.size();
    slots_.emplace_back();
    ++refs_;
    if (static_cast<int>(slots_.size()) < kMaxStreamCallsInFlight) StartReadingLocked();
    lock.unlock();

    const Clock::time_point start = Clock::now();
    Metrics* metrics = service_->metrics_;
    if (metrics) metrics->IncrementInflight();
    const int64_t received = static_cast<int64_t>(request->Length());
    auto answer = [this, seq, start, metrics, received](const absl::Status& status,
                                                        grpc::ByteBuffer encoded, int64_t tokens,
                                                        const std::string& request_id) {
      const grpc::Status grpc_status = ToGrpcStatus(status);
      if (metrics) {
        if (status.ok()) metrics->AddTokens(tokens);
        // Each layer call of the stream (the stream itself is counted by the interceptor).
        metrics->RecordRequest("ForwardStream.call", grpc_status.error_code(),
                               MicrosSince(start) * 1e-6);
        metrics->AddBytes("ForwardStream", received,
                          status.ok() ? static_cast<int64_t>(encoded.Length()) : 0);
        metrics->DecrementInflight();
      }
      if (!status.ok()) encoded = ErrorAnswer(grpc_status, request_id);
      Answer(seq, encoded);
    };
    // Admission by bytes, as for Forward: this message's request now, its answer once decoded;
    // held until its answer is written (a refusal is this message's error).
    auto hold = [this, seq](int64_t bytes, absl::string_view what) {
      return Hold(seq, bytes, what);
    };
    if (absl::Status s = hold(request_bytes, "this request"); !s.ok()) {
      answer(s, {}, 0, "");
      return;
    }
    // A stream's calls are decoded on a worker; where workers decode Forward requests too
    // (--inline_request_bytes >= 0, so they poll) the worker runs the step as for Forward.
    const bool may_run_inline = service_->WorkersDecodeRequests();
    auto task = [this, request, start, hold, answer, may_run_inline]() {
      service_->RunForward(
          *request, deadline_, [this] { return stop_.load(std::memory_order_relaxed); }, start,
          peer_,
          CallSource{.caller = reinterpret_cast<uintptr_t>(this), .may_run_inline = may_run_inline},
          hold, answer);
    };
    if (!service_->state_->SubmitWork(task)) {
      answer(absl::UnavailableError("ForwardStream: the server is shutting down"), {}, 0, "");
    }
  }

  void OnWriteDone(bool ok) override {
    UnwatchWrite();
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok) {  // the stream broke: nothing more can be written
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "ForwardStream: write failed"));
      return;
    }
    Release(slots_.front().held);
    slots_.pop_front();
    ++front_seq_;
    if (!reading_ && !reads_done_ && !finished_) StartReadingLocked();
    MaybeWriteLocked();
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "ForwardStream: cancelled"));
  }

  void OnDone() override {
    UnwatchWrite();  // the context goes away now
    Unref();
  }

 private:
  struct Slot {
    bool ready = false;
    grpc::ByteBuffer answer;
    int64_t held = 0;  // bytes of the service's budget this call holds (request + answer)
  };

  // Takes `bytes` of the service's budget for call `seq` (whose slot stays until its answer is
  // written), or the call's RESOURCE_EXHAUSTED.
  absl::Status Hold(uint64_t seq, int64_t bytes, absl::string_view what) {
    if (!service_->held_bytes_.TryAcquire(bytes)) {
      int64_t call_held;
      {
        std::lock_guard<std::mutex> lock(mu_);
        call_held = slots_[seq - front_seq_].held;
      }
      return service_->HoldRefused("ForwardStream", bytes, what, call_held);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      slots_[seq - front_seq_].held += bytes;
    }
    if (service_->metrics_) service_->metrics_->SetHeldBytes(service_->held_bytes_.used());
    return absl::OkStatus();
  }

  void Release(int64_t bytes) {
    if (bytes <= 0) return;
    service_->held_bytes_.Release(bytes);
    if (service_->metrics_) service_->metrics_->SetHeldBytes(service_->held_bytes_.used());
  }

  // The write in flight is over (or the call is): stop watching it. Not under mu_ (the watch
  // may cancel the call, and so run OnCancel, while it holds its own lock).
  void UnwatchWrite() {
    std::shared_ptr<AnswerHoldWatch::Held> watched;
    {
      std::lock_guard<std::mutex> lock(mu_);
      watched.swap(write_watch_);
    }
    if (watched != nullptr) service_->answer_watch_.Done(watched);
  }

  static grpc::ByteBuffer ErrorAnswer(const grpc::Status& status, const std::string& request_id) {
    v1::ForwardResponse header;
    header.set_request_id(request_id);
    header.set_error_code(static_cast<int32_t>(status.error_code()));
    header.set_error_message(status.error_message());
    absl::StatusOr<grpc::ByteBuffer> encoded = v1wire::EncodeForwardResponse(header, {});
    return encoded.ok() ? *encoded : grpc::ByteBuffer();
  }

  // A call's answer (any thread): parks it in its slot and writes whatever is next in order.
  void Answer(uint64_t seq, grpc::ByteBuffer encoded) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!finished_) {
        Slot& slot = slots_[seq - front_seq_];
        slot.answer.Swap(&encoded);
        slot.ready = true;
        MaybeWriteLocked();
      }
    }
    Unref();
  }

  void StartReadingLocked() {
    reading_ = true;
    StartRead(&read_buffer_);
  }

  // Writes the oldest answer if it is ready (deque elements keep their address while the write
  // is in flight: only the front is popped, after it completes).
  void MaybeWriteLocked() {
    if (writing_ || finished_ || slots_.empty() || !slots_.front().ready) return;
    writing_ = true;
    // An answer the client does not take within max_answer_hold cancels the stream.
    write_watch_ = service_->answer_watch_.Register(context_);
    StartWrite(&slots_.front().answer);
  }

  void MaybeFinishLocked() {
    if (reads_done_ && slots_.empty() && !writing_) FinishLocked(grpc::Status::OK);
  }

  void FinishLocked(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    stop_.store(true, std::memory_order_relaxed);
    Finish(status);
  }

  void Unref() {
    bool last;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last = --refs_ == 0;
    }
    if (last) delete this;
  }

  MoeServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;  // valid until OnDone: for the answer watch only
  const absl::Time deadline_;
  const std::string peer_;         // the client, for the shared-memory check
  std::atomic<bool> stop_{false};  // finished or cancelled: queued calls are dropped
  std::mutex mu_;
  grpc::ByteBuffer read_buffer_;
  std::deque<Slot> slots_;  // calls in request order, from front_seq_
  uint64_t front_seq_ = 0;
  bool reading_ = false;
  bool reads_done_ = false;
  bool writing_ = false;
  bool finished_ = false;
  int refs_ = 1;  // gRPC's (released at OnDone) + one per call not yet answered
  std::shared_ptr<AnswerHoldWatch::Held> write_watch_;  // the write in flight, watched
};

namespace {

// Ends a stream at once with `status` (a refused ForwardStream).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* MoeServiceImpl::ForwardStream(
    grpc::CallbackServerContext* context) {
  if (absl::Status s = Authorize(*context, "ForwardStream"); !s.ok()) {
    return new RefusedStream(ToGrpcStatus(s));  // counted by the interceptor
  }
  return new StreamReactor(this, context);
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetModelInfo(grpc::CallbackServerContext* context,
                                                       const v1::GetModelInfoRequest* request,
                                                       v1::ModelInfo* response) {
  if (metrics_) metrics_->IncrementInflight();
  absl::Status s = Authorize(*context, "GetModelInfo");
  if (s.ok()) {
    if (Engine* engine = state_->engine()) {
      EngineInfoToProto(engine->info(), state_->max_message_bytes(), response);
    } else {
      s = state_->NotReady("GetModelInfo");
    }
  }
  const grpc::Status status = ToGrpcStatus(s);
  if (metrics_) {
    metrics_->AddBytes("GetModelInfo", static_cast<int64_t>(request->ByteSizeLong()),
                       status.ok() ? static_cast<int64_t>(response->ByteSizeLong()) : 0);
    metrics_->DecrementInflight();
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetExpertWeights(
    grpc::CallbackServerContext* context, const v1::GetExpertWeightsRequest* request,
    v1::GetExpertWeightsResponse* response) {
  if (metrics_) metrics_->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto slot = std::make_shared<bool>(false);  // whether this call holds an expert-call slot
  auto finish = [this, reactor, slot, request, response](const absl::Status& status) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (metrics_) {
      metrics_->AddBytes("GetExpertWeights", static_cast<int64_t>(request->ByteSizeLong()),
                         status.ok() ? static_cast<int64_t>(response->ByteSizeLong()) : 0);
      metrics_->DecrementInflight();
    }
    // The slot goes before the answer: a client that has its answer may start the next call
    // at once and must find the slot free (afterwards, it sometimes did not: a sequential
    // caller was refused).
    if (*slot) expert_calls_.fetch_sub(1);
    reactor->Finish(grpc_status);
  };
  // Every refusal comes before the answer's buffers exist.
  if (absl::Status s =
          AdmitExpertWeights(*context, "GetExpertWeights", request->layer(), request->expert());
      !s.ok()) {
    finish(s);
    return reactor;
  }
  // AdmitExpertWeights saw the engine attached: it stays so.
  const ModelConfig& model = state_->engine()->info().model;
  const int64_t bytes = ExpertWeightsBytes(model);
  if (bytes + kExpertMessageFramingBytes > state_->max_message_bytes()) {
    finish(absl::ResourceExhaustedError(absl::StrCat(
        "GetExpertWeights: one expert of this model is ", bytes,
        " bytes, more than fits in a message (max_message_bytes ", state_->max_message_bytes(),
        "); use StreamExpertWeights, which sends it in chunks (moeserve-cli and the clients do "
        "so by themselves)")));
    return reactor;
  }
  if (absl::Status s = TakeExpertCallSlot("GetExpertWeights"); !s.ok()) {
    finish(s);
    return reactor;
  }
  *slot = true;
  // Dequantizing one expert of a large model takes milliseconds: keep it off gRPC's threads.
  auto task = [this, request, response, finish]() {
    Engine* const engine = state_->engine();
    const ModelConfig& model = engine->info().model;
    const int64_t k = model.hidden, n = model.intermediate;
    const TensorView w13 = AllocateProtoTensor(DType::kBF16, {2 * n, k}, response->mutable_w13());
    const TensorView w2 = AllocateProtoTensor(DType::kBF16, {k, n}, response->mutable_w2());
    absl::Status s = engine->GetExpertWeightsBf16(request->layer(), request->expert(),
                                                  w13.data<uint16_t>(), w2.data<uint16_t>());
    if (!s.ok()) response->Clear();
    finish(s);
  };
  if (!state_->SubmitWork(task)) {
    finish(absl::UnavailableError("GetExpertWeights: the server is shutting down"));
  }
  return reactor;
}

absl::Status MoeServiceImpl::AdmitExpertWeights(const grpc::CallbackServerContext& context,
                                                absl::string_view method, int layer,
                                                int expert) const {
  MOESERVE_RETURN_IF_ERROR(Authorize(context, method));
  if (!options_.enable_get_expert_weights) {
    return absl::FailedPreconditionError(absl::StrCat(
        method,
        ": this server does not hand out expert weights; start moeserve with "
        "--enable_get_expert_weights to allow GetExpertWeights and StreamExpertWeights (anyone "
        "who can call them can copy the model)"));
  }
  Engine* const engine = state_->engine();
  if (engine == nullptr) return state_->NotReady(method);
  absl::Status s = engine->ValidateExpertRef(layer, expert);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(method, ": ", s.message()));
  return absl::OkStatus();
}

absl::Status MoeServiceImpl::TakeExpertCallSlot(absl::string_view method) {
  if (expert_calls_.fetch_add(1) >= std::max(1, options_.max_expert_weight_calls)) {
    expert_calls_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        method, ": ", std::max(1, options_.max_expert_weight_calls),
        " expert-weight calls are in flight, the most this server runs at once; retry when one "
        "has finished"));
  }
  return absl::OkStatus();
}

namespace {

// StreamExpertWeights' reactor: the expert is computed once on a worker (Begin), then written
// chunk by chunk, each write started when the previous one is done. Deletes itself in OnDone.
class ExpertWeightsStream final : public grpc::ServerWriteReactor<v1::ExpertWeightsChunk> {
 public:
  explicit ExpertWeightsStream(Metrics* metrics) : metrics_(metrics) {
    if (metrics_) metrics_->IncrementInflight();
  }

  // The weights are ready: w13 then w2 go out in chunks of at most `chunk_bytes`.
  void Begin(std::string w13, Shape w13_shape, std::string w2, Shape w2_shape,
             int64_t chunk_bytes) {
    tensors_[0] = {"w13", std::move(w13), std::move(w13_shape)};
    tensors_[1] = {"w2", std::move(w2), std::move(w2_shape)};
    chunk_bytes_ = static_cast<size_t>(chunk_bytes);
    NextWrite();
  }

  void Fail(const absl::Status& status) { End(status); }

  void OnWriteDone(bool ok) override {
    if (!ok) return End(absl::CancelledError("StreamExpertWeights: the client went away"));
    NextWrite();
  }

  // The call holds one of `slots` until it ends (End: before its status goes out, so that a
  // client that has the status finds the slot free for its next call; OnDone ran later and a
  // sequential caller was sometimes refused). Set before the task that ends the call is queued.
  void HoldSlot(std::atomic<int>* slots) { slots_ = slots; }

  void OnDone() override {
    if (metrics_) metrics_->DecrementInflight();  // counted by the interceptor
    delete this;
  }

 private:
  struct Part {
    const char* name = "";
    std::string bytes;
    Shape shape;
  };

  void NextWrite() {
    // Each tensor sends at least one chunk (so that its shape arrives even when empty).
    while (current_ < 2 && offset_ >= tensors_[current_].bytes.size() && sent_any_) {
      ++current_;
      offset_ = 0;
      sent_any_ = false;
    }
    if (current_ >= 2) return End(absl::OkStatus());
    const Part& part = tensors_[current_];
    const size_t n = std::min(chunk_bytes_, part.bytes.size() - offset_);
    chunk_.Clear();
    chunk_.set_tensor(part.name);
    chunk_.set_dtype(v1::DTYPE_BF16);
    for (int64_t d : part.shape) chunk_.add_shape(d);
    chunk_.set_offset(static_cast<int64_t>(offset_));
    chunk_.set_data(part.bytes.data() + offset_, n);
    offset_ += n;
    sent_any_ = true;
    StartWrite(&chunk_);
  }

  void End(const absl::Status& status) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    // Every chunk written has completed (or the call failed): the weights and the slot go now.
    // (End runs once: only it calls Finish, and gRPC calls OnDone after Finish.)
    for (Part& part : tensors_) std::string().swap(part.bytes);
    if (slots_ != nullptr) slots_->fetch_sub(1);
    Finish(grpc_status);
  }

  Metrics* const metrics_;
  Part tensors_[2];
  size_t chunk_bytes_ = 0;
  int current_ = 0;
  size_t offset_ = 0;
  bool sent_any_ = false;
  v1::ExpertWeightsChunk chunk_;
  std::atomic<int>* slots_ = nullptr;
};

}  // namespace

grpc::ServerWriteReactor<v1::ExpertWeightsChunk>* MoeServiceImpl::StreamExpertWeights(
    grpc::CallbackServerContext* context, const v1::StreamExpertWeightsRequest* request) {
  auto* stream = new ExpertWeightsStream(metrics_);
  const int layer = request->layer(), expert = request->expert();
  if (absl::Status s = AdmitExpertWeights(*context, "StreamExpertWeights", layer, expert);
      !s.ok()) {
    stream->Fail(s);
    return stream;
  }
  if (request->chunk_bytes() < 0) {
    stream->Fail(absl::InvalidArgumentError(
        absl::StrCat("StreamExpertWeights: chunk_bytes: got ", request->chunk_bytes(),
                     ", expected >= 0 (0: ", kDefaultExpertChunkBytes, ")")));
    return stream;
  }
  if (absl::Status s = TakeExpertCallSlot("StreamExpertWeights"); !s.ok()) {
    stream->Fail(s);
    return stream;
  }
  stream->HoldSlot(&expert_calls_);
  int64_t chunk = request->chunk_bytes() == 0 ? kDefaultExpertChunkBytes : request->chunk_bytes();
  chunk = std::max<int64_t>(
      1, std::min(chunk, state_->max_message_bytes() - kExpertMessageFramingBytes));
  auto task = [this, stream, layer, expert, chunk]() {
    Engine* const engine = state_->engine();  // attached: AdmitExpertWeights saw it
    const ModelConfig& model = engine->info().model;
    const int64_t k = model.hidden, n = model.intermediate;
    std::string w13(static_cast<size_t>(2 * n * k) * sizeof(uint16_t), '\0');
    std::string w2(static_cast<size_t>(k * n) * sizeof(uint16_t), '\0');
    absl::Status s =
        engine->GetExpertWeightsBf16(layer, expert, reinterpret_cast<uint16_t*>(w13.data()),
                                     reinterpret_cast<uint16_t*>(w2.data()));
    if (!s.ok()) return stream->Fail(s);
    stream->Begin(std::move(w13), {2 * n, k}, std::move(w2), {k, n}, chunk);
  };
  if (!state_->SubmitWork(task)) {
    stream->Fail(absl::UnavailableError("StreamExpertWeights: the server is shutting down"));
  }
  return stream;
}

}  // namespace moeserve
