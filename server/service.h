// moeserve.v1.MoeService on gRPC's callback API.
//
// Forward is served raw: the request's tensors are read straight out of gRPC's slices and the
// answer is written by the engine into a buffer that the reply's slice then owns, so tensor
// bytes are never copied by protobuf (the wire format is still moeserve.v1's).
// Forward and GetExpertWeights run on the service's own worker threads (a WorkQueue), never on
// gRPC's callback threads; each reply is Finished from the worker. GetModelInfo answers inline.
//
// Bounds (server/call_limits.h): a Forward call holds its request's bytes from arrival and its
// answer's from decoding until gRPC is done with the call; beyond max_held_bytes in all a call
// is refused at once with RESOURCE_EXHAUSTED. An answer the client does not take within
// max_answer_hold is cancelled (the client sees CANCELLED), releasing what it held.
// Calls are counted by the server's interceptor (server/call_accounting.h), not here.
#ifndef MOESERVE_SERVER_SERVICE_H_
#define MOESERVE_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>

#include "core/engine.h"
#include "core/forward_batcher.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/call_limits.h"
#include "server/metrics.h"
#include "server/work_queue.h"

namespace moeserve {

struct ServiceOptions {
  int num_worker_threads = 2;
  // Reported in ModelInfo; the limit itself is set on the ServerBuilder.
  int64_t max_message_bytes = 64 << 20;
  // Request + answer bytes all Forward calls in progress may hold; <= 0: unbounded.
  int64_t max_held_bytes = int64_t{512} << 20;
  // How long a finished answer may wait for the client to take it; <= 0: forever.
  std::chrono::milliseconds max_answer_hold{10000};
};

using MoeServiceBase =
    v1::MoeService::WithRawCallbackMethod_Forward<v1::MoeService::WithCallbackMethod_GetModelInfo<
        v1::MoeService::WithCallbackMethod_GetExpertWeights<v1::MoeService::Service>>>;

class MoeServiceImpl final : public MoeServiceBase {
 public:
  // `engine` and `metrics` must outlive the service; `metrics` may be null. Forward calls go
  // through `batcher` (over the same engine), which the service owns.
  MoeServiceImpl(Engine* engine, std::unique_ptr<ForwardBatcher> batcher, Metrics* metrics,
                 const ServiceOptions& options);
  // Drains the workers.
  ~MoeServiceImpl() override;

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

  // Runs every queued call and stops the workers; calls arriving later get UNAVAILABLE. Call
  // after grpc::Server::Shutdown (which waits for in-flight calls) and before destroying the
  // server. Idempotent.
  void Drain() { workers_.Drain(); }

  // Bytes Forward calls hold now; answers cancelled so far for not being taken.
  int64_t held_bytes() const { return held_bytes_.used(); }
  int64_t answers_cancelled() const { return answer_watch_.cancelled(); }

 private:
  Engine* const engine_;
  Metrics* const metrics_;
  const ServiceOptions options_;
  ByteBudget held_bytes_;
  AnswerHoldWatch answer_watch_;
  WorkQueue workers_;
  std::unique_ptr<ForwardBatcher> batcher_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_SERVICE_H_
