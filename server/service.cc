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
      workers_(options.num_worker_threads),
      batcher_(std::move(batcher)) {}

MoeServiceImpl::~MoeServiceImpl() { workers_.Drain(); }

grpc::ServerUnaryReactor* MoeServiceImpl::Forward(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* raw_request,
                                                  grpc::ByteBuffer* response) {
  const Clock::time_point start = Clock::now();
  if (metrics_) metrics_->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Records metrics and answers; `tokens` counts only on success.
  auto finish = [this, reactor, start](const absl::Status& status, int64_t tokens) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (metrics_) {
      if (status.ok()) metrics_->AddTokens(tokens);
      metrics_->RecordRequest("Forward", grpc_status.error_code(), MicrosSince(start) * 1e-6);
      metrics_->DecrementInflight();
    }
    reactor->Finish(grpc_status);
  };
  auto task = [this, context, raw_request, response, start, finish]() {
    const double server_queue_us = MicrosSince(start);
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
    const EngineInfo& info = engine_->info();
    // No topk tensors: the server routes with the layer's gate, into a recycled buffer that
    // lives as long as the call (ids INT32 [M, topk], then weights FP32 [M, topk]).
    std::unique_ptr<PooledBuffer> routing;
    double route_us = 0;
    if (input->topk_ids.empty()) {
      const Clock::time_point route_start = Clock::now();
      const TensorView& x = input->hidden_states;
      // Sized only for a hidden_states that Route will accept; anything else is refused there
      // (before the routing buffers are touched).
      const int64_t m =
          x.rank() == 2 && x.dim(1) == info.model.hidden && x.dim(0) <= info.max_tokens_per_request
              ? x.dim(0)
              : 0;
      const int64_t routes = m * info.model.topk;
      routing = PooledBuffer::Acquire(static_cast<size_t>(routes) * 8);
      char* base = static_cast<char*>(routing->data());
      input->topk_ids = TensorView(base, DType::kINT32, {m, info.model.topk});
      input->topk_weights = TensorView(base + routes * 4, DType::kFP32, {m, info.model.topk});
      if (absl::Status s = engine_->Route(input->layer, x, input->topk_ids, input->topk_weights);
          !s.ok()) {
        return finish(s, 0);
      }
      route_us = MicrosSince(route_start);
    }
    // Shapes before sizing the output (it comes from hidden_states); Forward checks the values.
    if (absl::Status s = ValidateForwardShapes(info.model, info.max_tokens_per_request, *input);
        !s.ok()) {
      return finish(s, 0);
    }
    const int64_t m = input->hidden_states.dim(0);
    const DType dtype = input->hidden_states.dtype();
    const Shape out_shape = {m, info.model.hidden};
    const size_t out_bytes = static_cast<size_t>(NumElements(out_shape)) * DTypeSize(dtype);
    // What the call needs until the batcher answers it: the request's slices (its tensors may
    // be views into them), the gathered bytes and the answer buffer, which the engine writes
    // and the reply's slice then owns (no copy).
    struct Pending {
      v1wire::ForwardRequestView request;
      GatheredBytes gathered;
      ForwardInput input;
      std::unique_ptr<PooledBuffer> out;      // recycled: no page faults per call
      std::unique_ptr<PooledBuffer> routing;  // server-side routing only
    };
    auto pending =
        std::make_shared<Pending>(Pending{std::move(*request), std::move(gathered), *input,
                                          PooledBuffer::Acquire(out_bytes), std::move(routing)});
    const TensorView output(pending->out->data(), dtype, out_shape);
    auto done = [this, pending, response, dtype, out_shape, out_bytes, m, start, server_queue_us,
                 route_us, finish](const absl::Status& status, const ForwardTimings& timings) {
      if (!status.ok()) return finish(status, 0);
      v1::ForwardResponse header;
      header.mutable_output()->set_dtype(DTypeToProto(dtype));
      for (int64_t d : out_shape) header.mutable_output()->add_shape(d);
      header.set_request_id(pending->request.header.request_id());
      if (metrics_) metrics_->RecordStages(server_queue_us + timings.queue_us, timings.stages);
      if (pending->request.header.return_timings()) {
        ForwardTimingsToProto(timings, server_queue_us, MicrosSince(start),
                              header.mutable_timings());
        header.mutable_timings()->set_route_us(route_us);
      }
      if (pending->request.header.return_routing()) {
        RoutingToProto(pending->input, header.mutable_topk_ids(), header.mutable_topk_weights());
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
  const Clock::time_point start = Clock::now();
  if (metrics_) metrics_->IncrementInflight();
  EngineInfoToProto(engine_->info(), options_.max_message_bytes, response);
  if (metrics_) {
    metrics_->RecordRequest("GetModelInfo", grpc::StatusCode::OK, MicrosSince(start) * 1e-6);
    metrics_->DecrementInflight();
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* MoeServiceImpl::GetExpertWeights(
    grpc::CallbackServerContext* context, const v1::GetExpertWeightsRequest* request,
    v1::GetExpertWeightsResponse* response) {
  const Clock::time_point start = Clock::now();
  if (metrics_) metrics_->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [this, reactor, start](const absl::Status& status) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (metrics_) {
      metrics_->RecordRequest("GetExpertWeights", grpc_status.error_code(),
                              MicrosSince(start) * 1e-6);
      metrics_->DecrementInflight();
    }
    reactor->Finish(grpc_status);
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
