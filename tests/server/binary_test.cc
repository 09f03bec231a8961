// The moeserve binary as a process: flags, the ready file, health, serving, metrics, a clean
// exit 0 on SIGTERM, and exit 1 (no serving) on bad configuration.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "moeserve_build_info.h"
#include "server/limits.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

std::string TempPath(const std::string& stem) {
  return ::testing::TempDir() + "/" + stem + "." + std::to_string(getpid());
}

class Process {
 public:
  // `output`: if set, stdout and stderr go to this file.
  explicit Process(std::vector<std::string> args, const std::string& output = "",
                   const char* binary = MOESERVE_BINARY) {
    args.insert(args.begin(), binary);
    pid_ = fork();
    if (pid_ == 0) {
      if (!output.empty()) {
        const int fd = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
          dup2(fd, 1);
          dup2(fd, 2);
        }
      }
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // Exit status, or -1 if still running after `timeout`.
  int Wait(std::chrono::seconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  bool Running() {
    if (exited_) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      return false;
    }
    return true;
  }
  void Signal(int signo) { kill(pid_, signo); }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The ready file's lines once it exists (empty if the process exits or 120 s pass first).
std::vector<std::string> WaitForReadyFile(Process& p, const std::string& path) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < end && p.Running()) {
    std::ifstream f(path);
    if (f) {
      std::vector<std::string> lines;
      for (std::string line; std::getline(f, line);) lines.push_back(line);
      return lines;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return {};
}

TEST(BinaryTest, ServesThenExitsCleanlyOnSigterm) {
  const std::string ready = TempPath("moeserve_ready");
  std::remove(ready.c_str());
  Process p({"--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0", "--ready_file=" + ready,
             "--model=tiny", "--hidden=64", "--intermediate=32", "--num_experts=4", "--topk=2",
             "--threads=1", "--server_threads=1"});
  const std::vector<std::string> lines = WaitForReadyFile(p, ready);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[0], MatchesRegex("127\\.0\\.0\\.1:[1-9][0-9]*"));
  EXPECT_THAT(lines[1], MatchesRegex("metrics 127\\.0\\.0\\.1:[1-9][0-9]*"));
  EXPECT_NE(lines[0], "127.0.0.1:0");

  auto channel = grpc::CreateChannel(lines[0], grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  for (const char* service : {"", "moeserve.v1.MoeService"}) {
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  auto stub = v1::MoeService::NewStub(channel);
  v1::ModelInfo info;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  }
  EXPECT_EQ(info.model_name(), "tiny");
  EXPECT_EQ(info.hidden(), 64);
  EXPECT_EQ(info.num_experts(), 4);
  // Derived from the model: 8192 fp32 tokens of hidden 64 (and top-2 ids and weights) fit.
  ModelConfig served = ModelPreset("tiny").value();
  served.hidden = 64;
  served.intermediate = 32;
  served.num_experts = 4;
  served.topk = 2;
  EXPECT_EQ(info.max_message_bytes(), MaxForwardMessageBytes(served, 8192));
  EXPECT_EQ(info.max_tokens_per_request(), 8192);
  std::mt19937_64 rng(5);
  v1::ForwardRequest req =
      testing::RandomRequest(rng, 0, 4, 64, 4, 2, v1::DTYPE_BF16, v1::DTYPE_INT32);
  v1::ForwardResponse resp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = stub->Forward(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(resp.output().data().size(), 4u * 64u * 2u);

  const int metrics_port = std::stoi(lines[1].substr(lines[1].rfind(':') + 1));
  const std::string metrics = testing::HttpGetMetrics(metrics_port);
  EXPECT_EQ(testing::MetricValue(metrics, "moeserve_tokens_total"), 4);

  p.Signal(SIGTERM);
  EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 0);
  std::remove(ready.c_str());
}

TEST(BinaryTest, SigintAlsoExitsCleanly) {
  const std::string ready = TempPath("moeserve_ready_int");
  std::remove(ready.c_str());
  Process p({"--listen=127.0.0.1:0", "--metrics_address=", "--ready_file=" + ready, "--hidden=64",
             "--intermediate=32", "--threads=1"});
  const std::vector<std::string> lines = WaitForReadyFile(p, ready);
  ASSERT_EQ(lines.size(), 1u);  // metrics off: one line
  p.Signal(SIGINT);
  EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 0);
  std::remove(ready.c_str());
}

TEST(BinaryTest, BadConfigurationExitsOne) {
  for (const char* bad :
       {"--model=no-such-model", "--experts=bogus", "--weight_format=fp4", "--hidden=-5",
        "--backend=tpu", "--max_tokens_per_request=0", "--listen=", "--listen=not-an-address:99999",
        // Sizes that used to crash (SIGSEGV) or start serving.
        "--hidden=1073741824", "--hidden=9223372036854775807", "--intermediate=1073741824",
        "--num_experts=100000",
        // Batcher settings (refused with the flags, see below).
        "--company_wait_us=-3", "--max_batch_delay_us=-1", "--gather_threads=-1",
        "--gather_threads=65", "--malloc_trim_threshold_mb=-1",
        "--malloc_trim_threshold_mb=1048577", "--upload_min_bytes=-1", "--inline_request_bytes=-3",
        "--grpc_channel_args=foo", "--grpc_channel_args=grpc.http2.max_frame_size=big",
        "--grpc_channel_args=http2.x=1", "--group_formation_timeout_s=0",
        "--group_formation_timeout_s=86401"}) {
    Process p({"--listen=127.0.0.1:0", "--metrics_address=", "--hidden=64", "--intermediate=32",
               "--threads=1", bad});
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 1) << bad;
  }
}

