#include "server/internal_bootstrap.h"

#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "core/weight_loader.h"
#include "moeserve/v1/internal.grpc.pb.h"
#include "server/server.h"
#include "server/status.h"

namespace moeserve {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<int> EnvInt(const EnvLookup& env, const char* name) {
  std::optional<std::string> v = env(name);
  if (!v.has_value()) return -1;
  int out = 0;
  if (!absl::SimpleAtoi(*v, &out) || out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": got '", *v, "', expected a non-negative integer"));
  }
  return out;
}

}  // namespace

EnvLookup ProcessEnvironment() {
  return [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  };
}

absl::StatusOr<MultiProcessConfig> ResolveMultiProcess(const MultiProcessFlags& flags,
                                                       const EnvLookup& env) {
  MultiProcessConfig c;
  c.local_ranks = flags.local_ranks;
  int world = flags.world_size;
  const char* world_from = "--world_size";
  if (world < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--world_size: got ", world, ", expected >= 0 (0: unset)"));
  }
  if (world == 0) {
    MOESERVE_ASSIGN_OR_RETURN(const int group, EnvInt(env, "LWS_GROUP_SIZE"));
    if (group <= 1) return c;  // single process (no group, or a group of one pod)
    if (flags.local_ranks <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ranks: LWS_GROUP_SIZE=", group,
                       " asks for multi-process serving, which needs the "
                       "ranks (GPUs) per process given explicitly (--ranks > 0)"));
    }
    world = group * flags.local_ranks;
    world_from = "LWS_GROUP_SIZE * --ranks";
  }
  if (flags.local_ranks <= 0) {
    if (world <= 1) return c;
    return absl::InvalidArgumentError(absl::StrCat("--ranks: --world_size=", world,
                                                   " needs the ranks (GPUs) per process given "
                                                   "explicitly (--ranks > 0)"));
  }
  if (world <= flags.local_ranks) {
    if (world < flags.local_ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat(world_from, ": got ", world, ", fewer than --ranks=", flags.local_ranks));
    }
    return c;  // every rank in this process
  }
  if (world % flags.local_ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        world_from, ": got ", world, ", expected a multiple of --ranks=", flags.local_ranks));
  }
  c.enabled = true;
  c.world_size = world;
  const int nodes = world / flags.local_ranks;
  int node = flags.node_rank;
  const char* node_from = "--node_rank";
  if (node < 0) {
    MOESERVE_ASSIGN_OR_RETURN(node, EnvInt(env, "LWS_WORKER_INDEX"));
    node_from = "LWS_WORKER_INDEX";
    if (node < 0) node = 0;
  }
  if (node >= nodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        node_from, ": got ", node, ", expected a value in [0, ", nodes, ") (world_size / ranks)"));
  }
  c.node_rank = node;
  c.leader_address = flags.leader_address;
  if (c.leader_address.empty()) {
    if (std::optional<std::string> host = env("LWS_LEADER_ADDRESS"); host.has_value()) {
      c.leader_address = host->find(':') == std::string::npos
                             ? absl::StrCat(*host, ":", flags.leader_port)
                             : *host;
    }
  }
  if (c.leader_address.empty()) {
    return absl::InvalidArgumentError(
        "--leader_address: multi-process serving needs the leader's host:port (or "
        "LWS_LEADER_ADDRESS)");
  }
  if (c.leader_address.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--leader_address: got '", c.leader_address, "', expected host:port"));
  }
  return c;
}

