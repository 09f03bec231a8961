#include "clients/cpp/moeserve_client.h"

#include <grpc/support/time.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "clients/cpp/dtype_convert.h"

namespace moeserve::client {

using grpc::health::v1::HealthCheckResponse;

namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string ServingStatusName(HealthCheckResponse::ServingStatus status) {
  return HealthCheckResponse::ServingStatus_Name(status);
}

MoeClient::MoeClient(std::string target, MoeClientOptions options,
                     std::shared_ptr<grpc::Channel> channel)
    : target_(std::move(target)),
      options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::MoeService::NewStub(channel_)),
      generic_stub_(std::make_unique<grpc::GenericStub>(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<MoeClient>> MoeClient::Create(const std::string& target,
                                                             const MoeClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("target is empty; expected HOST:PORT");
  if (options.max_message_bytes <= 0 || options.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes is ", options.max_message_bytes, "; expected in [1, ", INT_MAX, "]"));
  }
  if (options.deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("deadline is ", absl::FormatDuration(options.deadline), "; expected > 0"));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (options.own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  for (const auto& [name, value] : options.channel_args) {
    if (name.rfind("grpc.", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "channel_args: '", name, "' is not a gRPC channel argument (expected grpc.*)"));
    }
    args.SetInt(name, value);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.use_tls || !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
      !options.tls_key_file.empty()) {
    if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
      return absl::InvalidArgumentError(
          "tls_cert_file and tls_key_file go together: give both or neither");
    }
    grpc::SslCredentialsOptions ssl;
    for (auto [path, out] : {std::pair{&options.tls_ca_file, &ssl.pem_root_certs},
                             {&options.tls_cert_file, &ssl.pem_cert_chain},
                             {&options.tls_key_file, &ssl.pem_private_key}}) {
      if (path->empty()) continue;
      absl::StatusOr<std::string> data = ReadFile(*path);
      if (!data.ok()) return data.status();
      *out = std::move(*data);
    }
    credentials = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  }
  auto channel = grpc::CreateCustomChannel(target, credentials, args);
  if (channel == nullptr) return absl::InternalError("could not create a gRPC channel");
  return std::unique_ptr<MoeClient>(new MoeClient(target, options, std::move(channel)));
}

void MoeClient::PrepareContext(grpc::ClientContext* context, absl::Duration deadline) const {
  if (deadline <= absl::ZeroDuration()) deadline = options_.deadline;
  context->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  context->set_wait_for_ready(options_.wait_for_ready);
  if (!options_.auth_token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.auth_token));
  }
}

