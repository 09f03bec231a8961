// Every RPC the gRPC server answers is counted here, once, with the code the client gets:
// moeserve_requests_total{method,code} and moeserve_request_latency_seconds{method}.
//
// A server interceptor sees calls the handlers never see (a request protobuf could not parse,
// an unknown method, health checks, reflection) and every handler's answer; it also
//  - counts a call whose deadline passed before it was answered as DEADLINE_EXCEEDED (that is
//    what the client gets, whatever the handler sent);
//  - turns gRPC's answer to an unparseable request of a protobuf method (UNIMPLEMENTED with an
//    empty message) into INVALID_ARGUMENT naming the method.
// Unknown methods are answered by a generic service: UNIMPLEMENTED naming the method.
//
// The method label is bounded: the served methods by name, anything else "unknown".
#ifndef MOESERVE_SERVER_CALL_ACCOUNTING_H_
#define MOESERVE_SERVER_CALL_ACCOUNTING_H_

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/metrics.h"

namespace moeserve {

// The metrics label of a method path ("/moeserve.v1.MoeService/Forward" -> "Forward",
// "/inference.GRPCInferenceService/ModelInfer" -> "ModelInfer", "/grpc.health.v1.Health/Check" ->
// "grpc.health.v1.Health/Check", others -> "unknown").
std::string MethodLabel(absl::string_view path);

// Interceptors counting into `metrics` (must outlive the server).
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
MakeCallAccountingInterceptors(Metrics* metrics);

// Answers every method no service registered with UNIMPLEMENTED naming it and the served ones.
class UnknownMethodService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_CALL_ACCOUNTING_H_
