#include "server/server.h"

#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/memory_region.h"
#include "core/status_macros.h"
#include "core/thread_name.h"
#include "server/call_accounting.h"
#include "server/convert.h"

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
  MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<MoeServer> server, Bind(options));
  if (absl::Status s = server->AttachEngine(engine); !s.ok()) {
    server->Shutdown(std::chrono::milliseconds(0));
    return s;
  }
  return server;
}

absl::StatusOr<std::unique_ptr<MoeServer>> MoeServer::Bind(
    const ServerOptions& options, std::function<std::string()> describe_startup) {
  if (options.listen_addresses.empty()) {
    return absl::InvalidArgumentError("listen: no address given; expected host:port[,...]");
  }
  if (options.max_message_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes: got ", options.max_message_bytes, ", expected a positive size"));
  }
  for (auto [name, value] :
       {std::pair<const char*, int64_t>{"max_concurrent_streams", options.max_concurrent_streams},
        {"grpc_memory_bytes", options.grpc_memory_bytes},
        {"grpc_max_threads", options.grpc_max_threads},
        {"max_metadata_bytes", options.max_metadata_bytes}}) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": got ", value, ", expected a positive value"));
    }
  }
  if (options.upload_min_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "upload_min_bytes: got ", options.upload_min_bytes, ", expected 0 (off) or more"));
  }
  if (options.inline_request_bytes < kInlineRequestBytesByBackend) {
    return absl::InvalidArgumentError(
        absl::StrCat("inline_request_bytes: got ", options.inline_request_bytes,
                     ", expected -2 (by backend), -1 (every request on gRPC's thread), 0 (every "
                     "one on a worker) or more"));
  }
  if (options.gather_threads < 0 || options.gather_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("gather_threads: got ", options.gather_threads, ", expected 0 (auto) to 64"));
  }
  SetGatherOptions(options.gather_threads, options.gather_streaming_stores);
  auto server = std::unique_ptr<MoeServer>(new MoeServer());
  server->options_ = options;
  // Credentials first: bad certificate files fail before anything listens.
  MOESERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                            MakeServerCredentials(options.tls, "--tls_", options.tls_refresh_s));
  MOESERVE_ASSIGN_OR_RETURN(server->metrics_,
                            Metrics::Create(options.metrics_address, options.metrics_tls));
  server->state_ = std::make_unique<ServingState>(
      server->metrics_.get(), std::max(1, options.server_threads), options.max_message_bytes,
      options.auth, std::move(describe_startup));
  ServiceOptions service_options;
  service_options.max_held_bytes = options.max_queued_bytes;
  service_options.max_answer_hold = options.max_answer_hold;
  service_options.enable_get_expert_weights = options.enable_get_expert_weights;
  service_options.enable_shared_memory = options.enable_shared_memory;
  service_options.max_forward_channels = options.max_forward_channels;
  service_options.forward_channel_spin = options.forward_channel_spin;
  service_options.max_expert_weight_calls = options.max_expert_weight_calls;
  service_options.upload_min_bytes = options.upload_min_bytes;
  service_options.inline_request_bytes = options.inline_request_bytes;
  server->service_ = std::make_unique<MoeServiceImpl>(server->state_.get(), service_options);
  server->inference_service_ = std::make_unique<InferenceServiceImpl>(
      server->state_.get(), server->service_.get(), [s = server.get()] { return s->serving(); });

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  SetReflection(&builder, options.enable_reflection);
  const int64_t grpc_limit =
      options.grpc_limit_bytes > 0 ? options.grpc_limit_bytes : options.max_message_bytes;
  const int limit = static_cast<int>(std::min<int64_t>(grpc_limit, INT_MAX));
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  // A port another process holds must fail loudly, not be silently shared (SO_REUSEPORT).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // What clients can make gRPC itself hold (see ServerOptions).
  grpc::ResourceQuota quota("moeserve");
  quota.Resize(static_cast<size_t>(options.grpc_memory_bytes));
  quota.SetMaxThreads(options.grpc_max_threads);
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  for (const auto& [name, value] : options.grpc_channel_args) {
    if (!absl::StartsWith(name, "grpc.")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grpc_channel_args: '", name, "' is not a gRPC channel argument (expected grpc.*)"));
    }
    builder.AddChannelArgument(name, value);
  }
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, options.max_metadata_bytes);
  builder.AddChannelArgument(
      GRPC_ARG_KEEPALIVE_TIME_MS,
      static_cast<int>(std::min<int64_t>(options.keepalive_time.count(), INT_MAX)));
  builder.AddChannelArgument(
      GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
      static_cast<int>(std::min<int64_t>(options.keepalive_timeout.count(), INT_MAX)));
  // Every call counted once with the code its client gets, unknown methods answered by name.
  builder.experimental().SetInterceptorCreators(
      MakeCallAccountingInterceptors(server->metrics_.get()));
  server->unknown_methods_ = std::make_unique<UnknownMethodService>();
  builder.RegisterCallbackGenericService(server->unknown_methods_.get());
  server->bound_ports_.assign(options.listen_addresses.size(), 0);
  for (size_t i = 0; i < options.listen_addresses.size(); ++i) {
    builder.AddListeningPort(options.listen_addresses[i], credentials, &server->bound_ports_[i]);
  }
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->inference_service_.get());
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
    server->bound_addresses_.push_back(BoundAddress(address, server->bound_ports_[i]));
  }
  // Live, not ready: the weights are not loaded yet.
  server->SetServing(false);
  return server;
}

