// Issue 14 item 1, the multi-process bootstrap: it hands out the NCCL unique id, so it must
// refuse callers without the group's token or certificate, and its refusals must not reveal
// the leader's options (which used to be echoed, letting any caller then ask with the right
// ones) or the id.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/internal_bootstrap.h"
#include "server/security.h"
#include "tests/server/test_certs.h"

namespace moeserve {
namespace {

using ::moeserve::testing::CertKey;
using ::moeserve::testing::TestCa;
using ::moeserve::testing::WriteFile;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kLeaderFingerprint[] = "model=leader-secret-fingerprint seed=424242";
const std::string kId(128, '\x37');  // the id's bytes are '7'

MultiProcessConfig Config(int node, const std::string& leader) {
  MultiProcessConfig c;
  c.enabled = true;
  c.world_size = 4;
  c.local_ranks = 2;
  c.node_rank = node;
  c.leader_address = leader;
  return c;
}

std::shared_ptr<BearerTokens> Tokens(const std::string& dir, const std::string& name,
                                     const std::string& token) {
  return BearerTokens::FromFile(WriteFile(dir, name, token + "\n"), "--bootstrap_token_file")
      .value();
}

// Nothing of the leader's secrets in a refusal.
void ExpectRevealsNothing(const absl::Status& s) {
  const std::string m(s.message());
  EXPECT_THAT(m, Not(HasSubstr("leader-secret"))) << m;
  EXPECT_THAT(m, Not(HasSubstr("424242"))) << m;
  EXPECT_THAT(m, Not(HasSubstr("7777777777"))) << m;
}

TEST(BootstrapSecurity, FingerprintMismatchDoesNotRevealTheLeaders) {
  auto server = BootstrapServer::Start("127.0.0.1:0", Config(0, ""), kId, kLeaderFingerprint);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string leader = absl::StrCat("127.0.0.1:", (*server)->port());
  auto got = FetchCollectiveId(Config(1, leader), "model=guess", absl::Seconds(20));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("leader's log"));
  // The follower's own options are named (it knows them), the leader's are not.
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("model=guess"));
  ExpectRevealsNothing(got.status());
}

TEST(BootstrapSecurity, TokenRequiredWhenTheLeaderHasOne) {
  const std::string dir = testing::MakeTempDir("moeserve_bootstrap_token");
  InternalSecurity leader_security;
  leader_security.token = Tokens(dir, "leader", "group-token-0123456789abcdef");
  auto server = BootstrapServer::Start("127.0.0.1:0", Config(0, ""), kId, kLeaderFingerprint,
                                       leader_security);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string leader = absl::StrCat("127.0.0.1:", (*server)->port());

  // No token, a wrong one: refused at once, UNAUTHENTICATED, before the options are compared.
  const absl::Time start = absl::Now();
  auto none = FetchCollectiveId(Config(1, leader), kLeaderFingerprint, absl::Seconds(30));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated) << none.status();
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("--bootstrap_token_file"));
  ExpectRevealsNothing(none.status());
  InternalSecurity wrong;
  wrong.token = Tokens(dir, "wrong", "some-other-token-0123456789");
  auto bad = FetchCollectiveId(Config(1, leader), kLeaderFingerprint, absl::Seconds(30), wrong);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnauthenticated) << bad.status();
  ExpectRevealsNothing(bad.status());
  // With the right token but other options: the mismatch, still revealing nothing.
  InternalSecurity right;
  right.token = Tokens(dir, "right", "group-token-0123456789abcdef");
  auto other = FetchCollectiveId(Config(1, leader), "model=guess", absl::Seconds(30), right);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  ExpectRevealsNothing(other.status());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));  // refusals are not retried
  // The right token and options: the id.
  auto got = FetchCollectiveId(Config(1, leader), kLeaderFingerprint, absl::Seconds(30), right);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, kId);
}

