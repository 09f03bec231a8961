#include "clients/cpp/moeserve_client_c.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "clients/cpp/moeserve_client.h"
#include "moeserve/v1/forward_wire.h"

namespace {

using moeserve::client::ForwardResult;
using moeserve::client::MoeClient;
using moeserve::client::MoeClientOptions;
namespace v1 = moeserve::v1;

int Fail(const absl::Status& status, char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) {
    const size_t n = std::min(err_len - 1, status.message().size());
    std::memcpy(err, status.message().data(), n);
    err[n] = '\0';
  }
  const int code = static_cast<int>(status.code());
  return code == 0 ? static_cast<int>(absl::StatusCode::kUnknown) : code;
}

int Ok(char* err, size_t err_len) {
  if (err != nullptr && err_len > 0) err[0] = '\0';
  return 0;
}

int64_t FloatItemSize(int32_t dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16:
      return 2;
    case v1::DTYPE_FP32:
      return 4;
    default:
      return 0;
  }
}

absl::Duration TimeoutOf(double timeout_s) {
  return timeout_s > 0 ? absl::Seconds(timeout_s) : absl::ZeroDuration();
}

// Slices that point at the caller's bytes (STATIC_SLICE: gRPC neither copies nor frees them).
grpc::Slice Borrow(const void* data, int64_t bytes) {
  if (bytes <= 0) return grpc::Slice();
  return grpc::Slice(data, static_cast<size_t>(bytes), grpc::Slice::STATIC_SLICE);
}

absl::StatusOr<grpc::ByteBuffer> BuildRequest(const MoeserveForwardArgs* a) {
  if (a == nullptr) return absl::InvalidArgumentError("args is NULL");
  const int64_t item = FloatItemSize(a->hidden_dtype);
  if (item == 0) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_dtype is ", a->hidden_dtype,
                                                   "; expected 1 (BF16), 2 (FP16) or 3 (FP32)"));
  }
  if (a->num_tokens < 0 || a->hidden <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("hidden_states shape [", a->num_tokens, ", ",
                                                   a->hidden, "]; expected [>= 0, > 0]"));
  }
  const int64_t hidden_bytes = a->num_tokens * a->hidden * item;
  if (hidden_bytes > 0 && a->hidden_states == nullptr) {
    return absl::InvalidArgumentError("hidden_states is NULL");
  }
  const bool routed = a->topk_ids != nullptr || a->topk_weights != nullptr;
  if (routed && (a->topk_ids == nullptr || a->topk_weights == nullptr)) {
    return absl::InvalidArgumentError(
        "pass both topk_ids and topk_weights, or neither (routing on the server)");
  }
  v1::ForwardRequest header;
  header.set_layer(a->layer);
  if (a->request_id != nullptr) header.set_request_id(a->request_id);
  header.set_return_timings(a->return_timings != 0 && a->return_timings != 2);
  header.set_return_host_timings(a->return_timings == 2);
  header.set_return_routing(a->return_routing != 0);
  v1::Tensor* hs = header.mutable_hidden_states();
  hs->set_dtype(static_cast<v1::DType>(a->hidden_dtype));
  hs->add_shape(a->num_tokens);
  hs->add_shape(a->hidden);
  grpc::Slice ids, weights;
  if (routed) {
    if (a->ids_dtype != v1::DTYPE_INT32 && a->ids_dtype != v1::DTYPE_INT64) {
      return absl::InvalidArgumentError(
          absl::StrCat("ids_dtype is ", a->ids_dtype, "; expected 4 (INT32) or 5 (INT64)"));
    }
    if (a->topk <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("topk is ", a->topk, "; expected > 0"));
    }
    const int64_t routes = a->num_tokens * a->topk;
    for (v1::Tensor* t : {header.mutable_topk_ids(), header.mutable_topk_weights()}) {
      t->add_shape(a->num_tokens);
      t->add_shape(a->topk);
    }
    header.mutable_topk_ids()->set_dtype(static_cast<v1::DType>(a->ids_dtype));
    header.mutable_topk_weights()->set_dtype(v1::DTYPE_FP32);
    ids = Borrow(a->topk_ids, routes * (a->ids_dtype == v1::DTYPE_INT64 ? 8 : 4));
    weights = Borrow(a->topk_weights, routes * 4);
  }
  return moeserve::v1wire::EncodeForwardRequest(header, Borrow(a->hidden_states, hidden_bytes), ids,
                                                weights);
}