absl::StatusOr<HealthCheckResponse::ServingStatus> MoeClient::Health(const std::string& service) {
  grpc::ClientContext context;
  PrepareContext(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  grpc::Status status = health_stub_->Check(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.status();
}

absl::StatusOr<v1::ModelInfo> MoeClient::GetModelInfo() {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::ModelInfo info;
  grpc::Status status = stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<v1::GetExpertWeightsResponse> MoeClient::GetExpertWeights(int layer, int expert) {
  int64_t server_limit = 0, bytes = 0;
  {
    std::lock_guard<std::mutex> lock(info_mu_);
    if (!info_.has_value()) {
      absl::StatusOr<v1::ModelInfo> info = GetModelInfo();
      if (!info.ok()) return info.status();
      info_ = *std::move(info);
    }
    server_limit = info_->max_message_bytes();
    bytes = 3 * static_cast<int64_t>(info_->hidden()) * info_->intermediate() * 2;
  }
  // The unary reply carries both tensors plus a little framing.
  constexpr int64_t kFraming = 1024;
  const int64_t limit = server_limit > 0 ? std::min(server_limit, options_.max_message_bytes)
                                         : options_.max_message_bytes;
  if (bytes + kFraming <= limit) return GetExpertWeightsUnary(layer, expert);
  return StreamExpertWeights(layer, expert, std::min<int64_t>(limit - kFraming, 1 << 20));
}

absl::StatusOr<v1::GetExpertWeightsResponse> MoeClient::StreamExpertWeights(int layer, int expert,
                                                                            int64_t chunk_bytes) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::StreamExpertWeightsRequest request;
  request.set_layer(layer);
  request.set_expert(expert);
  request.set_chunk_bytes(chunk_bytes);
  std::unique_ptr<grpc::ClientReader<v1::ExpertWeightsChunk>> reader =
      stub_->StreamExpertWeights(&context, request);
  v1::GetExpertWeightsResponse response;
  std::string error;
  int current = -1;  // 0: w13, 1: w2
  int64_t expected_bytes = 0;
  v1::ExpertWeightsChunk chunk;
  while (error.empty() && reader->Read(&chunk)) {
    const int index = chunk.tensor() == "w13" ? 0 : chunk.tensor() == "w2" ? 1 : -1;
    v1::Tensor* t = index == 0 ? response.mutable_w13() : response.mutable_w2();
    if (index < 0 || index < current) {
      error = absl::StrCat("unexpected chunk of tensor '", chunk.tensor(), "'");
      break;
    }
    if (index != current) {  // the first chunk of a tensor: its dtype and shape
      if (current == 0 && static_cast<int64_t>(response.w13().data().size()) != expected_bytes) {
        error = "w13 ended early";
        break;
      }
      if (current < 0 && index != 0) {  // w13 comes first, always
        error = "the stream began with w2 (no w13)";
        break;
      }
      current = index;
      // Two dims of at most 2^20 each (the server's sizes are far smaller): no overflow.
      bool usable = chunk.dtype() == v1::DTYPE_BF16 && chunk.shape_size() == 2;
      expected_bytes = 2;
      for (int64_t d : chunk.shape()) {
        usable = usable && d >= 0 && d <= (int64_t{1} << 20);
        if (usable) expected_bytes *= d;
      }
      if (!usable) {
        error = absl::StrCat(chunk.tensor(), " has an unusable dtype or shape");
        break;
      }
      t->set_dtype(chunk.dtype());
      *t->mutable_shape() = chunk.shape();
      t->mutable_data()->reserve(static_cast<size_t>(expected_bytes));
    }
    if (chunk.offset() != static_cast<int64_t>(t->data().size()) ||
        static_cast<int64_t>(t->data().size() + chunk.data().size()) > expected_bytes) {
      error = absl::StrCat(chunk.tensor(), ": chunk at byte ", chunk.offset(), " of ",
                           chunk.data().size(), " bytes; expected byte ", t->data().size(), " of ",
                           expected_bytes);
      break;
    }
    t->mutable_data()->append(chunk.data());
  }
  if (!error.empty()) {
    context.TryCancel();
    reader->Finish();
    return absl::DataLossError(absl::StrCat("StreamExpertWeights: ", error));
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (current != 1 || static_cast<int64_t>(response.w2().data().size()) != expected_bytes) {
    return absl::DataLossError("StreamExpertWeights: the stream ended before w2 was complete");
  }
  return response;
}

absl::StatusOr<v1::GetExpertWeightsResponse> MoeClient::GetExpertWeightsUnary(int layer,
                                                                              int expert) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::GetExpertWeightsRequest request;
  request.set_layer(layer);
  request.set_expert(expert);
  v1::GetExpertWeightsResponse response;
  grpc::Status status = stub_->GetExpertWeights(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

namespace {

// Checks `args`' sizes against each other.
absl::Status ValidateForwardArgs(const ForwardArgs& args) {
  if (args.hidden_dtype != v1::DTYPE_BF16 && args.hidden_dtype != v1::DTYPE_FP16 &&
      args.hidden_dtype != v1::DTYPE_FP32) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_dtype is ", DTypeName(args.hidden_dtype),
                                                   "; expected bf16, fp16 or fp32"));
  }
  if (args.num_tokens < 0 || args.hidden <= 0 || args.topk <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad shape: num_tokens=", args.num_tokens,
                                                   " hidden=", args.hidden, " topk=", args.topk));
  }
  const int64_t hidden_bytes = args.num_tokens * args.hidden * DTypeSize(args.hidden_dtype);
  if (static_cast<int64_t>(args.hidden_bytes.size()) != hidden_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_bytes has ", args.hidden_bytes.size(), " bytes; [", args.num_tokens, ", ",
        args.hidden, "] ", DTypeName(args.hidden_dtype), " needs ", hidden_bytes));
  }
  const size_t routes = static_cast<size_t>(args.num_tokens * args.topk);
  if (args.topk_ids.size() != routes || args.topk_weights.size() != routes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "topk_ids has ", args.topk_ids.size(), " and topk_weights ", args.topk_weights.size(),
        " elements; [", args.num_tokens, ", ", args.topk, "] needs ", routes));
  }
  return absl::OkStatus();
}

