#include "server/startup.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/engine.h"
#include "core/weight_loader.h"
#include "server/limits.h"
#include "server/load_progress.h"
#include "server/metrics.h"
#include "server/security.h"
#include "server/tls.h"

namespace moeserve {
namespace {

// One byte per event on a pipe, so the main thread sleeps in one place: the signal number for
// SIGTERM / SIGINT (async-signal-safe to write), or one of these.
constexpr char kLoadDone = 'L';
constexpr char kFollowerDone = 'F';

int g_event_pipe[2] = {-1, -1};

void OnSignal(int signo) {
  const char byte = static_cast<char>(signo);
  const int saved = errno;
  (void)!write(g_event_pipe[1], &byte, 1);
  errno = saved;
}

void PostEvent(char event) { (void)!write(g_event_pipe[1], &event, 1); }

absl::Status InstallSignalHandlers() {
  if (pipe2(g_event_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: errno ", errno));
  }
  fcntl(g_event_pipe[1], F_SETFL, O_NONBLOCK);
  struct sigaction sa = {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGTERM, &sa, nullptr) != 0 || sigaction(SIGINT, &sa, nullptr) != 0) {
    return absl::InternalError(absl::StrCat("sigaction: errno ", errno));
  }
  signal(SIGPIPE, SIG_IGN);  // a client hanging up must not kill the server
  return absl::OkStatus();
}

// The next event; nullopt when `timeout` passes first (negative: wait forever).
std::optional<char> WaitForEvent(absl::Duration timeout = absl::InfiniteDuration()) {
  const absl::Time end = absl::Now() + timeout;
  for (;;) {
    int ms = -1;
    if (timeout != absl::InfiniteDuration()) {
      ms = static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(end - absl::Now())));
    }
    pollfd p = {g_event_pipe[0], POLLIN, 0};
    const int n = poll(&p, 1, ms);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) return std::nullopt;
    char byte = 0;
    const ssize_t r = read(g_event_pipe[0], &byte, 1);
    if (r == 1) return byte;
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    return std::nullopt;
  }
}

bool IsSignal(char event) { return event == SIGTERM || event == SIGINT; }

absl::Status WriteReadyFile(const std::string& path, const std::string& grpc_address,
                            const std::string& metrics_address) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  std::string text = absl::StrCat(grpc_address, "\n");
  if (!metrics_address.empty()) absl::StrAppend(&text, "metrics ", metrics_address, "\n");
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    return absl::UnavailableError(absl::StrCat("--ready_file: cannot write ", tmp));
  }
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  if (!written || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("--ready_file: cannot write ", path));
  }
  return absl::OkStatus();
}

void Log(const std::string& line) {
  std::fprintf(stderr, "moeserve: %s\n", line.c_str());
  std::fflush(stderr);
}

// The background load: multi-process bootstrap, then the engine. Posts kLoadDone when finished.
class Loader {
 public:
  Loader(EngineOptions options, MultiProcessConfig mp, absl::Duration bootstrap_timeout,
         BootstrapOptions bootstrap)
      : options_(std::move(options)),
        mp_(std::move(mp)),
        bootstrap_timeout_(bootstrap_timeout),
        bootstrap_(std::move(bootstrap)) {}
  ~Loader() {
    if (thread_.joinable()) thread_.join();
  }

  void Start() {
    thread_ = std::thread([this] {
      result_ = Load();
      PostEvent(kLoadDone);
    });
  }
  // After kLoadDone: joins the thread; the engine or why there is none.
  absl::StatusOr<std::unique_ptr<Engine>> Take() {
    thread_.join();
    return std::move(result_);
  }
  // For a process that gives up waiting on a stuck load (it exits without returning).
  void Abandon() { thread_.detach(); }

 private:
  absl::StatusOr<std::unique_ptr<Engine>> Load() {
    absl::StatusOr<std::unique_ptr<BootstrapServer>> bootstrap =
        PrepareMultiProcess(mp_, &options_, bootstrap_timeout_, bootstrap_);
    if (!bootstrap.ok()) {
      return absl::Status(
          bootstrap.status().code(),
          absl::StrCat("multi-process bootstrap failed: ", bootstrap.status().message()));
    }
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options_);
    if (*bootstrap != nullptr) (*bootstrap)->Shutdown();  // the group has formed (or failed)
    return engine;
  }

  EngineOptions options_;
  const MultiProcessConfig mp_;
  const absl::Duration bootstrap_timeout_;
  const BootstrapOptions bootstrap_;
  std::thread thread_;
  absl::StatusOr<std::unique_ptr<Engine>> result_ = absl::UnknownError("not loaded");
};

// What an operator should know about an address that others can reach.
void WarnIfExposed(const ServerOptions& server) {
  for (const std::string& address : server.listen_addresses) {
    if (IsLocalAddress(address)) continue;
    if (!server.tls.enabled() && server.auth != nullptr) {
      Log(absl::StrCat("warning: ", address,
                       " serves without TLS: the bearer token crosses the network in the clear "
                       "(--tls_cert/--tls_key)"));
    } else if (!server.tls.enabled() && server.auth == nullptr) {
      Log(absl::StrCat("note: ", address,
                       " serves without TLS or a token: whoever reaches it can call the API "
                       "(docs/security.md)"));
    }
  }
}

