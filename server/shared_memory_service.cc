// MoeServiceImpl's shared-memory RPCs (after Triton's shared-memory extension): register, list
// and unregister regions in the service's RegionRegistry (core/memory_region.h). Opening a
// region maps and may page-lock it, which can take milliseconds for large ones: the calls run on
// the service's workers, never on gRPC's callback threads.
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "server/convert.h"
#include "server/service.h"
#include "server/status.h"

namespace moeserve {

bool IsSameHostPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  if (absl::StartsWith(peer, "ipv4:")) return absl::StartsWith(peer, "ipv4:127.");
  if (absl::StartsWith(peer, "ipv6:")) {
    const std::string p = absl::AsciiStrToLower(absl::StrReplaceAll(
        peer.substr(5), {{"%5b", "["}, {"%5d", "]"}, {"%5B", "["}, {"%5D", "]"}}));
    return absl::StartsWith(p, "[::1]") || absl::StartsWith(p, "[::ffff:127.");
  }
  return false;
}

absl::Status MoeServiceImpl::CheckSharedMemoryPeer(const std::string& peer,
                                                   absl::string_view what) {
  if (!IsSameHostPeer(peer)) {
    return absl::PermissionDeniedError(
        absl::StrCat(what,
                     ": shared-memory regions are served to clients on the server's host "
                     "only (a unix socket or loopback); this call came from ",
                     peer));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* MoeServiceImpl::RunSharedMemoryCall(grpc::CallbackServerContext* context,
                                                              const char* method,
                                                              std::function<absl::Status()> fn) {
  if (metrics_) metrics_->IncrementInflight();
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Counted by the server's interceptor (server/call_accounting.h).
  auto finish = [this, reactor](const absl::Status& status) {
    if (metrics_) metrics_->DecrementInflight();
    reactor->Finish(ToGrpcStatus(status));
  };
  if (absl::Status s = Authorize(*context, method); !s.ok()) {
    finish(s);
    return reactor;
  }
  if (!options_.enable_shared_memory) {
    finish(SharedMemoryDisabledError(method));
    return reactor;
  }
  if (state_->engine() == nullptr) {  // acquire: regions_ is set before the engine
    finish(state_->NotReady(method));
    return reactor;
  }
  if (absl::Status s = CheckSharedMemoryPeer(context->peer(), method); !s.ok()) {
    finish(s);
    return reactor;
  }
  if (!state_->SubmitWork([fn = std::move(fn), finish] { finish(fn()); })) {
    finish(absl::UnavailableError(absl::StrCat(method, ": the server is shutting down")));
  }
  return reactor;
}

grpc::ServerUnaryReactor* MoeServiceImpl::RegisterSystemSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSystemSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* response) {
  return RunSharedMemoryCall(context, "RegisterSystemSharedMemory", [this, request] {
    return regions_->RegisterSystem(request->name(), request->key(), request->offset(),
                                    request->byte_size());
  });
}

grpc::ServerUnaryReactor* MoeServiceImpl::RegisterCudaSharedMemory(
    grpc::CallbackServerContext* context, const v1::RegisterCudaSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* response) {
  return RunSharedMemoryCall(context, "RegisterCudaSharedMemory", [this, request] {
    return regions_->RegisterCuda(request->name(), request->raw_handle(), request->device_id(),
                                  request->byte_size());
  });
}

grpc::ServerUnaryReactor* MoeServiceImpl::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* response) {
  return RunSharedMemoryCall(context, "UnregisterSharedMemory",
                             [this, request] { return regions_->Unregister(request->name()); });
}

grpc::ServerUnaryReactor* MoeServiceImpl::SharedMemoryStatus(
    grpc::CallbackServerContext* context, const v1::SharedMemoryStatusRequest* request,
    v1::SharedMemoryStatusResponse* response) {
  return RunSharedMemoryCall(context, "SharedMemoryStatus", [this, request, response] {
    absl::StatusOr<std::vector<RegionInfo>> regions = regions_->Status(request->name());
    if (!regions.ok()) return regions.status();
    for (const RegionInfo& info : *regions) RegionInfoToProto(info, response->add_regions());
    return absl::OkStatus();
  });
}

