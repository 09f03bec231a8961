// The overload and slow-client runs of issue 14 item 2, against the moeserve binary, with the
// server's resident memory (VmRSS) sampled every 20 ms:
//  - overload: `--requests` Forward calls of about `--request_mib` MiB each, all at once (the
//    issue: 100 x 8 MiB all accepted, RSS 119 MB -> 1,240 MB, the last answer after 99 s);
//  - slow clients: `--slow_clients` clients send a Forward each and never read the answer (the
//    issue: 20 such clients pinned 586 MB with no timeout).
// Each run is done twice in one invocation: with the limits (defaults or the flags given) and
// with them off (--max_queued_bytes=0 --max_answer_hold_ms=0, the queue bound raised), the peer
// that shows what the limits change. Prints a markdown table (RESULTS.md).
//
//   build/tests/benchmarks/overload/overload_bench [--requests=100 --request_mib=8 ...]
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "moeserve/v1/moeserve.pb.h"

ABSL_FLAG(std::string, binary, MOESERVE_BINARY, "The moeserve binary");
ABSL_FLAG(int, requests, 100, "Overload: concurrent Forward calls");
ABSL_FLAG(int, request_mib, 8, "Overload: MiB per request (FP32 hidden states)");
ABSL_FLAG(int, slow_clients, 20, "Slow clients: connections that never read their answer");
ABSL_FLAG(int64_t, hidden, 4096, "Model hidden size");
ABSL_FLAG(std::string, limits, "--max_queued_bytes=268435456 --max_answer_hold_ms=2000",
          "Server flags of the run with limits (the rest default)");

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Resident set of `pid` in MiB, or -1.
double RssMiB(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (f >> key) {
    if (key == "VmRSS:") {
      double kb = 0;
      f >> kb;
      return kb / 1024;
    }
  }
  return -1;
}

class Server {
 public:
  explicit Server(const std::vector<std::string>& flags) {
    ready_ = "/tmp/overload_bench_ready." + std::to_string(getpid());
    std::remove(ready_.c_str());
    std::vector<std::string> args = {absl::GetFlag(FLAGS_binary), "--listen=127.0.0.1:0",
                                     "--metrics_address=127.0.0.1:0", "--ready_file=" + ready_};
    args.insert(args.end(), flags.begin(), flags.end());
    pid_ = fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    for (int i = 0; i < 6000 && metrics_port_ == 0; ++i) {
      std::ifstream f(ready_);
      std::string metrics;
      if (std::getline(f, address_) && std::getline(f, metrics)) {
        metrics_port_ = std::stoi(metrics.substr(metrics.rfind(':') + 1));
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  // A gauge or counter from GET /metrics (the first sample named `name`), or -1.
  double Metric(const std::string& name) const {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(metrics_port_));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::string text;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string req = "GET /metrics HTTP/1.0\r\n\r\n";
      if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) > 0) {
        char buf[8192];
        for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) text.append(buf, n);
      }
    }
    close(fd);
    const size_t at = text.find("\n" + name + " ");
    return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
  }
  ~Server() {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
    std::remove(ready_.c_str());
  }
  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int metrics_port_ = 0;
  std::string ready_, address_;
};

// Samples the server's RSS until stopped; keeps the peak.
class RssSampler {
 public:
  explicit RssSampler(pid_t pid)
      : thread_([this, pid] {
          while (!stop_) {
            peak_ = std::max(peak_.load(), RssMiB(pid));
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        }) {}
  double Stop() {
    stop_ = true;
    thread_.join();
    return peak_;
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<double> peak_{0};
  std::thread thread_;
};

std::string Request(int64_t m, int64_t hidden, std::mt19937& rng) {
  moeserve::v1::ForwardRequest r;
  auto* x = r.mutable_hidden_states();
  x->set_dtype(moeserve::v1::DTYPE_FP32);
  x->add_shape(m);
  x->add_shape(hidden);
  std::vector<float> v(m * hidden);
  std::normal_distribution<float> normal;
  for (float& f : v) f = normal(rng);
  x->set_data(v.data(), v.size() * 4);
  auto* ids = r.mutable_topk_ids();
  ids->set_dtype(moeserve::v1::DTYPE_INT32);
  ids->add_shape(m);
  ids->add_shape(2);
  std::vector<int32_t> id(m * 2);
  for (int64_t t = 0; t < m; ++t) id[2 * t] = t % 8, id[2 * t + 1] = (t + 3) % 8;
  ids->set_data(id.data(), id.size() * 4);
  auto* w = r.mutable_topk_weights();
  w->set_dtype(moeserve::v1::DTYPE_FP32);
  w->add_shape(m);
  w->add_shape(2);
  std::vector<float> wv(m * 2, 0.5f);
  w->set_data(wv.data(), wv.size() * 4);
  return r.SerializeAsString();
}

struct Outcome {
  double idle_rss = 0, peak_rss = 0, end_rss = 0, seconds = 0;
  double held_mib = 0;  // moeserve_held_bytes at the end
  std::map<std::string, int> codes;
};

std::string CodeName(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    default:
      return absl::StrCat("code ", static_cast<int>(c));
  }
}

// All requests at once, every answer read.
Outcome Overload(const Server& server, const std::string& request, int n) {
  Outcome o;
  o.idle_rss = RssMiB(server.pid());
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(256 << 20);
  args.SetMaxReceiveMessageSize(256 << 20);
  auto channel =
      grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(), args);
  grpc::GenericStub stub(channel);
  RssSampler sampler(server.pid());
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  std::mutex mu;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
      grpc::Slice slice(request.data(), request.size());
      const grpc::ByteBuffer req(&slice, 1);
      grpc::ByteBuffer resp;
      std::promise<grpc::Status> done;
      stub.UnaryCall(&ctx, "/moeserve.v1.MoeService/Forward", grpc::StubOptions(), &req, &resp,
                     [&done](grpc::Status s) { done.set_value(s); });
      const grpc::Status s = done.get_future().get();
      std::lock_guard<std::mutex> lock(mu);
      ++o.codes[CodeName(s.error_code())];
    });
  }
  for (auto& t : threads) t.join();
  o.seconds = Since(start);
  o.peak_rss = sampler.Stop();
  o.end_rss = RssMiB(server.pid());
  o.held_mib = server.Metric("moeserve_held_bytes") / (1 << 20);
  return o;
}