absl::StatusOr<grpc::ByteBuffer> PartsRequest(int num_parts, const void* const* parts,
                                              const int64_t* part_bytes) {
  if (num_parts < 0 || (num_parts > 0 && (parts == nullptr || part_bytes == nullptr))) {
    return absl::InvalidArgumentError("parts: expected num_parts >= 0 byte ranges");
  }
  std::vector<grpc::Slice> slices;
  slices.reserve(static_cast<size_t>(num_parts));
  for (int i = 0; i < num_parts; ++i) {
    if (part_bytes[i] < 0 || (part_bytes[i] > 0 && parts[i] == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("part ", i, ": ", part_bytes[i], " bytes at ", parts[i] ? "" : "NULL"));
    }
    if (part_bytes[i] > 0) slices.push_back(Borrow(parts[i], part_bytes[i]));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Copies of large answers, split over a few threads of the library's own (one core copies at
// ~5-10 GB/s: 14.7 MB, one token's layer at M=1024, took ~1.5 ms on one). The threads sleep on
// a condition variable between copies. Threads: $MOESERVE_CLIENT_COPY_THREADS, else a quarter of
// the cores, at most 4 (0: every copy on the caller's thread).
class CopyPool {
 public:
  static constexpr size_t kMinBytes = size_t{1} << 20;  // below this one memcpy is faster

  static CopyPool& Get() {
    static CopyPool* pool = new CopyPool(Threads());  // never destroyed: threads detached
    return *pool;
  }

  // Copies `src`'s pieces, in order, to dst.
  void Copy(const std::vector<absl::Span<const uint8_t>>& src, size_t bytes, void* dst) {
    auto* out = static_cast<uint8_t*>(dst);
    const size_t ways = std::min(threads_ + 1, bytes / (kMinBytes / 2));
    if (bytes < kMinBytes || ways < 2) {
      for (absl::Span<const uint8_t> piece : src) {
        std::memcpy(out, piece.data(), piece.size());
        out += piece.size();
      }
      return;
    }
    // Part i copies bytes [i * part, (i + 1) * part) of the answer, across pieces.
    const size_t part = (bytes + ways - 1) / ways;
    auto copy_part = [&src, out, part, bytes](size_t i) {
      const size_t lo = i * part, hi = std::min(bytes, lo + part);
      size_t at = 0;  // offset of the current piece in the answer
      for (absl::Span<const uint8_t> piece : src) {
        const size_t a = std::max(lo, at), b = std::min(hi, at + piece.size());
        if (a < b) std::memcpy(out + a, piece.data() + (a - at), b - a);
        at += piece.size();
        if (at >= hi) break;
      }
    };
    std::unique_lock<std::mutex> one(busy_, std::try_to_lock);  // one pooled copy at a time
    if (!one.owns_lock()) {
      for (size_t i = 0; i < ways; ++i) copy_part(i);
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    job_ = copy_part;
    next_ = 0;
    parts_ = ways;
    left_ = ways;
    ++generation_;
    cv_.notify_all();
    TakeParts(lock, job_);  // the caller copies too
    done_.wait(lock, [this] { return left_ == 0; });
    job_ = nullptr;
  }

 private:
  static size_t Threads() {
    if (const char* v = std::getenv("MOESERVE_CLIENT_COPY_THREADS"); v != nullptr && *v != '\0') {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (*end == '\0' && n >= 0 && n <= 64) return static_cast<size_t>(n);
    }
    return std::min<size_t>(4, std::thread::hardware_concurrency() / 4);
  }

  // Copies parts until none is left to take; `lock` holds mu_ on entry and on return.
  void TakeParts(std::unique_lock<std::mutex>& lock, const std::function<void(size_t)>& job) {
    while (next_ < parts_) {
      const size_t i = next_++;
      lock.unlock();
      job(i);
      lock.lock();
      if (--left_ == 0) done_.notify_one();
    }
  }

  explicit CopyPool(size_t threads) : threads_(threads) {
    for (size_t t = 0; t < threads; ++t) std::thread([this] { Run(); }).detach();
  }

  void Run() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return generation_ != seen && next_ < parts_; });
      seen = generation_;
      TakeParts(lock, job_);
    }
  }

  const size_t threads_;
  std::mutex busy_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::function<void(size_t)> job_;  // guarded by mu_
  size_t next_ = 0, parts_ = 0, left_ = 0;
  uint64_t generation_ = 0;
};

