// The raw gRPC floor of issue 11's transport benchmark: a generic callback service that answers
// every call with the request's own ByteBuffer (its slices, no protobuf parse, no copy), and a
// client that sends N bytes as one raw slice and times unary round trips.
//
//   grpc_echo_bench server --listen ADDR[,ADDR...] [--ready_file F]
//       ADDR: HOST:PORT (port 0 picks one) or unix:/path. Once serving, writes the first bound
//       address (TCP with the port picked) as line 1 of --ready_file. Stops on SIGTERM/SIGINT.
//   grpc_echo_bench client --target ADDR --bytes N[,N...] [--calls R] [--warmup W] [--check]
//       One line per N: "echo bytes=N calls=R p50_us=.. p90_us=.. p99_us=.. max_us=..".
//       --check compares every answer with what was sent (outside the timed part); exit 1 on
//       a mismatch or a failed call, 2 on usage errors.
//   grpc_echo_bench openloop --target ADDR --bytes N --rate R [--seconds S] [--connections C]
//       An open loop (issue 12's overload, gRPC alone): call k leaves at k / R seconds over
//       connection k mod C, whatever the answers do; one line with the counts (ok, refused:
//       RESOURCE_EXHAUSTED, other errors), latency from the schedule and the send lag, then the
//       p50 / p99 of the calls sent in each second.
//   Server --refuse_percent P: answers P of every 100 calls RESOURCE_EXHAUSTED (moeserve's
//   overload mix), after reading the request, or with --refuse_early before reading it (at the
//   call's start, as a server could refuse on its headers alone).
//
// The payload is random bytes from a fixed seed; the same ByteBuffer (one slice) is sent on
// every call, so the client side costs what a zero-copy client costs.
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tests/benchmarks/percentile.h"

