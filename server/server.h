// A running moeserve gRPC server: MoeService, the KServe v2 GRPCInferenceService, the standard
// health service, reflection (when asked) and the Prometheus endpoint, around an Engine.
// Closed by default: loopback addresses, no reflection, no expert weights; TLS, mutual TLS and a
// bearer token (checked on both public services) are options (docs/security.md).
//
// Startup in two steps, so orchestrators see a live process while the weights load: Bind()
// opens every port with health NOT_SERVING (the services refuse calls with UNAVAILABLE saying
// what the process is doing), AttachEngine() then serves the loaded engine and reports SERVING.
// Start() does both for an engine that is already loaded.
#ifndef MOESERVE_SERVER_SERVER_H_
#define MOESERVE_SERVER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "core/forward_batcher.h"
#include "server/inference_service.h"
#include "server/metrics.h"
#include "server/security.h"
#include "server/service.h"
#include "server/serving_state.h"
#include "server/tls.h"

namespace moeserve {

inline constexpr char kMoeServiceName[] = "moeserve.v1.MoeService";

inline constexpr char kDefaultListenAddress[] = "127.0.0.1:50051";
// 9464 rather than Prometheus's own 9090 (the port OpenTelemetry's Prometheus exporters use).
inline constexpr char kDefaultMetricsAddress[] = "127.0.0.1:9464";

// ServerOptions::batcher.idle_spin "by backend" on a GPU engine. H200 host, one-token call of
// the trivial layer: server total 70.8 -> 54.1 us, round trip 196 -> 159 us
// (tests/benchmarks/serving/RESULTS.md).
inline constexpr absl::Duration kGpuIdleSpin = absl::Microseconds(2000);

// The address a client dials for listen address `listen` bound on `port`: "host:port", or the
// listen address itself for a unix socket ("unix:/path", "unix-abstract:name": no port).
std::string BoundAddress(const std::string& listen, int port);

// The batcher's idle_spin for an engine of `backend` (EngineInfo::backend): `configured`, or
// when negative, kGpuIdleSpin on a GPU backend and none on "cpu".
absl::Duration ResolveIdleSpin(absl::Duration configured, std::string_view backend);

// ServerOptions::batcher.lane_lead "by backend" on a GPU engine: about one step's host work
// there. Three H100 hosts, seed layer MXFP8, 8 callers at M=16: 6-10% more calls/s, p50 10%
// lower (tests/benchmarks/serving/RESULTS.md, 2026-12-06 10:30).
inline constexpr absl::Duration kGpuLaneLead = absl::Microseconds(120);

// --company_wait_us -1 (ForwardBatcherOptions::company_wait_auto): the longest wait for
// company. Twice the layer's last step bounds it first (a decode step: about a millisecond).
inline constexpr absl::Duration kAutoCompanyWait = absl::Milliseconds(50);

// The batcher's company wait for an engine of `backend` (`options` as configured): a negative
// company_wait means "by backend": auto (kAutoCompanyWait) on a GPU, where 8 callers of the
// seed layer's BF16 decode served 27-30% more calls/s merged on one H100 host and 8-12% more on
// another, and MXFP8 within +-3% of split (serving/RESULTS.md, 2026-12-06 13:45); off on "cpu",
// whose steps grow with their tokens.
void ResolveCompanyWait(std::string_view backend, ForwardBatcherOptions* options);

// The batcher's lane_lead for an engine of `backend`: `configured`, or when negative,
// kGpuLaneLead on a GPU backend and none on "cpu" (one lane there).
absl::Duration ResolveLaneLead(absl::Duration configured, std::string_view backend);

// ServerOptions::inline_request_bytes "by backend" (the binary's default).
inline constexpr int64_t kInlineRequestBytesByBackend = -2;
// The request size up to which gRPC's thread decodes a Forward (ServiceOptions::
// inline_request_bytes) for an engine of `backend`: `configured`, or for
// kInlineRequestBytesByBackend, 0 on a GPU (every request decoded on a polling worker, which
// runs an idle step itself: one H200 host, 2026-12-06, trivial one-token server total 56-59 ->
// 45-48 us, M=16 119-134 -> 102-107, seed layer 8 callers 5705-5939 -> 6014-6038 calls/s,
// tests/benchmarks/serving/RESULTS.md) and -1 on "cpu" (a worker there sleeps: a hop costs more
// than the decode).
int64_t ResolveInlineRequestBytes(int64_t configured, std::string_view backend);

struct ServerOptions {
  // "host:port" each; port 0 binds a free port (see MoeServer::bound_addresses()).
  std::vector<std::string> listen_addresses = {kDefaultListenAddress};
  int server_threads = 2;  // Forward / ModelInfer worker threads
  // Threads copying a large request's pieces into one buffer (GatherPieces); 0: auto. The
  // first server of the process sets it.
  int gather_threads = 0;
  // ... writing with streaming (non-temporal) stores (StreamingCopy). Off until measured
  // on a GPU host (tests/benchmarks/transport/RESULTS.md).
  bool gather_streaming_stores = false;
  // A GPU engine's large hidden_states (from this many bytes; 0: never) are uploaded to the
  // device as they are gathered (ServiceOptions::upload_min_bytes).
  int64_t upload_min_bytes = int64_t{4} << 20;
  // Forward requests up to this many bytes are handled on gRPC's receiving thread, larger ones
  // on a worker; -1: all on gRPC's thread (ServiceOptions::inline_request_bytes);
  // kInlineRequestBytesByBackend: ResolveInlineRequestBytes when the engine is attached.
  int64_t inline_request_bytes = -1;
  // A merged step's answers are sent from the workers at once (ForwardBatcherOptions::
  // answer_executor), not one after another from the step's thread.
  bool parallel_answers = true;
  // Before serving, run every CUDA graph size (up to max_batch_tokens) of every layer once on
  // every engine lane (ForwardBatcher::WarmUp), so that no call waits for a capture. Only a
  // GPU engine with graphs has anything to warm.
  bool warm_graphs = true;
  int64_t max_message_bytes = 64 << 20;  // the logical limit (ModelInfo; checked per request)
  // What gRPC refuses by itself, receive and send (server/limits.h); 0: max_message_bytes.
  int64_t grpc_limit_bytes = 0;
  // Bounds on what clients can make the server hold (server/call_limits.h, README "Limits"):
  // request + answer bytes of Forward calls in progress (RESOURCE_EXHAUSTED beyond; <= 0 off),
  int64_t max_queued_bytes = int64_t{512} << 20;
  // how long an answer may wait for the client to take it before the call is cancelled (<= 0:
  // forever),
  std::chrono::milliseconds max_answer_hold{10000};
  // concurrent streams per HTTP/2 connection (GRPC_ARG_MAX_CONCURRENT_STREAMS),
  int max_concurrent_streams = 128;
  // Further integer gRPC channel arguments for the listener (name, value), e.g.
  // grpc.http2.max_frame_size, for tuning the transport; names must start with "grpc.".
  std::vector<std::pair<std::string, int>> grpc_channel_args;
  // gRPC's own memory (transport buffers; grpc::ResourceQuota) and its threads,
  int64_t grpc_memory_bytes = int64_t{1} << 30;
  int grpc_max_threads = 64;
  // the metadata (headers) one call may send (GRPC_ARG_MAX_METADATA_SIZE). An oversized header
  // fails its call, and gRPC may then fail the connection's other calls too: keep it well above
  // what clients send.
  int max_metadata_bytes = 64 << 10;
  // Idle connections are pinged this often and closed when a ping goes unanswered for
  // keepalive_timeout (a vanished client's calls are cancelled).
  std::chrono::milliseconds keepalive_time{60000};
  std::chrono::milliseconds keepalive_timeout{20000};
  // Concurrent Forward calls for one layer share engine steps (core/forward_batcher.h). A
  // negative batcher.idle_spin means "by backend": kGpuIdleSpin on a GPU engine (a sleeping
  // scheduling thread's wake-up is a third of a one-token call there), none on the CPU (whose
  // steps need the cores). Workers that decode requests (inline_request_bytes >= 0) poll as
  // long. A negative batcher.lane_lead likewise means "by backend" (ResolveLaneLead), and so does
  // a negative batcher.company_wait (ResolveCompanyWait).
  ForwardBatcherOptions batcher;
  std::string metrics_address = kDefaultMetricsAddress;  // empty: no metrics endpoint
  // TLS of every listen address (all empty: plaintext); with tls.ca_file, mutual TLS. gRPC
  // re-reads the files every tls_refresh_s seconds.
  TlsFiles tls;
  int tls_refresh_s = kDefaultTlsRefreshSeconds;
  // TLS of the metrics endpoint (all empty: plain HTTP); with ca_file, mutual TLS.
  TlsFiles metrics_tls;
  // Bearer tokens every MoeService call and every KServe call but ServerLive / ServerReady must
  // carry (health and reflection stay open); null: none.
  std::shared_ptr<const BearerTokens> auth;
  bool enable_reflection = false;          // grpc.reflection.v1alpha.ServerReflection
  bool enable_get_expert_weights = false;  // GetExpertWeights, StreamExpertWeights
  // Expert-weight calls in flight at once (ServiceOptions::max_expert_weight_calls).
  int max_expert_weight_calls = 4;
  // The engine's health is polled this often; health reports NOT_SERVING while it is unhealthy
  // (e.g. an NCCL collective timed out or a rank failed). <= 0: no polling.
  std::chrono::milliseconds health_poll{500};
  // While unhealthy, Engine::Recover() is tried this often; <= 0: never.
  std::chrono::milliseconds recover_after{5000};
  // Shared-memory regions and forward channels for a frontend on the same host
  // (ServiceOptions).
  bool enable_shared_memory = false;
  int max_forward_channels = 16;
  absl::Duration forward_channel_spin = absl::Milliseconds(2);
};

// Splits "a:1,b:2" into addresses, dropping empty items and surrounding spaces.
std::vector<std::string> SplitListenAddresses(const std::string& list);

class MoeServer {
 public:
  // Bind() then AttachEngine(engine): `engine` must be ready and outlive the server.
  static absl::StatusOr<std::unique_ptr<MoeServer>> Start(Engine* engine,
                                                          const ServerOptions& options);
  // Binds every address and the metrics endpoint; health reports NOT_SERVING for "",
  // kMoeServiceName and kInferenceServiceName, calls get UNAVAILABLE with `describe_startup()`
  // (may be empty) in the message. UNAVAILABLE naming the address when one cannot be bound.
  static absl::StatusOr<std::unique_ptr<MoeServer>> Bind(
      const ServerOptions& options, std::function<std::string()> describe_startup = nullptr);
  // Serves `engine` (ready; must outlive the server): creates the batcher, exports the model's
  // metrics, reports SERVING (if the engine is healthy) and starts following its health. Once.
  absl::Status AttachEngine(Engine* engine);
  // Shutdown(kDefaultShutdownDeadline) if not done yet.
  ~MoeServer();

