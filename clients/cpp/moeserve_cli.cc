// moeserve-cli: health checks, model info, single forwards (optionally checked against an
// independent client-side reference) and a bounded closed-loop load generator.
//
//   moeserve-cli health  --target HOST:PORT [--service NAME]
//   moeserve-cli info    --target HOST:PORT
//   moeserve-cli forward --target HOST:PORT --layer L --tokens M --dtype bf16|fp16|fp32 --seed S
//                        [--input_file F] [--output_file F] [--check --tolerance T]
//   moeserve-cli load    --target HOST:PORT --requests N --concurrency C --tokens M
//                        [--max_seconds S] [--check_answers]
// Every command takes --tls / --tls_ca / --tls_cert / --tls_key / --tls_server_name and
// --auth_token_file for servers that require them (docs/security.md). forward --check needs a
// server started with --enable_get_expert_weights; experts larger than a message are streamed.
//   forward / load --shm: tensors and answers go through a POSIX shared-memory region this
//   client creates and registers (the server must be on this host, run as the same user, with
//   --enable_shared_memory); only region references travel over gRPC.
//   load --cuda_region: the same with the tensors and answers in this client's GPU memory
//   (--cuda_device), exported with cudaIpcGetMemHandle and registered as a CUDA region (server
//   on this host, cuda backend, --enable_shared_memory; a build with MOESERVE_ENABLE_CUDA).
//
// Exit codes: 0 success; 1 the check failed / not SERVING / load errors; 2 usage or RPC error.
//
// --input_file format (raw, little-endian, no header), with H = hidden and K = topk from
// GetModelInfo and M derived from the file size (--tokens is then ignored):
//   hidden_states [M, H] in --dtype (BF16/FP16 as 16-bit patterns, FP32 as IEEE floats), then
//   topk_ids      [M, K] int32, then
//   topk_weights  [M, K] float32.
// --output_file receives the output [M, H] as raw bytes in --dtype.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef MOESERVE_CLI_CUDA
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/cpp/dtype_convert.h"
#include "clients/cpp/forward_channel_client.h"
#include "clients/cpp/moeserve_client.h"
#include "clients/cpp/reference.h"
#include "moeserve/v1/channel_args.h"
#include "moeserve_build_info.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server gRPC address, HOST:PORT");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(30), "Per-call deadline");
ABSL_FLAG(int64_t, max_message_bytes, 256ll << 20, "Max gRPC message size sent/received");
ABSL_FLAG(bool, wait_for_ready, false, "Wait for the channel to connect instead of failing fast");
ABSL_FLAG(int64_t, client_spin_us, 0,
          "forward/load: a unary Forward polls for its answer this long before it sleeps "
          "(MoeClientOptions::spin_wait); costs a core per waiting caller");
ABSL_FLAG(bool, tls, false, "Connect over TLS (implied by --tls_ca / --tls_cert / --tls_key)");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM roots that verify the server's certificate (empty with --tls: the system's)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate chain, for servers that require one (mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name the server's certificate must carry when it is not --target's host");
ABSL_FLAG(std::string, auth_token_file, "",
          "File whose first token (line) is sent as 'authorization: Bearer <token>' (servers "
          "started with --auth_token_file)");
ABSL_FLAG(std::string, service, "", "health: service name to check ('' = whole server)");
ABSL_FLAG(int32_t, layer, 0, "forward/load: MoE layer index");
ABSL_FLAG(int64_t, tokens, 4, "forward/load: tokens per request (M)");
ABSL_FLAG(std::string, dtype, "bf16", "forward/load: hidden dtype, bf16 | fp16 | fp32");
ABSL_FLAG(uint64_t, seed, 1, "forward/load: seed of the random inputs");
ABSL_FLAG(
    std::string, routing, "uniform",
    "forward/load: uniform (distinct random experts per token) | balanced (the seed's "
    "((token*topk + k)*73 + 19) mod num_experts) | hot (route 0 of every token to --hot_expert, "
    "the rest distinct random)");
ABSL_FLAG(int32_t, hot_expert, 0, "forward/load --routing hot: the hot expert");
ABSL_FLAG(std::string, input_file, "", "forward: raw input file (format in the source header)");
ABSL_FLAG(std::string, output_file, "", "forward: write the output's raw bytes here");
ABSL_FLAG(std::string, request_id, "", "forward: request id (default: cli-<seed>)");
ABSL_FLAG(bool, return_timings, true, "forward/load: ask the server for stage timings");
ABSL_FLAG(bool, host_timings_only, false,
          "forward/load: with --return_timings, ask for the host clock's timings only "
          "(ForwardRequest.return_host_timings): the steps run no stage timers (on a GPU, device "
          "events of about 5 us a one-token step), so server_total_us is an untimed call's; "
          "prepare/experts/finalize read 0 but for the server's sampled steps");
ABSL_FLAG(bool, check, false,
          "forward: fetch the touched experts' weights and compare with a local reference");
ABSL_FLAG(double, tolerance, 1e-2,
          "forward --check, load --check_answers and load --rate: max relative L2 error");
ABSL_FLAG(int64_t, requests, 100, "load: total requests");
ABSL_FLAG(int32_t, concurrency, 4, "load: concurrent closed-loop workers");
ABSL_FLAG(int32_t, connections, 0,
          "load: TCP connections the workers (or the open loop's calls, round-robin) spread over "
          "(0: one per --concurrency worker, as separate frontends have; 1: all share one "
          "HTTP/2 connection)");
ABSL_FLAG(double, max_seconds, 60.0, "load: stop issuing requests after this many seconds");
ABSL_FLAG(int64_t, think_us, 0,
          "load (closed loop): each worker waits this long after an answer before its next call, "
          "as a frontend computes its attention layer between two MoE layers");
ABSL_FLAG(double, rate, 0,
          "load: open loop: send this many calls per second for --max_seconds, whatever the "
          "answers do (0: closed loop with --concurrency workers); every OK answer is checked "
          "against the same input's answer taken before the run. Latencies are printed timed "
          "from each call's actual send (latency_ms) and from when the schedule said it should "
          "leave (latency_from_schedule_ms, which keeps any lag of the senders), and how late the "
          "senders started the calls (send_lag_ms: the client's share of that lag)");
ABSL_FLAG(std::string, grpc_channel_args, "",
          "Further integer gRPC channel arguments, name=value[,name=value...] (e.g. "
          "grpc.http2.max_frame_size=1048576), for tuning the transport");
ABSL_FLAG(int32_t, senders, 1,
          "load --rate: threads that send the open loop's calls (call k from thread k mod N, on "
          "its schedule), 1 to 64");
ABSL_FLAG(int32_t, warmup_calls, 16,
          "load --rate: calls each connection makes before the open loop starts (all connections "
          "at once, each call after the last, untimed), so that the run starts on connected, "
          "warmed connections as a frontend's are; 0 starts on the cold connections (connect and "
          "HTTP/2 windows inside the first second's latencies), 0 to 10000");
ABSL_FLAG(int32_t, completion_threads, 0,
          "load --rate: threads that take the calls' completions, each draining one completion "
          "queue that a share of the connections end on; 0: one per connection (each client's "
          "own)");
ABSL_FLAG(bool, stream, false,
          "load: each worker sends its calls on one ForwardStream (one request, then its answer) "
          "instead of one unary Forward per call");
ABSL_FLAG(int32_t, distinct_inputs, 8, "load: distinct random requests cycled through");
ABSL_FLAG(bool, check_answers, false,
          "load (closed loop, gRPC bytes): every answer must match the first, unloaded answer to "
          "the same request within --tolerance (relative L2); mismatches are counted and fail the "
          "run (a server A/B then doubles as a consistency run)");
ABSL_FLAG(bool, channel, false,
          "load: send the calls through a forward channel (shared memory polled by the server, "
          "no gRPC per call; needs --enable_shared_memory and a same-host server); combine with "
          "--shm / --cuda_region for tensors by region, or alone for inline tensors");
ABSL_FLAG(bool, shm, false,
          "forward/load: pass tensors and answers through a POSIX shared-memory region (server on "
          "this host, same user, --enable_shared_memory)");
ABSL_FLAG(bool, cuda_region, false,
          "load: pass tensors and answers through a CUDA region of this client's GPU memory "
          "(cudaIpcGetMemHandle; server on this host, cuda backend, --enable_shared_memory)");
ABSL_FLAG(int32_t, cuda_device, 0,
          "load --cuda_region: the GPU ordinal of the region, here and on the server");

// clients/ may not include core/ (core/status_macros.h): the same early return, locally.
#define MOESERVE_CLI_RETURN_IF_ERROR(expr)             \
  do {                                                 \
    if (absl::Status _s = (expr); !_s.ok()) return _s; \
  } while (0)

namespace moeserve::client {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitError = 2;

int Fail(const absl::Status& status, absl::string_view what) {
  std::fprintf(stderr, "error: %s: %s\n", std::string(what).c_str(), status.ToString().c_str());
  // What to do about the refusals a secured server gives (docs/security.md).
  if (status.code() == absl::StatusCode::kUnauthenticated) {
    std::fprintf(stderr,
                 "hint: the server requires a bearer token: pass --auth_token_file with a token "
                 "from its --auth_token_file\n");
  } else if (status.code() == absl::StatusCode::kUnavailable &&
             absl::StrContains(status.message(), "not ready yet")) {
    std::fprintf(stderr,
                 "hint: the server is up and still loading its weights; `moeserve-cli health` "
                 "reports SERVING once it is done\n");
  } else if (status.code() == absl::StatusCode::kUnavailable &&
             absl::GetFlag(FLAGS_tls_ca).empty() && !absl::GetFlag(FLAGS_tls)) {
    std::fprintf(stderr,
                 "hint: if the server serves TLS, pass --tls_ca (and --tls_cert/--tls_key if it "
                 "requires a client certificate)\n");
  }
  return kExitError;
}

// The first token of --auth_token_file (blank lines and '#' comments skipped).
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("--auth_token_file: cannot read '", path, "'"));
  for (std::string line; std::getline(f, line);) {
    const size_t begin = line.find_first_not_of(" \t\r");
    if (begin == std::string::npos || line[begin] == '#') continue;
    return line.substr(begin, line.find_last_not_of(" \t\r") + 1 - begin);
  }
  return absl::InvalidArgumentError(absl::StrCat("--auth_token_file: '", path, "' holds no token"));
}

