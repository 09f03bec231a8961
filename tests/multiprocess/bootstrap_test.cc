#include <unistd.h>

#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/internal_bootstrap.h"
#include "server/server.h"

namespace moeserve {
namespace {

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

MultiProcessFlags Flags(int ranks) {
  MultiProcessFlags f;
  f.local_ranks = ranks;
  return f;
}

TEST(ResolveMultiProcess, SingleProcessWithoutFlagsOrEnv) {
  auto c = ResolveMultiProcess(Flags(2), Env({}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->enabled);
}

TEST(ResolveMultiProcess, FromLeaderWorkerSetEnvironment) {
  auto c = ResolveMultiProcess(Flags(2), Env({{"LWS_GROUP_SIZE", "3"},
                                              {"LWS_WORKER_INDEX", "2"},
                                              {"LWS_LEADER_ADDRESS", "moe-0.moe.default"}}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->enabled);
  EXPECT_EQ(c->world_size, 6);
  EXPECT_EQ(c->node_rank, 2);
  EXPECT_EQ(c->local_ranks, 2);
  EXPECT_EQ(c->leader_address, "moe-0.moe.default:50052");
  EXPECT_FALSE(c->leader());
}

TEST(ResolveMultiProcess, FlagsOverrideEnvironment) {
  MultiProcessFlags f = Flags(1);
  f.world_size = 2;
  f.node_rank = 0;
  f.leader_address = "10.0.0.1:7000";
  auto c = ResolveMultiProcess(
      f,
      Env({{"LWS_GROUP_SIZE", "4"}, {"LWS_WORKER_INDEX", "3"}, {"LWS_LEADER_ADDRESS", "other"}}));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->world_size, 2);
  EXPECT_EQ(c->node_rank, 0);
  EXPECT_TRUE(c->leader());
  EXPECT_EQ(c->leader_address, "10.0.0.1:7000");
}

TEST(ResolveMultiProcess, GroupOfOnePodIsSingleProcess) {
  auto c = ResolveMultiProcess(Flags(1), Env({{"LWS_GROUP_SIZE", "1"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->enabled);
}

TEST(ResolveMultiProcess, RefusesWhatDoesNotFit) {
  MultiProcessFlags f = Flags(2);
  f.world_size = 5;  // not a multiple of --ranks
  f.leader_address = "h:1";
  EXPECT_EQ(ResolveMultiProcess(f, Env({})).status().code(), absl::StatusCode::kInvalidArgument);
  f.world_size = 4;
  f.node_rank = 2;  // only nodes 0 and 1
  auto s = ResolveMultiProcess(f, Env({})).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("node_rank"), absl::string_view::npos) << s;
  f.node_rank = 1;
  f.leader_address = "";  // no leader
  EXPECT_EQ(ResolveMultiProcess(f, Env({})).status().code(), absl::StatusCode::kInvalidArgument);
  f.leader_address = "nohostport";
  EXPECT_EQ(ResolveMultiProcess(f, Env({})).status().code(), absl::StatusCode::kInvalidArgument);
  // LWS group without an explicit --ranks.
  EXPECT_EQ(ResolveMultiProcess(Flags(0), Env({{"LWS_GROUP_SIZE", "2"}})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveMultiProcess(Flags(1), Env({{"LWS_GROUP_SIZE", "x"}})).status().code(),
            absl::StatusCode::kInvalidArgument);
}

MultiProcessConfig Config(int node, const std::string& leader) {
  MultiProcessConfig c;
  c.enabled = true;
  c.world_size = 4;
  c.local_ranks = 2;
  c.node_rank = node;
  c.leader_address = leader;
  return c;
}

TEST(Bootstrap, FollowerGetsTheLeadersId) {
  const std::string id(128, '\x5a');
  auto server = BootstrapServer::Start("127.0.0.1:0", Config(0, ""), id, "fp");
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string leader = "127.0.0.1:" + std::to_string((*server)->port());
  auto got = FetchCollectiveId(Config(1, leader), "fp", absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, id);
}

// A follower's health server reports the addresses a client dials: host:port for TCP, the
// socket path itself for a unix socket (it reported "unix:<port>").
TEST(Bootstrap, FollowerReportsItsBoundAddresses) {
  const std::string socket = "/tmp/moeserve_follower_" + std::to_string(getpid()) + ".sock";
  auto follower = FollowerProcess::Bind({"127.0.0.1:0", "unix:" + socket});
  ASSERT_TRUE(follower.ok()) << follower.status();
  ASSERT_EQ((*follower)->bound_addresses().size(), 2u);
  EXPECT_EQ((*follower)->bound_addresses()[0].rfind("127.0.0.1:", 0), 0u);
  EXPECT_NE((*follower)->bound_addresses()[0], "127.0.0.1:0");
  EXPECT_EQ((*follower)->bound_addresses()[1], "unix:" + socket);
  EXPECT_EQ(BoundAddress("unix-abstract:moe", 0), "unix-abstract:moe");
  EXPECT_EQ(BoundAddress("[::1]:0", 5051), "[::1]:5051");
}

TEST(Bootstrap, LeaderRefusesOtherOptionsAtOnce) {
  auto server =
      BootstrapServer::Start("127.0.0.1:0", Config(0, ""), std::string(128, 'a'), "model=tiny");
  ASSERT_TRUE(server.ok());
  const std::string leader = "127.0.0.1:" + std::to_string((*server)->port());
  const absl::Time start = absl::Now();
  auto got = FetchCollectiveId(Config(1, leader), "model=other", absl::Seconds(30));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  MultiProcessConfig wrong = Config(1, leader);
  wrong.world_size = 6;
  EXPECT_EQ(FetchCollectiveId(wrong, "model=tiny", absl::Seconds(30)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FetchCollectiveId(Config(5, leader), "model=tiny", absl::Seconds(30)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Bootstrap, AbsentLeaderTimesOutWithinTheBound) {
  // Nothing listens there: the follower retries, then gives up near its deadline.
  auto probe = BootstrapServer::Start("127.0.0.1:0", Config(0, ""), "x", "");
  ASSERT_TRUE(probe.ok());
  const std::string leader = "127.0.0.1:" + std::to_string((*probe)->port());
  (*probe)->Shutdown();
  const absl::Time start = absl::Now();
  auto got = FetchCollectiveId(Config(1, leader), "", absl::Seconds(2));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  EXPECT_NE(got.status().message().find(leader), absl::string_view::npos);
  EXPECT_LT(took, absl::Seconds(6));
}

TEST(Bootstrap, LateLeaderIsWaitedFor) {
  // The follower starts first; the leader comes up a moment later on the same port.
  auto probe = BootstrapServer::Start("127.0.0.1:0", Config(0, ""), "x", "");
  ASSERT_TRUE(probe.ok());
  const int port = (*probe)->port();
  (*probe)->Shutdown();
  const std::string leader = "127.0.0.1:" + std::to_string(port);
  std::unique_ptr<BootstrapServer> late;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(700));
    auto s = BootstrapServer::Start(leader, Config(0, ""), std::string(128, 'q'), "fp");
    if (s.ok()) late = std::move(*s);
  });
  auto got = FetchCollectiveId(Config(1, leader), "fp", absl::Seconds(20));
  starter.join();
  ASSERT_NE(late, nullptr);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, std::string(128, 'q'));
}

TEST(EngineFingerprint, DiffersWhenTheWeightsDiffer) {
  EngineOptions a, b;
  b.seed = 7;
  EXPECT_NE(EngineFingerprint(a), EngineFingerprint(b));
  EXPECT_EQ(EngineFingerprint(a), EngineFingerprint(EngineOptions()));
}

// With a checkpoint, what the processes must agree on is its config.json, not the preset the
// flags name: a follower whose checkpoint (at the same path) has another hidden size would form
// the group and hang on the first step's token rows.
TEST(EngineFingerprint, FollowsTheCheckpointsConfig) {
  char dir_template[] = "/tmp/moeserve_fingerprint_XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  auto write_config = [&](int hidden) {
    std::FILE* f = std::fopen((dir + "/config.json").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fprintf(f,
                 "{\"model_type\": \"qwen3_moe\", \"hidden_size\": %d, "
                 "\"num_hidden_layers\": 2, \"num_experts\": 8, \"num_experts_per_tok\": 2, "
                 "\"moe_intermediate_size\": 48}",
                 hidden);
    std::fclose(f);
  };
  EngineOptions o;
  o.checkpoint_dir = dir;
  write_config(512);
  const std::string first = EngineFingerprint(o);
  EXPECT_THAT(first, ::testing::HasSubstr("hidden=512")) << first;
  write_config(1024);
  const std::string second = EngineFingerprint(o);
  EXPECT_THAT(second, ::testing::HasSubstr("hidden=1024")) << second;
  EXPECT_NE(first, second);
  std::remove((dir + "/config.json").c_str());
  rmdir(dir.c_str());
}

TEST(EngineFingerprint, DiffersWhenTheCollectiveTimeoutsDiffer) {
  // The leader's heartbeat is checked against its own timeout; a follower waiting less would
  // give up between heartbeats.
  EngineOptions a, b;
  b.collective_timeout_ms = a.collective_timeout_ms / 2;
  EXPECT_NE(EngineFingerprint(a), EngineFingerprint(b));
}

}  // namespace
}  // namespace moeserve