// Batcher settings the batcher would refuse are refused with the flags, before the server
// listens or loads a weight (they used to pass until the weights had loaded).
TEST(BinaryTest, BadBatcherFlagsAreRefusedBeforeListening) {
  for (const char* bad : {"--company_wait_us=-3", "--max_batch_delay_us=-1", "--max_batch_tokens=0",
                          "--max_queued_tokens=0", "--inline_max_tokens=-1",
                          "--max_queue_wait_ms=-1", "--step_spin_us=-2", "--step_spin_us=2000000",
                          "--lane_lead_us=-2", "--lane_lead_us=2000000"}) {
    const std::string log = ::testing::TempDir() + "/bad_batcher_flag.log";
    Process p({"--listen=127.0.0.1:0", "--metrics_address=", "--hidden=64", "--intermediate=32",
               "--threads=1", bad},
              log);
    ASSERT_EQ(p.Wait(std::chrono::seconds(60)), 1) << bad;
    const std::string out = ReadFile(log);
    EXPECT_NE(out.find("bad flags"), std::string::npos) << bad << ": " << out;
    EXPECT_NE(out.find("batcher flags"), std::string::npos) << bad << ": " << out;
    EXPECT_EQ(out.find("listening"), std::string::npos) << bad << ": " << out;
    std::remove(log.c_str());
  }
}

