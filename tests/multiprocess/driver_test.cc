// MultiProcessDriver as a follower: commands from the leader are checked before anything is
// sized from them (a leader of another build, or a bug, must fail the step with a Status, not
// abort the process in a resize). A fake group hands the follower scripted commands.
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "core/engine_plan.h"
#include "core/multi_process_driver.h"
#include "core/rank_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMagic = 0x6d6f65736d703031;  // the driver's "moesmp01"
constexpr int64_t kNoop = 0, kForward = 1, kShutdown = 2;

// [magic, op, layer, M, dtype, world, bounds...]
std::vector<int64_t> Command(int64_t op, int64_t layer = 0, int64_t m = 0,
                             int64_t dtype = static_cast<int64_t>(DType::kBF16),
                             std::vector<int64_t> bounds = {}) {
  std::vector<int64_t> c = {kMagic, op, layer, m, dtype, 2};
  c.insert(c.end(), bounds.begin(), bounds.end());
  return c;
}

// Broadcast hands out the scripted commands, then shutdowns; AllToAllV (the token exchange
// that follows an accepted forward command) fails with a marker.
class ScriptedTransfer : public HostTransfer {
 public:
  explicit ScriptedTransfer(std::deque<std::vector<int64_t>> commands)
      : commands_(std::move(commands)) {}
  absl::Status Broadcast(void* host, int64_t bytes, int root) override {
    std::vector<int64_t> c = commands_.empty() ? Command(kShutdown) : commands_.front();
    if (!commands_.empty()) commands_.pop_front();
    c.resize(static_cast<size_t>(bytes) / sizeof(int64_t), 0);
    std::memcpy(host, c.data(), static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status AllToAllV(const void*, absl::Span<const int64_t>, absl::Span<const int64_t>, void*,
                         absl::Span<const int64_t>, absl::Span<const int64_t>) override {
    ++exchanges;
    return absl::UnavailableError("scripted: token exchange reached");
  }
  int exchanges = 0;

 private:
  std::deque<std::vector<int64_t>> commands_;
};

// Global rank 1 of a world of 2, one local rank; its kernels are never built (every scripted
// forward stops at the token exchange or before).
class FollowerGroup : public RankGroup {
 public:
  FollowerGroup(const EnginePlan& plan, std::deque<std::vector<int64_t>> commands)
      : RankGroup(plan), transfer_(std::move(commands)) {
    ranks_.resize(1);
  }
  int num_local_ranks() const override { return 1; }
  HostTransfer* host_transfer(int) override { return &transfer_; }
  ScriptedTransfer transfer_;
};

EnginePlan FollowerPlan() {
  EnginePlan plan;
  plan.model.num_layers = 2;
  plan.model.hidden = 8;
  plan.model.topk = 2;
  plan.world_size = 2;
  plan.local_ranks = 1;
  plan.node_rank = 1;
  plan.first_rank = 1;
  plan.multi_process = true;
  plan.max_tokens_per_request = 16;
  return plan;
}

absl::Status RunFollowerOn(std::deque<std::vector<int64_t>> commands, int* exchanges = nullptr) {
  FollowerGroup group(FollowerPlan(), std::move(commands));
  std::mutex step_mu;
  MultiProcessDriver driver(&group, &step_mu);
  absl::Status s = driver.RunFollower();
  if (exchanges != nullptr) *exchanges = group.transfer_.exchanges;
  return s;
}

TEST(MultiProcessFollower, NoopsThenShutdownEndTheLoop) {
  EXPECT_TRUE(RunFollowerOn({Command(kNoop), Command(kNoop)}).ok());
}

TEST(MultiProcessFollower, AGoodForwardCommandReachesTheTokenExchange) {
  int exchanges = 0;
  const absl::Status s = RunFollowerOn(
      {Command(kForward, 1, 3, static_cast<int64_t>(DType::kFP32), {0, 1, 3})}, &exchanges);
  EXPECT_EQ(exchanges, 1);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token exchange reached")) << s;
}

TEST(MultiProcessFollower, BadForwardCommandsFailTheStepBeforeAnyExchange) {
  const int64_t bf16 = static_cast<int64_t>(DType::kBF16);
  struct Case {
    std::vector<int64_t> command;
    std::string message;
  };
  const std::vector<Case> cases = {
      {Command(kForward, 0, -5, bf16, {0, 1, -5}), "M=-5, expected [0, 16]"},
      {Command(kForward, 0, int64_t{1} << 40, bf16, {0, 1, int64_t{1} << 40}), "M=1099511627776"},
      {Command(kForward, 0, 3, bf16, {0, 5, 3}), "token bounds of rank 1 run backwards (5 -> 3)"},
      {Command(kForward, 0, 4, bf16, {0, 1, 3}), "token bounds [0, 3], expected [0, M=4]"},
      {Command(kForward, 0, 3, bf16, {1, 1, 3}), "token bounds [1, 3]"},
      {Command(kForward, 0, 3, 99, {0, 1, 3}), "hidden dtype code 99"},
      {Command(kForward, 0, 3, static_cast<int64_t>(DType::kINT32), {0, 1, 3}),
       "expected BF16, FP16 or FP32"},
      {Command(kForward, 2, 3, bf16, {0, 1, 3}), "layer 2, expected [0, 2)"},
      {Command(kForward, -1, 3, bf16, {0, 1, 3}), "layer -1"},
  };
  for (const Case& c : cases) {
    int exchanges = -1;
    const absl::Status s = RunFollowerOn({c.command}, &exchanges);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("bad forward command from the leader")) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << s;
    EXPECT_EQ(exchanges, 0) << s;
  }
}

TEST(MultiProcessFollower, ACommandForAnotherWorldIsRefused) {
  std::vector<int64_t> c = Command(kNoop);
  c[5] = 3;
  const absl::Status s = RunFollowerOn({c});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("bad command from the leader (world 3")) << s;
}

TEST(MultiProcessLeader, StridedHiddenStatesAreRefusedBeforeAnyCommand) {
  EnginePlan plan = FollowerPlan();
  plan.first_rank = 0;
  plan.node_rank = 0;
  FollowerGroup group(plan, {});
  std::mutex step_mu;
  MultiProcessDriver driver(&group, &step_mu);
  std::vector<uint16_t> wide(4 * 16, 0);
  std::vector<int32_t> ids(4 * 2, 0);
  std::vector<float> w(4 * 2, 0.5f), out(4 * 8);
  ForwardStep step;
  step.hidden_states = TensorView(wide.data(), DType::kBF16, {4, 8}, {16, 1});  // every other half
  step.topk_ids = TensorView(ids.data(), DType::kINT32, {4, 2});
  step.topk_weights = TensorView(w.data(), DType::kFP32, {4, 2});
  step.output = TensorView(out.data(), DType::kBF16, {4, 8});
  step.bounds = {0, 2, 4};
  const absl::Status s = driver.Forward(step);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not strided views")) << s;
  EXPECT_EQ(group.transfer_.exchanges, 0);
}

}  // namespace
}  // namespace moeserve
