// Forward calls through the forward channel end to end: a real server (CPU backend,
// --enable_shared_memory) and the C++ client's ForwardChannelClient. Answers are checked against
// an independent reference engine with fresh random inputs (relative L2: BF16 / FP16 1e-2, FP32
// 1e-5), inline and by region, from several threads at once; every refusal comes back through the
// slot with its code and a message naming what was wrong, and the server serves on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "clients/cpp/forward_channel_client.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "server/server.h"
#include "tests/server/test_util.h"
#include "tests/testing/shm_util.h"

namespace moeserve {
namespace {

using ::moeserve::client::ForwardChannelClient;
using ::moeserve::client::ForwardChannelOptions;
using ::moeserve::client::ForwardResult;
using ::moeserve::client::MoeClient;
using ::moeserve::testing::DecodeFloats;
using ::moeserve::testing::RandomRequest;
using ::moeserve::testing::ReferenceForward;
using ::moeserve::testing::RelativeL2;
using ::moeserve::testing::ShmObject;
using ::moeserve::testing::TestModel;
using ::testing::HasSubstr;

class ForwardChannelE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EngineOptions options;
    options.model = TestModel();
    options.seed = 5;
    options.experts = "blas";
    options.num_threads = 2;
    options.max_tokens_per_request = 64;
    engine_ = Engine::Create(options).value().release();
    options.experts = "reference";
    reference_ = Engine::Create(options).value().release();
    ServerOptions server_options;
    server_options.listen_addresses = {"127.0.0.1:0"};
    server_options.metrics_address = "";
    server_options.enable_shared_memory = true;
    server_options.max_forward_channels = 3;
    server_ = MoeServer::Start(engine_, server_options).value().release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete reference_;
    delete engine_;
  }

  static std::unique_ptr<MoeClient> ClientFor(const MoeServer& server) {
    return MoeClient::Create(server.bound_addresses()[0]).value();
  }
  const ModelConfig& model() const { return engine_->info().model; }
  v1::ForwardRequest Random(int64_t m, v1::DType dtype = v1::DTYPE_BF16,
                            v1::DType ids = v1::DTYPE_INT32) {
    return RandomRequest(rng_, static_cast<int>(m % 2), m, model().hidden, model().num_experts,
                         model().topk, dtype, ids);
  }
  static std::vector<float> Expected(const v1::ForwardRequest& request) {
    return ReferenceForward(*reference_, request);
  }

  static Engine* engine_;
  static Engine* reference_;
  static MoeServer* server_;
  std::unique_ptr<MoeClient> client_ = ClientFor(*server_);
  std::mt19937_64 rng_{std::random_device{}()};
};

Engine* ForwardChannelE2eTest::engine_ = nullptr;
Engine* ForwardChannelE2eTest::reference_ = nullptr;
MoeServer* ForwardChannelE2eTest::server_ = nullptr;

TEST_F(ForwardChannelE2eTest, InlineTensorsMatchReference) {
  auto channel = ForwardChannelClient::Create(client_.get(), {});
  ASSERT_TRUE(channel.ok()) << channel.status();
  struct Case {
    v1::DType dtype;
    v1::DType ids;
    double tolerance;
  };
  for (const Case& c :
       {Case{v1::DTYPE_BF16, v1::DTYPE_INT32, 1e-2}, Case{v1::DTYPE_FP16, v1::DTYPE_INT64, 1e-2},
        Case{v1::DTYPE_FP32, v1::DTYPE_INT32, 1e-5}}) {
    for (int64_t m : {1, 7, 33}) {
      v1::ForwardRequest r = Random(m, c.dtype, c.ids);
      r.set_request_id("ch-" + std::to_string(m));
      r.set_return_timings(true);
      absl::StatusOr<ForwardResult> got = (*channel)->Forward(r);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->request_id, "ch-" + std::to_string(m));
      EXPECT_EQ(got->output.dtype(), c.dtype);
      ASSERT_EQ(got->output.shape_size(), 2);
      EXPECT_EQ(got->output.shape(0), m);
      EXPECT_GT(got->timings.total_us(), 0);
      const std::vector<float> out = DecodeFloats(got->output.data(), c.dtype);
      ASSERT_EQ(out.size(), static_cast<size_t>(m * model().hidden));
      EXPECT_LT(RelativeL2(out, Expected(r)), c.tolerance) << "dtype " << c.dtype << " m " << m;
    }
  }
  EXPECT_TRUE((*channel)->Close().ok());
}