std::string BoundAddress(const std::string& listen, int port) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) {
    return listen;  // no port: the path is the address
  }
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  return absl::StrCat(host, ":", port);
}

absl::Duration ResolveIdleSpin(absl::Duration configured, std::string_view backend) {
  if (configured >= absl::ZeroDuration()) return configured;
  return backend == "cpu" ? absl::ZeroDuration() : kGpuIdleSpin;
}

void ResolveCompanyWait(std::string_view backend, ForwardBatcherOptions* options) {
  if (options->company_wait >= absl::ZeroDuration()) return;
  options->company_wait_auto = backend != "cpu";
  options->company_wait = options->company_wait_auto ? kAutoCompanyWait : absl::ZeroDuration();
}

absl::Duration ResolveLaneLead(absl::Duration configured, std::string_view backend) {
  if (configured >= absl::ZeroDuration()) return configured;
  return backend == "cpu" ? absl::ZeroDuration() : kGpuLaneLead;
}

int64_t ResolveInlineRequestBytes(int64_t configured, std::string_view backend) {
  if (configured != kInlineRequestBytesByBackend) return configured;
  return backend == "cpu" ? -1 : 0;
}

absl::Status MoeServer::AttachEngine(Engine* engine) {
  if (engine_ != nullptr) return absl::FailedPreconditionError("AttachEngine: already attached");
  if (shut_down_) return absl::FailedPreconditionError("AttachEngine: the server is shut down");
  ForwardBatcherOptions batcher_options = options_.batcher;
  batcher_options.observer = metrics_.get();
  batcher_options.idle_spin = ResolveIdleSpin(batcher_options.idle_spin, engine->info().backend);
  batcher_options.lane_lead = ResolveLaneLead(batcher_options.lane_lead, engine->info().backend);
  ResolveCompanyWait(engine->info().backend, &batcher_options);
  // Workers that decode requests (--inline_request_bytes >= 0) poll as the scheduling thread
  // does. Those that only send a merged step's answers sleep: one polling under the serving
  // benchmark's overload kept a core busy for little (serving/RESULTS.md 20:35).
  const int64_t inline_request_bytes =
      ResolveInlineRequestBytes(options_.inline_request_bytes, engine->info().backend);
  service_->SetInlineRequestBytes(inline_request_bytes);
  if (inline_request_bytes >= 0) state_->SetWorkerIdleSpin(batcher_options.idle_spin);
  // A GPU engine moves a merged step's hidden states and answer by DMA from and to page-locked
  // merge buffers, without a second host copy through its own staging.
  if (engine->info().backend == "cuda") batcher_options.merge_pinner = CudaHostPinner();
  if (options_.parallel_answers) {
    // A merged step's answers go out on the workers (the state owns the batcher: it outlives
    // it; once draining, SubmitWork refuses and the step's thread answers).
    batcher_options.answer_executor = [state = state_.get()](std::function<void()> task) {
      return state->SubmitWork(std::move(task));
    };
  }
  MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<ForwardBatcher> batcher,
                            ForwardBatcher::Create(engine, batcher_options));
  if (options_.warm_graphs && engine->info().graph_max_tokens > 0) {
    const absl::Time start = absl::Now();
    std::vector<int64_t> sizes;
    // graph_max_tokens is per rank: a step of s x ranks tokens gives each rank about s.
    for (int64_t s : DefaultGraphSizes(engine->info().graph_max_tokens)) {
      if (s * engine->info().num_ranks > batcher_options.max_batch_tokens) break;
      sizes.push_back(s * engine->info().num_ranks);
    }
    const ModelConfig& model = engine->info().model;
    std::vector<int> layers;
    for (int l = 0; l < model.num_layers; ++l) {
      if (model.IsMoeLayer(l)) layers.push_back(l);
    }
    MOESERVE_RETURN_IF_ERROR(batcher->WarmUp(sizes, layers));
    const GraphStats graphs = engine->graph_stats();
    std::fprintf(stderr, "moeserve: graphs warmed in %.0f ms: %zu sizes x %zu layers, %lld held\n",
                 absl::ToDoubleMilliseconds(absl::Now() - start), sizes.size(), layers.size(),
                 static_cast<long long>(graphs.graphs));
  }
  if (batcher_options.max_queue_wait > absl::ZeroDuration() ||
      batcher_options.lane_lead > absl::ZeroDuration() || batcher_options.company_wait_auto) {
    // The bound prices the first calls too: a fresh batcher would admit everything until its
    // first step ended, and a cold GPU's first steps are its slowest.
    const int64_t most =
        std::min(batcher_options.max_batch_tokens, engine->info().max_tokens_per_request);
    const absl::Time start = absl::Now();
    MOESERVE_RETURN_IF_ERROR(batcher->Calibrate({16, most / 4, most}, /*rounds=*/3));
    const ForwardBatcher::CostLine line = batcher->cost_line();
    std::fprintf(stderr,
                 "moeserve: batcher calibrated in %.0f ms: a step of n tokens takes about %.0f + "
                 "%.3f x n us\n",
                 absl::ToDoubleMilliseconds(absl::Now() - start), line.fixed_us, line.per_token_us);
  }
  engine_ = engine;
  metrics_->SetModelInfo(engine->info());
  service_->PrepareForEngine(*engine);  // before the engine is published to the calls
  state_->Attach(engine, std::move(batcher));
  SetServing(engine->healthy());
  if (options_.health_poll.count() > 0) {
    health_watcher_ = std::thread([this] {
      SetCurrentThreadName("ms-health");
      WatchHealth(options_);
    });
  }
  return absl::OkStatus();
}