// Limits that cannot hold (issue 14 items 2 and 4): non-positive, beyond the memory there is, or
// a token limit whose step buffers cannot fit.
// With a queue-wait bound the server times its steps before it serves (the log says the line
// it learned), and --warm_graphs on an engine without graphs is a no-op; both then serve (over
// a listener with a tuned HTTP/2 frame size, --grpc_channel_args).
TEST(BinaryTest, QueueWaitBoundIsCalibratedBeforeServing) {
  // So is the auto company wait, which weighs its callers' turnaround against the line.
  for (const char* flag : {"--max_queue_wait_ms=5", "--company_wait_us=-1"}) {
    SCOPED_TRACE(flag);
    const std::string ready = TempPath("moeserve_ready_calibrated");
    const std::string log = TempPath("moeserve_log_calibrated");
    std::remove(ready.c_str());
    Process p(
        {"--listen=127.0.0.1:0", "--metrics_address=", "--ready_file=" + ready, "--model=tiny",
         "--hidden=64", "--intermediate=32", "--num_experts=4", "--topk=2", "--threads=1", flag,
         "--warm_graphs", "--grpc_channel_args=grpc.http2.max_frame_size=1048576"},
        log);
    const std::vector<std::string> lines = WaitForReadyFile(p, ready);
    ASSERT_FALSE(lines.empty()) << ReadFile(log);
    EXPECT_THAT(ReadFile(log), HasSubstr("moeserve: batcher calibrated in "));
    auto stub =
        v1::MoeService::NewStub(grpc::CreateChannel(lines[0], grpc::InsecureChannelCredentials()));
    std::mt19937_64 rng(6);
    v1::ForwardRequest req =
        testing::RandomRequest(rng, 1, 4, 64, 4, 2, v1::DTYPE_BF16, v1::DTYPE_INT32);
    v1::ForwardResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status s = stub->Forward(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    p.Signal(SIGTERM);
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 0);
    std::remove(ready.c_str());
    std::remove(log.c_str());
  }
}

TEST(BinaryTest, LimitsBeyondMemoryExitOne) {
  for (const char* bad :
       {"--max_queued_bytes=-1", "--max_queued_bytes=9223372036854775807", "--grpc_memory_bytes=0",
        "--grpc_memory_bytes=9223372036854775807", "--max_concurrent_streams=0",
        "--grpc_max_threads=0", "--max_metadata_bytes=0", "--max_message_bytes=9223372036854775807",
        "--max_tokens_per_request=4611686018427387904",
        "--model=deepseek-v3 --num_layers=1 --max_tokens_per_request=2147483647"}) {
    std::vector<std::string> args = {"--listen=127.0.0.1:0", "--metrics_address=", "--hidden=64",
                                     "--intermediate=32", "--threads=1"};
    for (absl::string_view a : absl::StrSplit(bad, ' ')) args.emplace_back(a);
    Process p(args);
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 1) << bad;
  }
}

// The default of `flag` as --helpfull prints it ("" if absent).
std::string HelpDefault(const std::string& help, const std::string& flag) {
  std::smatch m;
  const std::regex re("--" + flag + " \\([\\s\\S]*?\\);\\s+default: (\"[^\"]*\"|\\w+);");
  return std::regex_search(help, m, re) ? m[1].str() : "";
}

// Issue 14 item 1: the binary listened on 0.0.0.0:50051 and 0.0.0.0:9090 unless told
// otherwise, with reflection and GetExpertWeights always on.
TEST(BinaryTest, DefaultsAreLoopbackAndClosed) {
  std::string help;
  FILE* f = popen(MOESERVE_BINARY " --helpfull 2>&1", "r");
  ASSERT_NE(f, nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) help.append(buf, n);
  pclose(f);
  EXPECT_EQ(HelpDefault(help, "listen"), "\"127.0.0.1:50051\"") << help.substr(0, 2000);
  EXPECT_EQ(HelpDefault(help, "metrics_address"), "\"127.0.0.1:9464\"");
  EXPECT_EQ(HelpDefault(help, "enable_reflection"), "false");
  EXPECT_EQ(HelpDefault(help, "enable_get_expert_weights"), "false");
  EXPECT_EQ(HelpDefault(help, "bootstrap_listen"), "\"\"");
  EXPECT_EQ(HelpDefault(help, "auth_token_file"), "\"\"");
}

