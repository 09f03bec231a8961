// The C++ client against a secured server (TLS + bearer token), and its choice between the
// unary GetExpertWeights and StreamExpertWeights: the stream exactly when one expert does not
// fit in a message (issue 14 item 6), with the same bytes as the engine's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "clients/cpp/moeserve_client.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "server/security.h"
#include "server/server.h"
#include "tests/server/test_certs.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::CertKey;
using ::moeserve::testing::MetricValue;
using ::moeserve::testing::TestCa;
using ::moeserve::testing::WriteFile;
using ::testing::HasSubstr;

constexpr char kToken[] = "client-test-token-0123456789";

class ClientSecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelOverrides o;
    o.num_layers = 2, o.num_experts = 6, o.topk = 2, o.hidden = 128, o.intermediate = 96;
    EngineOptions options;
    options.model = ApplyOverrides(ModelPreset("tiny").value(), o).value();
    options.seed = 17;
    options.num_threads = 1;
    engine_ = Engine::Create(options).value().release();
    ca_ = new TestCa("client test CA");
    dir_ = new std::string(testing::MakeTempDir("moeserve_client_security"));
    const CertKey server = ca_->Issue("localhost");
    ca_file_ = new std::string(WriteFile(*dir_, "ca.pem", ca_->cert_pem()));
    tls_ = new TlsFiles{WriteFile(*dir_, "server.pem", server.cert),
                        WriteFile(*dir_, "server.key", server.key), ""};
  }
  static void TearDownTestSuite() {
    delete tls_;
    delete ca_file_;
    delete dir_;
    delete ca_;
    delete engine_;
  }

  // A TLS server with a token and the expert weights on; `max_message_bytes` its limit.
  static std::unique_ptr<MoeServer> Start(int64_t max_message_bytes) {
    ServerOptions o;
    o.listen_addresses = {"127.0.0.1:0"};
    o.metrics_address = "127.0.0.1:0";
    o.server_threads = 1;
    o.health_poll = std::chrono::milliseconds(0);
    o.max_message_bytes = max_message_bytes;
    o.tls = *tls_;
    o.auth = BearerTokens::FromFile(WriteFile(*dir_, "tokens", std::string(kToken) + "\n"),
                                    "--auth_token_file")
                 .value();
    o.enable_get_expert_weights = true;
    return MoeServer::Start(engine_, o).value();
  }

  static std::unique_ptr<client::MoeClient> Client(const MoeServer& server,
                                                   const std::string& token = kToken) {
    client::MoeClientOptions o;
    o.tls_ca_file = *ca_file_;
    o.tls_server_name = "localhost";
    o.auth_token = token;
    return client::MoeClient::Create(server.bound_addresses()[0], o).value();
  }

  static void ExpectEngineWeights(const v1::GetExpertWeightsResponse& got, int layer, int expert) {
    std::string w13(2 * 96 * 128 * 2, '\0'), w2(128 * 96 * 2, '\0');
    ASSERT_TRUE(engine_
                    ->GetExpertWeightsBf16(layer, expert, reinterpret_cast<uint16_t*>(w13.data()),
                                           reinterpret_cast<uint16_t*>(w2.data()))
                    .ok());
    EXPECT_EQ(got.w13().dtype(), v1::DTYPE_BF16);
    EXPECT_EQ(got.w13().shape_size(), 2);
    EXPECT_EQ(got.w13().shape(0), 2 * 96);
    EXPECT_EQ(got.w2().shape(0), 128);
    EXPECT_TRUE(got.w13().data() == w13);
    EXPECT_TRUE(got.w2().data() == w2);
  }

  static double Calls(MoeServer& server, const char* method) {
    return MetricValue(testing::HttpGetMetrics(server.metrics().port()), "moeserve_requests_total",
                       {absl::StrCat("method=\"", method, "\"")});
  }

  static Engine* engine_;
  static TestCa* ca_;
  static std::string* dir_;
  static std::string* ca_file_;
  static TlsFiles* tls_;
};

Engine* ClientSecurityTest::engine_ = nullptr;
TestCa* ClientSecurityTest::ca_ = nullptr;
std::string* ClientSecurityTest::dir_ = nullptr;
std::string* ClientSecurityTest::ca_file_ = nullptr;
TlsFiles* ClientSecurityTest::tls_ = nullptr;

TEST_F(ClientSecurityTest, TlsAndTokenFromTheClientOptions) {
  auto server = Start(64 << 20);
  auto good = Client(*server);
  auto info = good->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->hidden(), 128);
  auto health = good->Health();
  ASSERT_TRUE(health.ok());
  auto wrong = Client(*server, "not-the-token-0123456789");
  EXPECT_EQ(wrong->GetModelInfo().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(wrong->Health().ok());  // health needs no token
  // Unreadable TLS files fail at Create, naming the file.
  client::MoeClientOptions bad;
  bad.tls_ca_file = *dir_ + "/absent.pem";
  auto c = client::MoeClient::Create("127.0.0.1:1", bad);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("absent.pem"));
}

TEST_F(ClientSecurityTest, UnaryWhenTheExpertFitsStreamWhenNot) {
  // 64 MiB: one expert (72 KiB) fits, the client asks the unary RPC.
  auto roomy = Start(64 << 20);
  auto got = Client(*roomy)->GetExpertWeights(1, 4);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectEngineWeights(*got, 1, 4);
  EXPECT_EQ(Calls(*roomy, "GetExpertWeights"), 1);
  EXPECT_EQ(Calls(*roomy, "StreamExpertWeights"), -1);  // never called

  // 32 KiB: it does not fit; the client streams it by itself.
  auto tight = Start(32 << 10);
  auto c = Client(*tight);
  EXPECT_EQ(c->GetExpertWeightsUnary(1, 4).status().code(), absl::StatusCode::kResourceExhausted);
  for (int expert : {0, 4, 5}) {
    got = c->GetExpertWeights(1, expert);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectEngineWeights(*got, 1, expert);
  }
  EXPECT_EQ(Calls(*tight, "StreamExpertWeights"), 3);
  // Tiny chunks reassemble to the same bytes.
  got = c->StreamExpertWeights(0, 2, 333);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectEngineWeights(*got, 0, 2);
  // A bad reference is the server's INVALID_ARGUMENT, whichever path.
  EXPECT_EQ(c->GetExpertWeights(0, 6).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moeserve