grpc::Slice CopyToSlice(const void* data, size_t size) {
  return size == 0 ? grpc::Slice() : grpc::Slice(data, size);
}

}  // namespace

absl::StatusOr<v1::ForwardRequest> MoeClient::BuildForwardRequest(const ForwardArgs& args) {
  if (absl::Status s = ValidateForwardArgs(args); !s.ok()) return s;
  const size_t routes = static_cast<size_t>(args.num_tokens * args.topk);
  v1::ForwardRequest request;
  request.set_layer(args.layer);
  request.set_request_id(args.request_id);
  request.set_return_timings(args.return_timings);
  request.set_return_host_timings(args.return_host_timings);
  v1::Tensor* h = request.mutable_hidden_states();
  h->set_dtype(args.hidden_dtype);
  h->add_shape(args.num_tokens);
  h->add_shape(args.hidden);
  h->set_data(args.hidden_bytes.data(), args.hidden_bytes.size());
  v1::Tensor* ids = request.mutable_topk_ids();
  ids->set_dtype(v1::DTYPE_INT32);
  ids->add_shape(args.num_tokens);
  ids->add_shape(args.topk);
  ids->set_data(reinterpret_cast<const char*>(args.topk_ids.data()), routes * sizeof(int32_t));
  v1::Tensor* w = request.mutable_topk_weights();
  w->set_dtype(v1::DTYPE_FP32);
  w->add_shape(args.num_tokens);
  w->add_shape(args.topk);
  w->set_data(reinterpret_cast<const char*>(args.topk_weights.data()), routes * sizeof(float));
  return request;
}

absl::StatusOr<grpc::ByteBuffer> MoeClient::EncodeForwardRequest(const ForwardArgs& args) {
  if (absl::Status s = ValidateForwardArgs(args); !s.ok()) return s;
  v1::ForwardRequest header;
  header.set_layer(args.layer);
  header.set_request_id(args.request_id);
  header.set_return_timings(args.return_timings);
  header.set_return_host_timings(args.return_host_timings);
  const auto set = [&args](v1::DType dtype, int64_t cols, v1::Tensor* t) {
    t->set_dtype(dtype);
    t->add_shape(args.num_tokens);
    t->add_shape(cols);
  };
  set(args.hidden_dtype, args.hidden, header.mutable_hidden_states());
  set(v1::DTYPE_INT32, args.topk, header.mutable_topk_ids());
  set(v1::DTYPE_FP32, args.topk, header.mutable_topk_weights());
  return v1wire::EncodeForwardRequest(
      header, CopyToSlice(args.hidden_bytes.data(), args.hidden_bytes.size()),
      CopyToSlice(args.topk_ids.data(), args.topk_ids.size() * sizeof(int32_t)),
      CopyToSlice(args.topk_weights.data(), args.topk_weights.size() * sizeof(float)));
}

absl::StatusOr<grpc::ByteBuffer> MoeClient::EncodeForwardRequest(
    const v1::ForwardRequest& request) {
  v1::ForwardRequest header = request;
  v1::Tensor* tensors[] = {header.mutable_hidden_states(), header.mutable_topk_ids(),
                           header.mutable_topk_weights()};
  for (v1::Tensor* t : tensors) t->clear_data();
  if (!request.has_hidden_states()) header.clear_hidden_states();
  if (!request.has_topk_ids()) header.clear_topk_ids();
  if (!request.has_topk_weights()) header.clear_topk_weights();
  const auto data = [](const v1::Tensor& t) {
    return CopyToSlice(t.data().data(), t.data().size());
  };
  return v1wire::EncodeForwardRequest(header, data(request.hidden_states()),
                                      data(request.topk_ids()), data(request.topk_weights()));
}