// A client without a deadline (--deadline=inf) waits for its answer: the wait's end once
// overflowed into the past and every call that had to sleep failed at once.
TEST_F(ForwardChannelE2eTest, InfiniteDeadlineWaitsForTheAnswer) {
  client::MoeClientOptions options;
  options.deadline = absl::InfiniteDuration();
  auto client = MoeClient::Create(server_->bound_addresses()[0], options).value();
  ForwardChannelOptions sleepy;
  sleepy.spin = absl::ZeroDuration();  // every call sleeps on its slot
  auto channel = ForwardChannelClient::Create(client.get(), sleepy);
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (int i = 0; i < 5; ++i) {
    v1::ForwardRequest r = Random(7);
    absl::StatusOr<ForwardResult> got = (*channel)->Forward(r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LT(RelativeL2(DecodeFloats(got->output.data(), v1::DTYPE_BF16), Expected(r)), 1e-2);
  }
  EXPECT_TRUE((*channel)->Close().ok());
}

// Without copy_output an answer is a view into bytes the client owns apart from the slot (which
// the next call reuses): answers held at once must each keep their own bytes across later calls.
TEST_F(ForwardChannelE2eTest, AnswersHeldWithoutCopyKeepTheirBytes) {
  auto channel = ForwardChannelClient::Create(client_.get(), {});
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto bytes_of = [](const ForwardResult& r) {
    std::string data(r.raw.output.data_size, '\0');
    r.raw.output.CopyTo(data.data());
    return data;
  };
  std::vector<v1::ForwardRequest> requests;
  std::vector<ForwardResult> held;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 7; ++i) {
      requests.push_back(Random(1 + (i * 5) % 33));
      absl::StatusOr<ForwardResult> got =
          (*channel)->Forward(requests.back(), /*copy_output=*/false);
      ASSERT_TRUE(got.ok()) << got.status();
      held.push_back(*std::move(got));
    }
    for (size_t i = 0; i < held.size(); ++i) {
      const std::vector<float> out = DecodeFloats(bytes_of(held[i]), v1::DTYPE_BF16);
      ASSERT_EQ(out.size(), static_cast<size_t>(requests[i].hidden_states().shape(0)) *
                                static_cast<size_t>(model().hidden));
      EXPECT_LT(RelativeL2(out, Expected(requests[i])), 1e-2) << "round " << round << " call " << i;
    }
    // Drop every other answer before the next round's calls.
    std::vector<ForwardResult> kept;
    std::vector<v1::ForwardRequest> kept_requests;
    for (size_t i = 0; i < held.size(); i += 2) {
      kept.push_back(std::move(held[i]));
      kept_requests.push_back(requests[i]);
    }
    held = std::move(kept);
    requests = std::move(kept_requests);
  }
  EXPECT_TRUE((*channel)->Close().ok());
}

