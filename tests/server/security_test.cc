// Issue 14 item 1, "closed by default": a MoeServer in-process with real certificates made by
// the test (tests/server/test_certs.h). TLS and mutual TLS on the gRPC API (wrong CA, no client
// certificate, expired certificates, rotation without restart), the bearer token (missing,
// wrong, right, rotated; health stays open; the KServe v2 service checks the same token),
// reflection off unless asked (and only on the
// server that asked), TLS and mutual TLS on the metrics endpoint.
#include "server/security.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/metrics_http.h"
#include "server/server.h"
#include "server/tls.h"
#include "tests/server/test_certs.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::CertKey;
using ::moeserve::testing::HttpsGetMetrics;
using ::moeserve::testing::TestCa;
using ::moeserve::testing::WriteFile;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kToken1[] = "first-token-0123456789abcdef";
constexpr char kToken2[] = "second-token-0123456789abcdef";

struct Certs {
  TestCa ca{"moeserve test CA"};
  TestCa other_ca{"some other CA"};
  std::string dir = testing::MakeTempDir("moeserve_security");
  CertKey server = ca.Issue("localhost");
  CertKey client = ca.Issue("frontend");
  CertKey wrong_ca_client = other_ca.Issue("frontend");
  CertKey expired_client = ca.Issue("frontend", -2 * 86400, -86400);
  CertKey expired_server = ca.Issue("localhost", -2 * 86400, -86400);
  std::string ca_file = WriteFile(dir, "ca.pem", ca.cert_pem());
  std::string server_cert = WriteFile(dir, "server.pem", server.cert);
  std::string server_key = WriteFile(dir, "server.key", server.key);
};

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EngineOptions options;
    ModelOverrides o;
    o.num_experts = 4, o.topk = 2, o.hidden = 64, o.intermediate = 32;
    options.model = ApplyOverrides(ModelPreset("tiny").value(), o).value();
    options.seed = 3;
    options.num_threads = 1;
    engine_ = Engine::Create(options).value().release();
    certs_ = new Certs();
  }
  static void TearDownTestSuite() {
    delete certs_;
    delete engine_;
  }

  static ServerOptions Options() {
    ServerOptions o;
    o.listen_addresses = {"127.0.0.1:0"};
    o.metrics_address = "";
    o.server_threads = 1;
    o.health_poll = std::chrono::milliseconds(0);
    return o;
  }
  static std::unique_ptr<MoeServer> Start(const ServerOptions& o) {
    absl::StatusOr<std::unique_ptr<MoeServer>> server = MoeServer::Start(engine_, o);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }
  static TlsFiles ServerTls(bool mutual) {
    return {certs_->server_cert, certs_->server_key, mutual ? certs_->ca_file : ""};
  }

  static std::shared_ptr<grpc::Channel> Plain(const MoeServer& s) {
    return grpc::CreateChannel(s.bound_addresses()[0], grpc::InsecureChannelCredentials());
  }
  // A TLS channel trusting `ca_pem` (the test CA by default), presenting `client` if set.
  static std::shared_ptr<grpc::Channel> Tls(const MoeServer& s, const CertKey* client = nullptr,
                                            std::string ca_pem = "") {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ca_pem.empty() ? certs_->ca.cert_pem() : ca_pem;
    if (client != nullptr) {
      o.pem_cert_chain = client->cert;
      o.pem_private_key = client->key;
    }
    // A fresh connection each time (no subchannel sharing between the test's channels).
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return grpc::CreateCustomChannel(absl::StrCat("localhost:", s.port()), grpc::SslCredentials(o),
                                     args);
  }

  static grpc::Status Info(const std::shared_ptr<grpc::Channel>& channel,
                           const std::string& token = "") {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) ctx.AddMetadata("authorization", BearerHeader(token));
    v1::ModelInfo info;
    return v1::MoeService::NewStub(channel)->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  }
  static grpc::Status Health(const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::health::v1::HealthCheckResponse resp;
    return grpc::health::v1::Health::NewStub(channel)->Check(
        &ctx, grpc::health::v1::HealthCheckRequest(), &resp);
  }

  static Engine* engine_;
  static Certs* certs_;
};