v1::RegionRef MakeRegionRef(const std::string& name, int64_t offset, int64_t byte_size) {
  v1::RegionRef ref;
  ref.set_name(name);
  ref.set_offset(offset);
  ref.set_byte_size(byte_size);
  return ref;
}

absl::StatusOr<v1::ForwardRequest> MoeClient::BuildForwardRequest(const ForwardRegionArgs& args) {
  if (args.hidden_dtype != v1::DTYPE_BF16 && args.hidden_dtype != v1::DTYPE_FP16 &&
      args.hidden_dtype != v1::DTYPE_FP32) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_dtype is ", DTypeName(args.hidden_dtype),
                                                   "; expected bf16, fp16 or fp32"));
  }
  if (args.topk_ids_dtype != v1::DTYPE_INT32 && args.topk_ids_dtype != v1::DTYPE_INT64) {
    return absl::InvalidArgumentError("topk_ids_dtype: expected int32 or int64");
  }
  if (args.num_tokens < 0 || args.hidden <= 0 || args.topk <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad shape: num_tokens=", args.num_tokens,
                                                   " hidden=", args.hidden, " topk=", args.topk));
  }
  const int64_t hidden_bytes = args.num_tokens * args.hidden * DTypeSize(args.hidden_dtype);
  const int64_t routes = args.num_tokens * args.topk;
  const int64_t ids_bytes = routes * (args.topk_ids_dtype == v1::DTYPE_INT64 ? 8 : 4);
  const auto check = [](const char* what, const v1::RegionRef& ref, int64_t want) {
    if (ref.name().empty() || ref.byte_size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": region '", ref.name(), "' of ",
                                                     ref.byte_size(), " bytes; expected a named ",
                                                     "region range of ", want, " bytes"));
    }
    return absl::OkStatus();
  };
  for (absl::Status s : {check("hidden_states", args.hidden_states, hidden_bytes),
                         check("topk_ids", args.topk_ids, ids_bytes),
                         check("topk_weights", args.topk_weights, routes * 4),
                         check("output", args.output, hidden_bytes)}) {
    if (!s.ok()) return s;
  }
  v1::ForwardRequest request;
  request.set_layer(args.layer);
  request.set_request_id(args.request_id);
  request.set_return_timings(args.return_timings);
  request.set_return_host_timings(args.return_host_timings);
  const auto set = [&args](v1::DType dtype, int64_t cols, const v1::RegionRef& ref, v1::Tensor* t) {
    t->set_dtype(dtype);
    t->add_shape(args.num_tokens);
    t->add_shape(cols);
    *t->mutable_region() = ref;
  };
  set(args.hidden_dtype, args.hidden, args.hidden_states, request.mutable_hidden_states());
  set(args.topk_ids_dtype, args.topk, args.topk_ids, request.mutable_topk_ids());
  set(v1::DTYPE_FP32, args.topk, args.topk_weights, request.mutable_topk_weights());
  *request.mutable_output_region() = args.output;
  return request;
}

absl::StatusOr<ForwardResult> MoeClient::Forward(const ForwardRegionArgs& args) {
  absl::StatusOr<v1::ForwardRequest> request = BuildForwardRequest(args);
  if (!request.ok()) return request.status();
  return Forward(*request);
}

absl::Status MoeClient::RegisterSystemSharedMemory(const std::string& name, const std::string& key,
                                                   int64_t offset, int64_t byte_size) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::RegisterSystemSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  v1::RegisterSharedMemoryResponse response;
  return FromGrpcStatus(stub_->RegisterSystemSharedMemory(&context, request, &response));
}

absl::StatusOr<v1::RegisterForwardChannelResponse> MoeClient::RegisterForwardChannel(
    const std::string& name, const std::string& key, int64_t byte_size) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::RegisterForwardChannelRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_byte_size(byte_size);
  v1::RegisterForwardChannelResponse response;
  absl::Status s = FromGrpcStatus(stub_->RegisterForwardChannel(&context, request, &response));
  if (!s.ok()) return s;
  return response;
}

absl::Status MoeClient::UnregisterForwardChannel(const std::string& name) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::UnregisterForwardChannelRequest request;
  request.set_name(name);
  v1::UnregisterForwardChannelResponse response;
  return FromGrpcStatus(stub_->UnregisterForwardChannel(&context, request, &response));
}