// The answer into `result`: dtype and shape checked, the bytes copied to out, the rest of the
// response serialized into header.
absl::Status Deliver(ForwardResult& answer, const MoeserveResult* result) {
  if (result == nullptr) return absl::OkStatus();
  const moeserve::v1wire::WireTensor& o = answer.raw.output;
  const v1::Tensor& t = o.header;
  const bool shape_ok = t.shape_size() == 2 && t.shape(1) == result->expect_hidden &&
                        (result->expect_num_tokens < 0 || t.shape(0) == result->expect_num_tokens);
  if (t.dtype() != result->expect_dtype || !shape_ok) {
    return absl::InternalError(
        absl::StrCat("the server answered dtype ", t.dtype(), " shape [",
                     absl::StrJoin(t.shape(), ", "), "]; expected dtype ", result->expect_dtype,
                     " shape [", result->expect_num_tokens, ", ", result->expect_hidden, "]"));
  }
  if (o.data_size > 0) {
    if (result->out == nullptr || static_cast<int64_t>(o.data_size) != result->out_bytes) {
      return absl::InternalError(
          absl::StrCat("the answer has ", o.data_size, " bytes; out has ", result->out_bytes));
    }
    CopyPool::Get().Copy(o.data, o.data_size, result->out);
  }
  if (result->header != nullptr) {
    v1::ForwardResponse h = answer.raw.header;
    *h.mutable_output() = t;
    const size_t n = h.ByteSizeLong();
    if (result->header_len != nullptr) *result->header_len = n;
    if (n > result->header_cap) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the answer's header has ", n, " bytes; header_cap is ", result->header_cap));
    }
    if (!h.SerializeToArray(result->header, static_cast<int>(n))) {
      return absl::InternalError("could not serialize the answer's header");
    }
  }
  return absl::OkStatus();
}

int Finish(absl::StatusOr<ForwardResult> answer, const MoeserveResult* result, char* err,
           size_t err_len) {
  if (!answer.ok()) return Fail(answer.status(), err, err_len);
  if (absl::Status s = Deliver(*answer, result); !s.ok()) return Fail(s, err, err_len);
  return Ok(err, err_len);
}

}  // namespace

// A submitted call's answer, shared by the caller's handle and the `done` of its
// MoeClient::ForwardAsync (the request's slices borrow the caller's bytes until then).
struct MoeserveCallState {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> done{false};
  absl::StatusOr<ForwardResult> answer{absl::UnknownError("not answered")};
};

// One C++ client. Its ForwardAsync calls end on a thread of the client's own (no gRPC callback
// thread); destroying it waits for the calls in flight (their deadlines bound that).
struct MoeserveClient {
  std::unique_ptr<MoeClient> client;
  absl::Duration spin;
};

struct MoeserveCall {
  std::shared_ptr<MoeserveCallState> state = std::make_shared<MoeserveCallState>();
  absl::Duration spin;
  bool waited = false;

  void Wait() {
    MoeserveCallState& s = *state;
    if (spin > absl::ZeroDuration()) {
      const absl::Time end = absl::Now() + spin;
      while (!s.done.load(std::memory_order_acquire) && absl::Now() < end) {
      }
    }
    std::unique_lock<std::mutex> lock(s.mu);
    s.cv.wait(lock, [&s] { return s.done.load(std::memory_order_acquire); });
  }
};

namespace {

int Submit(MoeserveClient* client, absl::StatusOr<grpc::ByteBuffer> request, double timeout_s,
           MoeserveCall** call, char* err, size_t err_len) {
  if (call == nullptr) return Fail(absl::InvalidArgumentError("call is NULL"), err, err_len);
  *call = nullptr;
  if (!request.ok()) return Fail(request.status(), err, err_len);
  auto c = std::make_unique<MoeserveCall>();
  c->spin = client->spin;
  client->client->ForwardAsync(
      *request,
      [state = c->state](absl::StatusOr<ForwardResult> answer) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->answer = std::move(answer);
        state->done.store(true, std::memory_order_release);
        state->cv.notify_all();
      },
      /*copy_output=*/false, TimeoutOf(timeout_s));
  *call = c.release();
  return Ok(err, err_len);
}

}  // namespace