absl::StatusOr<std::unique_ptr<MoeClient>> MakeClient(bool own_connection = false) {
  MoeClientOptions options;
  options.deadline = absl::GetFlag(FLAGS_deadline);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  if (absl::GetFlag(FLAGS_client_spin_us) < 0 || absl::GetFlag(FLAGS_client_spin_us) > 1000000) {
    return absl::InvalidArgumentError(absl::StrCat("--client_spin_us must be in [0, 1000000], got ",
                                                   absl::GetFlag(FLAGS_client_spin_us)));
  }
  options.spin_wait = absl::Microseconds(absl::GetFlag(FLAGS_client_spin_us));
  options.use_tls = absl::GetFlag(FLAGS_tls);
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file); !path.empty()) {
    absl::StatusOr<std::string> token = ReadToken(path);
    if (!token.ok()) return token.status();
    options.auth_token = *std::move(token);
  }
  options.own_connection = own_connection;
  absl::StatusOr<std::vector<std::pair<std::string, int>>> channel_args =
      v1wire::ParseChannelArgs(absl::GetFlag(FLAGS_grpc_channel_args));
  if (!channel_args.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grpc_channel_args: ", channel_args.status().message()));
  }
  options.channel_args = *std::move(channel_args);
  return MoeClient::Create(absl::GetFlag(FLAGS_target), options);
}

// Random inputs as the flags describe: hidden ~ N(0, 1) (then rounded to `dtype`), experts per
// token chosen by --routing (default: `topk` distinct experts drawn uniformly), weights = softmax
// of N(0, 1) logits.
struct Inputs {
  int64_t num_tokens = 0;
  std::string hidden_bytes;          // encoded in dtype
  std::vector<float> hidden_values;  // the decoded (exactly what the server sees) values
  std::vector<int32_t> topk_ids;
  std::vector<float> topk_weights;
};

absl::StatusOr<Inputs> RandomInputs(int64_t num_tokens, int64_t hidden, int topk, int num_experts,
                                    v1::DType dtype, uint64_t seed) {
  // Bounded before anything is allocated (a negative count once threw std::length_error); the
  // server refuses what passes its own --max_tokens_per_request by name.
  constexpr int64_t kMaxElements = int64_t{1} << 32;
  if (num_tokens <= 0 || hidden <= 0 || num_tokens > kMaxElements / hidden) {
    return absl::InvalidArgumentError(absl::StrCat("--tokens: got ", num_tokens, ", expected 1 to ",
                                                   kMaxElements / hidden, " (hidden ", hidden,
                                                   ")"));
  }
  if (topk > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk ", topk, " exceeds num_experts ", num_experts));
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Inputs in;
  in.num_tokens = num_tokens;
  std::vector<float> h(static_cast<size_t>(num_tokens * hidden));
  for (float& v : h) v = normal(rng);
  absl::StatusOr<std::string> bytes = EncodeFloats(h.data(), static_cast<int64_t>(h.size()), dtype);
  if (!bytes.ok()) return bytes.status();
  in.hidden_bytes = std::move(*bytes);
  const std::string routing = absl::GetFlag(FLAGS_routing);
  const int hot = absl::GetFlag(FLAGS_hot_expert);
  if (routing != "uniform" && routing != "balanced" && routing != "hot") {
    return absl::InvalidArgumentError(
        absl::StrCat("--routing: got '", routing, "', expected uniform, balanced or hot"));
  }
  if (routing == "hot" && (hot < 0 || hot >= num_experts)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--hot_expert: got ", hot, ", expected [0, ", num_experts, ")"));
  }
  std::vector<int32_t> perm(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (routing == "balanced") {
      for (int k = 0; k < topk; ++k) {
        in.topk_ids.push_back(static_cast<int32_t>(((t * topk + k) * 73 + 19) % num_experts));
      }
    } else {
      for (int e = 0; e < num_experts; ++e) perm[e] = e;
      int first = 0;
      if (routing == "hot") {  // the hot expert first, then distinct others
        std::swap(perm[0], perm[hot]);
        in.topk_ids.push_back(perm[0]);
        first = 1;
      }
      for (int k = first; k < topk; ++k) {  // partial Fisher-Yates: topk distinct experts
        std::uniform_int_distribution<int> pick(k, num_experts - 1);
        std::swap(perm[k], perm[pick(rng)]);
        in.topk_ids.push_back(perm[k]);
      }
    }
    std::vector<double> logits(static_cast<size_t>(topk));
    double max_logit = -1e300, sum = 0.0;
    for (double& l : logits) max_logit = std::max(max_logit, l = normal(rng));
    for (double& l : logits) sum += (l = std::exp(l - max_logit));
    for (double l : logits) in.topk_weights.push_back(static_cast<float>(l / sum));
  }
  return in;
}

absl::StatusOr<Inputs> FileInputs(const std::string& path, int64_t hidden, int topk,
                                  v1::DType dtype) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open --input_file ", path));
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const int64_t per_token = hidden * DTypeSize(dtype) + static_cast<int64_t>(topk) * 8;
  if (data.empty() || static_cast<int64_t>(data.size()) % per_token != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--input_file ", path, " has ", data.size(), " bytes; expected a positive multiple of ",
        per_token, " (per token: hidden ", hidden, " x ", DTypeName(dtype), " + topk ", topk,
        " x (int32 id + float32 weight))"));
  }
  Inputs in;
  in.num_tokens = static_cast<int64_t>(data.size()) / per_token;
  const int64_t hidden_bytes = in.num_tokens * hidden * DTypeSize(dtype);
  const int64_t routes = in.num_tokens * topk;
  in.hidden_bytes = data.substr(0, hidden_bytes);
  in.topk_ids.resize(routes);
  in.topk_weights.resize(routes);
  std::memcpy(in.topk_ids.data(), data.data() + hidden_bytes, routes * 4);
  std::memcpy(in.topk_weights.data(), data.data() + hidden_bytes + routes * 4, routes * 4);
  return in;
}

absl::Status DecodeHidden(Inputs& in, int64_t hidden, v1::DType dtype) {
  v1::Tensor t;
  t.set_dtype(dtype);
  t.add_shape(in.num_tokens);
  t.add_shape(hidden);
  t.set_data(in.hidden_bytes);
  absl::StatusOr<std::vector<float>> values = DecodeFloats(t);
  if (!values.ok()) return values.status();
  in.hidden_values = std::move(*values);
  return absl::OkStatus();
}

// return_timings / return_host_timings of a request, from --return_timings and
// --host_timings_only.
template <typename Args>
void SetTimingsFromFlags(Args* args) {
  const bool timings = absl::GetFlag(FLAGS_return_timings);
  const bool host_only = absl::GetFlag(FLAGS_host_timings_only);
  args->return_timings = timings && !host_only;
  args->return_host_timings = timings && host_only;
}

ForwardArgs MakeArgs(const Inputs& in, int64_t hidden, int topk, v1::DType dtype) {
  ForwardArgs args;
  args.layer = absl::GetFlag(FLAGS_layer);
  args.hidden_dtype = dtype;
  args.num_tokens = in.num_tokens;
  args.hidden = hidden;
  args.hidden_bytes = in.hidden_bytes;
  args.topk = topk;
  args.topk_ids = in.topk_ids;
  args.topk_weights = in.topk_weights;
  SetTimingsFromFlags(&args);
  return args;
}