absl::Status MoeClient::RegisterCudaSharedMemory(const std::string& name,
                                                 absl::string_view raw_handle, int device_id,
                                                 int64_t byte_size) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::RegisterCudaSharedMemoryRequest request;
  request.set_name(name);
  request.set_raw_handle(raw_handle.data(), raw_handle.size());
  request.set_device_id(device_id);
  request.set_byte_size(byte_size);
  v1::RegisterSharedMemoryResponse response;
  return FromGrpcStatus(stub_->RegisterCudaSharedMemory(&context, request, &response));
}

absl::Status MoeClient::UnregisterSharedMemory(const std::string& name) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  v1::UnregisterSharedMemoryResponse response;
  return FromGrpcStatus(stub_->UnregisterSharedMemory(&context, request, &response));
}

absl::StatusOr<v1::SharedMemoryStatusResponse> MoeClient::SharedMemoryStatus(
    const std::string& name) {
  grpc::ClientContext context;
  PrepareContext(&context);
  v1::SharedMemoryStatusRequest request;
  request.set_name(name);
  v1::SharedMemoryStatusResponse response;
  grpc::Status status = stub_->SharedMemoryStatus(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<ForwardResult> MoeClient::Forward(const ForwardArgs& args) {
  absl::StatusOr<grpc::ByteBuffer> request = EncodeForwardRequest(args);
  if (!request.ok()) return request.status();
  return Forward(*request);
}

absl::StatusOr<ForwardResult> MoeClient::Forward(const v1::ForwardRequest& request) {
  absl::StatusOr<grpc::ByteBuffer> encoded = EncodeForwardRequest(request);
  if (!encoded.ok()) return encoded.status();
  return Forward(*encoded);
}

absl::StatusOr<ForwardResult> MoeClient::Forward(const grpc::ByteBuffer& request, bool copy_output,
                                                 absl::Duration deadline) {
  grpc::ClientContext context;
  PrepareContext(&context, deadline);
  grpc::ByteBuffer response;
  grpc::Status status;
  const absl::Time start = absl::Now();
  {
    // Waited for on a completion queue that this thread polls, so gRPC reads the answer on this
    // thread: a callback would run on one of gRPC's threads and then have to wake this one
    // (tests/benchmarks/transport/RESULTS.md, 2026-12-04 11:05).
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        generic_stub_->PrepareUnaryCall(&context, "/moeserve.v1.MoeService/Forward", request, &cq);
    call->StartCall();
    call->Finish(&response, &status, nullptr);
    void* tag = nullptr;
    bool ok = false;
    bool got = false;
    bool shut_down = false;
    if (options_.spin_wait > absl::ZeroDuration()) {
      const absl::Time spin_end = start + options_.spin_wait;
      const gpr_timespec now = gpr_time_0(GPR_CLOCK_MONOTONIC);  // poll: return at once
      while (!got && !shut_down && absl::Now() < spin_end) {
        switch (cq.AsyncNext(&tag, &ok, now)) {
          case grpc::CompletionQueue::GOT_EVENT:
            got = true;
            break;
          case grpc::CompletionQueue::SHUTDOWN:
            shut_down = true;
            break;
          case grpc::CompletionQueue::TIMEOUT:
            break;
        }
      }
    }
    if (!got && !shut_down) got = cq.Next(&tag, &ok);
    cq.Shutdown();
    for (void* t; cq.Next(&t, &ok);) {
    }
    if (!got) return absl::InternalError("Forward: the call's completion queue shut down");
  }
  const absl::Duration latency = absl::Now() - start;
  if (!status.ok()) return FromGrpcStatus(status);
  return DecodeForwardResult(response, copy_output, latency);
}

void MoeClient::StartForward(const grpc::ByteBuffer& request, grpc::CompletionQueue* cq,
                             QueuedForward* call, void* tag, absl::Duration deadline) {
  PrepareContext(&call->context, deadline);
  call->start = absl::Now();
  call->reader = generic_stub_->PrepareUnaryCall(&call->context, "/moeserve.v1.MoeService/Forward",
                                                 request, cq);
  call->reader->StartCall();
  call->reader->Finish(&call->response, &call->status, tag);
}

// The completion queue ForwardAsync's calls end on and the thread that answers them. Its
// destructor shuts the queue down and joins the thread, which first sees every call in flight
// end and runs its `done`.
struct MoeClient::AsyncCalls {
  struct Call {
    QueuedForward rpc;
    std::function<void(absl::StatusOr<ForwardResult>)> done;
    bool copy_output = true;
  };
  grpc::CompletionQueue cq;
  std::thread thread;

  AsyncCalls() : thread([this] { Drain(); }) {}
  ~AsyncCalls() {
    cq.Shutdown();
    thread.join();
  }

  void Drain() {
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
      std::unique_ptr<Call> call(static_cast<Call*>(tag));
      call->done(FinishForward(call->rpc, call->copy_output));
    }
  }
};

MoeClient::~MoeClient() = default;

void MoeClient::ForwardAsync(const grpc::ByteBuffer& request,
                             std::function<void(absl::StatusOr<ForwardResult>)> done,
                             bool copy_output, absl::Duration deadline) {
  AsyncCalls* calls;
  {
    std::lock_guard<std::mutex> lock(async_mu_);
    if (async_ == nullptr) async_ = std::make_unique<AsyncCalls>();
    calls = async_.get();
  }
  auto call = std::make_unique<AsyncCalls::Call>();
  call->done = std::move(done);
  call->copy_output = copy_output;
  AsyncCalls::Call* tag = call.release();  // the queue's Drain takes it back
  StartForward(request, &calls->cq, &tag->rpc, tag, deadline);
}

absl::StatusOr<ForwardResult> FinishForward(const MoeClient::QueuedForward& call,
                                            bool copy_output) {
  const absl::Duration latency = absl::Now() - call.start;
  if (!call.status.ok()) return FromGrpcStatus(call.status);
  return DecodeForwardResult(call.response, copy_output, latency);
}

absl::StatusOr<ForwardResult> DecodeForwardResult(const grpc::ByteBuffer& response,
                                                  bool copy_output, absl::Duration latency) {
  absl::StatusOr<v1wire::ForwardResponseView> decoded = v1wire::DecodeForwardResponse(response);
  if (!decoded.ok()) return absl::InternalError(decoded.status().message());
  if (decoded->header.error_code() != 0) {  // a ForwardStream call that failed
    return absl::Status(static_cast<absl::StatusCode>(decoded->header.error_code()),
                        decoded->header.error_message());
  }
  ForwardResult result;
  result.raw = *std::move(decoded);
  result.output = result.raw.output.header;
  if (copy_output && result.raw.output.data_size > 0) {
    std::string* data = result.output.mutable_data();
    data->resize(result.raw.output.data_size);
    result.raw.output.CopyTo(data->data());
  }
  result.request_id = result.raw.header.request_id();
  result.timings = result.raw.header.timings();
  result.latency = latency;
  return result;
}

// ForwardStream's client half: a callback reactor turned into blocking calls.
class ForwardStream::Reactor final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    write_ok_ = ok;
    cv_.notify_all();
  }
  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    read_ok_ = ok;
    cv_.notify_all();
  }
  void OnDone(const grpc::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = status;
    cv_.notify_all();
  }

  // Drops the hold taken at StartCall (once), so that OnDone can come. Call without mu_ held:
  // OnDone may run on this thread.
  void ReleaseHold() {
    bool release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      release = held_;
      held_ = false;
    }
    if (release) RemoveHold();
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;
  bool writing_ = false, write_ok_ = true;
  bool reading_ = false, read_ok_ = true;
  bool writes_done_ = false;
  bool done_ = false;
  grpc::Status status_;
  grpc::ByteBuffer write_buffer_, read_buffer_;
};