TEST(BootstrapSecurity, MutualTlsRefusesPeersWithoutTheGroupsCertificate) {
  TestCa ca("moeserve group CA");
  TestCa other("another CA");
  const std::string dir = testing::MakeTempDir("moeserve_bootstrap_tls");
  const CertKey leader_cert = ca.Issue("localhost");
  const CertKey follower_cert = ca.Issue("follower");
  const CertKey stranger_cert = other.Issue("follower");
  const CertKey expired_cert = ca.Issue("follower", -2 * 86400, -86400);
  const std::string ca_file = WriteFile(dir, "ca.pem", ca.cert_pem());
  InternalSecurity leader_security;
  leader_security.tls = {WriteFile(dir, "leader.pem", leader_cert.cert),
                         WriteFile(dir, "leader.key", leader_cert.key), ca_file};
  auto server = BootstrapServer::Start("127.0.0.1:0", Config(0, ""), kId, kLeaderFingerprint,
                                       leader_security);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string leader = absl::StrCat("localhost:", (*server)->port());

  const auto follower = [&](const CertKey& cert, const std::string& ca_path,
                            const std::string& name) {
    InternalSecurity s;
    s.tls = {WriteFile(dir, name + ".pem", cert.cert), WriteFile(dir, name + ".key", cert.key),
             ca_path};
    return s;
  };
  auto got = FetchCollectiveId(Config(1, leader), kLeaderFingerprint, absl::Seconds(20),
                               follower(follower_cert, ca_file, "follower"));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, kId);

  // A stranger's certificate, none at all (plaintext): no id. The handshake fails, which the
  // follower retries until its (short) timeout.
  const std::string other_ca_file = WriteFile(dir, "other_ca.pem", other.cert_pem());
  for (const auto& [security, what] :
       {std::pair{follower(stranger_cert, ca_file, "stranger"), "stranger"},
        std::pair{InternalSecurity{}, "plaintext"}}) {
    auto refused =
        FetchCollectiveId(Config(1, leader), kLeaderFingerprint, absl::Seconds(2), security);
    EXPECT_FALSE(refused.ok()) << what;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kDeadlineExceeded) << refused.status();
    ExpectRevealsNothing(refused.status());
  }
  // An expired certificate is refused before it is sent (the leader would refuse it too, as
  // the API's mutual TLS does: tests/server/security_test.cc).
  auto expired = FetchCollectiveId(Config(1, leader), kLeaderFingerprint, absl::Seconds(2),
                                   follower(expired_cert, ca_file, "expired"));
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(expired.status().message()), HasSubstr("expired"));
  // A follower that does not trust the leader's CA does not send it anything either.
  auto distrust = FetchCollectiveId(Config(1, leader), kLeaderFingerprint, absl::Seconds(2),
                                    follower(follower_cert, other_ca_file, "distrust"));
  EXPECT_EQ(distrust.status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(BootstrapSecurity, IncompleteTlsFlagsRefusedNamingThem) {
  TestCa ca("moeserve group CA");
  const std::string dir = testing::MakeTempDir("moeserve_bootstrap_flags");
  const CertKey cert = ca.Issue("localhost");
  InternalSecurity s;
  s.tls = {WriteFile(dir, "c.pem", cert.cert), WriteFile(dir, "c.key", cert.key), ""};
  auto server = BootstrapServer::Start("127.0.0.1:0", Config(0, ""), kId, "fp", s);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("--internal_tls_ca"));
  auto fetched = FetchCollectiveId(Config(1, "127.0.0.1:1"), "fp", absl::Seconds(1), s);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BootstrapSecurity, ListensOnlyWhereAsked) {
  // It used to listen on 0.0.0.0 at the leader address's port, whatever was asked.
  const MultiProcessConfig leader = Config(0, "moe-0.moe.default:50052");
  EXPECT_EQ(BootstrapListenAddress(leader, {}), "moe-0.moe.default:50052");
  BootstrapOptions asked;
  asked.listen = "10.1.2.3:7000";
  EXPECT_EQ(BootstrapListenAddress(leader, asked), "10.1.2.3:7000");
  // An address that is not this machine's cannot be bound: refused, naming the flag.
  auto elsewhere = BootstrapServer::Start("192.0.2.1:0", Config(0, ""), kId, "fp");  // TEST-NET-1
  EXPECT_EQ(elsewhere.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(elsewhere.status().message()), HasSubstr("--bootstrap_listen"));
}

}  // namespace
}  // namespace moeserve