Engine* SecurityTest::engine_ = nullptr;
Certs* SecurityTest::certs_ = nullptr;

// Issue 14 item 1: 0.0.0.0 and 9090 by default, reflection and GetExpertWeights always on.
TEST_F(SecurityTest, DefaultsAreLoopbackAndClosed) {
  const ServerOptions o;
  ASSERT_EQ(o.listen_addresses.size(), 1u);
  EXPECT_EQ(o.listen_addresses[0], "127.0.0.1:50051");
  EXPECT_EQ(o.metrics_address, "127.0.0.1:9464");
  EXPECT_FALSE(o.enable_reflection);
  EXPECT_FALSE(o.enable_get_expert_weights);
  EXPECT_EQ(o.auth, nullptr);
  EXPECT_FALSE(o.tls.enabled());
  EXPECT_TRUE(IsLocalAddress(o.listen_addresses[0]));
  EXPECT_TRUE(IsLocalAddress(o.metrics_address));
  EXPECT_FALSE(IsLocalAddress("0.0.0.0:50051"));
  EXPECT_TRUE(IsLocalAddress("unix:/tmp/x.sock"));
  EXPECT_TRUE(IsLocalAddress("[::1]:1"));
}

TEST_F(SecurityTest, TlsServesTlsClientsOnly) {
  ServerOptions o = Options();
  o.tls = ServerTls(/*mutual=*/false);
  auto server = Start(o);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(Info(Tls(*server)).ok()) << Info(Tls(*server)).error_message();
  EXPECT_TRUE(Health(Tls(*server)).ok());
  // Plaintext is not answered; neither is a client that trusts another CA.
  EXPECT_EQ(Info(Plain(*server)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Info(Tls(*server, nullptr, certs_->other_ca.cert_pem())).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecurityTest, MutualTlsRefusesMissingWrongCaAndExpiredClientCertificates) {
  ServerOptions o = Options();
  o.tls = ServerTls(/*mutual=*/true);
  auto server = Start(o);
  ASSERT_NE(server, nullptr);
  grpc::Status ok = Info(Tls(*server, &certs_->client));
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_TRUE(Health(Tls(*server, &certs_->client)).ok());
  EXPECT_EQ(Info(Tls(*server)).error_code(), grpc::StatusCode::UNAVAILABLE) << "no client cert";
  EXPECT_EQ(Info(Tls(*server, &certs_->wrong_ca_client)).error_code(),
            grpc::StatusCode::UNAVAILABLE)
      << "client cert from another CA";
  EXPECT_EQ(Info(Tls(*server, &certs_->expired_client)).error_code(), grpc::StatusCode::UNAVAILABLE)
      << "expired client cert";
  EXPECT_EQ(Info(Plain(*server)).error_code(), grpc::StatusCode::UNAVAILABLE);
  // The server is still fine.
  EXPECT_TRUE(Info(Tls(*server, &certs_->client)).ok());
}

TEST_F(SecurityTest, UnusableCertificateFilesRefusedAtStartNamingTheFlag) {
  const std::string& dir = certs_->dir;
  const std::string expired_cert = WriteFile(dir, "expired.pem", certs_->expired_server.cert);
  const std::string expired_key = WriteFile(dir, "expired.key", certs_->expired_server.key);
  const std::string other_key = WriteFile(dir, "other.key", certs_->client.key);
  const std::string garbage = WriteFile(dir, "garbage.pem", "not a certificate\n");
  struct Case {
    TlsFiles files;
    const char* want;
  } cases[] = {
      {{expired_cert, expired_key, ""}, "--tls_cert: the certificate"},
      {{certs_->server_cert, other_key, ""}, "--tls_key: the key"},
      {{garbage, certs_->server_key, ""}, "--tls_cert"},
      {{certs_->server_cert, certs_->server_key, garbage}, "--tls_client_ca"},
      {{certs_->server_cert, "", ""}, "--tls_cert and --tls_key go together"},
      {{"", "", certs_->ca_file}, "--tls_client_ca needs --tls_cert"},
      {{dir + "/missing.pem", certs_->server_key, ""}, "missing.pem"},
  };
  for (const Case& c : cases) {
    ServerOptions o = Options();
    o.tls = c.files;
    absl::StatusOr<std::unique_ptr<MoeServer>> server = MoeServer::Start(engine_, o);
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(std::string(server.status().message()), HasSubstr(c.want));
    // Never the key material.
    EXPECT_THAT(std::string(server.status().message()), Not(HasSubstr("PRIVATE KEY")));
  }
  EXPECT_THAT(
      std::string(
          CheckTlsFiles({expired_cert, expired_key, ""}, "--tls_", TlsRole::kServer).message()),
      HasSubstr("expired"));
}

// The client side of "expired certificate": a server presenting one (started without our
// start-up check) is refused by a client.
TEST_F(SecurityTest, ClientRefusesAnExpiredServerCertificate) {
  const std::string& dir = certs_->dir;
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      WriteFile(dir, "exp_server.key", certs_->expired_server.key),
      WriteFile(dir, "exp_server.pem", certs_->expired_server.cert), 60);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::experimental::TlsServerCredentials(options), &port);
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<grpc::Server> raw = builder.BuildAndStart();
  ASSERT_NE(raw, nullptr);
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = certs_->ca.cert_pem();
  auto channel = grpc::CreateChannel(absl::StrCat("localhost:", port), grpc::SslCredentials(o));
  EXPECT_EQ(Health(channel).error_code(), grpc::StatusCode::UNAVAILABLE);
  raw->Shutdown();
}

