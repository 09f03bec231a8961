#include "server/inference_service.h"

#include <chrono>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "inference/infer_wire.h"
#include "server/convert.h"
#include "server/status.h"

namespace moeserve {

namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

bool WantsTimings(const inference::ModelInferRequest& request) {
  auto it = request.parameters().find("return_timings");
  return it != request.parameters().end() &&
         it->second.parameter_choice_case() == inference::InferParameter::kBoolParam &&
         it->second.bool_param();
}

}  // namespace

grpc::ServerUnaryReactor* InferenceServiceImpl::Answer(grpc::CallbackServerContext* context,
                                                       const char* method,
                                                       const absl::Status& status, int64_t received,
                                                       int64_t sent) {
  const grpc::Status grpc_status = ToGrpcStatus(status);
  if (Metrics* metrics = state_->metrics()) {
    metrics->AddBytes(method, received, status.ok() ? sent : 0);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc_status);
  return reactor;
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerLive(
    grpc::CallbackServerContext* context, const inference::ServerLiveRequest* request,
    inference::ServerLiveResponse* response) {
  response->set_live(true);  // answering at all means the process is up
  return Answer(context, "ServerLive", absl::OkStatus(), request->ByteSizeLong(),
                response->ByteSizeLong());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerReady(
    grpc::CallbackServerContext* context, const inference::ServerReadyRequest* request,
    inference::ServerReadyResponse* response) {
  response->set_ready(state_->engine() != nullptr && ready_());
  return Answer(context, "ServerReady", absl::OkStatus(), request->ByteSizeLong(),
                response->ByteSizeLong());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelReady(
    grpc::CallbackServerContext* context, const inference::ModelReadyRequest* request,
    inference::ModelReadyResponse* response) {
  if (absl::Status s = state_->Authorize(*context, "ModelReady"); !s.ok()) {
    return Answer(context, "ModelReady", s, request->ByteSizeLong(), 0);
  }
  // An unknown model is not ready (rather than an error), so probes read one answer.
  Engine* engine = state_->engine();
  response->set_ready(
      engine != nullptr && ready_() &&
      ModelLayerFromKServe(engine->info().model, request->name(), request->version(), nullptr)
          .ok());
  return Answer(context, "ModelReady", absl::OkStatus(), request->ByteSizeLong(),
                response->ByteSizeLong());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest* request,
    inference::ServerMetadataResponse* response) {
  if (absl::Status s = state_->Authorize(*context, "ServerMetadata"); !s.ok()) {
    return Answer(context, "ServerMetadata", s, request->ByteSizeLong(), 0);
  }
  ServerMetadataToKServe(response);
  return Answer(context, "ServerMetadata", absl::OkStatus(), request->ByteSizeLong(),
                response->ByteSizeLong());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  absl::Status status = state_->Authorize(*context, "ModelMetadata");
  Engine* const engine = status.ok() ? state_->engine() : nullptr;
  if (!status.ok()) {
    response->Clear();
  } else if (engine != nullptr) {
    absl::StatusOr<int> layer =
        ModelLayerFromKServe(engine->info().model, request->name(), request->version(), nullptr);
    if (layer.ok()) {
      ModelMetadataToKServe(engine->info(), request->name(), response);
    } else {
      status = layer.status();
    }
  } else {
    status = state_->NotReady("ModelMetadata");
  }
  return Answer(context, "ModelMetadata", status, request->ByteSizeLong(),
                response->ByteSizeLong());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* raw_request,
                                                           grpc::ByteBuffer* response) {
  const Clock::time_point start = Clock::now();
  Metrics* const metrics = state_->metrics();
  if (metrics) metrics->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const int64_t received = static_cast<int64_t>(raw_request->Length());
  auto finish = [metrics, reactor, received, response](const absl::Status& status, int64_t tokens) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (metrics) {
      if (status.ok()) metrics->AddTokens(tokens);
      metrics->AddBytes("ModelInfer", received,
                        status.ok() ? static_cast<int64_t>(response->Length()) : 0);
      metrics->DecrementInflight();
    }
    reactor->Finish(grpc_status);
  };
  if (absl::Status s = state_->Authorize(*context, "ModelInfer"); !s.ok()) {
    finish(s, 0);
    return reactor;
  }
  auto task = [this, context, raw_request, response, start, received, finish]() {
    const double server_queue_us = MicrosSince(start);
    if (context->IsCancelled()) {
      return finish(absl::CancelledError("ModelInfer: cancelled by the client before it ran"), 0);
    }
    Engine* engine = state_->engine();
    if (engine == nullptr) return finish(state_->NotReady("ModelInfer"), 0);
    absl::StatusOr<inference_wire::ModelInferRequestView> request =
        inference_wire::DecodeModelInferRequest(*raw_request);
    if (!request.ok()) {
      return finish(
          absl::InvalidArgumentError(absl::StrCat("ModelInfer: ", request.status().message())), 0);
    }
    const inference::ModelInferRequest& header = request->header;
    absl::StatusOr<int> layer = ModelLayerFromKServe(engine->info().model, header.model_name(),
                                                     header.model_version(), &header.parameters());
    if (!layer.ok()) return finish(layer.status(), 0);
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> input = ForwardInputFromKServe(*request, *layer, &gathered);
    if (!input.ok()) return finish(input.status(), 0);
    // Neither topk input: the server routes with the layer's gate, as Forward does.
    std::unique_ptr<PooledBuffer> routing;
    if (input->topk_ids.empty()) {
      if (absl::Status s = RouteOnServer(*engine, &*input, &routing); !s.ok()) {
        return finish(s, 0);
      }
    }
    struct Pending {
      inference_wire::ModelInferRequestView request;
      GatheredBytes gathered;
      std::unique_ptr<PooledBuffer> routing;  // server-side routing only
    };
    auto pending = std::make_shared<Pending>(
        Pending{std::move(*request), std::move(gathered), std::move(routing)});
    Metrics* const metrics = state_->metrics();
    auto done = [pending, response, start, server_queue_us, metrics, finish](
                    absl::Status status, ServingState::ForwardAnswer answer) {
      if (!status.ok()) return finish(status, 0);
      const inference::ModelInferRequest& req = pending->request.header;
      inference::ModelInferResponse header;
      header.set_model_name(req.model_name());
      header.set_model_version(kKServeModelVersion);
      header.set_id(req.id());
      inference::ModelInferResponse::InferOutputTensor* out = header.add_outputs();
      out->set_name(kKServeOutputName);
      out->set_datatype(std::string(DTypeToKServe(answer.dtype)));
      for (int64_t d : answer.shape) out->add_shape(d);
      const double queue_us = server_queue_us + answer.timings.queue_us;
      if (metrics) metrics->RecordStages(queue_us, answer.timings.stages);
      if (WantsTimings(req)) {
        auto& p = *header.mutable_parameters();
        p["queue_us"].set_double_param(queue_us);
        p["prepare_us"].set_double_param(answer.timings.stages.prepare_us);
        p["experts_us"].set_double_param(answer.timings.stages.experts_us);
        p["finalize_us"].set_double_param(answer.timings.stages.finalize_us);
        p["total_us"].set_double_param(MicrosSince(start));
      }
      void* out_data = answer.output->data();
      absl::StatusOr<grpc::ByteBuffer> encoded = inference_wire::EncodeModelInferResponse(
          header, {v1wire::SliceOwning(out_data, answer.bytes, std::move(answer.output))});
      if (!encoded.ok()) return finish(absl::InternalError(encoded.status().message()), 0);
      response->Swap(&*encoded);
      finish(absl::OkStatus(), answer.shape[0]);
    };
    state_->SubmitForward(
        "ModelInfer", *input, received, CallDeadline(context->deadline()),
        [context] { return context->IsCancelled(); }, std::move(done));
  };
  if (!state_->SubmitWork(task)) {
    finish(absl::UnavailableError("ModelInfer: the server is shutting down"), 0);
  }
  return reactor;
}

}  // namespace moeserve