std::string EngineFingerprint(const EngineOptions& o) {
  // With a checkpoint, the model its config.json gives (the preset's fields only seed it): two
  // nodes with different configs at the same path must not form a group (their token rows would
  // differ in size, and the first step would hang until the collective timeout).
  WeightSource source;
  source.checkpoint_dir = o.checkpoint_dir;
  absl::StatusOr<ModelConfig> resolved = o.checkpoint_dir.empty()
                                             ? absl::StatusOr<ModelConfig>(o.model)
                                             : ResolveModelConfig(source, o.model);
  if (!resolved.ok()) return absl::StrCat("unresolved model: ", resolved.status().ToString());
  const ModelConfig& m = *resolved;
  return absl::StrCat("model=", m.name, " layers=", m.num_layers, " experts=", m.num_experts,
                      " topk=", m.topk, " hidden=", m.hidden, " intermediate=", m.intermediate,
                      " seed=", o.seed, " weights=", WeightFormatName(o.weight_format),
                      " checkpoint=", o.checkpoint_dir, " backend=", o.backend,
                      " experts_impl=", o.experts, " pf=", o.prepare_finalize,
                      " placement=", o.placement, " max_tokens=", o.max_tokens_per_request,
                      " tokens_per_rank=", o.max_tokens_per_rank, " dispatch=", o.dispatch,
                      " moe_layers=", absl::StrJoin(m.moe_layers, ","),
                      " collective_timeout_ms=", o.collective_timeout_ms);
}

// ---------------------------------------------------------------------------------------------
// Leader: the bootstrap service.

class BootstrapServer::Impl final : public v1::InternalService::Service {
 public:
  Impl(const MultiProcessConfig& config, std::string id, std::string fingerprint,
       std::shared_ptr<const BearerTokens> token)
      : config_(config),
        id_(std::move(id)),
        fingerprint_(std::move(fingerprint)),
        token_(std::move(token)) {}

  grpc::Status GetBootstrap(grpc::ServerContext* context, const v1::GetBootstrapRequest* req,
                            v1::Bootstrap* reply) override {
    if (token_ != nullptr) {
      if (absl::Status s = token_->Check(context->client_metadata(), "GetBootstrap"); !s.ok()) {
        std::fprintf(stderr, "moeserve: bootstrap: refused %s: %s\n", context->peer().c_str(),
                     std::string(s.message()).c_str());
        return ToGrpcStatus(s);
      }
    }
    const int nodes = config_.world_size / config_.local_ranks;
    if (req->world_size() != config_.world_size || req->local_ranks() != config_.local_ranks) {
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "GetBootstrap: the follower has world_size=", req->world_size(),
          " ranks=", req->local_ranks(), ", the leader world_size=", config_.world_size,
          " ranks=", config_.local_ranks)));
    }
    if (req->node_rank() < 1 || req->node_rank() >= nodes) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "GetBootstrap: node_rank: got ", req->node_rank(), ", expected [1, ", nodes, ")")));
    }
    if (req->config_fingerprint() != fingerprint_) {
      // The caller may be anyone: the details go to the leader's log only.
      std::fprintf(stderr,
                   "moeserve: bootstrap: refused node %d (%s): its engine options '%s' differ "
                   "from the leader's '%s'\n",
                   req->node_rank(), context->peer().c_str(), req->config_fingerprint().c_str(),
                   fingerprint_.c_str());
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "GetBootstrap: node ", req->node_rank(),
          " was started with engine options (model, weights, placement, ...) other than the "
          "leader's; the leader's log names both")));
    }
    reply->set_nccl_unique_id(id_);
    reply->set_world_size(config_.world_size);
    reply->set_local_ranks(config_.local_ranks);
    return grpc::Status::OK;
  }

 private:
  const MultiProcessConfig config_;
  const std::string id_;
  const std::string fingerprint_;
  const std::shared_ptr<const BearerTokens> token_;
};

absl::StatusOr<std::unique_ptr<BootstrapServer>> BootstrapServer::Start(
    const std::string& address, const MultiProcessConfig& config, std::string collective_id,
    std::string fingerprint, const InternalSecurity& security) {
  if (absl::Status st = CheckTlsFiles(security.tls, "--internal_tls_", TlsRole::kMutual);
      !st.ok()) {
    return st;
  }
  MOESERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                            MakeServerCredentials(security.tls, "--internal_tls_"));
  auto s = std::unique_ptr<BootstrapServer>(new BootstrapServer());
  s->impl_ = std::make_unique<Impl>(config, std::move(collective_id), std::move(fingerprint),
                                    security.token);
  grpc::ServerBuilder builder;
  SetReflection(&builder, false);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, credentials, &s->port_);
  builder.RegisterService(s->impl_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--bootstrap_listen: cannot serve the bootstrap service on ", address,
        " (without --bootstrap_listen it listens on --leader_address, whose host must be an "
        "address of this machine; in a pod, e.g. --bootstrap_listen=0.0.0.0:50052)"));
  }
  return s;
}

