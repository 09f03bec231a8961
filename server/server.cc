#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <climits>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status_macros.h"

namespace moeserve {

std::vector<std::string> SplitListenAddresses(const std::string& list) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) out.emplace_back(part);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<MoeServer>> MoeServer::Start(Engine* engine,
                                                            const ServerOptions& options) {
  if (options.listen_addresses.empty()) {
    return absl::InvalidArgumentError("listen: no address given; expected host:port[,...]");
  }
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes: got ", options.max_message_bytes, ", expected a positive size"));
  }
  auto server = std::unique_ptr<MoeServer>(new MoeServer());
  server->engine_ = engine;
  MOESERVE_ASSIGN_OR_RETURN(server->metrics_, Metrics::Create(options.metrics_address));
  server->metrics_->SetModelInfo(engine->info());

  ServiceOptions service_options;
  service_options.num_worker_threads = std::max(1, options.server_threads);
  service_options.max_message_bytes = options.max_message_bytes;
  server->service_ =
      std::make_unique<MoeServiceImpl>(engine, server->metrics_.get(), service_options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const int limit = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT_MAX));
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  // A port another process holds must fail loudly, not be silently shared (SO_REUSEPORT).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  server->bound_ports_.assign(options.listen_addresses.size(), 0);
  for (size_t i = 0; i < options.listen_addresses.size(); ++i) {
    builder.AddListeningPort(options.listen_addresses[i], grpc::InsecureServerCredentials(),
                             &server->bound_ports_[i]);
  }
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("listen: cannot start a gRPC server on ",
                                               absl::StrJoin(options.listen_addresses, ",")));
  }
  for (size_t i = 0; i < options.listen_addresses.size(); ++i) {
    const std::string& address = options.listen_addresses[i];
    if (server->bound_ports_[i] == 0) {
      server->Shutdown(std::chrono::milliseconds(0));
      return absl::UnavailableError(absl::StrCat("listen: cannot bind ", address));
    }
    const size_t colon = address.rfind(':');
    const std::string host = colon == std::string::npos ? address : address.substr(0, colon);
    server->bound_addresses_.push_back(absl::StrCat(host, ":", server->bound_ports_[i]));
  }
  // The engine is ready (Create loaded the weights), so the process is ready to serve.
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus("", true);
    health->SetServingStatus(kMoeServiceName, true);
  }
  return server;
}

MoeServer::~MoeServer() { Shutdown(); }

void MoeServer::Shutdown(std::chrono::milliseconds deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->SetServingStatus("", false);
      health->SetServingStatus(kMoeServiceName, false);
    }
    server_->Shutdown(std::chrono::system_clock::now() + deadline);
  }
  // Every call the server accepted has been queued by now; run what is left, then stop.
  if (service_ != nullptr) service_->Drain();
  if (server_ != nullptr) server_->Wait();
}

}  // namespace moeserve