// Each client sends one request on its own connection and never reads the answer; after
// `wait_s` the clients finally read (or give up).
Outcome SlowClients(const Server& server, const std::string& request, int n, double wait_s) {
  Outcome o;
  o.idle_rss = RssMiB(server.pid());
  RssSampler sampler(server.pid());
  const auto start = Clock::now();
  struct Client {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<grpc::GenericStub> stub;
    grpc::ClientContext ctx;
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call;
  };
  std::vector<std::unique_ptr<Client>> clients;
  auto next = [](grpc::CompletionQueue& cq) {
    void* tag;
    bool ok;
    return cq.Next(&tag, &ok) && ok;
  };
  for (int i = 0; i < n; ++i) {
    auto c = std::make_unique<Client>();
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt("overload_bench.client", i);  // a connection of its own
    args.SetMaxSendMessageSize(256 << 20);
    args.SetMaxReceiveMessageSize(256 << 20);
    c->channel =
        grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(), args);
    c->stub = std::make_unique<grpc::GenericStub>(c->channel);
    c->call = c->stub->PrepareCall(&c->ctx, "/moeserve.v1.MoeService/Forward", &c->cq);
    c->call->StartCall(nullptr);
    next(c->cq);
    grpc::Slice slice(request.data(), request.size());
    c->call->Write(grpc::ByteBuffer(&slice, 1), nullptr);
    next(c->cq);
    c->call->WritesDone(nullptr);
    next(c->cq);
    clients.push_back(std::move(c));
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(wait_s));
  o.end_rss = RssMiB(server.pid());  // before any client reads
  o.held_mib = server.Metric("moeserve_held_bytes") / (1 << 20);
  for (auto& c : clients) {
    grpc::ByteBuffer answer;
    c->call->Read(&answer, nullptr);
    const bool got = next(c->cq);
    grpc::Status s;
    c->call->Finish(&s, nullptr);
    next(c->cq);
    ++o.codes[got && s.ok() ? "OK (read late)" : CodeName(s.error_code())];
  }
  o.seconds = Since(start);
  o.peak_rss = sampler.Stop();
  return o;
}

void Row(const char* run, const char* limits, const Outcome& o, const char* time_label) {
  std::string codes;
  for (const auto& [code, count] : o.codes)
    absl::StrAppend(&codes, codes.empty() ? "" : ", ", count, " ", code);
  std::printf("| %s | %s | %.0f | %.0f | %.0f | %.1f | %.1f s %s | %s |\n", run, limits, o.idle_rss,
              o.peak_rss, o.end_rss, o.held_mib, o.seconds, time_label, codes.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t hidden = absl::GetFlag(FLAGS_hidden);
  const int64_t m = (int64_t{absl::GetFlag(FLAGS_request_mib)} << 20) / (hidden * 4);
  std::mt19937 rng(1);
  const std::string request = Request(m, hidden, rng);
  const std::vector<std::string> model = {
      "--model=tiny",
      "--num_experts=8",
      "--topk=2",
      absl::StrCat("--hidden=", hidden),
      "--intermediate=32",
      "--threads=2",
      "--max_message_bytes=268435456",
      absl::StrCat("--max_tokens_per_request=", std::max<int64_t>(m, 8192))};
  std::vector<std::string> limited = model;
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_limits), ' ')) {
    if (!f.empty()) limited.emplace_back(f);
  }
  std::vector<std::string> unlimited = model;
  unlimited.insert(unlimited.end(), {"--max_queued_bytes=0", "--max_answer_hold_ms=0",
                                     "--max_queued_tokens=100000000"});
  std::printf(
      "| run | server limits | idle RSS MiB | peak RSS MiB | RSS MiB at end | "
      "held MiB at end | time | answers |\n|---|---|---|---|---|---|---|---|\n");
  for (bool limits : {true, false}) {
    Server server(limits ? limited : unlimited);
    if (server.address().empty()) {
      std::fprintf(stderr, "overload_bench: the server did not start\n");
      return 1;
    }
    const Outcome o = Overload(server, request, absl::GetFlag(FLAGS_requests));
    Row(absl::StrCat(absl::GetFlag(FLAGS_requests), " x ", request.size() >> 20, " MiB at once")
            .c_str(),
        limits ? absl::GetFlag(FLAGS_limits).c_str() : "off", o, "to the last answer");
  }
  for (bool limits : {true, false}) {
    Server server(limits ? limited : unlimited);
    const Outcome o = SlowClients(server, request, absl::GetFlag(FLAGS_slow_clients), 6.0);
    Row(absl::StrCat(absl::GetFlag(FLAGS_slow_clients), " clients never reading").c_str(),
        limits ? absl::GetFlag(FLAGS_limits).c_str() : "off", o, "(RSS at end: after 6 s unread)");
  }
  return 0;
}
