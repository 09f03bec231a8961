// C++ client for moeserve's gRPC API (moeserve.v1.MoeService and grpc.health.v1.Health).
//
// Depends only on the generated proto stubs (moeserve_proto). Every method is a blocking unary
// call bounded by the options' deadline; MoeClient is thread-safe (one HTTP/2 channel shared by
// all callers), so a load generator can call it from many threads at once.
#ifndef MOESERVE_CLIENTS_CPP_MOESERVE_CLIENT_H_
#define MOESERVE_CLIENTS_CPP_MOESERVE_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "moeserve/v1/forward_wire.h"
#include "moeserve/v1/moeserve.grpc.pb.h"

namespace moeserve::client {

struct MoeClientOptions {
  // Largest message sent or received, in bytes. Forward carries [M, hidden] both ways, so this
  // bounds M * hidden * itemsize (plus a little framing).
  int64_t max_message_bytes = 256ll << 20;
  // Per-call deadline.
  absl::Duration deadline = absl::Seconds(30);
  // If true, calls wait (up to the deadline) for the channel to connect instead of failing fast
  // with UNAVAILABLE while the server is not up yet.
  bool wait_for_ready = false;
  // A TCP connection of its own: by default gRPC shares one connection between channels to the
  // same target in a process, so concurrent callers would share one HTTP/2 connection (as
  // callers in separate processes do not).
  bool own_connection = false;
  // Further integer gRPC channel arguments (name, value), e.g. grpc.http2.max_frame_size, for
  // tuning the transport; names must start with "grpc.".
  std::vector<std::pair<std::string, int>> channel_args;
  // TLS (docs/security.md): on when use_tls or any tls_* file is set. tls_ca_file: PEM roots
  // that verify the server (empty: the system's); tls_cert_file + tls_key_file: this client's
  // certificate, for servers that require one (mutual TLS); tls_server_name: the name the
  // server's certificate must carry when it is not the target's host.
  bool use_tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  // Sent as "authorization: Bearer <auth_token>" on every call when not empty.
  std::string auth_token;
  // Forward (the blocking one) polls its completion queue without sleeping for up to this long
  // before it blocks: a thread that sleeps through a call of a few hundred us pays its wake-up
  // on the answer. Costs a core while it polls; 0: block at once.
  absl::Duration spin_wait = absl::ZeroDuration();
};

// Inputs of one Forward call. Shapes: hidden_states [num_tokens, hidden] in hidden_dtype
// (BF16/FP16/FP32, little-endian bytes, not owned: must outlive the call); topk_ids and
// topk_weights [num_tokens, topk] row-major.
struct ForwardArgs {
  int layer = 0;
  v1::DType hidden_dtype = v1::DTYPE_BF16;
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  absl::string_view hidden_bytes;
  int64_t topk = 0;
  std::vector<int32_t> topk_ids;
  std::vector<float> topk_weights;
  std::string request_id;
  bool return_timings = false;
  // The host clock's timings only (ForwardRequest.return_host_timings): no stage timers.
  bool return_host_timings = false;
};

// A Forward whose tensors live in registered shared-memory regions (the server must run with
// --enable_shared_memory and have the regions registered): each RegionRef names a region and a
// byte range of exactly shape x itemsize bytes. The answer goes into `output`; the result's output
// then carries dtype and shape only. Shapes: hidden [num_tokens, hidden] in hidden_dtype,
// topk_ids [num_tokens, topk] in topk_ids_dtype (INT32/INT64), topk_weights [num_tokens, topk]
// FP32, output [num_tokens, hidden] in hidden_dtype.
struct ForwardRegionArgs {
  int layer = 0;
  v1::DType hidden_dtype = v1::DTYPE_BF16;
  v1::DType topk_ids_dtype = v1::DTYPE_INT32;
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t topk = 0;
  v1::RegionRef hidden_states;
  v1::RegionRef topk_ids;
  v1::RegionRef topk_weights;
  v1::RegionRef output;
  std::string request_id;
  bool return_timings = false;
  // The host clock's timings only (ForwardRequest.return_host_timings): no stage timers.
  bool return_host_timings = false;
};

// A RegionRef from its parts.
v1::RegionRef MakeRegionRef(const std::string& name, int64_t offset, int64_t byte_size);

struct ForwardResult {
  // [num_tokens, hidden], the request's hidden dtype. Its data is filled (one copy out of the
  // received slices) unless the call asked for no copy; `raw` always has it in place.
  v1::Tensor output;
  std::string request_id;    // as echoed by the server
  v1::StageTimings timings;  // zeros unless return_timings or return_host_timings
  absl::Duration latency;    // client-side round trip
  // The response as received: raw.output.data points into raw.slices (owned here).
  v1wire::ForwardResponseView raw;
};

class ForwardStream;

class MoeClient {
 public:
  // Creates a client for `target` ("host:port", or any gRPC target URI); insecure unless the
  // options ask for TLS (their files are read now: NOT_FOUND naming one that cannot be read).
  // Does not contact the server.
  static absl::StatusOr<std::unique_ptr<MoeClient>> Create(const std::string& target,
                                                           const MoeClientOptions& options = {});
  // Waits for ForwardAsync calls in flight (see there).
  ~MoeClient();
  MoeClient(const MoeClient&) = delete;
  MoeClient& operator=(const MoeClient&) = delete;