TEST(BinaryTest, ExpertWeightsOnlyWithTheFlag) {
  for (const bool enable : {false, true}) {
    const std::string ready = TempPath(enable ? "moeserve_ready_gew1" : "moeserve_ready_gew0");
    std::remove(ready.c_str());
    std::vector<std::string> args = {"--listen=127.0.0.1:0",
                                     "--metrics_address=",
                                     "--ready_file=" + ready,
                                     "--hidden=64",
                                     "--intermediate=32",
                                     "--num_experts=4",
                                     "--topk=2",
                                     "--threads=1"};
    if (enable) args.push_back("--enable_get_expert_weights");
    Process p(args);
    const std::vector<std::string> lines = WaitForReadyFile(p, ready);
    ASSERT_EQ(lines.size(), 1u);
    auto stub =
        v1::MoeService::NewStub(grpc::CreateChannel(lines[0], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::GetExpertWeightsRequest req;
    req.set_expert(1);
    v1::GetExpertWeightsResponse resp;
    grpc::Status s = stub->GetExpertWeights(&ctx, req, &resp);
    if (enable) {
      EXPECT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.w13().data().size(), 2u * 32 * 64 * 2);
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
      EXPECT_THAT(s.error_message(), HasSubstr("--enable_get_expert_weights"));
    }
    p.Signal(SIGTERM);
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 0);
    std::remove(ready.c_str());
  }
}

TEST(BinaryTest, UnusableSecurityFlagsExitOne) {
  for (const char* bad :
       {"--tls_cert=/nonexistent/cert.pem", "--tls_key=/nonexistent/key.pem",
        "--tls_client_ca=/nonexistent/ca.pem", "--auth_token_file=/nonexistent/tokens",
        "--metrics_tls_cert=/nonexistent/cert.pem", "--internal_tls_cert=/nonexistent/c.pem",
        "--bootstrap_token_file=/nonexistent/tokens", "--tls_refresh_s=0"}) {
    Process p({"--listen=127.0.0.1:0", "--metrics_address=", "--hidden=64", "--intermediate=32",
               "--threads=1", bad});
    EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 1) << bad;
  }
}

TEST(BinaryTest, PortInUseExitsOne) {
  const std::string ready = TempPath("moeserve_ready_port");
  std::remove(ready.c_str());
  Process first({"--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0", "--ready_file=" + ready,
                 "--hidden=64", "--intermediate=32", "--threads=1"});
  const std::vector<std::string> lines = WaitForReadyFile(first, ready);
  ASSERT_EQ(lines.size(), 2u);
  // Same gRPC port: refused, not silently shared.
  Process second({"--listen=" + lines[0], "--metrics_address=", "--hidden=64", "--intermediate=32",
                  "--threads=1"});
  EXPECT_EQ(second.Wait(std::chrono::seconds(60)), 1);
  // Same metrics port: refused too.
  Process third({"--listen=127.0.0.1:0", "--metrics_address=" + lines[1].substr(8), "--hidden=64",
                 "--intermediate=32", "--threads=1"});
  EXPECT_EQ(third.Wait(std::chrono::seconds(60)), 1);
  first.Signal(SIGTERM);
  EXPECT_EQ(first.Wait(std::chrono::seconds(60)), 0);
  std::remove(ready.c_str());
}

// Every ABSL_FLAG name defined in a source file.
std::vector<std::string> FlagsDefinedIn(const std::string& path) {
  const std::string text = ReadFile(path);
  std::vector<std::string> names;
  const std::string key = "ABSL_FLAG(";
  for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + 1)) {
    const size_t comma = text.find(',', at);
    const size_t begin = text.find_first_not_of(" \n", comma + 1);
    const size_t end = text.find(',', begin);
    names.push_back(text.substr(begin, end - begin));
  }
  return names;
}