std::string Describe(const Engine& engine) {
  const EngineInfo& info = engine.info();
  const ModelConfig& m = info.model;
  std::string graphs = "off";
  if (info.graph_max_tokens > 0) {
    graphs = absl::StrCat("<=", info.graph_max_tokens, "_tokens");
  } else if (!info.no_graphs_reason.empty()) {
    graphs = absl::StrCat("off(", info.no_graphs_reason, ")");
  }
  return absl::StrCat("model=", m.name, " (layers=", m.num_layers, " experts=", m.num_experts,
                      " topk=", m.topk, " hidden=", m.hidden, " intermediate=", m.intermediate,
                      ") backend=", info.backend, " experts=", info.experts,
                      " ranks=", info.num_ranks, " steps_in_flight=", engine.steps_in_flight(),
                      " cuda_graphs=", graphs, " weights=", WeightFormatName(info.weight_format),
                      " max_tokens_per_request=", info.max_tokens_per_request);
}

}  // namespace

int RunMoeserveProcess(ProcessOptions options) {
  if (absl::Status s = InstallSignalHandlers(); !s.ok()) {
    Log(s.ToString());
    return 1;
  }
  // 1. What will be served, and limits that fit it.
  options.multi_process.local_ranks = options.engine.num_ranks;
  absl::StatusOr<MultiProcessConfig> mp =
      ResolveMultiProcess(options.multi_process, ProcessEnvironment());
  if (!mp.ok()) {
    Log(absl::StrCat("bad flags: ", mp.status().ToString()));
    return 1;
  }
  WeightSource source;
  source.checkpoint_dir = options.engine.checkpoint_dir;
  absl::StatusOr<ModelConfig> model = ResolveModelConfig(source, options.engine.model);
  if (model.ok()) {
    if (absl::Status s = model->Validate(); !s.ok()) model = s;
  }
  if (!model.ok()) {
    Log(absl::StrCat("bad model: ", model.status().ToString()));
    return 1;
  }
  absl::StatusOr<MessageLimits> limits = ResolveMessageLimits(
      *model, options.engine.max_tokens_per_request, options.max_message_bytes);
  if (!limits.ok()) {
    Log(absl::StrCat("bad flags: ", limits.status().ToString()));
    return 1;
  }
  if (!limits->note.empty()) Log(limits->note);
  if (const std::string note =
          HeldBytesNote(*model, limits->max_tokens_per_request, options.server.max_queued_bytes);
      !note.empty()) {
    Log(note);
  }
  options.engine.max_tokens_per_request = limits->max_tokens_per_request;
  options.server.max_message_bytes = limits->max_message_bytes;
  options.server.grpc_limit_bytes = limits->grpc_limit_bytes;
  {
    // Byte limits beyond the memory there is would only defer the failure to an overload.
    const int64_t available = AvailableHostMemoryBytes();
    for (auto [name, value] :
         {std::pair<const char*, int64_t>{"max_queued_bytes", options.server.max_queued_bytes},
          {"grpc_memory_bytes", options.server.grpc_memory_bytes},
          {"max_message_bytes", options.server.max_message_bytes}}) {
      if (value < 0 || (available > 0 && value > available)) {
        Log(absl::StrCat("bad flags: --", name, "=", value, ": expected a size in [0, ", available,
                         "] (the memory available now)"));
        return 1;
      }
    }
  }
  const bool follower = mp->enabled && !mp->leader();

  // 2. Ports first: health NOT_SERVING until the engine exists.
  // Created first, destroyed last: the server's refusals read its description from the moment
  // the server binds. Its metrics are set before the load starts (the only readers of them).
  auto progress = std::make_unique<LoadProgress>(stderr, nullptr);
  std::unique_ptr<Metrics> follower_metrics;
  std::unique_ptr<MoeServer> server;
  std::unique_ptr<FollowerProcess> follower_process;
  std::string grpc_addresses, metrics_address;
  WarnIfExposed(options.server);
  if (follower) {
    // The follower's health server is secured as the leader's public API is.
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
        MakeServerCredentials(options.server.tls, "--tls_", options.server.tls_refresh_s);
    absl::StatusOr<std::unique_ptr<Metrics>> metrics =
        credentials.ok()
            ? Metrics::Create(options.server.metrics_address, options.server.metrics_tls)
            : absl::StatusOr<std::unique_ptr<Metrics>>(credentials.status());
    absl::StatusOr<std::unique_ptr<FollowerProcess>> f =
        metrics.ok() ? FollowerProcess::Bind(options.server.listen_addresses, *credentials)
                     : absl::StatusOr<std::unique_ptr<FollowerProcess>>(metrics.status());
    if (!f.ok()) {
      Log(absl::StrCat("cannot start serving: ", f.status().ToString()));
      return 1;
    }
    follower_metrics = std::move(*metrics);
    follower_process = std::move(*f);
    progress->set_metrics(follower_metrics.get());
    grpc_addresses = absl::StrJoin(follower_process->bound_addresses(), ",");
    metrics_address = follower_metrics->address();
  } else {
    absl::StatusOr<std::unique_ptr<MoeServer>> s = MoeServer::Bind(
        options.server, [p = progress.get()]() -> std::string { return p->Describe(); });
    if (!s.ok()) {
      Log(absl::StrCat("cannot start serving: ", s.status().ToString()));
      return 1;
    }
    server = std::move(*s);
    progress->set_metrics(&server->metrics());
    grpc_addresses = absl::StrJoin(server->bound_addresses(), ",");
    metrics_address = server->metrics_address();
  }
  progress->set_shard_delay(std::chrono::milliseconds(options.load_delay_ms));
  Log(absl::StrCat(follower ? "follower " : "", "listening: grpc=", grpc_addresses,
                   " metrics=", metrics_address.empty() ? "off" : metrics_address,
                   " (health NOT_SERVING until the weights are loaded); max_message_bytes=",
                   limits->max_message_bytes,
                   " max_tokens_per_request=", limits->max_tokens_per_request));

  // 3. The load, in the background.
  options.engine.load_observer = progress.get();
  Loader loader(options.engine, *mp, options.bootstrap_timeout, options.bootstrap);
  loader.Start();
  std::optional<char> event = WaitForEvent();
  if (event.has_value() && IsSignal(*event)) {
    Log(absl::StrCat("signal ", static_cast<int>(*event),
                     " during the weight load: stopping it and exiting"));
    progress->Cancel();
    if (server) server->Shutdown(std::chrono::milliseconds(0));
    if (follower_process) (void)follower_process->Stop();
    for (;;) {
      event = WaitForEvent(kLoadStopWait);
      if (!event.has_value()) {
        Log("the load did not stop in time; exiting without it");
        loader.Abandon();
        std::fflush(stderr);
        std::_Exit(0);
      }
      if (*event == kLoadDone) break;
    }
    (void)loader.Take();  // CANCELLED, or an engine freed right away
    server.reset();
    follower_process.reset();
    Log("stopped");
    return 0;
  }
  absl::StatusOr<std::unique_ptr<Engine>> engine = loader.Take();
  if (!engine.ok()) {
    Log(absl::StrCat("cannot create the engine: ", engine.status().ToString()));
    if (server) server->Shutdown(std::chrono::milliseconds(0));
    if (follower_process) (void)follower_process->Stop();
    return 1;
  }
  progress->Finish();

  // 4. Serve.
  if (follower) {
    follower_process->Run(engine->get(), [] { PostEvent(kFollowerDone); });
    const EngineInfo& info = (*engine)->info();
    Log(absl::StrCat("follower node_rank=", info.node_rank, " ranks=", info.local_ranks,
                     " world=", info.num_ranks, " health=", grpc_addresses, " SERVING"));
    if (!options.ready_file.empty()) {
      (void)WriteReadyFile(options.ready_file, follower_process->bound_addresses()[0],
                           metrics_address);
    }
    do {
      event = WaitForEvent();
    } while (event.has_value() && !IsSignal(*event) && *event != kFollowerDone);
    // Stopped by a signal: the loop ends with the abort Stop() sends it, which is not a failure
    // (exit 0 on SIGTERM, as for the leader).
    const bool by_signal = event.has_value() && IsSignal(*event);
    const absl::Status result = follower_process->Stop();
    Log(absl::StrCat("follower: stopped", by_signal ? " by a signal" : "", ": ",
                     result.ToString()));
    follower_process.reset();
    engine->reset();
    return result.ok() || by_signal ? 0 : 1;
  }
  if (absl::Status s = server->AttachEngine(engine->get()); !s.ok()) {
    Log(absl::StrCat("cannot start serving: ", s.ToString()));
    server->Shutdown(std::chrono::milliseconds(0));
    return 1;
  }
  Log(absl::StrCat("serving ", Describe(**engine), " grpc=", grpc_addresses,
                   " metrics=", metrics_address.empty() ? "off" : metrics_address));
  if (!options.ready_file.empty()) {
    if (absl::Status s =
            WriteReadyFile(options.ready_file, server->bound_addresses()[0], metrics_address);
        !s.ok()) {
      Log(s.ToString());
      server->Shutdown(std::chrono::milliseconds(0));
      return 1;
    }
  }
  // 5. Until told to stop.
  do {
    event = WaitForEvent();
  } while (event.has_value() && !IsSignal(*event));
  Log(absl::StrCat("signal ", event.has_value() ? static_cast<int>(*event) : 0,
                   ", shutting down (in-flight calls may finish)"));
  server->Shutdown(MoeServer::kDefaultShutdownDeadline);
  server.reset();
  engine->reset();
  Log("stopped");
  return 0;
}

}  // namespace moeserve