ForwardStream::ForwardStream() : reactor_(std::make_unique<Reactor>()) {}

ForwardStream::~ForwardStream() {
  if (!started_) return;
  {
    std::lock_guard<std::mutex> lock(reactor_->mu_);
    if (reactor_->done_) return;
  }
  context_.TryCancel();
  reactor_->ReleaseHold();
  std::unique_lock<std::mutex> lock(reactor_->mu_);
  reactor_->cv_.wait(lock, [this] { return reactor_->done_ && !reactor_->reading_; });
}

absl::Status ForwardStream::Write(const grpc::ByteBuffer& request) {
  Reactor& r = *reactor_;
  std::unique_lock<std::mutex> lock(r.mu_);
  r.cv_.wait(lock, [&r] { return !r.writing_; });
  if (r.done_ || r.writes_done_ || !r.write_ok_) {
    return absl::FailedPreconditionError("ForwardStream: the stream is closed for writing");
  }
  r.write_buffer_ = request;  // shares the slices (refcounted), no byte copy
  r.writing_ = true;
  r.StartWrite(&r.write_buffer_);
  r.cv_.wait(lock, [&r] { return !r.writing_; });
  if (!r.write_ok_) return absl::UnavailableError("ForwardStream: the stream broke while writing");
  return absl::OkStatus();
}