BootstrapServer::~BootstrapServer() { Shutdown(); }

void BootstrapServer::Shutdown() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server_->Wait();
  server_.reset();
}

// ---------------------------------------------------------------------------------------------
// Follower: fetch the id.

absl::StatusOr<std::string> FetchCollectiveId(const MultiProcessConfig& config,
                                              const std::string& fingerprint,
                                              absl::Duration timeout,
                                              const InternalSecurity& security) {
  if (absl::Status st = CheckTlsFiles(security.tls, "--internal_tls_", TlsRole::kMutual);
      !st.ok()) {
    return st;
  }
  MOESERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                            MakeChannelCredentials(security.tls, "--internal_tls_"));
  grpc::ChannelArguments args;
  if (!security.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(security.tls_server_name);
  }
  auto channel = grpc::CreateCustomChannel(config.leader_address, credentials, args);
  auto stub = v1::InternalService::NewStub(channel);
  const std::string token = security.token != nullptr ? security.token->first() : "";
  const absl::Time deadline = absl::Now() + timeout;
  v1::GetBootstrapRequest req;
  req.set_node_rank(config.node_rank);
  req.set_world_size(config.world_size);
  req.set_local_ranks(config.local_ranks);
  req.set_config_fingerprint(fingerprint);
  grpc::Status last;
  absl::Duration backoff = absl::Milliseconds(100);
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    const absl::Time call_deadline = std::min(deadline, absl::Now() + absl::Seconds(5));
    ctx.set_deadline(absl::ToChronoTime(call_deadline));
    ctx.set_wait_for_ready(true);  // the leader may not listen yet: wait, within the deadline
    if (!token.empty()) ctx.AddMetadata(kAuthorizationKey, BearerHeader(token));
    v1::Bootstrap reply;
    last = stub->GetBootstrap(&ctx, req, &reply);
    if (last.ok()) {
      if (reply.world_size() != config.world_size || reply.nccl_unique_id().empty()) {
        return absl::FailedPreconditionError("GetBootstrap: the leader's answer does not fit");
      }
      return reply.nccl_unique_id();
    }
    if (last.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      // A refusal: retrying will not help. What this process has, for comparison with the
      // leader's log (which names both).
      return absl::FailedPreconditionError(
          absl::StrCat(last.error_message(), " (this process: '", fingerprint, "')"));
    }
    if (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
        last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return FromGrpc(last);  // a refusal: retrying will not help
    }
    absl::SleepFor(std::min(backoff, std::max(absl::ZeroDuration(), deadline - absl::Now())));
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "the leader at ", config.leader_address, " did not hand out the group's id within ",
      absl::FormatDuration(timeout), " (last: ", last.error_message(), ")"));
}

std::string BootstrapListenAddress(const MultiProcessConfig& config,
                                   const BootstrapOptions& bootstrap) {
  return bootstrap.listen.empty() ? config.leader_address : bootstrap.listen;
}

