// The KServe v2 / Open Inference Protocol gRPC service (inference.GRPCInferenceService) beside
// moeserve.v1: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer,
// one model per MoE layer ("moe_layer_<i>") plus "moeserve" with a `layer` parameter (see
// proto/inference/grpc_service.proto and server/convert.h).
//
// ModelInfer is served raw, like Forward: raw_input_contents are viewed in gRPC's slices (or
// gathered once when split or misaligned), the call goes through the same ServingState (worker
// threads, the message-size check, the per-layer batcher, the engine, the metrics) as Forward,
// and the answer buffer the engine writes becomes raw_output_contents' slice. A request with
// hidden_states only is routed by the server (RouteOnServer), as Forward is. Request parameter
// `return_timings` (bool) adds the stage times (double_param, microseconds) to the response's
// parameters.
//
// ModelConfig (Triton's extension) describes each model as ModelMetadata does, with
// max_batch_size 0, so perf_analyzer can drive ModelInfer.
//
// Shared memory (the protocol's extension, as tritonclient's utils.shared_memory and
// utils.cuda_shared_memory use it): System/CudaSharedMemory{Status,Register,Unregister} and
// ModelInfer tensors whose parameters name a region (shared_memory_region, _byte_size, _offset)
// run through MoeServiceImpl's RegionRegistry and checks (RunSharedMemoryCall: flag, peer,
// token), so one registry serves both protocols: a region registered through either is listed,
// used and unregistered through both (the KServe calls list and unregister their own kind only).
// Region tensors are resolved as Forward's (RegionTensor: in place where addressable, the ids
// snapshotted); an output region is written, flushed and released before the answer.
//
// Limits: ModelInfer holds its request and answer bytes in the same max_queued_bytes budget as
// Forward (RESOURCE_EXHAUSTED at once beyond it) and its answer is watched by the same
// max_answer_hold timeout (cancelled when the client does not take it).
//
// Access: every call but ServerLive and ServerReady (which, like grpc.health.v1, stay open for
// probes) passes ServingState::Authorize, the same bearer-token check as moeserve.v1.
#ifndef MOESERVE_SERVER_INFERENCE_SERVICE_H_
#define MOESERVE_SERVER_INFERENCE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/service.h"
#include "server/serving_state.h"

namespace moeserve {

inline constexpr char kInferenceServiceName[] = "inference.GRPCInferenceService";

namespace kserve_detail {
using S = inference::GRPCInferenceService;
using SharedMemoryBase =
    S::WithCallbackMethod_SystemSharedMemoryStatus<S::WithCallbackMethod_SystemSharedMemoryRegister<
        S::WithCallbackMethod_SystemSharedMemoryUnregister<
            S::WithCallbackMethod_CudaSharedMemoryStatus<
                S::WithCallbackMethod_CudaSharedMemoryRegister<
                    S::WithCallbackMethod_CudaSharedMemoryUnregister<
                        S::WithCallbackMethod_ModelConfig<S::Service>>>>>>>;
}  // namespace kserve_detail

using InferenceServiceBase = inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
    inference::GRPCInferenceService::WithCallbackMethod_ServerLive<
        inference::GRPCInferenceService::WithCallbackMethod_ServerReady<
            inference::GRPCInferenceService::WithCallbackMethod_ModelReady<
                inference::GRPCInferenceService::WithCallbackMethod_ServerMetadata<
                    inference::GRPCInferenceService::WithCallbackMethod_ModelMetadata<
                        kserve_detail::SharedMemoryBase>>>>>>;

class InferenceServiceImpl final : public InferenceServiceBase {
 public:
  // `state` and `moe` (its byte budget, answer watch and region registry are shared) must
  // outlive the service; `ready` says whether the server reports SERVING (the health service's
  // state), thread-safe.
  InferenceServiceImpl(ServingState* state, MoeServiceImpl* moe, std::function<bool()> ready)
      : state_(state), moe_(moe), ready_(std::move(ready)) {}

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  // Triton's ModelConfig (what perf_analyzer reads): NOT_FOUND for an unknown model, as
  // ModelMetadata.
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  // `request` / `response`: serialized ModelInferRequest / ModelInferResponse.
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryStatusRequest* request,
      inference::SystemSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryRegisterRequest* request,
      inference::SystemSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryUnregisterRequest* request,
      inference::SystemSharedMemoryUnregisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
      inference::CudaSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryRegisterRequest* request,
      inference::CudaSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryUnregisterRequest* request,
      inference::CudaSharedMemoryUnregisterResponse* response) override;

 private:
  // Authorizes, then runs `fill` on a ready engine's info once (model name, version) names one
  // of its models; otherwise the refusal (unauthorized, not ready, unknown model). Calling thread.
  absl::Status ForModel(grpc::CallbackServerContext* context, const char* method,
                        const std::string& model, const std::string& version,
                        absl::FunctionRef<void(const EngineInfo&)> fill);
  // Answers inline, recording the request's metrics.
  grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const char* method,
                                   const absl::Status& status, int64_t received, int64_t sent);

  ServingState* const state_;
  MoeServiceImpl* const moe_;
  const std::function<bool()> ready_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_INFERENCE_SERVICE_H_