absl::Status ForwardStream::Write(const ForwardArgs& args) {
  absl::StatusOr<grpc::ByteBuffer> request = MoeClient::EncodeForwardRequest(args);
  if (!request.ok()) return request.status();
  return Write(*request);
}

absl::StatusOr<ForwardResult> ForwardStream::Read(bool copy_output) {
  Reactor& r = *reactor_;
  std::unique_lock<std::mutex> lock(r.mu_);
  const absl::Time start = absl::Now();
  if (!r.done_ && r.read_ok_) {
    r.reading_ = true;
    r.StartRead(&r.read_buffer_);
    r.cv_.wait(lock, [&r] { return !r.reading_; });
  }
  if (r.done_ || !r.read_ok_) {
    // No more answers: the stream ended; its status says why.
    lock.unlock();
    r.ReleaseHold();
    lock.lock();
    r.cv_.wait(lock, [&r] { return r.done_; });
    if (!r.status_.ok()) return FromGrpcStatus(r.status_);
    return absl::OutOfRangeError("ForwardStream: the server ended the stream (no more answers)");
  }
  grpc::ByteBuffer response;
  response.Swap(&r.read_buffer_);
  lock.unlock();
  return DecodeForwardResult(response, copy_output, absl::Now() - start);
}

void ForwardStream::WritesDone() {
  Reactor& r = *reactor_;
  std::unique_lock<std::mutex> lock(r.mu_);
  r.cv_.wait(lock, [&r] { return !r.writing_; });
  if (r.writes_done_ || r.done_) return;
  r.writes_done_ = true;
  r.StartWritesDone();
}

absl::Status ForwardStream::Finish() {
  WritesDone();
  Reactor& r = *reactor_;
  std::unique_lock<std::mutex> lock(r.mu_);
  // Drain answers nobody read so that the server's Finish arrives.
  while (!r.done_ && r.read_ok_) {
    r.reading_ = true;
    r.StartRead(&r.read_buffer_);
    r.cv_.wait(lock, [&r] { return !r.reading_; });
  }
  lock.unlock();
  r.ReleaseHold();
  lock.lock();
  r.cv_.wait(lock, [&r] { return r.done_; });
  return FromGrpcStatus(r.status_);
}

absl::StatusOr<std::unique_ptr<ForwardStream>> MoeClient::OpenForwardStream(
    absl::Duration deadline) {
  auto stream = absl::WrapUnique(new ForwardStream());
  PrepareContext(&stream->context_);
  // A stream outlives any one call: no per-call deadline, only the stream's own.
  stream->context_.set_deadline(deadline == absl::InfiniteDuration()
                                    ? std::chrono::system_clock::time_point::max()
                                    : absl::ToChronoTime(absl::Now() + deadline));
  generic_stub_->PrepareBidiStreamingCall(&stream->context_,
                                          "/moeserve.v1.MoeService/ForwardStream",
                                          grpc::StubOptions(), stream->reactor_.get());
  // Reads and writes start from the caller's threads, outside the reactions: the hold keeps
  // OnDone from coming before they do (released once the stream has ended).
  stream->reactor_->held_ = true;
  stream->reactor_->AddHold();
  stream->reactor_->StartCall();
  stream->started_ = true;
  return stream;
}

}  // namespace moeserve::client