// A POSIX shared-memory object this client creates, maps and registers with the server as one
// region. The name is unlinked as soon as the server has mapped it, so nothing is left behind
// if the client dies; Unregister() lets the server drop it.
class ShmArena {
 public:
  static absl::StatusOr<std::unique_ptr<ShmArena>> Create(MoeClient* client, int64_t bytes) {
    auto arena = std::unique_ptr<ShmArena>(new ShmArena());
    arena->client_ = client;
    arena->bytes_ = std::max<int64_t>(bytes, 1);
    static std::atomic<int> counter{0};
    const std::string suffix = absl::StrCat(getpid(), "_", counter++);
    const std::string key = absl::StrCat("/moeserve_cli_", suffix);
    arena->name_ = absl::StrCat("moeserve-cli-", suffix);
    const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      return absl::UnavailableError(absl::StrCat("shm_open(", key, "): ", std::strerror(errno)));
    }
    void* p = MAP_FAILED;
    if (ftruncate(fd, arena->bytes_) == 0) {
      p = mmap(nullptr, arena->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    const int err = errno;
    close(fd);
    if (p == MAP_FAILED) {
      shm_unlink(key.c_str());
      return absl::UnavailableError(absl::StrCat("sizing or mapping ", arena->bytes_, " bytes of ",
                                                 key, ": ", std::strerror(err)));
    }
    arena->data_ = static_cast<char*>(p);
    const absl::Status s = client->RegisterSystemSharedMemory(arena->name_, key, 0, arena->bytes_);
    shm_unlink(key.c_str());
    if (!s.ok()) return s;
    arena->registered_ = true;
    return arena;
  }
  ~ShmArena() {
    Unregister().IgnoreError();
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  absl::Status Unregister() {
    if (!registered_) return absl::OkStatus();
    registered_ = false;
    return client_->UnregisterSharedMemory(name_);
  }
  char* data() const { return data_; }
  const std::string& name() const { return name_; }
  absl::Status Write(int64_t offset, const void* src, size_t n) const {
    std::memcpy(data_ + offset, src, n);
    return absl::OkStatus();
  }

 private:
  ShmArena() = default;
  MoeClient* client_ = nullptr;
  std::string name_;
  int64_t bytes_ = 0;
  char* data_ = nullptr;
  bool registered_ = false;
};

// One cudaMalloc'd block on --cuda_device registered with the server as a CUDA region (the
// cudaIpcMemHandle_t of its base). Without MOESERVE_CLI_CUDA, or without a GPU, Create refuses.
class CudaArena {
 public:
  static absl::StatusOr<std::unique_ptr<CudaArena>> Create(MoeClient* client, int64_t bytes,
                                                           int device) {
#ifdef MOESERVE_CLI_CUDA
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      return absl::FailedPreconditionError("--cuda_region: no CUDA device on this machine");
    }
    if (device < 0 || device >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("--cuda_device: got ", device, ", this machine has ", count, " GPUs"));
    }
    auto arena = std::unique_ptr<CudaArena>(new CudaArena());
    arena->client_ = client;
    arena->bytes_ = std::max<int64_t>(bytes, 1);
    arena->name_ = absl::StrCat("moeserve-cli-cuda-", getpid());
    if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
      return CudaError("cudaSetDevice", e);
    void* p = nullptr;
    if (cudaError_t e = cudaMalloc(&p, arena->bytes_); e != cudaSuccess) {
      return CudaError("cudaMalloc", e);
    }
    arena->data_ = static_cast<char*>(p);
    cudaIpcMemHandle_t handle;
    if (cudaError_t e = cudaIpcGetMemHandle(&handle, p); e != cudaSuccess) {
      return CudaError("cudaIpcGetMemHandle", e);
    }
    MOESERVE_CLI_RETURN_IF_ERROR(client->RegisterCudaSharedMemory(
        arena->name_, absl::string_view(reinterpret_cast<const char*>(&handle), sizeof(handle)),
        device, arena->bytes_));
    arena->registered_ = true;
    return arena;
#else
    (void)client, (void)bytes, (void)device;
    return absl::FailedPreconditionError(
        "--cuda_region: this moeserve-cli was built without CUDA (MOESERVE_ENABLE_CUDA=OFF)");
#endif
  }
  ~CudaArena() {
    Unregister().IgnoreError();
#ifdef MOESERVE_CLI_CUDA
    if (data_ != nullptr) cudaFree(data_);
#endif
  }
  absl::Status Unregister() {
    if (!registered_) return absl::OkStatus();
    registered_ = false;
    return client_->UnregisterSharedMemory(name_);
  }
  const std::string& name() const { return name_; }
  absl::Status Write(int64_t offset, const void* src, size_t n) const {
#ifdef MOESERVE_CLI_CUDA
    if (cudaError_t e = cudaMemcpy(data_ + offset, src, n, cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      return CudaError("cudaMemcpy", e);
    }
    return absl::OkStatus();
#else
    (void)offset, (void)src, (void)n;
    return absl::FailedPreconditionError("built without CUDA");
#endif
  }

 private:
  CudaArena() = default;
#ifdef MOESERVE_CLI_CUDA
  static absl::Status CudaError(const char* what, cudaError_t e) {
    return absl::InternalError(absl::StrCat("--cuda_region: ", what, ": ", cudaGetErrorString(e)));
  }
#endif
  MoeClient* client_ = nullptr;
  std::string name_;
  int64_t bytes_ = 0;
  char* data_ = nullptr;
  bool registered_ = false;
};

int64_t Align64(int64_t n) { return (n + 63) / 64 * 64; }

// Where one request's tensors sit in an arena: hidden, ids, weights, each 64-byte aligned.
struct ShmLayout {
  int64_t hidden_bytes = 0, routing_bytes = 0;
  int64_t input_block() const { return Align64(hidden_bytes) + 2 * Align64(routing_bytes); }
};

// Copies `in` into `arena` at `base` (ShmLayout) and returns the Forward naming it, answered at
// `out_offset`.
template <typename Arena>
absl::StatusOr<ForwardRegionArgs> PlaceInArena(const Inputs& in, const Arena& arena, int64_t base,
                                               int64_t out_offset, int64_t hidden, int topk,
                                               v1::DType dtype) {
  ShmLayout layout;
  layout.hidden_bytes = static_cast<int64_t>(in.hidden_bytes.size());
  layout.routing_bytes = in.num_tokens * topk * 4;
  const int64_t ids_at = base + Align64(layout.hidden_bytes);
  const int64_t w_at = ids_at + Align64(layout.routing_bytes);
  MOESERVE_CLI_RETURN_IF_ERROR(arena.Write(base, in.hidden_bytes.data(), layout.hidden_bytes));
  MOESERVE_CLI_RETURN_IF_ERROR(arena.Write(ids_at, in.topk_ids.data(), layout.routing_bytes));
  MOESERVE_CLI_RETURN_IF_ERROR(arena.Write(w_at, in.topk_weights.data(), layout.routing_bytes));
  ForwardRegionArgs args;
  args.layer = absl::GetFlag(FLAGS_layer);
  args.hidden_dtype = dtype;
  args.num_tokens = in.num_tokens;
  args.hidden = hidden;
  args.topk = topk;
  args.hidden_states = MakeRegionRef(arena.name(), base, layout.hidden_bytes);
  args.topk_ids = MakeRegionRef(arena.name(), ids_at, layout.routing_bytes);
  args.topk_weights = MakeRegionRef(arena.name(), w_at, layout.routing_bytes);
  args.output = MakeRegionRef(arena.name(), out_offset, layout.hidden_bytes);
  SetTimingsFromFlags(&args);
  return args;
}

int RunHealth() {
  auto client = MakeClient();
  if (!client.ok()) return Fail(client.status(), "create client");
  auto status = (*client)->Health(absl::GetFlag(FLAGS_service));
  if (!status.ok()) {
    std::printf("UNKNOWN\n");
    return Fail(status.status(), "health check");
  }
  std::printf("%s\n", ServingStatusName(*status).c_str());
  return *status == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk : kExitFailed;
}

std::string DTypeList(const google::protobuf::RepeatedField<int>& dtypes) {
  std::vector<std::string> names;
  for (int d : dtypes) names.push_back(DTypeName(static_cast<v1::DType>(d)));
  return absl::StrJoin(names, ", ");
}

int RunInfo() {
  auto client = MakeClient();
  if (!client.ok()) return Fail(client.status(), "create client");
  auto info = (*client)->GetModelInfo();
  if (!info.ok()) return Fail(info.status(), "GetModelInfo");
  const v1::ModelInfo& m = *info;
  std::printf("model_name:               %s\n", m.model_name().c_str());
  std::printf("num_layers:               %d\n", m.num_layers());
  std::printf("moe_layers:               [%s]\n", absl::StrJoin(m.moe_layers(), ", ").c_str());
  std::printf("num_experts:              %d\n", m.num_experts());
  std::printf("topk:                     %d\n", m.topk());
  std::printf("hidden:                   %d\n", m.hidden());
  std::printf("intermediate:             %d\n", m.intermediate());
  std::printf("activation:               %s\n", m.activation().c_str());
  std::printf("weight_format:            %s\n", m.weight_format().c_str());
  std::printf("accepted_hidden_dtypes:   [%s]\n", DTypeList(m.accepted_hidden_dtypes()).c_str());
  std::printf("accepted_topk_ids_dtypes: [%s]\n", DTypeList(m.accepted_topk_ids_dtypes()).c_str());
  std::printf("backend:                  %s\n", m.backend().c_str());
  std::printf("num_ranks:                %d\n", m.num_ranks());
  std::printf("prepare_finalize:         %s\n", m.prepare_finalize().c_str());
  std::printf("experts:                  %s\n", m.experts().c_str());
  std::printf("max_tokens_per_request:   %lld\n",
              static_cast<long long>(m.max_tokens_per_request()));
  std::printf("max_message_bytes:        %lld\n", static_cast<long long>(m.max_message_bytes()));
  std::printf("placement:                %s\n", m.placement().c_str());
  for (const v1::ExpertPlacement& p : m.expert_placement()) {
    std::printf("  rank %d: experts [%s]\n", p.rank(), absl::StrJoin(p.expert_ids(), ", ").c_str());
  }
  return kExitOk;
}

void PrintTimings(const v1::StageTimings& t) {
  std::printf("server_timings_us: queue=%.1f prepare=%.1f experts=%.1f finalize=%.1f total=%.1f\n",
              t.queue_us(), t.prepare_us(), t.experts_us(), t.finalize_us(), t.total_us());
}

int RunForward() {
  auto dtype = ParseFloatDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(dtype.status(), "--dtype");
  if (absl::GetFlag(FLAGS_input_file).empty() && absl::GetFlag(FLAGS_tokens) <= 0) {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat("--tokens: got ", absl::GetFlag(FLAGS_tokens), ", expected > 0")),
                "flags");
  }
  auto client = MakeClient();
  if (!client.ok()) return Fail(client.status(), "create client");
  auto info = (*client)->GetModelInfo();
  if (!info.ok()) return Fail(info.status(), "GetModelInfo");
  const int64_t hidden = info->hidden();
  const int topk = info->topk();
  const std::string input_file = absl::GetFlag(FLAGS_input_file);
  absl::StatusOr<Inputs> in =
      input_file.empty() ? RandomInputs(absl::GetFlag(FLAGS_tokens), hidden, topk,
                                        info->num_experts(), *dtype, absl::GetFlag(FLAGS_seed))
                         : FileInputs(input_file, hidden, topk, *dtype);
  if (!in.ok()) return Fail(in.status(), "inputs");
  ForwardArgs args = MakeArgs(*in, hidden, topk, *dtype);
  args.request_id = absl::GetFlag(FLAGS_request_id);
  if (args.request_id.empty()) args.request_id = absl::StrCat("cli-", absl::GetFlag(FLAGS_seed));
  absl::StatusOr<ForwardResult> result;
  if (absl::GetFlag(FLAGS_shm)) {
    // Inputs, then the answer, in one region; the answer is copied out into result->output.
    ShmLayout layout;
    layout.hidden_bytes = static_cast<int64_t>(in->hidden_bytes.size());
    layout.routing_bytes = in->num_tokens * topk * 4;
    auto arena = ShmArena::Create(client->get(), layout.input_block() + layout.hidden_bytes);
    if (!arena.ok()) return Fail(arena.status(), "shared memory");
    auto region_args = PlaceInArena(*in, **arena, 0, layout.input_block(), hidden, topk, *dtype);
    if (!region_args.ok()) return Fail(region_args.status(), "shared memory");
    region_args->request_id = args.request_id;
    result = (*client)->Forward(*region_args);
    if (result.ok()) {
      result->output.set_data((*arena)->data() + layout.input_block(), layout.hidden_bytes);
    }
    if (absl::Status s = (*arena)->Unregister(); !s.ok() && result.ok()) result = s;
  } else {
    result = (*client)->Forward(args);
  }
  if (!result.ok()) return Fail(result.status(), "Forward");
  const v1::Tensor& out = result->output;
  std::printf("request_id: %s\n", result->request_id.c_str());
  std::printf("output: dtype=%s shape=[%s] bytes=%zu\n", DTypeName(out.dtype()).c_str(),
              absl::StrJoin(out.shape(), ", ").c_str(), out.data().size());
  if (args.return_timings || args.return_host_timings) PrintTimings(result->timings);
  std::printf("latency_ms=%.3f\n", absl::ToDoubleMilliseconds(result->latency));
  if (out.dtype() != *dtype || out.shape_size() != 2 || out.shape(0) != in->num_tokens ||
      out.shape(1) != hidden) {
    std::fprintf(stderr, "error: output is %s [%s]; expected %s [%lld, %lld]\n",
                 DTypeName(out.dtype()).c_str(), absl::StrJoin(out.shape(), ", ").c_str(),
                 DTypeName(*dtype).c_str(), static_cast<long long>(in->num_tokens),
                 static_cast<long long>(hidden));
    return kExitFailed;
  }
  const std::string output_file = absl::GetFlag(FLAGS_output_file);
  if (!output_file.empty()) {
    std::ofstream f(output_file, std::ios::binary);
    f.write(out.data().data(), static_cast<std::streamsize>(out.data().size()));
    if (!f) return Fail(absl::UnavailableError(output_file), "write --output_file");
  }
  if (!absl::GetFlag(FLAGS_check)) return kExitOk;

  if (absl::Status s = DecodeHidden(*in, hidden, *dtype); !s.ok()) return Fail(s, "decode input");
  std::map<int, ExpertWeightsF32> experts;
  for (int32_t id : std::set<int32_t>(in->topk_ids.begin(), in->topk_ids.end())) {
    if (id < 0) continue;
    auto reply = (*client)->GetExpertWeights(args.layer, id);
    if (!reply.ok()) {
      const int code = Fail(reply.status(), absl::StrCat("GetExpertWeights expert ", id));
      if (reply.status().code() == absl::StatusCode::kFailedPrecondition ||
          reply.status().code() == absl::StatusCode::kPermissionDenied) {
        std::fprintf(stderr,
                     "hint: --check compares against the experts' weights, which this server "
                     "does not hand out: restart it with --enable_get_expert_weights, or run "
                     "forward without --check\n");
      }
      return code;
    }
    auto weights = ExpertWeightsFromProto(*reply);
    if (!weights.ok()) return Fail(weights.status(), absl::StrCat("expert ", id, " weights"));
    experts.emplace(id, std::move(*weights));
  }
  std::vector<float> expected(static_cast<size_t>(in->num_tokens * hidden));
  absl::Status s =
      ReferenceMoeForward(in->hidden_values.data(), in->num_tokens, hidden, in->topk_ids.data(),
                          in->topk_weights.data(), topk, experts, expected.data());
  if (!s.ok()) return Fail(s, "reference");
  auto actual = DecodeFloats(out);
  if (!actual.ok()) return Fail(actual.status(), "decode output");
  const double err =
      RelativeL2Error(actual->data(), expected.data(), static_cast<int64_t>(expected.size()));
  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  std::printf("relative_l2_error=%.6g\n", err);
  if (!(err <= tolerance)) {
    std::fprintf(stderr, "check FAILED: relative_l2_error %.6g > tolerance %.6g\n", err, tolerance);
    return kExitFailed;
  }
  std::printf("check passed (tolerance %.3g, %zu experts fetched)\n", tolerance, experts.size());
  return kExitOk;
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0.0;
  // Nearest rank.
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

