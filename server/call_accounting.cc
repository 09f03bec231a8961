#include "server/call_accounting.h"

#include <chrono>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace moeserve {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr absl::string_view kMoeServicePrefix = "/moeserve.v1.MoeService/";
// Methods the server registers, by full path (the label of the others is "unknown", so a
// client cannot grow the metrics with made-up names).
constexpr absl::string_view kMoeMethods[] = {"Forward",
                                             "ForwardStream",
                                             "GetModelInfo",
                                             "GetExpertWeights",
                                             "StreamExpertWeights",
                                             "RegisterSystemSharedMemory",
                                             "RegisterCudaSharedMemory",
                                             "UnregisterSharedMemory",
                                             "SharedMemoryStatus",
                                             "RegisterForwardChannel",
                                             "UnregisterForwardChannel"};
// KServe v2 (server/inference_service.h), labelled by method name like MoeService's.
constexpr absl::string_view kKServePrefix = "/inference.GRPCInferenceService/";
constexpr absl::string_view kKServeMethods[] = {"ServerLive",
                                                "ServerReady",
                                                "ModelReady",
                                                "ServerMetadata",
                                                "ModelMetadata",
                                                "ModelInfer",
                                                "ModelConfig",
                                                "SystemSharedMemoryStatus",
                                                "SystemSharedMemoryRegister",
                                                "SystemSharedMemoryUnregister",
                                                "CudaSharedMemoryStatus",
                                                "CudaSharedMemoryRegister",
                                                "CudaSharedMemoryUnregister"};
constexpr absl::string_view kOtherMethods[] = {
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
};

class CallAccountingInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallAccountingInterceptor(grpc::experimental::ServerRpcInfo* info, Metrics* metrics)
      : info_(info),
        metrics_(metrics),
        label_(MethodLabel(info->method() == nullptr ? "" : info->method())),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // A protobuf method whose request did not parse reaches no handler: gRPC answers it
    // UNIMPLEMENTED with an empty message.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparseable_ = true;
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status status = methods->GetSendStatus();
      if (unparseable_ && status.error_code() == grpc::StatusCode::UNIMPLEMENTED &&
          status.error_message().empty()) {
        status = grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat(label_,
                         ": the request is not a valid protobuf message of the method's "
                         "request type (it could not be parsed)"));
        methods->ModifySendStatus(status);
      }
      Record(status.error_code());
    }
    methods->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) {
    if (recorded_ || metrics_ == nullptr) return;
    recorded_ = true;
    // Past its deadline the client gets DEADLINE_EXCEEDED, whatever is sent (gRPC cancels the
    // call at the deadline; the handler may only have seen a cancellation).
    const grpc::ServerContextBase* context = info_->server_context();
    if (context != nullptr && context->deadline() <= std::chrono::system_clock::now()) {
      code = grpc::StatusCode::DEADLINE_EXCEEDED;
    }
    metrics_->RecordRequest(
        label_, code,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }

  grpc::experimental::ServerRpcInfo* const info_;
  Metrics* const metrics_;
  const std::string label_;
  const std::chrono::steady_clock::time_point start_;
  bool unparseable_ = false;
  bool recorded_ = false;
};

class CallAccountingFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallAccountingFactory(Metrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new CallAccountingInterceptor(info, metrics_);
  }

 private:
  Metrics* const metrics_;
};

class UnknownMethodReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit UnknownMethodReactor(const std::string& method) {
    // The name comes from the client: quoted, escaped and cut short in the answer.
    const std::string shown =
        absl::CHexEscape(method.size() > 200 ? method.substr(0, 200) + "..." : method);
    Finish(grpc::Status(
        grpc::StatusCode::UNIMPLEMENTED,
        absl::StrCat("unknown method '", shown,
                     "'; moeserve serves /moeserve.v1.MoeService/{Forward,ForwardStream,"
                     "GetModelInfo,GetExpertWeights,StreamExpertWeights,"
                     "RegisterSystemSharedMemory,RegisterCudaSharedMemory,"
                     "UnregisterSharedMemory,SharedMemoryStatus}, "
                     "/inference.GRPCInferenceService/{ServerLive,ServerReady,ModelReady,"
                     "ServerMetadata,ModelMetadata,ModelConfig,ModelInfer,"
                     "System/CudaSharedMemoryStatus/Register/Unregister}, "
                     "grpc.health.v1.Health and (when enabled) server reflection")));
  }
  void OnDone() override { delete this; }
};

}  // namespace

std::string MethodLabel(absl::string_view path) {
  if (absl::StartsWith(path, kMoeServicePrefix)) {
    const absl::string_view name = path.substr(kMoeServicePrefix.size());
    for (absl::string_view m : kMoeMethods) {
      if (name == m) return std::string(m);
    }
    return "unknown";
  }
  if (absl::StartsWith(path, kKServePrefix)) {
    const absl::string_view name = path.substr(kKServePrefix.size());
    for (absl::string_view m : kKServeMethods) {
      if (name == m) return std::string(m);
    }
    return "unknown";
  }
  for (absl::string_view m : kOtherMethods) {
    if (path == m) return std::string(m.substr(1));
  }
  return "unknown";
}

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
MakeCallAccountingInterceptors(Metrics* metrics) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> out;
  out.push_back(std::make_unique<CallAccountingFactory>(metrics));
  return out;
}

grpc::ServerGenericBidiReactor* UnknownMethodService::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  return new UnknownMethodReactor(context->method());
}

}  // namespace moeserve