extern "C" {

int moeserve_client_abi_version(void) { return MOESERVE_CLIENT_C_ABI_VERSION; }

MoeserveClient* moeserve_client_create(const char* target, const MoeserveClientOptions* options,
                                       char* err, size_t err_len) {
  if (target == nullptr) {
    Fail(absl::InvalidArgumentError("target is NULL"), err, err_len);
    return nullptr;
  }
  const MoeserveClientOptions defaults{};
  const MoeserveClientOptions& o = options != nullptr ? *options : defaults;
  if (o.timeout_s < 0 || o.spin_us < 0 || o.max_message_bytes < 0) {
    Fail(absl::InvalidArgumentError(absl::StrCat("timeout_s ", o.timeout_s, ", spin_us ", o.spin_us,
                                                 ", max_message_bytes ", o.max_message_bytes,
                                                 "; expected >= 0 (0: the default)")),
         err, err_len);
    return nullptr;
  }
  // As moeserve and moeserve-cli do: gRPC locks and destroys absl::Mutexes on every call, and a
  // distribution's Abseil may keep its lock-order graph on (GraphCycles in a Python client's
  // profile, 2026-12-06). Process-wide, once; only this library's gRPC uses that Abseil there.
  static std::once_flag no_lock_graph;
  std::call_once(no_lock_graph,
                 [] { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); });
  const auto str = [](const char* s) { return s != nullptr ? std::string(s) : std::string(); };
  MoeClientOptions client_options;
  if (o.max_message_bytes > 0) client_options.max_message_bytes = o.max_message_bytes;
  if (o.timeout_s > 0) client_options.deadline = absl::Seconds(o.timeout_s);
  client_options.spin_wait = absl::Microseconds(o.spin_us);
  client_options.auth_token = str(o.auth_token);
  client_options.use_tls = o.use_tls != 0;
  client_options.tls_ca_file = str(o.tls_ca_file);
  client_options.tls_cert_file = str(o.tls_cert_file);
  client_options.tls_key_file = str(o.tls_key_file);
  client_options.tls_server_name = str(o.tls_server_name);
  client_options.wait_for_ready = o.wait_for_ready != 0;
  absl::StatusOr<std::unique_ptr<MoeClient>> client = MoeClient::Create(target, client_options);
  if (!client.ok()) {
    Fail(client.status(), err, err_len);
    return nullptr;
  }
  Ok(err, err_len);
  return new MoeserveClient{*std::move(client), client_options.spin_wait};
}

void moeserve_client_destroy(MoeserveClient* client) { delete client; }

int moeserve_forward(MoeserveClient* client, const MoeserveForwardArgs* args,
                     const MoeserveResult* result, char* err, size_t err_len) {
  if (client == nullptr) return Fail(absl::InvalidArgumentError("client is NULL"), err, err_len);
  absl::StatusOr<grpc::ByteBuffer> request = BuildRequest(args);
  if (!request.ok()) return Fail(request.status(), err, err_len);
  return Finish(
      client->client->Forward(*request, /*copy_output=*/false, TimeoutOf(args->timeout_s)), result,
      err, err_len);
}

int moeserve_forward_parts(MoeserveClient* client, int num_parts, const void* const* parts,
                           const int64_t* part_bytes, double timeout_s,
                           const MoeserveResult* result, char* err, size_t err_len) {
  if (client == nullptr) return Fail(absl::InvalidArgumentError("client is NULL"), err, err_len);
  absl::StatusOr<grpc::ByteBuffer> request = PartsRequest(num_parts, parts, part_bytes);
  if (!request.ok()) return Fail(request.status(), err, err_len);
  return Finish(client->client->Forward(*request, /*copy_output=*/false, TimeoutOf(timeout_s)),
                result, err, err_len);
}

int moeserve_submit(MoeserveClient* client, const MoeserveForwardArgs* args, MoeserveCall** call,
                    char* err, size_t err_len) {
  if (client == nullptr) return Fail(absl::InvalidArgumentError("client is NULL"), err, err_len);
  return Submit(client, BuildRequest(args), args != nullptr ? args->timeout_s : 0, call, err,
                err_len);
}

int moeserve_submit_parts(MoeserveClient* client, int num_parts, const void* const* parts,
                          const int64_t* part_bytes, double timeout_s, MoeserveCall** call,
                          char* err, size_t err_len) {
  if (client == nullptr) return Fail(absl::InvalidArgumentError("client is NULL"), err, err_len);
  return Submit(client, PartsRequest(num_parts, parts, part_bytes), timeout_s, call, err, err_len);
}

int moeserve_call_done(const MoeserveCall* call) {
  return call != nullptr && call->state->done.load(std::memory_order_acquire) ? 1 : 0;
}

int moeserve_call_wait(MoeserveCall* call, const MoeserveResult* result, char* err,
                       size_t err_len) {
  if (call == nullptr) return Fail(absl::InvalidArgumentError("call is NULL"), err, err_len);
  if (call->waited) {
    return Fail(absl::FailedPreconditionError("the call's answer was taken already"), err, err_len);
  }
  call->Wait();
  call->waited = true;
  return Finish(std::move(call->state->answer), result, err, err_len);
}

void moeserve_call_free(MoeserveCall* call) {
  if (call == nullptr) return;
  // The request borrows the caller's bytes: they must not be released while gRPC may read them.
  if (!call->waited) call->Wait();
  delete call;
}

}  // extern "C"