// The server's timings of answered calls (their requests ask return_timings), for the report:
// server_total_us, and per stage the p50 (and p99, which shows where a loaded server's tail
// goes).
struct ServerTimes {
  static constexpr const char* kStages[10] = {
      "queue", "prepare",    "experts",     "finalize",     "engine",
      "input", "host_stage", "host_launch", "host_collect", "host_timer"};
  std::vector<double> total;
  std::array<std::vector<double>, 10> stage;

  void Add(const v1::StageTimings& t) {
    total.push_back(t.total_us());
    const double values[10] = {t.queue_us(),      t.prepare_us(),     t.experts_us(),
                               t.finalize_us(),   t.engine_us(),      t.input_us(),
                               t.host_stage_us(), t.host_launch_us(), t.host_collect_us(),
                               t.host_timer_us()};
    for (size_t i = 0; i < stage.size(); ++i) stage[i].push_back(values[i]);
  }
  void Merge(const ServerTimes& o) {
    total.insert(total.end(), o.total.begin(), o.total.end());
    for (size_t i = 0; i < stage.size(); ++i) {
      stage[i].insert(stage[i].end(), o.stage[i].begin(), o.stage[i].end());
    }
  }
  // Sorts, then prints server_total_us and server_stages_us_p50 (and _p99 if `tails`).
  void Print(bool tails) {
    std::sort(total.begin(), total.end());
    for (auto& v : stage) std::sort(v.begin(), v.end());
    std::printf("server_total_us: p50=%.1f p99=%.1f\n", Percentile(total, 50),
                Percentile(total, 99));
    for (const double p : {50.0, 99.0}) {
      if (p > 50 && !tails) break;
      std::printf("server_stages_us_p%.0f:", p);
      for (size_t i = 0; i < stage.size(); ++i) {
        std::printf(" %s=%.1f", kStages[i], Percentile(stage[i], p));
      }
      std::printf("\n");
    }
  }
};

