#include "server/service.h"

#include <chrono>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "moeserve/v1/forward_wire.h"
#include "server/convert.h"
#include "server/status.h"

namespace moeserve {

namespace {

using Clock = std::chrono::steady_clock;

// The call's deadline; none (gRPC's infinite future) maps to absl::InfiniteFuture().
absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

}  // namespace

MoeServiceImpl::MoeServiceImpl(Engine* engine, std::unique_ptr<ForwardBatcher> batcher,
                               Metrics* metrics, const ServiceOptions& options)
    : engine_(engine),
      metrics_(metrics),
      options_(options),
      held_bytes_(options.max_held_bytes),
      answer_watch_(options.max_answer_hold,
                    [metrics] {
                      if (metrics) metrics->OnAnswerCancelled();
                    }),
      workers_(options.num_worker_threads),
      batcher_(std::move(batcher)) {}

MoeServiceImpl::~MoeServiceImpl() { workers_.Drain(); }

grpc::ServerUnaryReactor* MoeServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* raw_request,
                                                  grpc::ByteBuffer* response) {
  const Clock::time_point start = Clock::now();
  if (metrics_) metrics_->IncrementInflight();
  // Holds the call's bytes until gRPC is done with it, and watches its answer being taken.
  auto* reactor = new HeldUnaryReactor(context, &answer_watch_, &held_bytes_, [this] {
    if (metrics_) metrics_->SetHeldBytes(held_bytes_.used());
  });
  // Answers; `tokens` counts only on success.
  auto finish = [this, reactor](const absl::Status& status, int64_t tokens) {
    if (metrics_) {
      if (status.ok()) metrics_->AddTokens(tokens);
      metrics_->DecrementInflight();
    }
    reactor->FinishAndHold(ToGrpcStatus(status));
  };
  // Admission: refused at once when the bytes calls hold would pass the limit.
  auto hold = [this, reactor](int64_t bytes, absl::string_view what) {
    if (reactor->Hold(bytes)) {
      if (metrics_) metrics_->SetHeldBytes(held_bytes_.used());
      return absl::OkStatus();
    }
    if (metrics_) metrics_->OnRefusedForMemory();
    return absl::ResourceExhaustedError(absl::StrCat(
        "Forward: the server holds ", held_bytes_.used(), " bytes of requests and answers; ", what,
        " of ", bytes, " bytes would pass max_queued_bytes=", held_bytes_.limit(),
        "; retry later or elsewhere"));
  };
  if (absl::Status s = hold(static_cast<int64_t>(raw_request->Length()), "this request"); !s.ok()) {
    finish(s, 0);
    return reactor;
  }
  auto task = [this, context, raw_request, response, start, finish, hold]() {
    const double server_queue_us = MicrosSince(start);
    if (DeadlineOf(*context) <= absl::Now()) {
      finish(absl::DeadlineExceededError(absl::StrCat("Forward: the deadline passed after ",
                                                      server_queue_us,
                                                      " us waiting for a worker, before it ran")),
             0);
      return;
    }
    if (context->IsCancelled()) {
      finish(absl::CancelledError("Forward: cancelled by the client before it ran"), 0);
      return;
    }
    absl::StatusOr<v1wire::ForwardRequestView> request = v1wire::DecodeForwardRequest(*raw_request);
    if (!request.ok()) {
      return finish(
          absl::InvalidArgumentError(absl::StrCat("Forward: ", request.status().message())), 0);
    }
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> input = ForwardInputFromWire(*request, &gathered);
    if (!input.ok()) return finish(input.status(), 0);
    // Shapes before sizing the output (it comes from hidden_states); Forward checks the values.
    const EngineInfo& info = engine_->info();
    if (absl::Status s = ValidateForwardShapes(info.model, info.max_tokens_per_request, *input);
        !s.ok()) {
      return finish(s, 0);
    }
    const int64_t m = input->hidden_states.dim(0);
    const DType dtype = input->hidden_states.dtype();
    const Shape out_shape = {m, info.model.hidden};
    const size_t out_bytes = static_cast<size_t>(NumElements(out_shape)) * DTypeSize(dtype);
    if (absl::Status s = hold(static_cast<int64_t>(out_bytes), "its answer"); !s.ok()) {
      return finish(s, 0);
    }
    // What the call needs until the batcher answers it: the request's slices (its tensors may
    // be views into them), the gathered bytes and the answer buffer, which the engine writes
    // and the reply's slice then owns (no copy).
    struct Pending {
      v1wire::ForwardRequestView request;
      GatheredBytes gathered;
      ForwardInput input;
      std::unique_ptr<PooledBuffer> out;  // recycled: no page faults per call
    };
    auto pending = std::make_shared<Pending>(Pending{std::move(*request), std::move(gathered),
                                                     *input, PooledBuffer::Acquire(out_bytes)});
    const TensorView output(pending->out->data(), dtype, out_shape);
    auto done = [this, pending, response, dtype, out_shape, out_bytes, m, start, server_queue_us,
                 finish](const absl::Status& status, const ForwardTimings& timings) {
      if (!status.ok()) return finish(status, 0);
      v1::ForwardResponse header;
      header.mutable_output()->set_dtype(DTypeToProto(dtype));
      for (int64_t d : out_shape) header.mutable_output()->add_shape(d);
      header.set_request_id(pending->request.header.request_id());
      if (metrics_) metrics_->RecordStages(server_queue_us + timings.queue_us, timings.stages);
      if (pending->request.header.return_timings()) {
        ForwardTimingsToProto(timings, server_queue_us, MicrosSince(start),
                              header.mutable_timings());
      }
      void* out_data = pending->out->data();
      absl::StatusOr<grpc::ByteBuffer> encoded = v1wire::EncodeForwardResponse(
          header, v1wire::SliceOwning(out_data, out_bytes, std::move(pending->out)));
      if (!encoded.ok()) return finish(absl::InternalError(encoded.status().message()), 0);
      response->Swap(&*encoded);
      finish(absl::OkStatus(), m);
    };
    batcher_->Submit(
        pending->input, output, DeadlineOf(*context), [context] { return context->IsCancelled(); },
        std::move(done));
  };
  if (!workers_.Submit(task)) {
    finish(absl::UnavailableError("Forward: the server is shutting down"), 0);
  }
  return reactor;
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetModelInfo(grpc::CallbackServerContext* context,
                                                       const v1::GetModelInfoRequest* request,
                                                       v1::ModelInfo* response) {
  if (metrics_) metrics_->IncrementInflight();
  EngineInfoToProto(engine_->info(), options_.max_message_bytes, response);
  if (metrics_) metrics_->DecrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetExpertWeights(
    grpc::CallbackServerContext* context, const v1::GetExpertWeightsRequest* request,
    v1::GetExpertWeightsResponse* response) {
  if (metrics_) metrics_->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [this, reactor](const absl::Status& status) {
    if (metrics_) metrics_->DecrementInflight();
    reactor->Finish(ToGrpcStatus(status));
  };
  // Dequantizing one expert of a large model takes milliseconds: keep it off gRPC's threads.
  auto task = [this, request, response, finish]() {
    const ModelConfig& model = engine_->info().model;
    const int64_t k = model.hidden, n = model.intermediate;
    const TensorView w13 = AllocateProtoTensor(DType::kBF16, {2 * n, k}, response->mutable_w13());
    const TensorView w2 = AllocateProtoTensor(DType::kBF16, {k, n}, response->mutable_w2());
    absl::Status s = engine_->GetExpertWeightsBf16(request->layer(), request->expert(),
                                                   w13.data<uint16_t>(), w2.data<uint16_t>());
    if (!s.ok()) response->Clear();
    finish(s);
  };
  if (!workers_.Submit(task)) {
    finish(absl::UnavailableError("GetExpertWeights: the server is shutting down"));
  }
  return reactor;
}

}  // namespace moeserve