TEST_F(SecurityTest, ServerCertificateRotatesWithoutRestart) {
  const std::string dir = testing::MakeTempDir("moeserve_rotate");
  ServerOptions o = Options();
  o.tls = {WriteFile(dir, "server.pem", certs_->server.cert),
           WriteFile(dir, "server.key", certs_->server.key), ""};
  o.tls_refresh_s = 1;
  auto server = Start(o);
  ASSERT_NE(server, nullptr);
  const std::string other_ca = certs_->other_ca.cert_pem();
  ASSERT_TRUE(Info(Tls(*server)).ok());
  ASSERT_FALSE(Info(Tls(*server, nullptr, other_ca)).ok());
  // Rotate to a certificate from the other CA: new connections get it within a few seconds.
  const CertKey next = certs_->other_ca.Issue("localhost");
  WriteFile(dir, "server.key", next.key);
  WriteFile(dir, "server.pem", next.cert);
  bool rotated = false;
  for (int i = 0; i < 100 && !rotated; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rotated = Info(Tls(*server, nullptr, other_ca)).ok();
  }
  EXPECT_TRUE(rotated);
  EXPECT_FALSE(Info(Tls(*server)).ok());  // the old CA no longer matches
}

TEST_F(SecurityTest, BearerTokenGuardsMoeServiceNotHealth) {
  const std::string dir = testing::MakeTempDir("moeserve_token");
  const std::string file =
      WriteFile(dir, "tokens", absl::StrCat("# API tokens\n", kToken1, "\n\n", kToken2, "\n"));
  ServerOptions o = Options();
  o.auth = BearerTokens::FromFile(file, "--auth_token_file").value();
  o.enable_get_expert_weights = true;
  auto server = Start(o);
  ASSERT_NE(server, nullptr);
  auto channel = Plain(*server);

  grpc::Status missing = Info(channel);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(missing.error_message(), HasSubstr("GetModelInfo"));
  EXPECT_THAT(missing.error_message(), HasSubstr("authorization: Bearer"));
  EXPECT_THAT(missing.error_message(), HasSubstr("--auth_token_file"));
  grpc::Status wrong = Info(channel, "not-the-token-0123456789");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(wrong.error_message(), HasSubstr("not accepted"));
  // A prefix of a right token is not it.
  EXPECT_EQ(Info(channel, std::string(kToken1).substr(0, 20)).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  {
    grpc::ClientContext ctx;  // not the Bearer scheme
    ctx.AddMetadata("authorization", absl::StrCat("Basic ", kToken1));
    v1::ModelInfo info;
    grpc::Status s =
        v1::MoeService::NewStub(channel)->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_THAT(s.error_message(), HasSubstr("not 'Bearer <token>'"));
  }
  EXPECT_TRUE(Info(channel, kToken1).ok());
  EXPECT_TRUE(Info(channel, kToken2).ok());  // every line of the file is accepted
  EXPECT_TRUE(Health(channel).ok());         // health stays open

  // Forward and the expert-weight RPCs are guarded the same way.
  std::mt19937_64 rng(11);
  const v1::ForwardRequest req =
      testing::RandomRequest(rng, 0, 3, 64, 4, 2, v1::DTYPE_BF16, v1::DTYPE_INT32);
  auto stub = v1::MoeService::NewStub(channel);
  for (const std::string token : {"", "wrong-token-0123456789", kToken2}) {
    const bool right = token == kToken2;
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", BearerHeader(token));
    v1::ForwardResponse resp;
    grpc::Status s = stub->Forward(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), right ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED);
    if (!right) {
      EXPECT_THAT(s.error_message(), HasSubstr("Forward"));
    }

    {  // ForwardStream: refused as a whole before any message without the token
      grpc::ClientContext fctx;
      if (!token.empty()) fctx.AddMetadata("authorization", BearerHeader(token));
      auto stream = stub->ForwardStream(&fctx);
      stream->Write(req);
      v1::ForwardResponse answer;
      const bool got = stream->Read(&answer);
      EXPECT_EQ(got, right);
      if (got) {
        EXPECT_EQ(answer.error_code(), 0) << answer.error_message();
      }
      stream->WritesDone();
      grpc::Status fs = stream->Finish();
      EXPECT_EQ(fs.error_code(), right ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED);
      if (!right) {
        EXPECT_THAT(fs.error_message(), HasSubstr("ForwardStream"));
      }
    }

    grpc::ClientContext wctx;
    if (!token.empty()) wctx.AddMetadata("authorization", BearerHeader(token));
    v1::GetExpertWeightsRequest wreq;
    wreq.set_expert(1);
    v1::GetExpertWeightsResponse wresp;
    EXPECT_EQ(stub->GetExpertWeights(&wctx, wreq, &wresp).error_code(),
              right ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED);

    grpc::ClientContext sctx;
    if (!token.empty()) sctx.AddMetadata("authorization", BearerHeader(token));
    v1::StreamExpertWeightsRequest sreq;
    sreq.set_expert(1);
    auto reader = stub->StreamExpertWeights(&sctx, sreq);
    v1::ExpertWeightsChunk chunk;
    int chunks = 0;
    while (reader->Read(&chunk)) ++chunks;
    EXPECT_EQ(reader->Finish().error_code(),
              right ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(chunks > 0, right);
  }

  // The KServe v2 service checks the same token; ServerLive / ServerReady stay open (probes).
  auto kserve = inference::GRPCInferenceService::NewStub(channel);
  inference::ModelInferRequest infer;
  infer.set_model_name("moe_layer_0");
  const struct {
    const char* name;
    const char* datatype;
    const v1::Tensor& t;
  } inputs[] = {{"hidden_states", "BF16", req.hidden_states()},
                {"topk_ids", "INT32", req.topk_ids()},
                {"topk_weights", "FP32", req.topk_weights()}};
  for (const auto& in : inputs) {
    auto* t = infer.add_inputs();
    t->set_name(in.name);
    t->set_datatype(in.datatype);
    for (int64_t d : in.t.shape()) t->add_shape(d);
    infer.add_raw_input_contents(in.t.data());
  }
  for (const std::string token : {"", "wrong-token-0123456789", kToken1}) {
    const bool right = token == kToken1;
    const grpc::StatusCode want = right ? grpc::StatusCode::OK : grpc::StatusCode::UNAUTHENTICATED;
    auto context = [&token] {
      auto ctx = std::make_unique<grpc::ClientContext>();
      if (!token.empty()) ctx->AddMetadata("authorization", BearerHeader(token));
      return ctx;
    };
    inference::ModelInferResponse infer_resp;
    grpc::Status s = kserve->ModelInfer(context().get(), infer, &infer_resp);
    EXPECT_EQ(s.error_code(), want) << s.error_message();
    if (right) {
      EXPECT_EQ(infer_resp.raw_output_contents_size(), 1);
    } else {
      EXPECT_THAT(s.error_message(), HasSubstr("ModelInfer"));
    }
    inference::ModelMetadataRequest mreq;
    mreq.set_name("moe_layer_0");
    inference::ModelMetadataResponse mresp;
    EXPECT_EQ(kserve->ModelMetadata(context().get(), mreq, &mresp).error_code(), want);
    inference::ServerMetadataResponse sresp;
    EXPECT_EQ(kserve->ServerMetadata(context().get(), {}, &sresp).error_code(), want);
    inference::ModelReadyRequest rreq;
    rreq.set_name("moe_layer_0");
    inference::ModelReadyResponse rresp;
    EXPECT_EQ(kserve->ModelReady(context().get(), rreq, &rresp).error_code(), want);
    inference::ServerLiveResponse live;
    EXPECT_TRUE(kserve->ServerLive(context().get(), {}, &live).ok());
    EXPECT_TRUE(live.live());
    inference::ServerReadyResponse ready;
    EXPECT_TRUE(kserve->ServerReady(context().get(), {}, &ready).ok());
    EXPECT_TRUE(ready.ready());
  }

  // Rotation: the file is re-read when it changes (checked at most once a second).
  WriteFile(dir, "tokens", absl::StrCat(kToken2, "\n"));
  bool rotated = false;
  for (int i = 0; i < 50 && !rotated; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rotated = !Info(channel, kToken1).ok();
  }
  EXPECT_TRUE(rotated);
  EXPECT_TRUE(Info(channel, kToken2).ok());
  // A broken edit keeps the previous tokens.
  WriteFile(dir, "tokens", "short\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  EXPECT_TRUE(Info(channel, kToken2).ok());
}

TEST_F(SecurityTest, TokenFileErrorsNameTheLineButNeverTheToken) {
  const std::string dir = testing::MakeTempDir("moeserve_badtokens");
  struct Case {
    std::string text;
    const char* want;
  } cases[] = {
      {"", "holds no token"},
      {"# only a comment\n\n", "holds no token"},
      {absl::StrCat(kToken1, "\nshort-secret\n"), "line 2"},
      {"has a space inside the token 0123456789\n", "line 1"},
  };
  for (const Case& c : cases) {
    const std::string file = WriteFile(dir, "tokens", c.text);
    absl::StatusOr<std::shared_ptr<BearerTokens>> t =
        BearerTokens::FromFile(file, "--auth_token_file");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(c.want));
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("--auth_token_file"));
    EXPECT_THAT(std::string(t.status().message()), Not(HasSubstr("short-secret")));
  }
  EXPECT_FALSE(BearerTokens::FromFile(dir + "/absent", "--auth_token_file").ok());
}

// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo with list_services: the status
// and the raw answer.
grpc::Status ListServices(const std::shared_ptr<grpc::Channel>& channel, std::string* answer) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  auto call =
      stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  const std::string request("\x3a\x00", 2);  // field 7 (list_services) = ""
  grpc::Slice slice(request.data(), request.size());
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer in;
  call->Read(&in, reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  answer->clear();
  if (ok) {
    std::vector<grpc::Slice> slices;
    (void)in.Dump(&slices);
    for (const grpc::Slice& s : slices)
      answer->append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  call->WritesDone(reinterpret_cast<void*>(4));
  cq.Next(&tag, &ok);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(5)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

TEST_F(SecurityTest, ReflectionOnlyWhenAskedAndOnlyOnThatServer) {
  ServerOptions on = Options();
  on.enable_reflection = true;
  auto with = Start(on);
  ASSERT_NE(with, nullptr);
  std::string answer;
  grpc::Status s = ListServices(Plain(*with), &answer);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(answer, HasSubstr("moeserve.v1.MoeService"));
  // A server built afterwards, without the flag, has none (reflection is per server).
  auto without = Start(Options());
  ASSERT_NE(without, nullptr);
  EXPECT_EQ(ListServices(Plain(*without), &answer).error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(SecurityTest, MetricsEndpointServesHttpsAndMutualTls) {
  const std::string ca = certs_->ca.cert_pem();
  {
    auto http = MetricsHttpServer::Start(
        "127.0.0.1:0", [] { return "moeserve_up 1\n"; }, ServerTls(/*mutual=*/false));
    ASSERT_TRUE(http.ok()) << http.status();
    const int port = (*http)->port();
    // Clients that connect and never start their handshake hold only their own connections
    // (the handshake runs in the endpoint's poll loop: a blocking accept would wait out its
    // 2 s read timeout on each of them first).
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::vector<int> stalled;
    for (int i = 0; i < 3; ++i) {
      stalled.push_back(::socket(AF_INET, SOCK_STREAM, 0));
      ASSERT_EQ(::connect(stalled.back(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    }
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THAT(HttpsGetMetrics(port, ca), HasSubstr("moeserve_up 1"));
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
    for (int fd : stalled) ::close(fd);
    EXPECT_EQ(HttpsGetMetrics(port, certs_->other_ca.cert_pem()), "");          // untrusted
    EXPECT_THAT(testing::HttpGetMetrics(port), Not(HasSubstr("moeserve_up")));  // plain HTTP
    EXPECT_THAT(HttpsGetMetrics(port, ca), HasSubstr("200 OK"));                // still serving
  }
  auto http = MetricsHttpServer::Start(
      "127.0.0.1:0", [] { return "moeserve_up 1\n"; }, ServerTls(/*mutual=*/true));
  ASSERT_TRUE(http.ok()) << http.status();
  const int port = (*http)->port();
  EXPECT_THAT(HttpsGetMetrics(port, ca, &certs_->client), HasSubstr("moeserve_up 1"));
  EXPECT_EQ(HttpsGetMetrics(port, ca), "") << "no client certificate";
  EXPECT_EQ(HttpsGetMetrics(port, ca, &certs_->wrong_ca_client), "") << "another CA";
  EXPECT_EQ(HttpsGetMetrics(port, ca, &certs_->expired_client), "") << "expired";
  EXPECT_THAT(HttpsGetMetrics(port, ca, &certs_->client), HasSubstr("200 OK"));
  // Unusable files are refused before binding, naming the metrics flags.
  auto bad =
      MetricsHttpServer::Start("127.0.0.1:0", [] { return ""; }, {certs_->server_cert, "", ""});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("--metrics_tls_"));
}

TEST_F(SecurityTest, MetricsCertificateRotatesWithoutRestart) {
  const std::string dir = testing::MakeTempDir("moeserve_metrics_rotate");
  const TlsFiles files = {WriteFile(dir, "m.pem", certs_->server.cert),
                          WriteFile(dir, "m.key", certs_->server.key), ""};
  auto http = MetricsHttpServer::Start(
      "127.0.0.1:0", [] { return "moeserve_up 1\n"; }, files);
  ASSERT_TRUE(http.ok()) << http.status();
  const int port = (*http)->port();
  const std::string other = certs_->other_ca.cert_pem();
  ASSERT_THAT(HttpsGetMetrics(port, certs_->ca.cert_pem()), HasSubstr("moeserve_up"));
  const CertKey next = certs_->other_ca.Issue("localhost");
  WriteFile(dir, "m.key", next.key);
  WriteFile(dir, "m.pem", next.cert);
  bool rotated = false;
  for (int i = 0; i < 50 && !rotated; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rotated = HttpsGetMetrics(port, other).find("moeserve_up") != std::string::npos;
  }
  EXPECT_TRUE(rotated);
}

TEST_F(SecurityTest, MetricsOfTheServerOverTls) {
  ServerOptions o = Options();
  o.metrics_address = "127.0.0.1:0";
  o.metrics_tls = ServerTls(/*mutual=*/false);
  auto server = Start(o);
  ASSERT_NE(server, nullptr);
  const int port = server->metrics().port();
  EXPECT_THAT(HttpsGetMetrics(port, certs_->ca.cert_pem()), HasSubstr("moeserve_model_info"));
}

}  // namespace
}  // namespace moeserve