// What an open-loop answer must match: its input's unloaded answer, as bytes and as floats.
struct ExpectedAnswer {
  std::string bytes;
  std::vector<float> floats;
};

absl::StatusOr<std::vector<float>> AnswerFloats(std::string bytes, v1::DType dtype) {
  v1::Tensor t;
  t.set_dtype(dtype);
  t.add_shape(static_cast<int64_t>(bytes.size() / DTypeSize(dtype)));
  *t.mutable_data() = std::move(bytes);
  return DecodeFloats(t);
}

// Each request's answer before the measured loop (unloaded), as ExpectedAnswer. A call refused
// with RESOURCE_EXHAUSTED is tried again (1 ms apart, for up to 30 s): another client's load may
// already fill the server (several load processes against one server), and the answer to a
// request does not depend on the load.
absl::StatusOr<std::vector<ExpectedAnswer>> UnloadedAnswers(
    MoeClient& client, const std::vector<grpc::ByteBuffer>& requests, v1::DType dtype) {
  std::vector<ExpectedAnswer> expected;
  for (const grpc::ByteBuffer& r : requests) {
    absl::StatusOr<ForwardResult> result = client.Forward(r, /*copy_output=*/true);
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (!result.ok() && absl::IsResourceExhausted(result.status()) && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));
      result = client.Forward(r, /*copy_output=*/true);
    }
    if (!result.ok()) return result.status();
    absl::StatusOr<std::vector<float>> floats = AnswerFloats(result->output.data(), dtype);
    if (!floats.ok()) return floats.status();
    expected.push_back(ExpectedAnswer{result->output.data(), *std::move(floats)});
  }
  return expected;
}

