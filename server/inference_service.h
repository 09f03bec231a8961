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
// Access: every call but ServerLive and ServerReady (which, like grpc.health.v1, stay open for
// probes) passes ServingState::Authorize, the same bearer-token check as moeserve.v1.
#ifndef MOESERVE_SERVER_INFERENCE_SERVICE_H_
#define MOESERVE_SERVER_INFERENCE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "inference/grpc_service.grpc.pb.h"
#include "server/serving_state.h"

namespace moeserve {

inline constexpr char kInferenceServiceName[] = "inference.GRPCInferenceService";

using InferenceServiceBase = inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
    inference::GRPCInferenceService::WithCallbackMethod_ServerLive<
        inference::GRPCInferenceService::WithCallbackMethod_ServerReady<
            inference::GRPCInferenceService::WithCallbackMethod_ModelReady<
                inference::GRPCInferenceService::WithCallbackMethod_ServerMetadata<
                    inference::GRPCInferenceService::WithCallbackMethod_ModelMetadata<
                        inference::GRPCInferenceService::Service>>>>>>;

class InferenceServiceImpl final : public InferenceServiceBase {
 public:
  // `state` must outlive the service; `ready` says whether the server reports SERVING (the
  // health service's state), thread-safe.
  InferenceServiceImpl(ServingState* state, std::function<bool()> ready)
      : state_(state), ready_(std::move(ready)) {}

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
  // `request` / `response`: serialized ModelInferRequest / ModelInferResponse.
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

 private:
  // Answers inline, recording the request's metrics.
  grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const char* method,
                                   const absl::Status& status, int64_t received, int64_t sent);

  ServingState* const state_;
  const std::function<bool()> ready_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_INFERENCE_SERVICE_H_
