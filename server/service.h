// moeserve.v1.MoeService on gRPC's callback API.
//
// Forward is served raw: the request's tensors are read straight out of gRPC's slices and the
// answer is written by the engine into a buffer that the reply's slice then owns, so tensor
// bytes are never copied by protobuf (the wire format is still moeserve.v1's).
// Forward and GetExpertWeights run on the service's own worker threads (a WorkQueue), never on
// gRPC's callback threads; each reply is Finished from the worker. GetModelInfo answers inline.
#ifndef MOESERVE_SERVER_SERVICE_H_
#define MOESERVE_SERVER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "core/engine.h"
#include "core/forward_batcher.h"
#include "core/memory_region.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/metrics.h"
#include "server/work_queue.h"

namespace moeserve {

struct ServiceOptions {
  int num_worker_threads = 2;
  // Reported in ModelInfo; the limit itself is set on the ServerBuilder.
  int64_t max_message_bytes = 64 << 20;
  // Shared-memory regions (the four *SharedMemory* RPCs, Tensor.region, output_region); off:
  // they are refused with FAILED_PRECONDITION naming --enable_shared_memory.
  bool enable_shared_memory = false;
  int max_shared_memory_regions = 256;
};

// Whether a gRPC peer (ServerContext::peer(): "unix:...", "ipv4:127.0.0.1:5000",
// "ipv6:[::1]:5000", brackets possibly percent-encoded) is on this host: shared-memory regions
// are served to those only (PERMISSION_DENIED otherwise), since they name this host's memory.
bool IsSameHostPeer(absl::string_view peer);

// The shared-memory RPCs (server/shared_memory_service.cc).
using MoeServiceSharedMemoryBase = v1::MoeService::WithCallbackMethod_RegisterSystemSharedMemory<
    v1::MoeService::WithCallbackMethod_RegisterCudaSharedMemory<
        v1::MoeService::WithCallbackMethod_UnregisterSharedMemory<
            v1::MoeService::WithCallbackMethod_SharedMemoryStatus<v1::MoeService::Service>>>>;

using MoeServiceBase =
    v1::MoeService::WithRawCallbackMethod_Forward<v1::MoeService::WithCallbackMethod_GetModelInfo<
        v1::MoeService::WithCallbackMethod_GetExpertWeights<MoeServiceSharedMemoryBase>>>;

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

  // Shared memory (server/shared_memory_service.cc): FAILED_PRECONDITION unless
  // ServiceOptions::enable_shared_memory.
  grpc::ServerUnaryReactor* RegisterSystemSharedMemory(
      grpc::CallbackServerContext* context, const v1::RegisterSystemSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* RegisterCudaSharedMemory(
      grpc::CallbackServerContext* context, const v1::RegisterCudaSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
      v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* SharedMemoryStatus(grpc::CallbackServerContext* context,
                                               const v1::SharedMemoryStatusRequest* request,
                                               v1::SharedMemoryStatusResponse* response) override;

  // Runs every queued call and stops the workers; calls arriving later get UNAVAILABLE. Call
  // after grpc::Server::Shutdown (which waits for in-flight calls) and before destroying the
  // server. Idempotent.
  void Drain() { workers_.Drain(); }

 private:
  // Runs `fn` (returning the call's status) on a worker and finishes `context`'s call with it,
  // recording `method` in the metrics.
  grpc::ServerUnaryReactor* RunSharedMemoryCall(grpc::CallbackServerContext* context,
                                                const char* method,
                                                std::function<absl::Status()> fn);
  // OK when shared memory is on and `context`'s peer is on this host.
  absl::Status CheckSharedMemoryAllowed(const grpc::CallbackServerContext& context,
                                        absl::string_view what) const;

  Engine* const engine_;
  Metrics* const metrics_;
  const ServiceOptions options_;
  // Before the workers and the batcher: outlives every call that holds a region.
  std::unique_ptr<RegionRegistry> regions_;  // null: shared memory off
  WorkQueue workers_;
  std::unique_ptr<ForwardBatcher> batcher_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_SERVICE_H_