ABSL_FLAG(std::string, wait, "queue",
          "client: how a call is waited for: queue (the caller polls a completion queue, as "
          "MoeClient::Forward does since 2026-12-04) or callback (gRPC's callback thread wakes "
          "the caller, as both did before)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "server: comma-separated addresses to listen on");
ABSL_FLAG(std::string, ready_file, "", "server: written with the first address once serving");
ABSL_FLAG(bool, corrupt, false,
          "server: flip the first byte of every answer (copies it; for testing --check)");
ABSL_FLAG(std::string, target, "127.0.0.1:50051", "client: server address");
ABSL_FLAG(std::string, bytes, "1024", "client: comma-separated payload sizes in bytes");
ABSL_FLAG(int32_t, calls, 200, "client: timed calls per size");
ABSL_FLAG(int32_t, warmup, 5, "client: untimed calls per size first");
ABSL_FLAG(bool, check, false, "client: compare every answer with the request");
ABSL_FLAG(int32_t, refuse_percent, 0,
          "server: answer this many of every 100 calls RESOURCE_EXHAUSTED instead of echoing");
ABSL_FLAG(bool, refuse_early, false,
          "server: refuse those calls at their start, before reading the request");
ABSL_FLAG(double, rate, 0, "openloop: calls per second");
ABSL_FLAG(double, seconds, 10, "openloop: how long calls are sent");
ABSL_FLAG(int32_t, connections, 8, "openloop: HTTP/2 connections the calls are spread over");
ABSL_FLAG(std::string, method, "/moeserve.bench.Echo/Echo",
          "openloop: the method called (another server's, e.g. /moeserve.v1.MoeService/Forward, "
          "to time its per-call cost on these bytes: answers other than OK and "
          "RESOURCE_EXHAUSTED count as other_errors)");
ABSL_FLAG(int32_t, cq_threads, 2,
          "openloop: threads taking completions, each polling its own completion queue");

namespace {

constexpr int kMaxMessage = 512 << 20;
std::atomic<bool> g_stop{false};

// Answers one call with its request: the ByteBuffer shares the received slices.
class EchoReactor : public grpc::ServerGenericBidiReactor {
 public:
  // refuse: answer RESOURCE_EXHAUSTED; early: before reading the request.
  EchoReactor(bool corrupt, bool refuse, bool early) : corrupt_(corrupt), refuse_(refuse) {
    if (refuse && early) {
      Finish(Refusal());
      return;
    }
    StartRead(&buffer_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    if (refuse_) {
      Finish(Refusal());
      return;
    }
    if (corrupt_) Corrupt();
    StartWriteAndFinish(&buffer_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  void Corrupt() {
    grpc::Slice flat;
    if (!buffer_.DumpToSingleSlice(&flat).ok() || flat.size() == 0) return;
    std::string copy(reinterpret_cast<const char*>(flat.begin()), flat.size());
    copy[0] = static_cast<char>(copy[0] ^ 0x5a);
    grpc::Slice slice(copy.data(), copy.size());
    buffer_ = grpc::ByteBuffer(&slice, 1);
  }
  static grpc::Status Refusal() {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "echo: refused (--refuse_percent)");
  }
  const bool corrupt_, refuse_;
  grpc::ByteBuffer buffer_;
};

class EchoService : public grpc::CallbackGenericService {
 public:
  EchoService(bool corrupt, int refuse_percent, bool refuse_early)
      : corrupt_(corrupt), refuse_percent_(refuse_percent), refuse_early_(refuse_early) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    const bool refuse = static_cast<int>(calls_.fetch_add(1) % 100) < refuse_percent_;
    return new EchoReactor(corrupt_, refuse, refuse_early_);
  }

 private:
  const bool corrupt_;
  const int refuse_percent_;
  const bool refuse_early_;
  std::atomic<uint64_t> calls_{0};
};

int RunServer() {
  const int refuse_percent = absl::GetFlag(FLAGS_refuse_percent);
  if (refuse_percent < 0 || refuse_percent > 100) {
    std::fprintf(stderr, "error: --refuse_percent: got %d, expected a percentage in [0, 100]\n",
                 refuse_percent);
    return 2;
  }
  std::vector<std::string> addresses = absl::StrSplit(absl::GetFlag(FLAGS_listen), ',');
  EchoService service(absl::GetFlag(FLAGS_corrupt), refuse_percent,
                      absl::GetFlag(FLAGS_refuse_early));
  grpc::ServerBuilder builder;
  std::vector<int> ports(addresses.size(), 0);
  for (size_t i = 0; i < addresses.size(); ++i) {
    builder.AddListeningPort(addresses[i], grpc::InsecureServerCredentials(), &ports[i]);
  }
  builder.SetMaxReceiveMessageSize(kMaxMessage);
  builder.SetMaxSendMessageSize(kMaxMessage);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "error: could not listen on %s\n", absl::GetFlag(FLAGS_listen).c_str());
    return 2;
  }
  std::string first = addresses[0];
  if (first.rfind("unix:", 0) != 0) {
    first = first.substr(0, first.rfind(':') + 1) + std::to_string(ports[0]);
  }
  std::fprintf(stderr, "grpc_echo_bench serving on %s\n", first.c_str());
  const std::string ready = absl::GetFlag(FLAGS_ready_file);
  if (!ready.empty()) {
    const std::string tmp = ready + ".tmp";
    std::ofstream(tmp) << first << "\n";
    std::rename(tmp.c_str(), ready.c_str());
  }
  std::signal(SIGTERM, [](int) { g_stop = true; });
  std::signal(SIGINT, [](int) { g_stop = true; });
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

// One blocking unary call through the generic stub; returns its status. `on_queue`: waited for
// on a completion queue that this thread polls (gRPC reads and writes on this thread); else
// through a callback on one of gRPC's threads that then wakes this one.
grpc::Status Call(grpc::GenericStub& stub, const grpc::ByteBuffer& request,
                  grpc::ByteBuffer* response, bool on_queue) {
  constexpr const char* kMethod = "/moeserve.bench.Echo/Echo";
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::Status status;
  if (on_queue) {
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&context, kMethod, request, &cq);
    call->StartCall();
    call->Finish(response, &status, nullptr);
    void* tag = nullptr;
    bool ok = false;
    const bool got = cq.Next(&tag, &ok);
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return got ? status : grpc::Status(grpc::StatusCode::INTERNAL, "completion queue shut down");
  }
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  stub.UnaryCall(&context, kMethod, grpc::StubOptions(), &request, response, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_one();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return status;
}

// Whether `response` holds exactly `expected`.
bool SameBytes(const grpc::ByteBuffer& response, const std::string& expected) {
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return false;
  size_t at = 0;
  for (const grpc::Slice& s : slices) {
    if (at + s.size() > expected.size() || std::memcmp(s.begin(), expected.data() + at, s.size()))
      return false;
    at += s.size();
  }
  return at == expected.size();
}

int RunClient() {
  std::vector<int64_t> sizes;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_bytes), ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(part, &n) || n <= 0 || n > kMaxMessage - 1024) {
      std::fprintf(stderr, "error: --bytes: '%s' is not a size in [1, %d]\n",
                   std::string(part).c_str(), kMaxMessage - 1024);
      return 2;
    }
    sizes.push_back(n);
  }
  const int calls = absl::GetFlag(FLAGS_calls), warmup = absl::GetFlag(FLAGS_warmup);
  if (calls <= 0 || warmup < 0) {
    std::fprintf(stderr, "error: need --calls > 0 and --warmup >= 0\n");
    return 2;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessage);
  args.SetMaxSendMessageSize(kMaxMessage);
  auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target),
                                           grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  const bool check = absl::GetFlag(FLAGS_check);
  const std::string wait = absl::GetFlag(FLAGS_wait);
  if (wait != "queue" && wait != "callback") {
    std::fprintf(stderr, "error: --wait: '%s' is not queue or callback\n", wait.c_str());
    return 2;
  }
  const bool on_queue = wait == "queue";
  std::mt19937_64 rng(20261201);
  int failures = 0;
  for (int64_t n : sizes) {
    std::string payload(static_cast<size_t>(n), '\0');
    for (char& c : payload) c = static_cast<char>(rng());
    grpc::Slice slice(payload.data(), payload.size());
    const grpc::ByteBuffer request(&slice, 1);
    std::vector<double> us;
    int64_t mismatches = 0, errors = 0;
    std::string first_error;
    for (int i = 0; i < warmup + calls; ++i) {
      grpc::ByteBuffer response;
      const auto t0 = std::chrono::steady_clock::now();
      const grpc::Status s = Call(stub, request, &response, on_queue);
      const auto t1 = std::chrono::steady_clock::now();
      if (!s.ok()) {
        ++errors;
        if (first_error.empty()) first_error = s.error_message();
        continue;
      }
      if (check && !SameBytes(response, payload)) ++mismatches;
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(us.begin(), us.end());
    std::printf("echo bytes=%lld calls=%zu p50_us=%.1f p90_us=%.1f p99_us=%.1f max_us=%.1f",
                static_cast<long long>(n), us.size(),
                moeserve::bench::NearestRankPercentile(us, 50),
                moeserve::bench::NearestRankPercentile(us, 90),
                moeserve::bench::NearestRankPercentile(us, 99), us.empty() ? 0.0 : us.back());
    if (check) std::printf(" mismatches=%lld", static_cast<long long>(mismatches));
    if (errors > 0)
      std::printf(" errors=%lld first_error=\"%s\"", static_cast<long long>(errors),
                  first_error.c_str());
    std::printf("\n");
    std::fflush(stdout);
    if (mismatches > 0 || errors > 0) ++failures;
  }
  return failures == 0 ? 0 : 1;
}

