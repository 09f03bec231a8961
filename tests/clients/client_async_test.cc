// MoeClient::ForwardAsync against an in-process server: every call answers exactly once with the
// bytes a blocking Forward gets, refusals keep their code, and the client may be destroyed right
// after its last answer or with calls still in flight (its destructor waits for them).
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "clients/cpp/moeserve_client.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "server/server.h"

namespace moeserve {
namespace {

constexpr int64_t kHidden = 64, kTopk = 2, kExperts = 6;

class ClientAsyncTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelOverrides o;
    o.num_layers = 2, o.num_experts = kExperts, o.topk = kTopk, o.hidden = kHidden;
    o.intermediate = 32;
    EngineOptions options;
    options.model = ApplyOverrides(ModelPreset("tiny").value(), o).value();
    options.seed = 5;
    options.num_threads = 1;
    engine_ = Engine::Create(options).value().release();
    ServerOptions so;
    so.listen_addresses = {"127.0.0.1:0"};
    so.metrics_address = "";
    so.health_poll = std::chrono::milliseconds(0);
    server_ = MoeServer::Start(engine_, so).value().release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete engine_;
  }

  static std::unique_ptr<client::MoeClient> Client() {
    return client::MoeClient::Create(server_->bound_addresses()[0]).value();
  }

  // A request of `m` tokens with fresh random BF16 hidden states and routing.
  static grpc::ByteBuffer Request(int64_t m, int layer, std::mt19937* rng) {
    std::vector<uint16_t> x(static_cast<size_t>(m * kHidden));
    for (auto& v : x) v = static_cast<uint16_t>(0x3c00 + ((*rng)() & 0x7ff));  // +-[1, 8)
    client::ForwardArgs a;
    a.layer = layer;
    a.num_tokens = m;
    a.hidden = kHidden;
    a.hidden_bytes = absl::string_view(reinterpret_cast<const char*>(x.data()), x.size() * 2);
    a.topk = kTopk;
    for (int64_t t = 0; t < m; ++t) {
      const int32_t first = static_cast<int32_t>((*rng)() % kExperts);
      a.topk_ids.push_back(first);
      a.topk_ids.push_back(
          static_cast<int32_t>((first + 1 + (*rng)() % (kExperts - 1)) % kExperts));
      a.topk_weights.push_back(0.75f);
      a.topk_weights.push_back(0.25f);
    }
    return client::MoeClient::EncodeForwardRequest(a).value();
  }

  // Counts answers; Wait blocks until `n` have come.
  struct Answers {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<absl::StatusOr<client::ForwardResult>> got;
    std::vector<int> calls;  // how many times each call's done ran

    explicit Answers(size_t n) : calls(n, 0) {
      for (size_t i = 0; i < n; ++i) got.emplace_back(absl::UnknownError("no answer"));
    }
    std::function<void(absl::StatusOr<client::ForwardResult>)> Done(size_t i) {
      return [this, i](absl::StatusOr<client::ForwardResult> r) {
        std::lock_guard<std::mutex> lock(mu);
        got[i] = std::move(r);
        ++calls[i];
        cv.notify_all();
      };
    }
    int Total() {
      std::lock_guard<std::mutex> lock(mu);
      int total = 0;
      for (int c : calls) total += c;
      return total;
    }
    void Wait(int n) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] {
        int total = 0;
        for (int c : calls) total += c;
        return total >= n;
      });
    }
  };

  static Engine* engine_;
  static MoeServer* server_;
};

Engine* ClientAsyncTest::engine_ = nullptr;
MoeServer* ClientAsyncTest::server_ = nullptr;

TEST_F(ClientAsyncTest, AnswersAsForwardDoes) {
  std::unique_ptr<client::MoeClient> c = Client();
  std::mt19937 rng(11);
  std::vector<grpc::ByteBuffer> requests;
  for (int64_t m : {1, 3, 16, 7, 0, 33})
    requests.push_back(Request(m, static_cast<int>(m % 2), &rng));
  Answers answers(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    c->ForwardAsync(requests[i], answers.Done(i), /*copy_output=*/i % 2 == 0);
  }
  answers.Wait(static_cast<int>(requests.size()));
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("call ", i));
    EXPECT_EQ(answers.calls[i], 1);
    ASSERT_TRUE(answers.got[i].ok()) << answers.got[i].status();
    absl::StatusOr<client::ForwardResult> blocking = c->Forward(requests[i]);
    ASSERT_TRUE(blocking.ok()) << blocking.status();
    std::string async_bytes = answers.got[i]->output.data();
    if (i % 2 == 1) {  // not copied: the bytes are in raw
      async_bytes.resize(answers.got[i]->raw.output.data_size);
      answers.got[i]->raw.output.CopyTo(async_bytes.data());
    }
    EXPECT_EQ(answers.got[i]->output.shape_size(), 2);
    EXPECT_EQ(answers.got[i]->output.dtype(), v1::DTYPE_BF16);
    EXPECT_TRUE(async_bytes == blocking->output.data());
    EXPECT_GT(answers.got[i]->latency, absl::ZeroDuration());
  }
}

TEST_F(ClientAsyncTest, RefusalsKeepTheirCode) {
  std::unique_ptr<client::MoeClient> c = Client();
  std::mt19937 rng(12);
  Answers answers(1);
  c->ForwardAsync(Request(2, /*layer=*/9, &rng), answers.Done(0));
  answers.Wait(1);
  EXPECT_EQ(answers.got[0].status().code(), absl::StatusCode::kInvalidArgument)
      << answers.got[0].status();
  EXPECT_NE(answers.got[0].status().message().find("layer"), std::string::npos)
      << answers.got[0].status();
}

// A client closed as soon as its last answer is in: the callback API could abort here
// (grpc_cq_internal_unref) when its shared completion queue died under its own thread.
TEST_F(ClientAsyncTest, ClientClosedRightAfterItsLastAnswer) {
  std::mt19937 rng(13);
  const grpc::ByteBuffer request = Request(2, 0, &rng);
  for (int round = 0; round < 150; ++round) {
    std::unique_ptr<client::MoeClient> c = Client();
    Answers answers(3);
    for (size_t i = 0; i < 3; ++i) c->ForwardAsync(request, answers.Done(i), false);
    answers.Wait(3);
    c.reset();
    ASSERT_EQ(answers.Total(), 3) << "round " << round;
  }
}

TEST_F(ClientAsyncTest, ClientClosedWithCallsInFlightAnswersThemFirst) {
  std::mt19937 rng(14);
  const grpc::ByteBuffer request = Request(8, 1, &rng);
  for (int round = 0; round < 20; ++round) {
    std::unique_ptr<client::MoeClient> c = Client();
    Answers answers(8);
    for (size_t i = 0; i < 8; ++i) c->ForwardAsync(request, answers.Done(i), false);
    c.reset();  // waits for all eight
    ASSERT_EQ(answers.Total(), 8) << "round " << round;
    for (size_t i = 0; i < 8; ++i) {
      EXPECT_EQ(answers.calls[i], 1);
      EXPECT_TRUE(answers.got[i].ok()) << answers.got[i].status();
    }
  }
}

}  // namespace
}  // namespace moeserve