// Relative L2 distance of an answer to the expected one (as floats of `dtype`). The open loop
// checks every answer on the client's completion threads, which it shares with the calls it
// times: a bit-identical answer is told by comparing the received pieces in place, and only
// a differing one is decoded (decoding both sides of every answer, as before, cost the client
// more CPU per call than sending it).
double AnswerDistance(const ForwardResult& got, const ExpectedAnswer& want, v1::DType dtype) {
  const v1wire::WireTensor& out = got.raw.output;
  if (out.data_size != want.bytes.size()) return 1e30;
  size_t at = 0;
  bool same = true;
  for (const absl::Span<const uint8_t>& piece : out.data) {
    if (std::memcmp(piece.data(), want.bytes.data() + at, piece.size()) != 0) {
      same = false;
      break;
    }
    at += piece.size();
  }
  if (same) return 0;
  std::string bytes(out.data_size, '\0');
  out.CopyTo(bytes.data());
  const auto a_or = AnswerFloats(std::move(bytes), dtype);
  if (!a_or.ok() || a_or->size() != want.floats.size()) return 1e30;
  const std::vector<float>& a = *a_or;
  const std::vector<float>& b = want.floats;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Open loop: calls leave at a fixed rate, whatever the answers do (an overload run). Reports
// answered / refused by code, the answered calls' latency, and wrong answers (relative L2 >
// --tolerance against the same input's unloaded answer).
// The calls go round-robin over `clients` (their own connections: overload comes from many
// frontends, and one HTTP/2 connection saturates before the server does).
int RunOpenLoop(const std::vector<MoeClient*>& clients,
                const std::vector<grpc::ByteBuffer>& requests, v1::DType dtype,
                int64_t num_tokens) {
  MoeClient& client = *clients.front();
  const double rate = absl::GetFlag(FLAGS_rate);
  const double seconds = absl::GetFlag(FLAGS_max_seconds);
  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  absl::StatusOr<std::vector<ExpectedAnswer>> unloaded = UnloadedAnswers(client, requests, dtype);
  if (!unloaded.ok()) return Fail(unloaded.status(), "unloaded Forward");
  const std::vector<ExpectedAnswer>& expected = *unloaded;
  // Warm every connection (a channel connects on its first call), all at once.
  const int warmup = absl::GetFlag(FLAGS_warmup_calls);
  std::atomic<int64_t> warm_refused{0}, warm_failed{0};
  if (warmup > 0) {
    std::vector<std::thread> warming;
    for (size_t c = 0; c < clients.size(); ++c) {
      warming.emplace_back([&, c] {
        for (int i = 0; i < warmup; ++i) {
          const size_t which = (c + static_cast<size_t>(i)) % requests.size();
          const absl::Status status =
              clients[c]->Forward(requests[which], /*copy_output=*/false).status();
          if (absl::IsResourceExhausted(status)) {
            ++warm_refused;  // a bounded queue refuses a burst: the connection is warm all the same
          } else if (!status.ok()) {
            ++warm_failed;
          }
        }
      });
    }
    for (std::thread& t : warming) t.join();
  }
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int64_t> outstanding{0}, sent{0};
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  const absl::Duration interval = absl::Seconds(1.0 / rate);
  // Call k leaves at start + k x interval, from sender k mod `senders` on connection k mod
  // `clients` (--senders: starting a gRPC call costs its thread tens of us; one sender ran at
  // 82% of a core for 21,000 calls/s on an H200 host and kept the schedule, four read a higher
  // p99 there, 2026-12-05 02:45: not understood, so one is the default).
  const int64_t senders =
      std::clamp<int64_t>(absl::GetFlag(FLAGS_senders), 1, static_cast<int64_t>(clients.size()));
  // The answered calls' latencies by the second they were sent in: where a tail sits in the run
  // (its start: cold caches, first captures; throughout: the steady state).
  const size_t num_seconds = static_cast<size_t>(std::ceil(seconds)) + 1;
  // What the completions record, one tally per completion thread (no lock shared between them
  // per call: 32 threads taking one at 21,000 calls/s queue on it), merged at the end.
  constexpr int kNumCodes = 17;  // absl::StatusCode 0 (OK) to 16 (UNAUTHENTICATED)
  struct Tally {
    std::vector<double> latencies_ms;
    // From the call's scheduled send time to its answer: includes any lag of the sender behind
    // the schedule, which the latency from the actual send omits (coordinated omission).
    std::vector<double> scheduled_ms;
    std::vector<std::vector<double>> by_second;
    ServerTimes server;
    std::array<int64_t, kNumCodes> codes{};  // by absl::StatusCode
    int64_t wrong = 0;
    std::string first_error;
  };
  std::vector<std::unique_ptr<Tally>> tallies;  // guarded by mu
  auto record = [&](size_t which, int64_t k, absl::StatusOr<ForwardResult> result) {
    const absl::Time answered = absl::Now();
    const size_t second = static_cast<size_t>(absl::ToDoubleSeconds(k * interval));
    // This run's tally of the calling thread (a thread serves one run: RunOpenLoop runs once).
    thread_local Tally* tally = nullptr;
    if (tally == nullptr) {
      auto fresh = std::make_unique<Tally>();
      fresh->by_second.resize(num_seconds);
      std::lock_guard<std::mutex> lock(mu);
      tallies.push_back(std::move(fresh));
      tally = tallies.back().get();
    }
    const bool bad = result.ok() && AnswerDistance(*result, expected[which], dtype) > tolerance;
    const int code = static_cast<int>(result.status().code());
    ++tally->codes[code >= 0 && code < kNumCodes ? code : 2];  // else UNKNOWN
    if (result.ok()) {
      tally->latencies_ms.push_back(absl::ToDoubleMilliseconds(result->latency));
      tally->scheduled_ms.push_back(absl::ToDoubleMilliseconds(answered - (start + k * interval)));
      tally->by_second[std::min(second, num_seconds - 1)].push_back(tally->latencies_ms.back());
      tally->server.Add(result->timings);
      tally->wrong += bad ? 1 : 0;
    } else if (tally->first_error.empty()) {
      tally->first_error = result.status().ToString();
    }
    if (outstanding.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> lock(mu);  // the waiter checks under it: no lost wake-up
      cv.notify_all();
    }
  };
  // --completion_threads K > 0: K completion queues, connection c's calls end on queue c mod K
  // (fewer threads than connections wake less often for more completions each); 0: each
  // client's own queue and thread (ForwardAsync).
  struct QueuedCall {
    MoeClient::QueuedForward rpc;
    size_t which = 0;
    int64_t k = 0;  // the call's place in the schedule
  };
  const int completion_threads =
      std::min<int>(absl::GetFlag(FLAGS_completion_threads), static_cast<int>(clients.size()));
  std::vector<std::unique_ptr<grpc::CompletionQueue>> queues;
  std::vector<std::thread> draining;
  for (int q = 0; q < completion_threads; ++q) {
    queues.push_back(std::make_unique<grpc::CompletionQueue>());
    draining.emplace_back([&record, cq = queues.back().get()] {
      void* tag = nullptr;
      bool ok = false;
      while (cq->Next(&tag, &ok)) {
        std::unique_ptr<QueuedCall> call(static_cast<QueuedCall*>(tag));
        record(call->which, call->k, FinishForward(call->rpc, /*copy_output=*/false));
      }
    });
  }
  // Per sender: how late each of its calls left (its own vector: no lock per call). A frontend
  // on this schedule sees this lag too; it separates the client's lag from the server's.
  std::vector<std::vector<double>> send_lag_ms(static_cast<size_t>(senders));
  auto send_from = [&](int64_t first) {
    std::vector<double>& lags = send_lag_ms[static_cast<size_t>(first)];
    for (int64_t k = first;; k += senders) {
      const absl::Time next = start + k * interval;
      if (next >= end) break;
      absl::SleepFor(next - absl::Now());
      lags.push_back(std::max(0.0, absl::ToDoubleMilliseconds(absl::Now() - next)));
      const size_t which = static_cast<size_t>(k) % requests.size();
      outstanding.fetch_add(1);
      sent.fetch_add(1);
      const size_t connection = static_cast<size_t>(k) % clients.size();
      if (!queues.empty()) {
        auto call = std::make_unique<QueuedCall>();
        call->which = which;
        call->k = k;
        QueuedCall* tag = call.release();  // its queue's thread takes it back
        clients[connection]->StartForward(requests[which], queues[connection % queues.size()].get(),
                                          &tag->rpc, tag);
        continue;
      }
      clients[connection]->ForwardAsync(
          requests[which],
          [&record, which, k](absl::StatusOr<ForwardResult> result) {
            record(which, k, std::move(result));
          },
          /*copy_output=*/false);
    }
  };
  std::vector<std::thread> sending;
  for (int64_t t = 1; t < senders; ++t) sending.emplace_back(send_from, t);
  send_from(0);
  for (std::thread& t : sending) t.join();
  const double send_s = absl::ToDoubleSeconds(absl::Now() - start);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return outstanding.load() == 0; });
  }
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  for (auto& cq : queues) cq->Shutdown();
  for (std::thread& t : draining) t.join();
  // Every completion has run: the tallies are final (the threads of ForwardAsync's clients
  // wrote theirs before the last decrement).
  std::vector<double> latencies_ms, scheduled_ms;
  std::vector<std::vector<double>> by_second(num_seconds);
  ServerTimes server;
  std::map<std::string, int64_t> codes;
  int64_t wrong = 0;
  std::string first_error;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& t : tallies) {
      latencies_ms.insert(latencies_ms.end(), t->latencies_ms.begin(), t->latencies_ms.end());
      scheduled_ms.insert(scheduled_ms.end(), t->scheduled_ms.begin(), t->scheduled_ms.end());
      for (size_t i = 0; i < num_seconds; ++i) {
        by_second[i].insert(by_second[i].end(), t->by_second[i].begin(), t->by_second[i].end());
      }
      server.Merge(t->server);
      for (int c = 0; c < kNumCodes; ++c) {
        if (t->codes[c] > 0) {
          codes[absl::StatusCodeToString(static_cast<absl::StatusCode>(c))] += t->codes[c];
        }
      }
      wrong += t->wrong;
      if (first_error.empty()) first_error = t->first_error;
    }
  }
  std::sort(latencies_ms.begin(), latencies_ms.end());
  std::sort(scheduled_ms.begin(), scheduled_ms.end());
  const int64_t ok = static_cast<int64_t>(latencies_ms.size());
  int64_t refused = 0, other = 0;
  for (const auto& [code, n] : codes) {
    if (code == "RESOURCE_EXHAUSTED") {
      refused += n;
    } else if (code != "OK") {
      other += n;
    }
  }
  std::printf(
      "load: open loop rate=%.1f/s seconds=%.1f tokens=%lld dtype=%s layer=%d connections=%zu\n",
      rate, seconds, static_cast<long long>(num_tokens), DTypeName(dtype).c_str(),
      absl::GetFlag(FLAGS_layer), clients.size());
  std::printf(
      "warmup: calls_per_connection=%d refused=%lld failed=%lld (before the run, untimed)\n",
      warmup, static_cast<long long>(warm_refused.load()),
      static_cast<long long>(warm_failed.load()));
  std::printf(
      "sent=%lld ok=%lld refused=%lld other_errors=%lld wrong_answers=%lld send_s=%.3f "
      "wall_s=%.3f\n",
      static_cast<long long>(sent.load()), static_cast<long long>(ok),
      static_cast<long long>(refused), static_cast<long long>(other), static_cast<long long>(wrong),
      send_s, wall_s);
  for (const auto& [code, n] : codes) {
    std::printf("  code %s: %lld\n", code.c_str(), static_cast<long long>(n));
  }
  if (!first_error.empty()) std::printf("  first error: %s\n", first_error.c_str());
  std::printf("latency_ms: p50=%.3f p90=%.3f p99=%.3f max=%.3f\n", Percentile(latencies_ms, 50),
              Percentile(latencies_ms, 90), Percentile(latencies_ms, 99),
              latencies_ms.empty() ? 0.0 : latencies_ms.back());
  // The same answers timed from when they were due to leave: what a frontend on this schedule
  // would see, however far the sending fell behind (offered_per_s: the rate it managed).
  std::printf("latency_from_schedule_ms: p50=%.3f p90=%.3f p99=%.3f max=%.3f offered_per_s=%.1f\n",
              Percentile(scheduled_ms, 50), Percentile(scheduled_ms, 90),
              Percentile(scheduled_ms, 99), scheduled_ms.empty() ? 0.0 : scheduled_ms.back(),
              send_s > 0 ? static_cast<double>(sent.load()) / send_s : 0.0);
  std::vector<double> lags;
  for (const auto& v : send_lag_ms) lags.insert(lags.end(), v.begin(), v.end());
  std::sort(lags.begin(), lags.end());
  std::printf("send_lag_ms: p50=%.3f p90=%.3f p99=%.3f max=%.3f n=%zu\n", Percentile(lags, 50),
              Percentile(lags, 90), Percentile(lags, 99), lags.empty() ? 0.0 : lags.back(),
              lags.size());
  std::printf("latency_ms_by_second_sent:");
  for (size_t i = 0; i < by_second.size(); ++i) {
    std::vector<double>& v = by_second[i];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::printf(" s%zu:n=%zu,p50=%.2f,p99=%.2f,max=%.1f", i, v.size(), Percentile(v, 50),
                Percentile(v, 99), v.back());
  }
  std::printf("\n");
  if (absl::GetFlag(FLAGS_return_timings)) server.Print(/*tails=*/true);
  std::printf("throughput: answered_per_s=%.1f tokens_per_s=%.1f\n", ok / wall_s,
              static_cast<double>(ok * num_tokens) / wall_s);
  // Overload may refuse; it must never answer wrongly or fail otherwise.
  return (wrong == 0 && other == 0 && ok > 0) ? kExitOk : kExitFailed;
}

