#include "server/inference_service.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "inference/infer_wire.h"
#include "server/call_limits.h"
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
  ServerMetadataToKServe(moe_ != nullptr ? moe_->regions() : nullptr, response);
  return Answer(context, "ServerMetadata", absl::OkStatus(), request->ByteSizeLong(),
                response->ByteSizeLong());
}

absl::Status InferenceServiceImpl::ForModel(grpc::CallbackServerContext* context,
                                            const char* method, const std::string& model,
                                            const std::string& version,
                                            absl::FunctionRef<void(const EngineInfo&)> fill) {
  MOESERVE_RETURN_IF_ERROR(state_->Authorize(*context, method));
  Engine* const engine = state_->engine();
  if (engine == nullptr) return state_->NotReady(method);
  MOESERVE_RETURN_IF_ERROR(
      ModelLayerFromKServe(engine->info().model, model, version, nullptr).status());
  fill(engine->info());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  const absl::Status status = ForModel(
      context, "ModelMetadata", request->name(), request->version(),
      [&](const EngineInfo& info) { ModelMetadataToKServe(info, request->name(), response); });
  if (!status.ok()) response->Clear();
  return Answer(context, "ModelMetadata", status, request->ByteSizeLong(),
                response->ByteSizeLong());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelConfig(
    grpc::CallbackServerContext* context, const inference::ModelConfigRequest* request,
    inference::ModelConfigResponse* response) {
  const absl::Status status = ForModel(
      context, "ModelConfig", request->name(), request->version(), [&](const EngineInfo& info) {
        ModelConfigToKServe(info, request->name(), response->mutable_config());
      });
  if (!status.ok()) response->Clear();
  return Answer(context, "ModelConfig", status, request->ByteSizeLong(), response->ByteSizeLong());
}

grpc::ServerUnaryReactor* InferenceServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* raw_request,
                                                           grpc::ByteBuffer* response) {
  const Clock::time_point start = Clock::now();
  Metrics* const metrics = state_->metrics();
  if (metrics) metrics->IncrementInflight();
  // Holds the call's bytes (max_queued_bytes, shared with Forward) until gRPC is done with it,
  // and watches its answer being taken (max_answer_hold).
  MoeServiceImpl* const moe = moe_;
  auto* reactor = new HeldUnaryReactor(context, moe ? moe->answer_watch() : nullptr,
                                       moe ? moe->held_budget() : nullptr, [metrics, moe] {
                                         if (metrics && moe)
                                           metrics->SetHeldBytes(moe->held_bytes());
                                       });
  const int64_t received = static_cast<int64_t>(raw_request->Length());
  auto finish = [metrics, reactor, received, response](const absl::Status& status, int64_t tokens) {
    const grpc::Status grpc_status = ToGrpcStatus(status);
    if (metrics) {
      if (status.ok()) metrics->AddTokens(tokens);
      metrics->AddBytes("ModelInfer", received,
                        status.ok() ? static_cast<int64_t>(response->Length()) : 0);
      metrics->DecrementInflight();
    }
    reactor->FinishAndHold(grpc_status);
  };
  // Admission: refused at once when the bytes calls hold would pass the limit.
  auto hold = [metrics, moe, reactor](int64_t bytes, absl::string_view what) {
    if (moe == nullptr) return absl::OkStatus();
    if (!reactor->Hold(bytes)) {
      return moe->HoldRefused("ModelInfer", bytes, what, reactor->held_bytes());
    }
    if (metrics) metrics->SetHeldBytes(moe->held_bytes());
    return absl::OkStatus();
  };
  if (absl::Status s = state_->Authorize(*context, "ModelInfer"); !s.ok()) {
    finish(s, 0);
    return reactor;
  }
  if (absl::Status s = hold(received, "this request"); !s.ok()) {
    finish(s, 0);
    return reactor;
  }
  auto task = [this, context, raw_request, response, start, finish, hold]() {
    const double server_queue_us = MicrosSince(start);
    if (context->IsCancelled()) {
      return finish(absl::CancelledError("ModelInfer: cancelled by the client before it ran"), 0);
    }
    Engine* engine = state_->engine();  // acquire: the region registry is set before it
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
    // Tensors in shared-memory regions hold their regions until the answer is ready (released
    // before the call is answered, so the client may unregister as soon as it has the answer).
    ForwardRegions regions;
    auto fail = [&regions, &finish](const absl::Status& status) {
      regions.Release();
      finish(status, 0);
    };
    const RegionRegistry* registry = moe_ != nullptr ? moe_->regions() : nullptr;
    // Regions name this host's memory: same-host clients only. (With shared memory off, the
    // conversion refuses naming the parameter and the flag.)
    if (registry != nullptr && KServeUsesSharedMemory(header)) {
      if (absl::Status s = MoeServiceImpl::CheckSharedMemoryPeer(context->peer(), "ModelInfer");
          !s.ok()) {
        return fail(s);
      }
    }
    const EngineInfo& info = engine->info();
    GatheredBytes gathered;
    absl::StatusOr<ForwardInput> input = ForwardInputFromKServe(
        *request, *layer, &gathered, registry, info.device_tensors, &regions);
    if (!input.ok()) return fail(input.status());
    // Neither topk input: the server routes with the layer's gate, as Forward does.
    std::unique_ptr<PooledBuffer> routing;
    if (input->topk_ids.empty()) {
      if (absl::Status s = RouteOnServer(*engine, &*input, &routing); !s.ok()) return fail(s);
    }
    // Shapes before sizing the output (it comes from hidden_states); Forward checks the values.
    if (absl::Status s = ValidateForwardShapes(info.model, info.max_tokens_per_request, *input);
        !s.ok()) {
      return fail(s);
    }
    const DType dtype = input->hidden_states.dtype();
    const Shape out_shape = {input->hidden_states.dim(0), info.model.hidden};
    if (absl::Status s = ResolveKServeOutputRegion(header, registry, dtype, out_shape,
                                                   info.device_tensors, &regions);
        !s.ok()) {
      return fail(s);
    }
    // The answer's bytes count against max_queued_bytes from here (an output region: none).
    if (!regions.output.has_value()) {
      const int64_t out_bytes = NumElements(out_shape) * static_cast<int64_t>(DTypeSize(dtype));
      if (out_bytes > 0) {
        if (absl::Status s = hold(out_bytes, "its answer"); !s.ok()) return fail(s);
      }
    }
    struct Pending {
      inference_wire::ModelInferRequestView request;
      GatheredBytes gathered;
      ForwardRegions regions;
      ForwardInput input;
      std::unique_ptr<PooledBuffer> routing;  // server-side routing only
    };
    auto pending = std::make_shared<Pending>(Pending{
        std::move(*request), std::move(gathered), std::move(regions), *input, std::move(routing)});
    std::optional<TensorView> region_output;
    if (pending->regions.output.has_value()) region_output = pending->regions.output->view();
    Metrics* const metrics = state_->metrics();
    auto done = [pending, response, start, server_queue_us, metrics, finish](
                    absl::Status status, ServingState::ForwardAnswer answer) {
      if (status.ok() && pending->regions.output.has_value()) {
        status = pending->regions.output->Flush();
      }
      std::optional<RegionRef> out_ref;
      if (pending->regions.output.has_value()) out_ref = pending->regions.output->ref();
      pending->regions.Release();
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
      if (out_ref.has_value()) {  // the answer is in the region: say where, send no bytes
        auto& p = *out->mutable_parameters();
        p[kKServeShmRegion].set_string_param(out_ref->name);
        p[kKServeShmByteSize].set_int64_param(out_ref->byte_size);
        p[kKServeShmOffset].set_int64_param(out_ref->offset);
      }
      const double queue_us = server_queue_us + answer.timings.queue_us;
      if (metrics) metrics->RecordStages(queue_us, answer.timings);
      if (WantsTimings(req)) {
        auto& p = *header.mutable_parameters();
        p["queue_us"].set_double_param(queue_us);
        p["prepare_us"].set_double_param(answer.timings.stages.prepare_us);
        p["experts_us"].set_double_param(answer.timings.stages.experts_us);
        p["finalize_us"].set_double_param(answer.timings.stages.finalize_us);
        p["total_us"].set_double_param(MicrosSince(start));
      }
      // One raw_output_contents entry per output, as Triton sends: an output in a region gets an
      // empty one (clients such as perf_analyzer index the entries by output).
      std::vector<grpc::Slice> raw(1);
      if (answer.output != nullptr) {
        void* out_data = answer.output->data();
        raw[0] = v1wire::SliceOwning(out_data, answer.bytes, std::move(answer.output));
      }
      absl::StatusOr<grpc::ByteBuffer> encoded =
          inference_wire::EncodeModelInferResponse(header, raw);
      if (!encoded.ok()) return finish(absl::InternalError(encoded.status().message()), 0);
      response->Swap(&*encoded);
      finish(absl::OkStatus(), answer.shape[0]);
    };
    state_->SubmitForward(
        "ModelInfer", pending->input, static_cast<int64_t>(raw_request->Length()),
        CallDeadline(context->deadline()), [context] { return context->IsCancelled(); },
        std::move(done), region_output,
        // Decoded on a worker like a stream's call: where workers poll for requests, the
        // worker runs an idle batcher's step itself (as Forward's and ForwardStream's do).
        CallSource{.caller = CallerKey(context->peer()),
                   .may_run_inline = moe_->WorkersDecodeRequests(),
                   .stage_timings = WantsTimings(pending->request.header)});
  };
  if (!state_->SubmitWork(task)) {
    finish(absl::UnavailableError("ModelInfer: the server is shutting down"), 0);
  }
  return reactor;
}