// One call of the open loop: what its completion needs.
struct OpenLoopCall {
  grpc::ClientContext context;
  grpc::ByteBuffer response;
  grpc::Status status;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
  std::chrono::steady_clock::time_point scheduled, sent;
};

int RunOpenLoop() {
  const double rate = absl::GetFlag(FLAGS_rate), seconds = absl::GetFlag(FLAGS_seconds);
  const int connections = absl::GetFlag(FLAGS_connections);
  const int cq_threads = absl::GetFlag(FLAGS_cq_threads);
  int64_t n = 0;
  if (!absl::SimpleAtoi(absl::GetFlag(FLAGS_bytes), &n) || n <= 0 || n > kMaxMessage - 1024 ||
      !(rate > 0) || !(seconds > 0) || connections <= 0 || connections > 1024 || cq_threads <= 0 ||
      cq_threads > 64) {
    std::fprintf(stderr,
                 "error: openloop needs one --bytes in [1, %d], --rate > 0, --seconds > 0 and "
                 "--connections in [1, 1024] and --cq_threads in [1, 64]\n",
                 kMaxMessage - 1024);
    return 2;
  }
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int c = 0; c < connections; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessage);
    args.SetMaxSendMessageSize(kMaxMessage);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    args.SetInt("moeserve.bench.connection", c);
    stubs.push_back(std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
        absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials(), args)));
  }
  std::string payload(static_cast<size_t>(n), '\0');
  std::mt19937_64 rng(20261207);
  for (char& ch : payload) ch = static_cast<char>(rng());
  grpc::Slice slice(payload.data(), payload.size());
  const grpc::ByteBuffer request(&slice, 1);
  for (auto& stub : stubs) {  // every connection up before the clock starts
    grpc::ByteBuffer response;
    // Any answer (an echo, a refusal, another server's UNIMPLEMENTED) means it is up.
    const grpc::Status s = Call(*stub, request, &response, /*on_queue=*/true);
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      std::fprintf(stderr, "error: warm-up call failed: %s\n", s.error_message().c_str());
      return 1;
    }
  }
  const std::string method = absl::GetFlag(FLAGS_method);
  const int64_t total = static_cast<int64_t>(rate * seconds);
  const int num_seconds = static_cast<int>(seconds) + 1;
  std::vector<grpc::CompletionQueue> cqs(static_cast<size_t>(cq_threads));
  std::mutex mu;  // guards the results below
  std::vector<double> lat_ms, lag_ms;
  std::vector<std::vector<double>> by_second(num_seconds);
  int64_t ok = 0, refused = 0, errors = 0;
  std::string first_error;
  const auto start = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
  // Queue q takes calls q, q + cq_threads, ...
  auto take = [&](int q) {
    const int64_t mine = (total - q + cq_threads - 1) / cq_threads;
    void* tag = nullptr;
    bool got = false;
    for (int64_t done = 0; done < mine && cqs[static_cast<size_t>(q)].Next(&tag, &got); ++done) {
      std::unique_ptr<OpenLoopCall> call(static_cast<OpenLoopCall*>(tag));
      const auto now = std::chrono::steady_clock::now();
      const double ms = std::chrono::duration<double, std::milli>(now - call->scheduled).count();
      std::lock_guard<std::mutex> lock(mu);
      if (call->status.ok()) {
        ++ok;
        lat_ms.push_back(ms);
        lag_ms.push_back(
            std::chrono::duration<double, std::milli>(call->sent - call->scheduled).count());
        const auto sec = std::chrono::duration_cast<std::chrono::seconds>(call->scheduled - start);
        by_second[std::min<size_t>(static_cast<size_t>(sec.count()), by_second.size() - 1)]
            .push_back(ms);
      } else if (call->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++refused;
      } else {
        ++errors;
        if (first_error.empty()) first_error = call->status.error_message();
      }
    }
  };
  std::vector<std::thread> completers;
  for (int q = 0; q < cq_threads; ++q) completers.emplace_back(take, q);
  for (int64_t k = 0; k < total; ++k) {
    const auto scheduled =
        start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                    std::chrono::duration<double>(static_cast<double>(k) / rate));
    std::this_thread::sleep_until(scheduled);
    auto* call = new OpenLoopCall;
    call->scheduled = scheduled;
    call->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    call->reader = stubs[static_cast<size_t>(k % connections)]->PrepareUnaryCall(
        &call->context, method, request, &cqs[static_cast<size_t>(k % cq_threads)]);
    call->sent = std::chrono::steady_clock::now();
    call->reader->StartCall();
    call->reader->Finish(&call->response, &call->status, call);
  }
  for (std::thread& t : completers) t.join();
  for (grpc::CompletionQueue& cq : cqs) {
    cq.Shutdown();
    void* tag = nullptr;
    bool got = false;
    while (cq.Next(&tag, &got)) {
    }
  }
  std::sort(lat_ms.begin(), lat_ms.end());
  std::sort(lag_ms.begin(), lag_ms.end());
  auto pct = [](const std::vector<double>& v, double p) {
    return moeserve::bench::NearestRankPercentile(v, p);
  };
  std::printf(
      "openloop bytes=%lld rate=%.0f seconds=%.1f connections=%d cq_threads=%d sent=%lld ok=%lld "
      "refused=%lld "
      "other_errors=%lld latency_from_schedule_ms: p50=%.3f p90=%.3f p99=%.3f max=%.3f "
      "send_lag_ms: p50=%.3f p99=%.3f",
      static_cast<long long>(n), rate, seconds, connections, cq_threads,
      static_cast<long long>(total), static_cast<long long>(ok), static_cast<long long>(refused),
      static_cast<long long>(errors), pct(lat_ms, 50), pct(lat_ms, 90), pct(lat_ms, 99),
      lat_ms.empty() ? 0.0 : lat_ms.back(), pct(lag_ms, 50), pct(lag_ms, 99));
  if (!first_error.empty()) std::printf(" first_error=\"%s\"", first_error.c_str());
  std::printf("\nlatency_ms_by_second_sent:");
  for (size_t sec = 0; sec < by_second.size(); ++sec) {
    std::vector<double>& v = by_second[sec];
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::printf(" s%zu:n=%zu,p50=%.2f,p99=%.2f", sec, v.size(), pct(v, 50), pct(v, 99));
  }
  std::printf("\n");
  return errors == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "grpc_echo_bench server --listen ADDR[,ADDR] [--ready_file F] [--refuse_percent P "
      "[--refuse_early]] | client --target ADDR --bytes N[,N] [--calls R] [--check] | "
      "openloop --target ADDR --bytes N --rate R [--seconds S] [--connections C] [--method M]");
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  const std::string mode = positional.size() == 2 ? positional[1] : "";
  if (mode == "server") return RunServer();
  if (mode == "client") return RunClient();
  if (mode == "openloop") return RunOpenLoop();
  std::fprintf(stderr, "%s\n", absl::ProgramUsageMessage().data());
  return 2;
}