absl::StatusOr<std::unique_ptr<BootstrapServer>> PrepareMultiProcess(
    const MultiProcessConfig& config, EngineOptions* options, absl::Duration timeout,
    const BootstrapOptions& bootstrap) {
  if (!config.enabled) return std::unique_ptr<BootstrapServer>();
  options->world_size = config.world_size;
  options->node_rank = config.node_rank;
  options->num_ranks = config.local_ranks;
  const std::string fingerprint = EngineFingerprint(*options);
  if (!config.leader()) {
    MOESERVE_ASSIGN_OR_RETURN(options->collective_id,
                              FetchCollectiveId(config, fingerprint, timeout, bootstrap.security));
    return std::unique_ptr<BootstrapServer>();
  }
  if (absl::Status s = CheckTlsFiles(bootstrap.security.tls, "--internal_tls_", TlsRole::kMutual);
      !s.ok()) {
    return s;
  }
  MOESERVE_ASSIGN_OR_RETURN(options->collective_id, Engine::NewCollectiveId());
  const std::string listen = BootstrapListenAddress(config, bootstrap);
  if (!bootstrap.security.tls.enabled() && bootstrap.security.token == nullptr) {
    std::fprintf(stderr,
                 "moeserve: warning: the bootstrap service on %s is open: whoever reaches it "
                 "while the group forms can obtain the NCCL id; set --bootstrap_token_file or "
                 "--internal_tls_cert/key/ca (docs/security.md)\n",
                 listen.c_str());
  }
  return BootstrapServer::Start(listen, config, options->collective_id, fingerprint,
                                bootstrap.security);
}

// ---------------------------------------------------------------------------------------------
// Follower process.

namespace {

// A follower answers bootstrap calls with a refusal (it is not the leader).
class NotLeaderService final : public v1::InternalService::Service {
  grpc::Status GetBootstrap(grpc::ServerContext*, const v1::GetBootstrapRequest*,
                            v1::Bootstrap*) override {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "GetBootstrap: this process is a follower; ask the leader (node_rank 0)"));
  }
};

void SetHealth(grpc::Server* server, bool loop_running) {
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", loop_running);
  health->SetServingStatus(kInternalServiceName, loop_running);
  health->SetServingStatus(kMoeServiceName, false);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FollowerProcess>> FollowerProcess::Start(
    Engine* engine, const std::vector<std::string>& listen, std::function<void()> on_exit,
    std::shared_ptr<grpc::ServerCredentials> credentials) {
  MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<FollowerProcess> f,
                            Bind(listen, std::move(credentials)));
  f->Run(engine, std::move(on_exit));
  return f;
}

absl::StatusOr<std::unique_ptr<FollowerProcess>> FollowerProcess::Bind(
    const std::vector<std::string>& listen, std::shared_ptr<grpc::ServerCredentials> credentials) {
  if (credentials == nullptr) credentials = grpc::InsecureServerCredentials();
  auto f = std::unique_ptr<FollowerProcess>(new FollowerProcess());
  f->service_ = std::make_unique<NotLeaderService>();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  SetReflection(&builder, false);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::vector<int> ports(listen.size(), 0);
  for (size_t i = 0; i < listen.size(); ++i) {
    builder.AddListeningPort(listen[i], credentials, &ports[i]);
  }
  builder.RegisterService(f->service_.get());
  f->server_ = builder.BuildAndStart();
  if (f->server_ == nullptr) {
    return absl::UnavailableError("listen: cannot start the follower's health server");
  }
  for (size_t i = 0; i < listen.size(); ++i) {
    if (ports[i] == 0)
      return absl::UnavailableError(absl::StrCat("listen: cannot bind ", listen[i]));
    f->bound_.push_back(BoundAddress(listen[i], ports[i]));
  }
  SetHealth(f->server_.get(), false);
  return f;
}

void FollowerProcess::Run(Engine* engine, std::function<void()> on_exit) {
  engine_ = engine;
  SetHealth(server_.get(), true);
  loop_ = std::thread([this, on_exit = std::move(on_exit)] {
    result_ = engine_->RunFollower();
    SetHealth(server_.get(), false);
    if (on_exit) on_exit();
  });
}

FollowerProcess::~FollowerProcess() { (void)Stop(); }

absl::Status FollowerProcess::Stop() {
  if (stopped_) return result_;
  stopped_ = true;
  if (engine_ != nullptr) {
    engine_->AbortCollectives(absl::CancelledError("the follower is shutting down"));
  }
  if (loop_.joinable()) loop_.join();
  if (server_ != nullptr) {
    SetHealth(server_.get(), false);
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_->Wait();
  }
  return result_;
}

}  // namespace moeserve