// ---- Shared memory: the KServe face of MoeServiceImpl's registry and checks. ----

namespace {

// A uint64 size or offset of the wire as int64; INVALID_ARGUMENT naming `field` beyond.
absl::StatusOr<int64_t> WireInt64(uint64_t value, absl::string_view field) {
  if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", value, " is larger than the largest int64"));
  }
  return static_cast<int64_t>(value);
}

// The registry's regions of `kind` (one when `name` is set: NOT_FOUND if it is of another kind).
absl::StatusOr<std::vector<RegionInfo>> RegionsOfKind(const RegionRegistry& registry,
                                                      const std::string& name, RegionKind kind) {
  absl::StatusOr<std::vector<RegionInfo>> all = registry.Status(name);
  if (!all.ok()) return all.status();
  std::vector<RegionInfo> out;
  for (RegionInfo& info : *all) {
    if (info.kind == kind) {
      out.push_back(std::move(info));
    } else if (!name.empty()) {
      return absl::NotFoundError(absl::StrCat("name: '", name, "' is a ", RegionKindName(info.kind),
                                              " region, not a ", RegionKindName(kind), " one"));
    }
  }
  return out;
}

}  // namespace

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::SystemSharedMemoryStatusRequest* request,
    inference::SystemSharedMemoryStatusResponse* response) {
  return moe_->RunSharedMemoryCall(context, "SystemSharedMemoryStatus", [this, request, response] {
    absl::StatusOr<std::vector<RegionInfo>> regions =
        RegionsOfKind(*moe_->regions(), request->name(), RegionKind::kSystem);
    if (!regions.ok()) return regions.status();
    for (const RegionInfo& info : *regions) {
      auto& r = (*response->mutable_regions())[info.name];
      r.set_name(info.name);
      r.set_key(info.key);
      r.set_offset(static_cast<uint64_t>(info.offset));
      r.set_byte_size(static_cast<uint64_t>(info.byte_size));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryRegisterRequest* request,
    inference::SystemSharedMemoryRegisterResponse* response) {
  return moe_->RunSharedMemoryCall(context, "SystemSharedMemoryRegister", [this, request] {
    MOESERVE_ASSIGN_OR_RETURN(const int64_t offset, WireInt64(request->offset(), "offset"));
    MOESERVE_ASSIGN_OR_RETURN(const int64_t bytes, WireInt64(request->byte_size(), "byte_size"));
    return moe_->mutable_regions()->RegisterSystem(request->name(), request->key(), offset, bytes);
  });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryUnregisterRequest* request,
    inference::SystemSharedMemoryUnregisterResponse* response) {
  return moe_->RunSharedMemoryCall(context, "SystemSharedMemoryUnregister", [this, request] {
    return moe_->mutable_regions()->Unregister(request->name(), RegionKind::kSystem);
  });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
    inference::CudaSharedMemoryStatusResponse* response) {
  return moe_->RunSharedMemoryCall(context, "CudaSharedMemoryStatus", [this, request, response] {
    absl::StatusOr<std::vector<RegionInfo>> regions =
        RegionsOfKind(*moe_->regions(), request->name(), RegionKind::kCuda);
    if (!regions.ok()) return regions.status();
    for (const RegionInfo& info : *regions) {
      auto& r = (*response->mutable_regions())[info.name];
      r.set_name(info.name);
      r.set_device_id(static_cast<uint64_t>(std::max(info.device_id, 0)));
      r.set_byte_size(static_cast<uint64_t>(info.byte_size));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryRegisterRequest* request,
    inference::CudaSharedMemoryRegisterResponse* response) {
  return moe_->RunSharedMemoryCall(context, "CudaSharedMemoryRegister", [this, request] {
    if (request->device_id() < 0 || request->device_id() > std::numeric_limits<int>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("device_id: ", request->device_id(),
                                                     " is not a device ordinal; expected >= 0"));
    }
    MOESERVE_ASSIGN_OR_RETURN(const int64_t bytes, WireInt64(request->byte_size(), "byte_size"));
    return moe_->mutable_regions()->RegisterCuda(request->name(), request->raw_handle(),
                                                 static_cast<int>(request->device_id()), bytes);
  });
}

grpc::ServerUnaryReactor* InferenceServiceImpl::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const inference::CudaSharedMemoryUnregisterRequest* request,
    inference::CudaSharedMemoryUnregisterResponse* response) {
  return moe_->RunSharedMemoryCall(context, "CudaSharedMemoryUnregister", [this, request] {
    return moe_->mutable_regions()->Unregister(request->name(), RegionKind::kCuda);
  });
}

}  // namespace moeserve