  static constexpr std::chrono::seconds kDefaultShutdownDeadline{30};

  // Whether the health service currently reports SERVING.
  bool serving() const;

  // Marks NOT_SERVING, stops accepting calls, lets in-flight calls finish until `deadline`
  // (then cancels them), drains the workers. Idempotent.
  void Shutdown(std::chrono::milliseconds deadline = kDefaultShutdownDeadline);

  // listen_addresses with each port resolved to the bound port, in order.
  const std::vector<std::string>& bound_addresses() const { return bound_addresses_; }
  int port() const { return bound_ports_.empty() ? 0 : bound_ports_[0]; }
  Metrics& metrics() { return *metrics_; }
  MoeServiceImpl& service() { return *service_; }
  // The batcher's counters (steps run inline, merged calls, refusals); zeros before the engine
  // is attached. Thread-safe.
  ForwardBatcherStats batcher_stats() const;
  // "host:port" of the metrics endpoint, empty when off.
  const std::string& metrics_address() const { return metrics_->address(); }

 private:
  MoeServer() = default;
  void SetServing(bool serving);
  void WatchHealth(const ServerOptions& options);

  ServerOptions options_;
  Engine* engine_ = nullptr;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ServingState> state_;
  std::unique_ptr<MoeServiceImpl> service_;
  std::unique_ptr<InferenceServiceImpl> inference_service_;
  std::unique_ptr<grpc::CallbackGenericService> unknown_methods_;
  std::unique_ptr<grpc::Server> server_;
  std::vector<int> bound_ports_;
  std::vector<std::string> bound_addresses_;
  bool shut_down_ = false;
  mutable std::mutex health_mu_;
  std::condition_variable health_cv_;
  bool serving_ = false;        // guarded by health_mu_
  bool stop_watching_ = false;  // guarded by health_mu_
  std::thread health_watcher_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_SERVER_H_