TEST_F(ForwardChannelE2eTest, RegionTensorsMatchReference) {
  ShmObject shm(1 << 20);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(client_->RegisterSystemSharedMemory("chin", shm.key(), 0, 1 << 20).ok());
  ForwardChannelOptions options;
  options.slot_bytes = 4096;  // region calls carry headers only
  auto channel = ForwardChannelClient::Create(client_.get(), options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  for (int64_t m : {1, 16, 64}) {
    v1::ForwardRequest r = Random(m);
    const std::vector<float> want = Expected(r);
    int64_t at = 0;
    for (v1::Tensor* t :
         {r.mutable_hidden_states(), r.mutable_topk_ids(), r.mutable_topk_weights()}) {
      shm.Write(static_cast<size_t>(at), t->data().data(), t->data().size());
      t->mutable_region()->set_name("chin");
      t->mutable_region()->set_offset(at);
      t->mutable_region()->set_byte_size(static_cast<int64_t>(t->data().size()));
      at += (static_cast<int64_t>(t->data().size()) + 63) / 64 * 64;
      t->clear_data();
    }
    const int64_t out_bytes = m * model().hidden * 2;
    std::memset(shm.data() + at, 0x7f, static_cast<size_t>(out_bytes));
    r.mutable_output_region()->set_name("chin");
    r.mutable_output_region()->set_offset(at);
    r.mutable_output_region()->set_byte_size(out_bytes);
    absl::StatusOr<ForwardResult> got = (*channel)->Forward(r);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->output.data().empty());
    const std::string answer(reinterpret_cast<const char*>(shm.data() + at),
                             static_cast<size_t>(out_bytes));
    EXPECT_LT(RelativeL2(DecodeFloats(answer, v1::DTYPE_BF16), want), 1e-2) << "m " << m;
  }
  // An answer that cannot fit the 4 KiB slot is refused before it runs: name an output region.
  v1::ForwardRequest big = Random(32);
  absl::StatusOr<ForwardResult> refused = (*channel)->Forward(big);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("slot's payload"));
  v1::ForwardRequest by_region = Random(16);
  {
    v1::Tensor* t = by_region.mutable_hidden_states();
    shm.Write(0, t->data().data(), t->data().size());
    t->mutable_region()->set_name("chin");
    t->mutable_region()->set_offset(0);
    t->mutable_region()->set_byte_size(static_cast<int64_t>(t->data().size()));
    t->clear_data();
  }
  refused = (*channel)->Forward(by_region);  // 16 x 128 x 2 = 4 KiB of answer inline
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("name an output_region or register larger slots"));
  EXPECT_TRUE((*channel)->Close().ok());
  EXPECT_TRUE(client_->UnregisterSharedMemory("chin").ok());
}