ForwardBatcherStats MoeServer::batcher_stats() const {
  return state_ != nullptr ? state_->batcher_stats() : ForwardBatcherStats{};
}

bool MoeServer::serving() const {
  std::lock_guard<std::mutex> lock(health_mu_);
  return serving_;
}

void MoeServer::SetServing(bool serving) {
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    serving_ = serving;
  }
  if (metrics_) metrics_->SetServing(serving);
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus("", serving);
    health->SetServingStatus(kMoeServiceName, serving);
    health->SetServingStatus(kInferenceServiceName, serving);
  }
}

// Follows the engine's health: NOT_SERVING while it is unhealthy, periodic Recover() attempts.
void MoeServer::WatchHealth(const ServerOptions& options) {
  auto last_recover = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(health_mu_);
  while (!stop_watching_) {
    health_cv_.wait_for(lock, options.health_poll, [&] { return stop_watching_; });
    if (stop_watching_) break;
    lock.unlock();
    absl::Status health = engine_->health();
    if (!health.ok() && options.recover_after.count() > 0 &&
        std::chrono::steady_clock::now() - last_recover >= options.recover_after) {
      last_recover = std::chrono::steady_clock::now();
      const absl::Status recovered = engine_->Recover();
      std::fprintf(stderr, "moeserve: engine unhealthy (%s); recover: %s\n",
                   std::string(health.message()).c_str(), recovered.ToString().c_str());
      health = engine_->health();
    }
    const bool was_serving = serving();
    if (health.ok() != was_serving) {
      std::fprintf(stderr, "moeserve: health -> %s%s%s\n", health.ok() ? "SERVING" : "NOT_SERVING",
                   health.ok() ? "" : ": ", std::string(health.message()).c_str());
    }
    lock.lock();
    if (!stop_watching_ && health.ok() != was_serving) {
      lock.unlock();
      SetServing(health.ok());
      lock.lock();
    }
  }
}

MoeServer::~MoeServer() {
  Shutdown();
  // The batcher and workers go before the services: a call still held would use the service
  // (and the shared-memory regions it owns).
  state_.reset();
}

void MoeServer::Shutdown(std::chrono::milliseconds deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  {
    std::lock_guard<std::mutex> lock(health_mu_);
    stop_watching_ = true;
  }
  health_cv_.notify_all();
  if (health_watcher_.joinable()) health_watcher_.join();
  if (server_ != nullptr) {
    SetServing(false);
    server_->Shutdown(std::chrono::system_clock::now() + deadline);
  }
  // No more calls from forward channels either.
  if (service_ != nullptr) service_->CloseForwardChannels();
  // Every call the server accepted has been queued by now; run what is left, then stop.
  if (state_ != nullptr) state_->Drain();
  if (server_ != nullptr) server_->Wait();
}

}  // namespace moeserve