// --help lists every flag the binary defines (it used to print "No flags matched").
TEST(BinaryTest, HelpListsEveryFlag) {
  const struct {
    const char* binary;
    std::string source;
  } cases[] = {
      {MOESERVE_BINARY, std::string(MOESERVE_SOURCE_DIR) + "/server/main.cc"},
      {MOESERVE_CLI_BINARY, std::string(MOESERVE_SOURCE_DIR) + "/clients/cpp/moeserve_cli.cc"}};
  for (const auto& c : cases) {
    const std::vector<std::string> flags = FlagsDefinedIn(c.source);
    ASSERT_GT(flags.size(), 10u) << c.source;
    for (const char* help : {"--help", "--helpfull"}) {
      const std::string out = TempPath("moeserve_help");
      Process p({help}, out, c.binary);
      const int rc = p.Wait(std::chrono::seconds(30));
      EXPECT_TRUE(rc == 0 || rc == 1) << c.binary << " " << help << " exited " << rc;
      const std::string text = ReadFile(out);
      EXPECT_THAT(text, ::testing::Not(HasSubstr("No flags matched"))) << c.binary;
      for (const std::string& flag : flags) {
        EXPECT_THAT(text, HasSubstr("--" + flag + " ")) << c.binary << " " << help;
      }
      std::remove(out.c_str());
    }
  }
}

TEST(BinaryTest, VersionPrintsTheBuild) {
  for (const char* binary : {MOESERVE_BINARY, MOESERVE_CLI_BINARY}) {
    const std::string out = TempPath("moeserve_version");
    Process p({"--version"}, out, binary);
    EXPECT_EQ(p.Wait(std::chrono::seconds(30)), 0);
    const std::string text = ReadFile(out);
    EXPECT_THAT(text, HasSubstr(build_info::kVersion));
    EXPECT_THAT(text, HasSubstr(build_info::kCommit));
    EXPECT_THAT(text, HasSubstr(std::string("build type: ") + build_info::kBuildType));
    EXPECT_THAT(text, ::testing::Not(HasSubstr("Debug build (NDEBUG not #defined)")));
    std::remove(out.c_str());
  }
  EXPECT_STREQ(build_info::kVersion, MOESERVE_PROJECT_VERSION);
  EXPECT_STREQ(build_info::kBuildType, MOESERVE_CMAKE_BUILD_TYPE);
}

// The log file's lines so far.
std::string Log(const std::string& path) { return ReadFile(path); }

// "HOST:PORT" from the log's "listening: grpc=HOST:PORT metrics=..." line, once it appears.
std::string WaitForListening(Process& p, const std::string& log) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < end && p.Running()) {
    const std::string text = Log(log);
    const size_t at = text.find("listening: grpc=");
    if (at != std::string::npos && text.find('\n', at) != std::string::npos) {
      const size_t begin = at + std::strlen("listening: grpc=");
      return text.substr(begin, text.find(' ', begin) - begin);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "";
}

// Ports open before the weights load: health NOT_SERVING and calls UNAVAILABLE (saying how far
// the load is) while it runs, progress on stderr, then SERVING.
TEST(BinaryTest, StartupIsObservableWhileLoading) {
  const std::string ready = TempPath("moeserve_ready_slow");
  const std::string log = TempPath("moeserve_log_slow");
  std::remove(ready.c_str());
  Process p({"--listen=127.0.0.1:0", "--metrics_address=127.0.0.1:0", "--ready_file=" + ready,
             "--model=tiny", "--num_layers=6", "--hidden=64", "--intermediate=32",
             "--num_experts=4", "--topk=2", "--threads=1", "--debug_load_delay_ms=500"},
            log);
  const std::string target = WaitForListening(p, log);
  ASSERT_FALSE(target.empty()) << Log(log);
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  }
  {
    auto stub = v1::MoeService::NewStub(channel);
    std::mt19937_64 rng(5);
    v1::ForwardRequest fr =
        testing::RandomRequest(rng, 0, 4, 64, 4, 2, v1::DTYPE_BF16, v1::DTYPE_INT32);
    v1::ForwardResponse out;
    grpc::ClientContext ctx;
    grpc::Status s = stub->Forward(&ctx, fr, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), ::testing::MatchesRegex(".*(loading weights|preparing).*"));
  }
  EXPECT_FALSE(std::ifstream(ready).good());  // the ready file means SERVING
  // SERVING once loaded: about 6 x 0.5 s.
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool serving = false;
  while (!serving && std::chrono::steady_clock::now() < end && p.Running()) {
    grpc::ClientContext ctx;
    serving = health->Check(&ctx, req, &resp).ok() &&
              resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
    if (!serving) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(serving) << Log(log);
  const std::vector<std::string> lines = WaitForReadyFile(p, ready);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], target);
  const std::string text = Log(log);
  // The memory estimate first, then layer i of N with GiB and rate, then the total.
  const size_t estimate = text.find("GiB of expert weights in host memory (6 layer shards)");
  const size_t first = text.find("layer 1 of 6");
  const size_t last = text.find("layer 6 of 6");
  const size_t loaded = text.find("weights loaded:");
  ASSERT_NE(estimate, std::string::npos) << text;
  ASSERT_NE(first, std::string::npos) << text;
  ASSERT_NE(last, std::string::npos) << text;
  ASSERT_NE(loaded, std::string::npos) << text;
  EXPECT_LT(text.find("listening:"), estimate);
  EXPECT_LT(estimate, first);
  EXPECT_LT(first, last);
  EXPECT_LT(last, loaded);
  EXPECT_THAT(text, HasSubstr("GiB/s"));
  const int metrics_port = std::stoi(lines[1].substr(lines[1].rfind(':') + 1));
  const std::string metrics = testing::HttpGetMetrics(metrics_port);
  EXPECT_EQ(testing::MetricValue(metrics, "moeserve_serving"), 1);
  EXPECT_GT(testing::MetricValue(metrics, "moeserve_weights_load_seconds"), 2.0);
  p.Signal(SIGTERM);
  EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 0);
  std::remove(ready.c_str());
  std::remove(log.c_str());
}