int RunLoad() {
  auto dtype = ParseFloatDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Fail(dtype.status(), "--dtype");
  const int64_t num_requests = absl::GetFlag(FLAGS_requests);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const int64_t num_tokens = absl::GetFlag(FLAGS_tokens);
  const double max_seconds = absl::GetFlag(FLAGS_max_seconds);
  if (num_requests <= 0 || concurrency <= 0 || concurrency > 1024 || num_tokens <= 0 ||
      !(max_seconds > 0)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "need --requests > 0 (got ", num_requests, "), --concurrency in [1, 1024] (",
                    concurrency, "), --tokens > 0 (", num_tokens, "), --max_seconds > 0 (",
                    max_seconds, ")")),
                "flags");
  }
  if (absl::GetFlag(FLAGS_completion_threads) < 0 ||
      absl::GetFlag(FLAGS_completion_threads) > 1024) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--completion_threads: got ", absl::GetFlag(FLAGS_completion_threads),
                    ", expected 0 (one per connection) to 1024")),
                "flags");
  }
  if (absl::GetFlag(FLAGS_warmup_calls) < 0 || absl::GetFlag(FLAGS_warmup_calls) > 10000) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat(
            "--warmup_calls: got ", absl::GetFlag(FLAGS_warmup_calls), ", expected 0 to 10000")),
        "flags");
  }
  if (absl::GetFlag(FLAGS_senders) < 1 || absl::GetFlag(FLAGS_senders) > 64) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--senders: got ", absl::GetFlag(FLAGS_senders), ", expected 1 to 64")),
                "flags");
  }
  if (absl::GetFlag(FLAGS_think_us) < 0 || absl::GetFlag(FLAGS_think_us) > 10000000) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("--think_us: got ", absl::GetFlag(FLAGS_think_us),
                                                ", expected 0 to 10000000 (10 s)")),
        "flags");
  }
  if (absl::GetFlag(FLAGS_connections) < 0 || absl::GetFlag(FLAGS_connections) > 1024) {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat("--connections: got ", absl::GetFlag(FLAGS_connections),
                                 ", expected 0 (one per worker) or a count up to 1024")),
                "flags");
  }
  const bool cuda_region = absl::GetFlag(FLAGS_cuda_region);
  if (cuda_region && absl::GetFlag(FLAGS_shm)) {
    return Fail(absl::InvalidArgumentError("--shm and --cuda_region: pick one way in"), "flags");
  }
  if (absl::GetFlag(FLAGS_rate) > 0 && absl::GetFlag(FLAGS_stream)) {
    return Fail(absl::InvalidArgumentError(
                    "--rate (open loop) sends unary calls; --stream is for the closed loop"),
                "flags");
  }
  const bool check_answers = absl::GetFlag(FLAGS_check_answers);
  if (check_answers && (cuda_region || absl::GetFlag(FLAGS_shm) || absl::GetFlag(FLAGS_channel) ||
                        absl::GetFlag(FLAGS_rate) > 0)) {
    return Fail(absl::InvalidArgumentError(
                    "--check_answers checks closed-loop answers that come back as gRPC bytes: not "
                    "with --shm, --cuda_region, --channel or --rate (--rate checks its own)"),
                "flags");
  }
  auto client = MakeClient();
  if (!client.ok()) return Fail(client.status(), "create client");
  auto info = (*client)->GetModelInfo();
  if (!info.ok()) return Fail(info.status(), "GetModelInfo");

  // A few distinct requests, built once and cycled, so that client-side encoding stays out of
  // the measured loop.
  const int distinct = std::max(1, absl::GetFlag(FLAGS_distinct_inputs));
  // shm: the tensors and answers go by a region (system or CUDA), not as gRPC bytes.
  const bool shm = absl::GetFlag(FLAGS_shm) || cuda_region;
  // requests[w][i]: worker w's i-th request. Over gRPC every worker sends the same bytes; by
  // shared memory the inputs are shared and each worker has its own output range.
  std::vector<std::vector<grpc::ByteBuffer>> requests(shm ? concurrency : 1);
  std::unique_ptr<ShmArena> arena;
  std::unique_ptr<CudaArena> cuda_arena;
  ShmLayout layout;
  layout.hidden_bytes = num_tokens * info->hidden() * DTypeSize(*dtype);
  layout.routing_bytes = num_tokens * info->topk() * 4;
  const int64_t arena_bytes =
      distinct * layout.input_block() + concurrency * Align64(layout.hidden_bytes);
  if (cuda_region) {
    auto created = CudaArena::Create(client->get(), arena_bytes, absl::GetFlag(FLAGS_cuda_device));
    if (!created.ok()) return Fail(created.status(), "CUDA region");
    cuda_arena = std::move(*created);
  } else if (shm) {
    auto created = ShmArena::Create(client->get(), arena_bytes);
    if (!created.ok()) return Fail(created.status(), "shared memory");
    arena = std::move(*created);
  }
  for (int i = 0; i < distinct; ++i) {
    auto in = RandomInputs(num_tokens, info->hidden(), info->topk(), info->num_experts(), *dtype,
                           absl::GetFlag(FLAGS_seed) + i);
    if (!in.ok()) return Fail(in.status(), "inputs");
    if (!shm) {
      ForwardArgs args = MakeArgs(*in, info->hidden(), info->topk(), *dtype);
      args.request_id = absl::StrCat("load-", i);
      auto request = MoeClient::EncodeForwardRequest(args);
      if (!request.ok()) return Fail(request.status(), "build request");
      requests[0].push_back(std::move(*request));
      continue;
    }
    for (int w = 0; w < concurrency; ++w) {
      const int64_t out_at = distinct * layout.input_block() + w * Align64(layout.hidden_bytes);
      auto args = cuda_arena ? PlaceInArena(*in, *cuda_arena, i * layout.input_block(), out_at,
                                            info->hidden(), info->topk(), *dtype)
                             : PlaceInArena(*in, *arena, i * layout.input_block(), out_at,
                                            info->hidden(), info->topk(), *dtype);
      if (!args.ok()) return Fail(args.status(), "shared memory");
      args->request_id = absl::StrCat("load-", i);
      auto built = MoeClient::BuildForwardRequest(*args);
      if (!built.ok()) return Fail(built.status(), "build request");
      auto request = MoeClient::EncodeForwardRequest(*built);
      if (!request.ok()) return Fail(request.status(), "build request");
      requests[w].push_back(std::move(*request));
    }
  }

  // --channel: one forward channel, a slot per worker, big enough for the largest message.
  std::unique_ptr<ForwardChannelClient> channel;
  const bool use_channel = absl::GetFlag(FLAGS_channel);
  if (use_channel) {
    if (absl::GetFlag(FLAGS_stream) || absl::GetFlag(FLAGS_rate) > 0) {
      return Fail(absl::InvalidArgumentError("--channel runs closed-loop unary calls: no --stream "
                                             "or --rate"),
                  "flags");
    }
    int64_t largest = static_cast<int64_t>(requests[0].front().Length());
    if (!shm) largest = std::max(largest, layout.hidden_bytes);  // the answer comes back inline
    ForwardChannelOptions options;
    options.num_slots = concurrency;
    options.slot_bytes = (largest + 8192 + 63) / 64 * 64;
    auto created = ForwardChannelClient::Create(client->get(), options);
    if (!created.ok()) return Fail(created.status(), "RegisterForwardChannel");
    channel = std::move(*created);
  }

  // The unloaded answer to each distinct request, before the measured loop.
  std::vector<ExpectedAnswer> expected;
  if (check_answers) {
    absl::StatusOr<std::vector<ExpectedAnswer>> unloaded =
        UnloadedAnswers(**client, requests[0], *dtype);
    if (!unloaded.ok()) return Fail(unloaded.status(), "unloaded Forward (--check_answers)");
    expected = *std::move(unloaded);
  }
  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  std::atomic<int64_t> checked{0}, wrong{0};

  if (absl::GetFlag(FLAGS_rate) > 0) {
    if (shm) {
      return Fail(absl::InvalidArgumentError(
                      "--rate (open loop) works over gRPC bytes, not --shm / --cuda_region"),
                  "flags");
    }
    // --connections 0: one per --concurrency worker, as in the closed loop.
    std::vector<std::unique_ptr<MoeClient>> owned;
    std::vector<MoeClient*> clients{client->get()};
    const int n =
        absl::GetFlag(FLAGS_connections) > 0 ? absl::GetFlag(FLAGS_connections) : concurrency;
    for (int i = 1; i < n; ++i) {
      auto c = MakeClient(/*own_connection=*/true);
      if (!c.ok()) return Fail(c.status(), "create client");
      owned.push_back(std::move(*c));
      clients.push_back(owned.back().get());
    }
    return RunOpenLoop(clients, requests[0], *dtype, num_tokens);
  }

  // Connections for the workers (gRPC shares one per target unless asked not to).
  std::vector<std::unique_ptr<MoeClient>> connections;
  const int num_connections =
      absl::GetFlag(FLAGS_connections) > 0 ? absl::GetFlag(FLAGS_connections) : concurrency;
  if (num_connections > 1 && !shm) {
    for (int i = 0; i < num_connections; ++i) {
      auto c = MakeClient(/*own_connection=*/true);
      if (!c.ok()) return Fail(c.status(), "create client");
      connections.push_back(std::move(*c));
    }
  }
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::vector<double> latencies_ms;
  std::map<std::string, int64_t> errors;  // status code name -> count
  std::string first_error;
  ServerTimes server;
  const absl::Time start = absl::Now();
  const absl::Time stop_at = start + absl::Seconds(max_seconds);
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(concurrency));
  std::atomic<int64_t> made{0};  // calls the workers made (answered or failed)
  const bool use_stream = absl::GetFlag(FLAGS_stream);
  const absl::Duration think = absl::Microseconds(absl::GetFlag(FLAGS_think_us));
  for (int w = 0; w < concurrency; ++w) {
    workers.emplace_back([&, w] {
      const std::vector<grpc::ByteBuffer>& mine = requests[shm ? w : 0];
      MoeClient* const mine_client =
          connections.empty() ? client->get() : connections[w % connections.size()].get();
      std::vector<double> local_ms;
      ServerTimes local_server;
      std::map<std::string, int64_t> local_errors;
      std::string local_first_error;
      std::unique_ptr<ForwardStream> stream;
      bool stream_failed = false;
      if (use_stream) {
        // The whole run's time plus one call's deadline: a server that stops answering ends
        // the stream instead of holding the worker in Read forever.
        auto opened = mine_client->OpenForwardStream(absl::Seconds(max_seconds) +
                                                     absl::GetFlag(FLAGS_deadline));
        if (!opened.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          ++errors[absl::StatusCodeToString(opened.status().code())];
          if (first_error.empty()) first_error = opened.status().ToString();
          return;
        }
        stream = std::move(*opened);
      }
      // One call: unary, or a write and its answer on this worker's stream.
      auto call = [&](const grpc::ByteBuffer& request) -> absl::StatusOr<ForwardResult> {
        if (channel) return channel->Forward(request, /*copy_output=*/false);
        if (!stream) return mine_client->Forward(request, /*copy_output=*/false);
        const absl::Time sent = absl::Now();
        if (absl::Status s = stream->Write(request); !s.ok()) return s;
        absl::StatusOr<ForwardResult> result = stream->Read(/*copy_output=*/false);
        if (result.ok()) result->latency = absl::Now() - sent;
        return result;
      };
      for (;;) {
        if (think > absl::ZeroDuration() && !local_ms.empty()) absl::SleepFor(think);
        const int64_t i = next.fetch_add(1);
        if (i >= num_requests || absl::Now() >= stop_at) break;
        const size_t which = static_cast<size_t>(i) % mine.size();
        made.fetch_add(1);
        auto result = call(mine[which]);
        if (result.ok() && check_answers) {
          checked.fetch_add(1);
          if (!(AnswerDistance(*result, expected[which], *dtype) <= tolerance)) wrong.fetch_add(1);
        }
        if (result.ok()) {
          local_ms.push_back(absl::ToDoubleMilliseconds(result->latency));
          local_server.Add(result->timings);
        } else {
          ++local_errors[absl::StatusCodeToString(result.status().code())];
          if (local_first_error.empty()) local_first_error = result.status().ToString();
          // A failed write or read ends the stream: this worker's later calls are not sent
          // (not_sent), and the stream's final status is this error, not another.
          if (stream) {
            stream_failed = true;
            break;
          }
        }
      }
      if (stream) {
        if (absl::Status s = stream->Finish(); !s.ok() && !stream_failed) {
          ++local_errors[absl::StatusCodeToString(s.code())];
          if (local_first_error.empty()) local_first_error = s.ToString();
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      latencies_ms.insert(latencies_ms.end(), local_ms.begin(), local_ms.end());
      server.Merge(local_server);
      for (const auto& [code, n] : local_errors) errors[code] += n;
      if (first_error.empty()) first_error = local_first_error;
    });
  }
  for (std::thread& t : workers) t.join();
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);

  std::sort(latencies_ms.begin(), latencies_ms.end());
  int64_t num_errors = 0;
  for (const auto& [code, n] : errors) num_errors += n;
  const int64_t ok = static_cast<int64_t>(latencies_ms.size());
  // Calls never made (a stream that failed or opened not at all, --max_seconds); the stream
  // errors that are not a call's (open, finish) do not use one up.
  const int64_t not_sent = num_requests - made.load();
  const int64_t channel_sleeps = channel ? channel->sleeps() : 0;
  if (channel != nullptr) {
    if (absl::Status s = channel->Close(); !s.ok()) return Fail(s, "UnregisterForwardChannel");
  }
  if (arena != nullptr) {
    if (absl::Status s = arena->Unregister(); !s.ok()) return Fail(s, "UnregisterSharedMemory");
  }
  if (cuda_arena != nullptr) {
    if (absl::Status s = cuda_arena->Unregister(); !s.ok()) {
      return Fail(s, "UnregisterSharedMemory");
    }
  }
  std::printf(
      "load: requests=%lld concurrency=%d connections=%d tokens=%lld dtype=%s layer=%d "
      "transport=%s rpc=%s\n",
      static_cast<long long>(num_requests), concurrency,
      connections.empty() ? 1 : static_cast<int>(connections.size()),
      static_cast<long long>(num_tokens), DTypeName(*dtype).c_str(), absl::GetFlag(FLAGS_layer),
      cuda_region ? "cuda_region" : (shm ? "shm" : "grpc"),
      use_channel ? "ForwardChannel" : (use_stream ? "ForwardStream" : "Forward"));
  if (use_channel) {
    std::printf("channel: slots=%d slot_bytes=%lld calls_that_slept=%lld\n", channel->num_slots(),
                static_cast<long long>(channel->slot_bytes()),
                static_cast<long long>(channel_sleeps));
  }
  std::printf("ok=%lld errors=%lld not_sent=%lld wall_s=%.3f\n", static_cast<long long>(ok),
              static_cast<long long>(num_errors), static_cast<long long>(not_sent), wall_s);
  for (const auto& [code, n] : errors) {
    std::printf("  error %s: %lld\n", code.c_str(), static_cast<long long>(n));
  }
  if (!first_error.empty()) std::printf("  first error: %s\n", first_error.c_str());
  std::printf("latency_ms: p50=%.3f p90=%.3f p99=%.3f max=%.3f\n", Percentile(latencies_ms, 50),
              Percentile(latencies_ms, 90), Percentile(latencies_ms, 99),
              latencies_ms.empty() ? 0.0 : latencies_ms.back());
  if (absl::GetFlag(FLAGS_return_timings)) {
    server.Print(/*tails=*/false);
  }
  std::printf("throughput: requests_per_s=%.1f tokens_per_s=%.1f\n", wall_s > 0 ? ok / wall_s : 0.0,
              wall_s > 0 ? static_cast<double>(ok * num_tokens) / wall_s : 0.0);
  if (not_sent > 0) std::printf("stopped by --max_seconds=%.1f\n", max_seconds);
  if (check_answers) {
    std::printf("answers: checked=%lld wrong=%lld (tolerance %.3g against the unloaded answer)\n",
                static_cast<long long>(checked.load()), static_cast<long long>(wrong.load()),
                tolerance);
  }
  return (num_errors == 0 && ok > 0 && wrong.load() == 0) ? kExitOk : kExitFailed;
}

}  // namespace
}  // namespace moeserve::client