  // grpc.health.v1 Check for `service` ("" = the whole server).
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service = "");

  absl::StatusOr<v1::ModelInfo> GetModelInfo();

  // Builds the request from `args` (checking sizes locally) and runs it.
  absl::StatusOr<ForwardResult> Forward(const ForwardArgs& args);
  // Sends a ready-made request (its tensor bytes are copied once into the outgoing slices).
  absl::StatusOr<ForwardResult> Forward(const v1::ForwardRequest& request);
  // Sends an encoded request, e.g. one built once by EncodeForwardRequest and re-sent by a load
  // generator: its slices are referenced, not copied. With `copy_output` false,
  // ForwardResult::output gets dtype and shape only and the bytes stay in ForwardResult::raw.
  // deadline: this call's (zero: the options').
  absl::StatusOr<ForwardResult> Forward(const grpc::ByteBuffer& request, bool copy_output = true,
                                        absl::Duration deadline = absl::ZeroDuration());

  // Starts a Forward and returns at once; `done` runs exactly once with the result, on a
  // thread of this client's own that every ForwardAsync call ends on (keep it short; it must not
  // destroy the client). `request`'s slices are shared, not copied; ForwardResult::output gets
  // the bytes copied out only with `copy_output`. The client may be destroyed right after the
  // last `done` returned, or with calls in flight: its destructor waits for them to end (their
  // deadlines bound that) and runs their `done`.
  // deadline: this call's (zero: the options').
  void ForwardAsync(const grpc::ByteBuffer& request,
                    std::function<void(absl::StatusOr<ForwardResult>)> done,
                    bool copy_output = true, absl::Duration deadline = absl::ZeroDuration());

  // A Forward whose completion the caller collects from its own completion queue: the
  // caller drains `cq` and gets `tag` once the call has ended (then `status` and `response`
  // are set; FinishForward reads them). `call` must stay alive, unmoved, until
  // then. Like ForwardAsync this uses no gRPC callback thread: a client whose last call just
  // completed may be destroyed at once (with the callback API, the shared completion queue could
  // be torn down under its own thread then: gRPC 1.51 aborted in grpc_cq_internal_unref).
  struct QueuedForward {
    grpc::ClientContext context;
    grpc::ByteBuffer response;
    grpc::Status status;
    absl::Time start;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
  };
  void StartForward(const grpc::ByteBuffer& request, grpc::CompletionQueue* cq, QueuedForward* call,
                    void* tag, absl::Duration deadline = absl::ZeroDuration());

  // Opens a ForwardStream: layer calls one after another on one HTTP/2 stream (answers in
  // order). The stream has no deadline of its own; the client options' deadline is not applied.
  // `deadline`: the whole stream's, from now (a stream outlives any one call, so there is no
  // per-call deadline); infinite: none.
  absl::StatusOr<std::unique_ptr<ForwardStream>> OpenForwardStream(
      absl::Duration deadline = absl::InfiniteDuration());

  // Tensors by region: see ForwardRegionArgs. Checks the byte sizes against the shapes locally.
  absl::StatusOr<ForwardResult> Forward(const ForwardRegionArgs& args);

  // Shared-memory regions (the server's --enable_shared_memory). A system region is bytes
  // [offset, offset + byte_size) of the POSIX shared-memory object `key` ("/name", made with
  // shm_open by the caller on the server's host); a CUDA region is the cudaIpcMemHandle_t
  // (64 bytes) of an allocation's base on `device_id` (the server's ordinal). Region names are
  // unique; Unregister ("" = all) is refused (FAILED_PRECONDITION) while a call uses the region,
  // and once it succeeds the server no longer touches the memory.
  absl::Status RegisterSystemSharedMemory(const std::string& name, const std::string& key,
                                          int64_t offset, int64_t byte_size);
  absl::Status RegisterCudaSharedMemory(const std::string& name, absl::string_view raw_handle,
                                        int device_id, int64_t byte_size);
  absl::Status UnregisterSharedMemory(const std::string& name = "");
  absl::StatusOr<v1::SharedMemoryStatusResponse> SharedMemoryStatus(const std::string& name = "");
  // The forward channel's registration (ForwardChannelClient does both for you).
  absl::StatusOr<v1::RegisterForwardChannelResponse> RegisterForwardChannel(const std::string& name,
                                                                            const std::string& key,
                                                                            int64_t byte_size);
  absl::Status UnregisterForwardChannel(const std::string& name);