namespace {

// Room left in a slot for the ForwardResponse's framing and header beside the output's bytes.
constexpr int64_t kChannelAnswerFramingBytes = 1024;

absl::Status Prefixed(absl::string_view method, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(method, ": ", s.message()));
}

}  // namespace

ChannelCallFn MoeServiceImpl::MakeChannelCall(std::string peer, std::string name) {
  const uint64_t caller = CallerKey(peer, name);
  return [this, caller, peer = std::move(peer), name = std::move(name)](
             const grpc::ByteBuffer& request, absl::Time deadline, int64_t max_answer_bytes,
             ChannelAnswerFn answer) {
    const auto start = std::chrono::steady_clock::now();
    Metrics* const metrics = metrics_;
    const int64_t received = static_cast<int64_t>(request.Length());
    if (metrics) metrics->IncrementInflight();
    // An answer the slot cannot hold is refused before the call runs.
    auto hold = [max_answer_bytes, &name](int64_t bytes, absl::string_view what) -> absl::Status {
      if (bytes + kChannelAnswerFramingBytes > max_answer_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "Forward: ", what, " of ", bytes, " bytes does not fit forward channel '", name,
            "''s slots (", max_answer_bytes, " bytes of payload, ", kChannelAnswerFramingBytes,
            " kept for the reply's header); name an output_region or register larger slots"));
      }
      return absl::OkStatus();
    };
    RunForward(
        request, deadline, /*cancelled=*/nullptr, start, peer, CallSource{.caller = caller}, hold,
        [metrics, start, received, answer = std::move(answer)](const absl::Status& status,
                                                               const grpc::ByteBuffer& encoded,
                                                               int64_t tokens, const std::string&) {
          if (metrics) {
            const double seconds =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (status.ok()) metrics->AddTokens(tokens);
            metrics->RecordRequest("ForwardChannel.call",
                                   static_cast<grpc::StatusCode>(status.code()), seconds);
            metrics->AddBytes("ForwardChannel", received,
                              status.ok() ? static_cast<int64_t>(encoded.Length()) : 0);
            metrics->DecrementInflight();
          }
          answer(status, encoded);
        });
  };
}

grpc::ServerUnaryReactor* MoeServiceImpl::RegisterForwardChannel(
    grpc::CallbackServerContext* context, const v1::RegisterForwardChannelRequest* request,
    v1::RegisterForwardChannelResponse* response) {
  constexpr const char* kMethod = "RegisterForwardChannel";
  return RunSharedMemoryCall(context, kMethod, [this, request, response, peer = context->peer()] {
    absl::StatusOr<std::shared_ptr<ForwardChannel>> channel =
        channels_->Register(request->name(), request->key(), request->byte_size(),
                            MakeChannelCall(peer, request->name()));
    if (!channel.ok()) return Prefixed(kMethod, channel.status());
    response->set_num_slots((*channel)->num_slots());
    response->set_slot_bytes((*channel)->slot_bytes());
    response->set_spin_us(absl::ToInt64Microseconds(channels_->spin()));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* MoeServiceImpl::UnregisterForwardChannel(
    grpc::CallbackServerContext* context, const v1::UnregisterForwardChannelRequest* request,
    v1::UnregisterForwardChannelResponse* response) {
  return RunSharedMemoryCall(context, "UnregisterForwardChannel", [this, request] {
    return Prefixed("UnregisterForwardChannel", channels_->Unregister(request->name()));
  });
}

int MoeServiceImpl::forward_channels() const {
  return channels_ != nullptr ? channels_->size() : 0;
}

void MoeServiceImpl::CloseForwardChannels() {
  if (channels_ != nullptr) channels_->CloseAll();
}

}  // namespace moeserve