int main(int argc, char** argv) {
  // As the server (server/main.cc): no lock-order graph on gRPC's absl::Mutexes per call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "moeserve-cli <health|info|forward|load> [--flags]\n"
      "  health   print SERVING/NOT_SERVING (exit 0 only if SERVING)\n"
      "  info     print the served model\n"
      "  forward  one Forward with random (or --input_file) inputs; --check verifies it\n"
      "  load     closed-loop load: --requests N --concurrency C --tokens M\n"
      "  --help lists every flag, --version prints the build");
  // --help lists the flags of this project's files (absl's default matched none).
  absl::FlagsUsageConfig config;
  auto ours = [](absl::string_view file) { return absl::StrContains(file, "clients/"); };
  config.contains_helpshort_flags = ours;
  config.contains_help_flags = ours;
  config.version_string = [] {
    return absl::StrCat("moeserve-cli ", moeserve::build_info::kVersion, " (",
                        moeserve::build_info::kCommit,
                        ")\nbuild type: ", moeserve::build_info::kBuildType, "\n");
  };
  absl::SetFlagsUsageConfig(config);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() != 2) {
    std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
    return moeserve::client::kExitError;
  }
  const std::string command = positional[1];
  if (command == "health") return moeserve::client::RunHealth();
  if (command == "info") return moeserve::client::RunInfo();
  if (command == "forward") return moeserve::client::RunForward();
  if (command == "load") return moeserve::client::RunLoad();
  std::fprintf(stderr, "unknown command '%s'\n%s\n", command.c_str(),
               absl::ProgramUsageMessage().data());
  return moeserve::client::kExitError;
}