  // One expert's weights as the server computes with them (BF16 w13 [2I, H], w2 [H, I]): the
  // unary GetExpertWeights when the expert fits in one message (the server's and this
  // client's max_message_bytes; sizes from GetModelInfo, asked once), else StreamExpertWeights.
  // The server must run with --enable_get_expert_weights (FAILED_PRECONDITION otherwise).
  absl::StatusOr<v1::GetExpertWeightsResponse> GetExpertWeights(int layer, int expert);
  // Always the unary RPC.
  absl::StatusOr<v1::GetExpertWeightsResponse> GetExpertWeightsUnary(int layer, int expert);
  // Always the stream, reassembled and checked (order, offsets, shapes, completeness);
  // chunk_bytes 0: the server's default.
  absl::StatusOr<v1::GetExpertWeightsResponse> StreamExpertWeights(int layer, int expert,
                                                                   int64_t chunk_bytes = 0);

  // Builds a ForwardRequest from `args`, validating the sizes.
  static absl::StatusOr<v1::ForwardRequest> BuildForwardRequest(const ForwardArgs& args);
  // The serialized ForwardRequest as slices: framing plus one slice per tensor. The tensor bytes
  // are copied once into slices the buffer owns, so `args` need not outlive it.
  static absl::StatusOr<grpc::ByteBuffer> EncodeForwardRequest(const ForwardArgs& args);
  static absl::StatusOr<grpc::ByteBuffer> EncodeForwardRequest(const v1::ForwardRequest& request);
  // The request of a Forward by regions (no tensor bytes: a few hundred bytes on the wire).
  static absl::StatusOr<v1::ForwardRequest> BuildForwardRequest(const ForwardRegionArgs& args);

  const std::string& target() const { return target_; }
  const MoeClientOptions& options() const { return options_; }

 private:
  MoeClient(std::string target, MoeClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // deadline: the call's (zero: the options').
  void PrepareContext(grpc::ClientContext* context,
                      absl::Duration deadline = absl::ZeroDuration()) const;

  std::string target_;
  MoeClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::MoeService::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_stub_;  // Forward, as raw bytes
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
  std::mutex info_mu_;
  std::optional<v1::ModelInfo> info_;  // guarded by info_mu_: sizes for GetExpertWeights
  // ForwardAsync's completion queue and the thread that drains it, made by the first call.
  // Declared last: destroyed (its calls ended) before the stubs and the channel.
  struct AsyncCalls;
  std::mutex async_mu_;
  std::unique_ptr<AsyncCalls> async_;  // guarded by async_mu_ until set
};

// One ForwardStream call. Write sends a request (blocking until gRPC has taken it), Read returns
// the next answer in request order: the result, or that call's own failure (the stream goes
// on), or, once the stream has ended, its final status (OUT_OF_RANGE after a clean end). Several
// writes may precede the reads (pipelining). Thread-safety: one writer thread and one reader
// thread may use it at once. The destructor cancels a stream that was not finished.
class ForwardStream {
 public:
  ~ForwardStream();
  absl::Status Write(const grpc::ByteBuffer& request);
  absl::Status Write(const ForwardArgs& args);
  absl::StatusOr<ForwardResult> Read(bool copy_output = true);
  // Half-closes: no more writes. Idempotent.
  void WritesDone();
  // WritesDone, discards unread answers, and waits for the stream's status.
  absl::Status Finish();

 private:
  friend class MoeClient;
  class Reactor;
  ForwardStream();
  grpc::ClientContext context_;
  std::unique_ptr<Reactor> reactor_;
  bool started_ = false;
};

// Decodes a serialized ForwardResponse; a response carrying error_code (ForwardStream) becomes
// that status.
absl::StatusOr<ForwardResult> DecodeForwardResult(const grpc::ByteBuffer& response,
                                                  bool copy_output, absl::Duration latency);

// The result of a StartForward call whose tag came back from its queue, its latency measured
// from the start to now; ForwardResult::output gets the bytes copied out only with
// `copy_output`.
absl::StatusOr<ForwardResult> FinishForward(const MoeClient::QueuedForward& call, bool copy_output);

// gRPC status -> absl::Status (the codes share numeric values).
absl::Status FromGrpcStatus(const grpc::Status& status);

// "SERVING", "NOT_SERVING", ...
std::string ServingStatusName(grpc::health::v1::HealthCheckResponse::ServingStatus status);

}  // namespace moeserve::client

#endif  // MOESERVE_CLIENTS_CPP_MOESERVE_CLIENT_H_
