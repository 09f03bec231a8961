// moeserve.v1.MoeService on gRPC's callback API.
//
// Forward is served raw: the request's tensors are read straight out of gRPC's slices and the
// answer is written by the engine into a buffer that the reply's slice then owns, so tensor
// bytes are never copied by protobuf (the wire format is still moeserve.v1's).
// Forward and GetExpertWeights run on the service's own worker threads (a WorkQueue), never on
// gRPC's callback threads; each reply is Finished from the worker. GetModelInfo answers inline.
// Until the engine is attached (weights still loading) every call is refused with UNAVAILABLE.
#ifndef MOESERVE_SERVER_SERVICE_H_
#define MOESERVE_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>

#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/serving_state.h"

namespace moeserve {

using MoeServiceBase =
    v1::MoeService::WithRawCallbackMethod_Forward<v1::MoeService::WithCallbackMethod_GetModelInfo<
        v1::MoeService::WithCallbackMethod_GetExpertWeights<v1::MoeService::Service>>>;

class MoeServiceImpl final : public MoeServiceBase {
 public:
  // `state` (engine, batcher, workers, metrics) must outlive the service.
  explicit MoeServiceImpl(ServingState* state) : state_(state) {}

  // `request` and `response` are serialized moeserve.v1 ForwardRequest / ForwardResponse.
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetExpertWeights(grpc::CallbackServerContext* context,
                                             const v1::GetExpertWeightsRequest* request,
                                             v1::GetExpertWeightsResponse* response) override;

 private:
  ServingState* const state_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_SERVICE_H_
