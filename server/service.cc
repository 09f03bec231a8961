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

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

}  // namespace

grpc::ServerUnaryReactor* MoeServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* raw_request,
                                                  grpc::ByteBuffer* response) {
  const Clock::time_point start = Clock::now();
  Metrics* const metrics = state_->metrics();
  if (metrics) metrics->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const int64_t received = static_cast<int64_t>(raw_request->Length());
  // Records metrics and answers; `tokens` counts only on success.
  auto finish = [metrics, reactor, start, received, response](const absl::Status& status,
                                                              int64_t tokens) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (metrics) {
      if (status.ok()) metrics->AddTokens(tokens);
      metrics->RecordRequest("Forward", grpc_status.error_code(), MicrosSince(start) * 1e-6);
      metrics->AddBytes("Forward", received,
                        status.ok() ? static_cast<int64_t>(response->Length()) : 0);
      metrics->DecrementInflight();
    }
    reactor->Finish(grpc_status);
  };
  auto task = [this, context, raw_request, response, start, received, finish]() {
    const double server_queue_us = MicrosSince(start);
    if (context->IsCancelled()) {
      finish(absl::CancelledError("Forward: cancelled by the client before it ran"), 0);
      return;
    }
    if (state_->engine() == nullptr) return finish(state_->NotReady("Forward"), 0);
    absl::StatusOr<v1wire::ForwardRequestView> request = v1wire::DecodeForwardRequest(*raw_request);
    if (!request.ok()) {
      return finish(
          absl::InvalidArgumentError(absl::StrCat("Forward: ", request.status().message())), 0);
    }
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> input = ForwardInputFromWire(*request, &gathered);
    if (!input.ok()) return finish(input.status(), 0);
    // The request's slices (the tensors may be views into them) and the gathered bytes live
    // until the batcher answers.
    struct Pending {
      v1wire::ForwardRequestView request;
      GatheredBytes gathered;
    };
    auto pending = std::make_shared<Pending>(Pending{std::move(*request), std::move(gathered)});
    Metrics* const metrics = state_->metrics();
    auto done = [pending, response, start, server_queue_us, metrics, finish](
                    absl::Status status, ServingState::ForwardAnswer answer) {
      if (!status.ok()) return finish(status, 0);
      v1::ForwardResponse header;
      header.mutable_output()->set_dtype(DTypeToProto(answer.dtype));
      for (int64_t d : answer.shape) header.mutable_output()->add_shape(d);
      header.set_request_id(pending->request.header.request_id());
      if (metrics)
        metrics->RecordStages(server_queue_us + answer.timings.queue_us, answer.timings.stages);
      if (pending->request.header.return_timings()) {
        ForwardTimingsToProto(answer.timings, server_queue_us, MicrosSince(start),
                              header.mutable_timings());
      }
      void* out_data = answer.output->data();
      // The answer buffer, written by the engine, becomes the reply's slice (no copy).
      absl::StatusOr<grpc::ByteBuffer> encoded = v1wire::EncodeForwardResponse(
          header, v1wire::SliceOwning(out_data, answer.bytes, std::move(answer.output)));
      if (!encoded.ok()) return finish(absl::InternalError(encoded.status().message()), 0);
      response->Swap(&*encoded);
      finish(absl::OkStatus(), answer.shape[0]);
    };
    state_->SubmitForward(
        "Forward", *input, received, CallDeadline(context->deadline()),
        [context] { return context->IsCancelled(); }, std::move(done));
  };
  if (!state_->SubmitWork(task)) {
    finish(absl::UnavailableError("Forward: the server is shutting down"), 0);
  }
  return reactor;
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetModelInfo(grpc::CallbackServerContext* context,
                                                       const v1::GetModelInfoRequest* request,
                                                       v1::ModelInfo* response) {
  const Clock::time_point start = Clock::now();
  Metrics* const metrics = state_->metrics();
  if (metrics) metrics->IncrementInflight();
  absl::Status status;
  if (Engine* engine = state_->engine()) {
    EngineInfoToProto(engine->info(), state_->max_message_bytes(), response);
  } else {
    status = state_->NotReady("GetModelInfo");
  }
  const grpc::Status grpc_status = ToGrpcStatus(status);
  if (metrics) {
    metrics->RecordRequest("GetModelInfo", grpc_status.error_code(), MicrosSince(start) * 1e-6);
    metrics->AddBytes("GetModelInfo", static_cast<int64_t>(request->ByteSizeLong()),
                      status.ok() ? static_cast<int64_t>(response->ByteSizeLong()) : 0);
    metrics->DecrementInflight();
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc_status);
  return reactor;
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetExpertWeights(
    grpc::CallbackServerContext* context, const v1::GetExpertWeightsRequest* request,
    v1::GetExpertWeightsResponse* response) {
  const Clock::time_point start = Clock::now();
  Metrics* const metrics = state_->metrics();
  if (metrics) metrics->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [metrics, reactor, start, request, response](const absl::Status& status) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (metrics) {
      metrics->RecordRequest("GetExpertWeights", grpc_status.error_code(),
                             MicrosSince(start) * 1e-6);
      metrics->AddBytes("GetExpertWeights", static_cast<int64_t>(request->ByteSizeLong()),
                        status.ok() ? static_cast<int64_t>(response->ByteSizeLong()) : 0);
      metrics->DecrementInflight();
    }
    reactor->Finish(grpc_status);
  };
  // Dequantizing one expert of a large model takes milliseconds: keep it off gRPC's threads.
  auto task = [this, request, response, finish]() {
    Engine* engine = state_->engine();
    if (engine == nullptr) return finish(state_->NotReady("GetExpertWeights"));
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

}  // namespace moeserve