TEST_F(ForwardChannelE2eTest, CallsFromSeveralThreadsEachGetTheirAnswer) {
  ForwardChannelOptions options;
  options.num_slots = 3;  // fewer slots than callers: callers wait for one
  auto channel = ForwardChannelClient::Create(client_.get(), options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  constexpr int kThreads = 4, kCalls = 15;
  std::vector<v1::ForwardRequest> requests;
  std::vector<std::vector<float>> want;
  for (int i = 0; i < kThreads * kCalls; ++i) {
    requests.push_back(Random(1 + i % 9));
    want.push_back(Expected(requests.back()));
  }
  std::atomic<int> good{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCalls; ++c) {
        const int i = t * kCalls + c;
        absl::StatusOr<ForwardResult> got = (*channel)->Forward(requests[i]);
        if (got.ok() &&
            RelativeL2(DecodeFloats(got->output.data(), v1::DTYPE_BF16), want[i]) < 1e-2) {
          ++good;
        } else {
          ADD_FAILURE() << "call " << i << ": " << got.status();
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(good.load(), kThreads * kCalls);
}

TEST_F(ForwardChannelE2eTest, BadCallsAreRefusedThroughTheSlot) {
  auto channel = ForwardChannelClient::Create(client_.get(), {});
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto expect = [&](const v1::ForwardRequest& r, absl::StatusCode code, const std::string& part) {
    absl::StatusOr<ForwardResult> got = (*channel)->Forward(r);
    EXPECT_EQ(got.status().code(), code) << got.status();
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(part));
  };
  v1::ForwardRequest short_bytes = Random(4);
  short_bytes.mutable_hidden_states()->mutable_data()->resize(4 * model().hidden * 2 - 2);
  expect(short_bytes, absl::StatusCode::kInvalidArgument, "bytes");
  v1::ForwardRequest bad_id = Random(4);
  reinterpret_cast<int32_t*>(bad_id.mutable_topk_ids()->mutable_data()->data())[5] =
      model().num_experts;
  expect(bad_id, absl::StatusCode::kInvalidArgument, "expert");
  v1::ForwardRequest bad_layer = Random(2);
  bad_layer.set_layer(1000);
  expect(bad_layer, absl::StatusCode::kInvalidArgument, "layer");
  // Bytes that are no ForwardRequest at all.
  grpc::Slice junk(std::string("\xff\xff\xff\xff garbage", 12));
  absl::StatusOr<ForwardResult> got = (*channel)->Forward(grpc::ByteBuffer(&junk, 1));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  // And the channel serves on.
  v1::ForwardRequest r = Random(5);
  got = (*channel)->Forward(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LT(RelativeL2(DecodeFloats(got->output.data(), v1::DTYPE_BF16), Expected(r)), 1e-2);
}

TEST_F(ForwardChannelE2eTest, RegistrationChecks) {
  ForwardChannelOptions named;
  named.name = "moeserve-e2e-" + std::to_string(getpid());
  auto first = ForwardChannelClient::Create(client_.get(), named);
  ASSERT_TRUE(first.ok()) << first.status();
  // The same name again: refused by the client's shm_open (the object exists) or the server.
  EXPECT_FALSE(ForwardChannelClient::Create(client_.get(), named).ok());
  ShmObject other(1 << 16);
  absl::StatusOr<v1::RegisterForwardChannelResponse> dup =
      client_->RegisterForwardChannel(named.name, other.key(), 1 << 16);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists) << dup.status();
  EXPECT_EQ(client_->UnregisterForwardChannel("no-such-channel").code(),
            absl::StatusCode::kNotFound);
  // A header never written.
  absl::StatusOr<v1::RegisterForwardChannelResponse> blank =
      client_->RegisterForwardChannel("blank", other.key(), 1 << 16);
  EXPECT_EQ(blank.status().code(), absl::StatusCode::kInvalidArgument) << blank.status();
  EXPECT_THAT(std::string(blank.status().message()), HasSubstr("RegisterForwardChannel: header"));
  // max_forward_channels = 3.
  auto second = ForwardChannelClient::Create(client_.get(), {});
  auto third = ForwardChannelClient::Create(client_.get(), {});
  ASSERT_TRUE(second.ok() && third.ok());
  auto fourth = ForwardChannelClient::Create(client_.get(), {});
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted) << fourth.status();
}

TEST(ForwardChannelServerTest, OffUnlessSharedMemoryAndDetachesAtShutdown) {
  EngineOptions options;
  options.model = ModelPreset("tiny").value();
  options.num_threads = 1;
  auto engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok());
  ServerOptions server_options;
  server_options.listen_addresses = {"127.0.0.1:0"};
  server_options.metrics_address = "";
  {
    auto off = MoeServer::Start(engine->get(), server_options);
    ASSERT_TRUE(off.ok());
    auto client = MoeClient::Create((*off)->bound_addresses()[0]).value();
    auto refused = ForwardChannelClient::Create(client.get(), {});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--enable_shared_memory"));
  }
  server_options.enable_shared_memory = true;
  auto server = MoeServer::Start(engine->get(), server_options);
  ASSERT_TRUE(server.ok());
  auto client = MoeClient::Create((*server)->bound_addresses()[0]).value();
  ForwardChannelOptions quick;
  quick.spin = absl::Milliseconds(1);
  quick.num_slots = 1;
  auto channel = ForwardChannelClient::Create(client.get(), quick);
  ASSERT_TRUE(channel.ok()) << channel.status();
  (*server)->Shutdown();
  std::mt19937_64 rng(1);
  const ModelConfig& model = (*engine)->info().model;
  // The first call gives its one slot up (unanswered); the next ones must not wait for it
  // forever (they once did: a slot given up on came back only when answered).
  for (int call = 0; call < 3; ++call) {
    auto got = std::async(std::launch::async, [&] {
      return (*channel)->Forward(RandomRequest(rng, 0, 2, model.hidden, model.num_experts,
                                               model.topk, v1::DTYPE_BF16, v1::DTYPE_INT32));
    });
    if (got.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      ADD_FAILURE() << "call " << call << " on a detached channel hangs";
      std::abort();  // the blocked call would keep the test from ending
    }
    const absl::Status s = got.get().status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << "call " << call << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("stopped serving channel"));
  }
}

}  // namespace
}  // namespace moeserve
