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
      batcher_(std::move(batcher)) {
  if (options_.enable_shared_memory) {
    RegionRegistryOptions regions;
    regions.backend = engine_->info().backend == "cuda" ? Backend::kCuda : Backend::kCpu;
    regions.max_regions = options_.max_shared_memory_regions;
    regions_ = std::make_unique<RegionRegistry>(regions);
  }
}

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
    // Tensors in shared-memory regions hold their regions until the answer is ready; released
    // before the call finishes, so the client may unregister as soon as it has the answer.
    ForwardRegions regions;
    auto fail = [&regions, &finish](const absl::Status& status) {
      regions.Release();
      finish(status, 0);
    };
    // A CUDA region's bytes are read and written in place where the engine takes device memory.
    const EngineInfo& info = engine_->info();
    const bool names_regions =
        request->header.has_output_region() || request->hidden_states.header.has_region() ||
        request->topk_ids.header.has_region() || request->topk_weights.header.has_region();
    // With shared memory off, the conversion names the field and the flag.
    if (names_regions && regions_ != nullptr) {
      if (absl::Status s = CheckSharedMemoryAllowed(*context, "Forward"); !s.ok()) return fail(s);
    }
    absl::StatusOr<ForwardInput> input =
        ForwardInputFromWire(*request, &gathered, regions_.get(), info.device_tensors, &regions);
    if (!input.ok()) return fail(input.status());
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
    const bool region_output = regions.output.has_value();
    const size_t out_bytes =
        region_output ? 0 : static_cast<size_t>(NumElements(out_shape)) * DTypeSize(dtype);
    // What the call needs until the batcher answers it: the request's slices (its tensors may
    // be views into them), the gathered bytes, the regions, and the answer buffer, which the
    // engine writes and the reply's slice then owns (no copy) -- or the output region.
    struct Pending {
      v1wire::ForwardRequestView request;
      GatheredBytes gathered;
      ForwardRegions regions;
      ForwardInput input;
      std::unique_ptr<PooledBuffer> out;  // recycled: no page faults per call
    };
    auto pending = std::make_shared<Pending>(
        Pending{std::move(*request), std::move(gathered), std::move(regions), *input,
                region_output ? nullptr : PooledBuffer::Acquire(out_bytes)});
    const TensorView output = region_output ? pending->regions.output->view()
                                            : TensorView(pending->out->data(), dtype, out_shape);
    auto done = [this, pending, response, dtype, out_shape, out_bytes, m, start, server_queue_us,
                 finish](const absl::Status& status, const ForwardTimings& timings) {
      absl::Status s = status;
      if (s.ok() && pending->regions.output.has_value()) s = pending->regions.output->Flush();
      pending->regions.Release();
      if (!s.ok()) return finish(s, 0);
      v1::ForwardResponse header;
      header.mutable_output()->set_dtype(DTypeToProto(dtype));
      for (int64_t d : out_shape) header.mutable_output()->add_shape(d);
      header.set_request_id(pending->request.header.request_id());
      if (metrics_) metrics_->RecordStages(server_queue_us + timings.queue_us, timings.stages);
      if (pending->request.header.return_timings()) {
        ForwardTimingsToProto(timings, server_queue_us, MicrosSince(start),
                              header.mutable_timings());
      }
      // With an output region the answer is there already: the reply has dtype and shape only.
      grpc::Slice data;
      if (pending->out != nullptr) {
        void* out_data = pending->out->data();
        data = v1wire::SliceOwning(out_data, out_bytes, std::move(pending->out));
      }
      absl::StatusOr<grpc::ByteBuffer> encoded = v1wire::EncodeForwardResponse(header, data);
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