// A SIGTERM while the weights load stops the load and exits 0 quickly.
TEST(BinaryTest, SigtermDuringLoadExitsZero) {
  const std::string log = TempPath("moeserve_log_term");
  Process p({"--listen=127.0.0.1:0", "--metrics_address=", "--model=tiny", "--num_layers=50",
             "--hidden=64", "--intermediate=32", "--num_experts=4", "--topk=2", "--threads=1",
             "--debug_load_delay_ms=1000"},
            log);
  ASSERT_FALSE(WaitForListening(p, log).empty()) << Log(log);
  const auto start = std::chrono::steady_clock::now();
  p.Signal(SIGTERM);
  EXPECT_EQ(p.Wait(std::chrono::seconds(30)), 0) << Log(log);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  EXPECT_THAT(Log(log), HasSubstr("during the weight load"));
  std::remove(log.c_str());
}

// A token limit that cannot fit the message limit is lowered, and the log says so.
TEST(BinaryTest, TokenLimitLoweredToFitMessageLimit) {
  const std::string ready = TempPath("moeserve_ready_limit");
  const std::string log = TempPath("moeserve_log_limit");
  std::remove(ready.c_str());
  Process p({"--listen=127.0.0.1:0", "--metrics_address=", "--ready_file=" + ready, "--model=tiny",
             "--hidden=1024", "--intermediate=32", "--threads=1", "--max_message_bytes=1000000"},
            log);
  const std::vector<std::string> lines = WaitForReadyFile(p, ready);
  ASSERT_EQ(lines.size(), 1u) << Log(log);
  EXPECT_THAT(Log(log), HasSubstr("--max_tokens_per_request lowered from 8192 to"));
  auto stub =
      v1::MoeService::NewStub(grpc::CreateChannel(lines[0], grpc::InsecureChannelCredentials()));
  v1::ModelInfo info;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_LT(info.max_tokens_per_request(), 8192);
  EXPECT_GT(info.max_tokens_per_request(), 100);
  EXPECT_EQ(info.max_message_bytes(), 1000000);
  p.Signal(SIGTERM);
  EXPECT_EQ(p.Wait(std::chrono::seconds(60)), 0);
  std::remove(ready.c_str());
  std::remove(log.c_str());
}

}  // namespace
}  // namespace moeserve
