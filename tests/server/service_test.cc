// MoeService in-process on 127.0.0.1:0, driven through the generated stub: bad inputs (each an
// exact code and a message naming the field, the server serving on afterwards), correctness
// against an independent reference engine, health, model info, expert weights, metrics and
// concurrency.
#include "server/service.h"

#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/metrics.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::DecodeFloats;
using ::moeserve::testing::HttpGetMetrics;
using ::moeserve::testing::LocalServerOptions;
using ::moeserve::testing::MetricValue;
using ::moeserve::testing::RandomRequest;
using ::moeserve::testing::ReferenceForward;
using ::moeserve::testing::RelativeL2;
using ::moeserve::testing::TestModel;
using ::testing::HasSubstr;

constexpr int64_t kMaxTokens = 64;
constexpr int64_t kMaxMessageBytes = 1 << 20;

// Tiny with small overrides: an odd topk and unequal hidden / intermediate catch transposes.
class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EngineOptions options;
    options.model = TestModel();
    options.seed = 7;
    options.experts = "blas";
    options.num_threads = 2;
    options.max_tokens_per_request = kMaxTokens;
    engine_ = Engine::Create(options).value().release();
    options.experts = "reference";  // independent oracle, same weights
    reference_ = Engine::Create(options).value().release();

    ServerOptions server_options;
    server_options.listen_addresses = {"127.0.0.1:0"};
    server_options.server_threads = 2;
    server_options.max_message_bytes = kMaxMessageBytes;
    server_options.metrics_address = "127.0.0.1:0";
    server_options.enable_get_expert_weights = true;  // off by default: expert_weights_test.cc
    server_ = MoeServer::Start(engine_, server_options).value().release();

    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);  // so that oversized requests reach the server
    channel_ = new std::shared_ptr<grpc::Channel>(grpc::CreateCustomChannel(
        server_->bound_addresses()[0], grpc::InsecureChannelCredentials(), args));
  }

  static void TearDownTestSuite() {
    delete channel_;
    delete server_;
    delete reference_;
    delete engine_;
  }

  std::unique_ptr<v1::MoeService::Stub> Stub() { return v1::MoeService::NewStub(*channel_); }
  const ModelConfig& model() const { return engine_->info().model; }

  v1::ForwardRequest Random(int64_t m, v1::DType dtype = v1::DTYPE_BF16,
                            v1::DType ids = v1::DTYPE_INT32, int layer = 1) {
    return RandomRequest(rng_, layer, m, model().hidden, model().num_experts, model().topk, dtype,
                         ids);
  }

  grpc::Status Call(const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return Stub()->Forward(&ctx, request, response);
  }

  // Forward with hand-made request bytes (the raw wire, as any client could send).
  grpc::Status RawCall(const std::string& request_bytes, std::string* response_bytes) {
    grpc::GenericStub stub(*channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    grpc::Slice slice(request_bytes.data(), request_bytes.size());
    const grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, "/moeserve.v1.MoeService/Forward", grpc::StubOptions(), &request,
                   &response, [&done](grpc::Status s) { done.set_value(std::move(s)); });
    grpc::Status status = done.get_future().get();
    response_bytes->clear();
    std::vector<grpc::Slice> slices;
    if (status.ok() && response.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        response_bytes->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return status;
  }

  // What the reference engine answers for `request`, as floats.
  static std::vector<float> Expected(const v1::ForwardRequest& request) {
    return ReferenceForward(*reference_, request);
  }

  // The server still answers a valid Forward correctly.
  void ExpectStillServing() {
    v1::ForwardRequest r = Random(3);
    v1::ForwardResponse resp;
    grpc::Status s = Call(r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_LT(RelativeL2(DecodeFloats(resp.output().data(), v1::DTYPE_BF16), Expected(r)), 1e-2);
  }

  // `request` fails with `code` and a message containing `field`; the server serves on.
  void ExpectRejected(const v1::ForwardRequest& request, grpc::StatusCode code,
                      const std::string& field) {
    v1::ForwardResponse resp;
    grpc::Status s = Call(request, &resp);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(field));
    EXPECT_FALSE(resp.has_output());
    if (std::getenv("MOESERVE_TEST_VERBOSE") != nullptr) {
      std::printf("  rejected (%d): %s\n", s.error_code(), s.error_message().c_str());
    }
    ExpectStillServing();
  }

  static Engine* engine_;
  static Engine* reference_;
  static MoeServer* server_;
  static std::shared_ptr<grpc::Channel>* channel_;
  std::mt19937_64 rng_{1234};
};

Engine* ServiceTest::engine_ = nullptr;
Engine* ServiceTest::reference_ = nullptr;
MoeServer* ServiceTest::server_ = nullptr;
std::shared_ptr<grpc::Channel>* ServiceTest::channel_ = nullptr;

// ---- correctness ----

struct DTypeCase {
  v1::DType dtype;
  v1::DType ids;
  double tolerance;
};

TEST_F(ServiceTest, ForwardMatchesReferenceForEveryDType) {
  for (const DTypeCase& c : {DTypeCase{v1::DTYPE_BF16, v1::DTYPE_INT32, 1e-2},
                             DTypeCase{v1::DTYPE_FP16, v1::DTYPE_INT64, 1e-2},
                             DTypeCase{v1::DTYPE_FP32, v1::DTYPE_INT32, 1e-5},
                             DTypeCase{v1::DTYPE_FP32, v1::DTYPE_INT64, 1e-5}}) {
    for (int layer = 0; layer < model().num_layers; ++layer) {
      for (int64_t m : {1, 7, 33}) {
        v1::ForwardRequest r = Random(m, c.dtype, c.ids, layer);
        r.set_request_id("req-" + std::to_string(m));
        v1::ForwardResponse resp;
        grpc::Status s = Call(r, &resp);
        ASSERT_TRUE(s.ok()) << s.error_message();
        EXPECT_EQ(resp.request_id(), "req-" + std::to_string(m));
        EXPECT_EQ(resp.output().dtype(), c.dtype);
        EXPECT_THAT(resp.output().shape(), ::testing::ElementsAre(m, model().hidden));
        const std::vector<float> got = DecodeFloats(resp.output().data(), c.dtype);
        ASSERT_EQ(got.size(), static_cast<size_t>(m * model().hidden));
        const std::vector<float> want = Expected(r);
        double norm = 0;
        for (float v : want) norm += v * v;
        ASSERT_GT(norm, 0) << "reference output is all zeros";
        EXPECT_LT(RelativeL2(got, want), c.tolerance)
            << v1::DType_Name(c.dtype) << " layer " << layer << " M=" << m;
        EXPECT_FALSE(resp.has_timings());
      }
    }
  }
}

// Bytes protobuf's serializer never writes but every parser accepts: tensors split over several
// occurrences (merged; the last data wins), unknown fields, fields out of order.
TEST_F(ServiceTest, UnusualButValidEncodingIsAnsweredAsProtobufReadsIt) {
  v1::ForwardRequest r = Random(5);
  r.set_request_id("odd");
  v1::ForwardRequest first;  // the first hidden_states occurrence: dtype and wrong data
  first.mutable_hidden_states()->set_dtype(r.hidden_states().dtype());
  first.mutable_hidden_states()->set_data(std::string(r.hidden_states().data().size(), '\x7f'));
  v1::ForwardRequest rest = r;
  rest.mutable_hidden_states()->clear_dtype();                 // merged from the first occurrence
  const std::string unknown = std::string("\xf8\x07\x2a", 3);  // field 127, varint 42
  const std::string bytes =
      unknown + first.SerializeAsString() + unknown + rest.SerializeAsString();
  v1::ForwardRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  ASSERT_EQ(parsed.hidden_states().data(), r.hidden_states().data());
  std::string response_bytes;
  grpc::Status s = RawCall(bytes, &response_bytes);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::ForwardResponse resp;
  ASSERT_TRUE(resp.ParseFromString(response_bytes));
  EXPECT_EQ(resp.request_id(), "odd");
  const std::vector<float> got = DecodeFloats(resp.output().data(), r.hidden_states().dtype());
  EXPECT_LT(RelativeL2(got, Expected(r)), 1e-2);
}

TEST_F(ServiceTest, UnparseableRequestRejected) {
  for (const std::string& bytes :
       {std::string("\x0a\x05"
                    "ab",
                    4),
        std::string("\x12\x03\x08\x80\x80", 5),
        std::string("\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", 12)}) {
    std::string response_bytes;
    grpc::Status s = RawCall(bytes, &response_bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("Forward: malformed moeserve.v1.ForwardRequest"));
    ExpectStillServing();
  }
}

TEST_F(ServiceTest, TimingsWhenAsked) {
  v1::ForwardRequest r = Random(16);
  r.set_return_timings(true);
  v1::ForwardResponse resp;
  ASSERT_TRUE(Call(r, &resp).ok());
  ASSERT_TRUE(resp.has_timings());
  const v1::StageTimings& t = resp.timings();
  EXPECT_GE(t.queue_us(), 0);
  EXPECT_GE(t.prepare_us(), 0);
  EXPECT_GT(t.experts_us(), 0);
  EXPECT_GE(t.finalize_us(), 0);
  EXPECT_GT(t.total_us(), 0);
  EXPECT_GE(t.total_us(), t.prepare_us() + t.experts_us() + t.finalize_us());
  // Decoding and viewing the request's tensors, inside the total.
  EXPECT_GT(t.input_us(), 0);
  EXPECT_LT(t.input_us(), t.total_us());
}

TEST_F(ServiceTest, ZeroTokensReturnsEmptyOutput) {
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32}) {
    v1::ForwardRequest r = Random(0, dtype);
    r.set_request_id("empty");
    v1::ForwardResponse resp;
    grpc::Status s = Call(r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.request_id(), "empty");
    EXPECT_EQ(resp.output().dtype(), dtype);
    EXPECT_THAT(resp.output().shape(), ::testing::ElementsAre(0, model().hidden));
    EXPECT_TRUE(resp.output().data().empty());
  }
}

TEST_F(ServiceTest, ConcurrentForwardsAreAllCorrect) {
  constexpr int kThreads = 8, kCalls = 10;
  std::vector<std::thread> threads;
  std::vector<int> ok(kThreads, 0);
  std::vector<std::string> failures(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      auto stub = v1::MoeService::NewStub(*channel_);
      const v1::DType dtypes[] = {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32};
      for (int i = 0; i < kCalls; ++i) {
        const v1::DType dtype = dtypes[(t + i) % 3];
        const int64_t m = 1 + static_cast<int64_t>(rng() % 24);
        v1::ForwardRequest r =
            RandomRequest(rng, i % model().num_layers, m, model().hidden, model().num_experts,
                          model().topk, dtype, i % 2 ? v1::DTYPE_INT64 : v1::DTYPE_INT32);
        r.set_request_id(std::to_string(t) + "/" + std::to_string(i));
        v1::ForwardResponse resp;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
        grpc::Status s = stub->Forward(&ctx, r, &resp);
        if (!s.ok()) {
          failures[t] = s.error_message();
          continue;
        }
        const double err = RelativeL2(DecodeFloats(resp.output().data(), dtype), Expected(r));
        const double tol = dtype == v1::DTYPE_FP32 ? 1e-5 : 1e-2;
        if (resp.request_id() == r.request_id() && err < tol) {
          ++ok[t];
        } else {
          failures[t] = "request " + r.request_id() + " error " + std::to_string(err);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(ok[t], kCalls) << "thread " << t << ": " << failures[t];
  }
}

// ---- bad inputs ----

TEST_F(ServiceTest, UnknownDTypeRejected) {
  v1::ForwardRequest r = Random(2);
  r.mutable_hidden_states()->set_dtype(static_cast<v1::DType>(42));
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states");
  r = Random(2);
  r.mutable_topk_ids()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
  r = Random(2);
  r.mutable_topk_weights()->set_dtype(static_cast<v1::DType>(-3));
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights");
}

TEST_F(ServiceTest, WrongDTypeForFieldRejected) {
  v1::ForwardRequest r = Random(2);
  r.mutable_hidden_states()->set_dtype(v1::DTYPE_INT32);  // same itemsize as fp32? no: bf16
  r.mutable_hidden_states()->mutable_data()->append(r.hidden_states().data());
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states");
  r = Random(2);
  r.mutable_topk_ids()->set_dtype(v1::DTYPE_FP32);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
  r = Random(2);
  r.mutable_topk_weights()->set_dtype(v1::DTYPE_INT32);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights");
}

TEST_F(ServiceTest, RankNotTwoRejected) {
  v1::ForwardRequest r = Random(2);
  r.mutable_hidden_states()->clear_shape();
  r.mutable_hidden_states()->add_shape(2 * model().hidden);  // rank 1, right byte count
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states");
  r = Random(2);
  r.mutable_hidden_states()->clear_shape();
  for (int64_t d : {int64_t{1}, int64_t{2}, model().hidden})
    r.mutable_hidden_states()->add_shape(d);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states");
  r = Random(2);
  r.mutable_topk_ids()->clear_shape();
  for (int64_t d : {2, 1, model().topk}) r.mutable_topk_ids()->add_shape(d);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
  r = Random(2);
  r.mutable_topk_weights()->clear_shape();
  r.mutable_topk_weights()->add_shape(2 * model().topk);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights");
  // Ten thousand dims: refused by the decoder before it stores them, with a short message
  // (printed in full, the shape made a status larger than gRPC carries).
  r = Random(2);
  for (int i = 0; i < 10000; ++i) r.mutable_hidden_states()->add_shape(1);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "tensor field 2 has a shape of 10002 dims");
  r = Random(2);
  r.mutable_topk_ids()->clear_shape();
  for (int i = 0; i < 9; ++i) r.mutable_topk_ids()->add_shape(1);
  v1::ForwardResponse resp;
  const grpc::Status s = Call(r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_LT(s.error_message().size(), 200u) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("tensor field 3 has a shape of 9 dims; at most 8"));
}

TEST_F(ServiceTest, HiddenSizeMismatchRejected) {
  v1::ForwardRequest r = Random(2);
  r.mutable_hidden_states()->set_shape(0, 4);
  r.mutable_hidden_states()->set_shape(1, model().hidden / 2);  // same bytes, wrong hidden
  v1::ForwardResponse resp;
  grpc::Status s = Call(r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("hidden_states"));
  EXPECT_THAT(s.error_message(), HasSubstr(std::to_string(model().hidden)));
  ExpectStillServing();
}

TEST_F(ServiceTest, TopkShapeMismatchRejected) {
  const int64_t m = 4, topk = model().topk;
  // topk_ids [M, topk + 1] with matching bytes.
  v1::ForwardRequest r = Random(m);
  r.mutable_topk_ids()->set_shape(1, topk + 1);
  r.mutable_topk_ids()->mutable_data()->append(m * 4, '\0');
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
  // topk_ids [M - 1, topk].
  r = Random(m);
  r.mutable_topk_ids()->set_shape(0, m - 1);
  r.mutable_topk_ids()->mutable_data()->resize((m - 1) * topk * 4);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
  // topk_weights [M, topk - 1].
  r = Random(m);
  r.mutable_topk_weights()->set_shape(1, topk - 1);
  r.mutable_topk_weights()->mutable_data()->resize(m * (topk - 1) * 4);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights");
  // topk_weights [M + 1, topk].
  r = Random(m);
  r.mutable_topk_weights()->set_shape(0, m + 1);
  r.mutable_topk_weights()->mutable_data()->append(topk * 4, '\0');
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights");
}

TEST_F(ServiceTest, ByteLengthMismatchRejected) {
  v1::ForwardRequest r = Random(2);
  r.mutable_hidden_states()->mutable_data()->pop_back();
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states: data has");
  r = Random(2);
  r.mutable_topk_ids()->mutable_data()->append(4, '\0');
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids: data has");
  r = Random(2);
  r.mutable_topk_weights()->mutable_data()->clear();
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights: data has");
}

TEST_F(ServiceTest, NegativeAndOverflowingDimsRejected) {
  v1::ForwardRequest r = Random(2);
  r.mutable_hidden_states()->set_shape(0, -2);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states");
  r = Random(2);
  r.mutable_topk_ids()->set_shape(0, int64_t{1} << 62);
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
}

TEST_F(ServiceTest, ExpertIdOutOfRangeRejected) {
  const int num_experts = model().num_experts;
  for (v1::DType ids : {v1::DTYPE_INT32, v1::DTYPE_INT64}) {
    for (int64_t bad : {int64_t{num_experts}, int64_t{-1}, int64_t{1} << 40}) {
      if (ids == v1::DTYPE_INT32 && bad > INT32_MAX) continue;
      v1::ForwardRequest r = Random(3, v1::DTYPE_BF16, ids);
      char* data = r.mutable_topk_ids()->mutable_data()->data();
      const int64_t index = 4;  // token 1, route 1
      if (ids == v1::DTYPE_INT32) {
        const int32_t v = static_cast<int32_t>(bad);
        std::memcpy(data + index * 4, &v, 4);
      } else {
        std::memcpy(data + index * 8, &bad, 8);
      }
      v1::ForwardResponse resp;
      grpc::Status s = Call(r, &resp);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("topk_ids"));
      EXPECT_THAT(s.error_message(), HasSubstr(std::to_string(bad)));
      ExpectStillServing();
    }
  }
}

TEST_F(ServiceTest, LayerOutOfRangeRejected) {
  for (int layer : {-1, model().num_layers, 1 << 30}) {
    v1::ForwardRequest r = Random(2);
    r.set_layer(layer);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "layer");
  }
}

TEST_F(ServiceTest, NonFiniteTopkWeightsRejected) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    v1::ForwardRequest r = Random(3);
    std::memcpy(r.mutable_topk_weights()->mutable_data()->data() + 5 * 4, &bad, 4);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights");
  }
}

TEST_F(ServiceTest, TooManyTokensIsResourceExhausted) {
  v1::ForwardRequest r = Random(kMaxTokens + 1);
  ExpectRejected(r, grpc::StatusCode::RESOURCE_EXHAUSTED, "hidden_states");
  // Exactly at the limit is fine.
  v1::ForwardResponse resp;
  r = Random(kMaxTokens);
  EXPECT_TRUE(Call(r, &resp).ok());
}

TEST_F(ServiceTest, OversizedMessageIsResourceExhausted) {
  v1::ForwardRequest r = Random(2);
  r.set_request_id(std::string(kMaxMessageBytes + 1, 'x'));
  v1::ForwardResponse resp;
  grpc::Status s = Call(r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  ExpectStillServing();
}

TEST_F(ServiceTest, MissingTensorsRejected) {
  v1::ForwardRequest r = Random(2);
  r.clear_topk_weights();
  ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights: missing");
  ExpectRejected(v1::ForwardRequest(), grpc::StatusCode::INVALID_ARGUMENT,
                 "hidden_states: missing");
}

// ---- server-side routing (a request without topk_ids / topk_weights) ----

TEST_F(ServiceTest, ServerRoutingUsesTheLayersGateAndReturnsItsChoice) {
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32}) {
    v1::ForwardRequest r = Random(9, dtype);
    r.clear_topk_ids();
    r.clear_topk_weights();
    r.set_return_routing(true);
    r.set_return_timings(true);
    v1::ForwardResponse resp;
    grpc::Status s = Call(r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.topk_ids().dtype(), v1::DTYPE_INT32);
    ASSERT_EQ(resp.topk_weights().dtype(), v1::DTYPE_FP32);
    ASSERT_THAT(resp.topk_ids().shape(), ::testing::ElementsAre(9, model().topk));
    ASSERT_THAT(resp.topk_weights().shape(), ::testing::ElementsAre(9, model().topk));
    EXPECT_GT(resp.timings().route_us(), 0);

    // The choice is the router's on the same hidden states (the reference engine routes with
    // the same synthetic gates, independently of the serving engine).
    const Shape shape = {9, model().hidden};
    const TensorView hidden(static_cast<const void*>(r.hidden_states().data().data()),
                            dtype == v1::DTYPE_BF16 ? DType::kBF16 : DType::kFP32, shape);
    std::vector<int32_t> ids(9 * model().topk);
    std::vector<float> weights(ids.size());
    ASSERT_TRUE(reference_
                    ->Route(1, hidden, TensorView(ids.data(), DType::kINT32, {9, model().topk}),
                            TensorView(weights.data(), DType::kFP32, {9, model().topk}))
                    .ok());
    EXPECT_EQ(resp.topk_ids().data(),
              std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
    EXPECT_EQ(resp.topk_weights().data(),
              std::string(reinterpret_cast<const char*>(weights.data()), weights.size() * 4));
    // Softmax top-k, renormalized (the preset's router): every token's weights sum to 1.
    for (int t = 0; t < 9; ++t) {
      float sum = 0;
      for (int k = 0; k < model().topk; ++k) sum += weights[t * model().topk + k];
      EXPECT_NEAR(sum, 1.0f, 1e-5f);
    }

    // The answer is the experts combined with that routing: the reference engine agrees, and
    // the same call routed by the client answers the same bytes.
    v1::ForwardRequest routed = r;
    *routed.mutable_topk_ids() = resp.topk_ids();
    *routed.mutable_topk_weights() = resp.topk_weights();
    routed.set_return_routing(false);
    EXPECT_LT(RelativeL2(DecodeFloats(resp.output().data(), dtype), Expected(routed)),
              dtype == v1::DTYPE_BF16 ? 1e-2 : 1e-5);
    v1::ForwardResponse again;
    ASSERT_TRUE(Call(routed, &again).ok());
    EXPECT_EQ(again.output().data(), resp.output().data());
    EXPECT_FALSE(again.has_topk_ids());  // not asked for
  }
}

TEST_F(ServiceTest, ReturnRoutingEchoesTheClientsRoutingAsInt32) {
  v1::ForwardRequest r = Random(4, v1::DTYPE_BF16, v1::DTYPE_INT64);
  r.set_return_routing(true);
  v1::ForwardResponse resp;
  ASSERT_TRUE(Call(r, &resp).ok());
  ASSERT_EQ(resp.topk_ids().dtype(), v1::DTYPE_INT32);
  const auto* sent = reinterpret_cast<const int64_t*>(r.topk_ids().data().data());
  const auto* got = reinterpret_cast<const int32_t*>(resp.topk_ids().data().data());
  ASSERT_EQ(resp.topk_ids().data().size(), 4u * 3 * 4);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(got[i], sent[i]);
  EXPECT_EQ(resp.topk_weights().data(), r.topk_weights().data());
}

TEST_F(ServiceTest, ServerRoutingRefusals) {
  v1::ForwardRequest only_ids = Random(2);
  only_ids.clear_topk_weights();
  ExpectRejected(only_ids, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights: missing while");
  v1::ForwardRequest only_weights = Random(2);
  only_weights.clear_topk_ids();
  ExpectRejected(only_weights, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids: missing while");

  auto unrouted = [&](int64_t m, int layer = 1) {
    v1::ForwardRequest r = Random(m, v1::DTYPE_BF16, v1::DTYPE_INT32, layer);
    r.clear_topk_ids();
    r.clear_topk_weights();
    return r;
  };
  ExpectRejected(unrouted(2, 7), grpc::StatusCode::INVALID_ARGUMENT, "layer");
  ExpectRejected(unrouted(kMaxTokens + 1), grpc::StatusCode::RESOURCE_EXHAUSTED, "hidden_states");
  v1::ForwardRequest wrong_hidden = unrouted(2);
  wrong_hidden.mutable_hidden_states()->set_shape(1, model().hidden / 2);
  wrong_hidden.mutable_hidden_states()->set_shape(0, 4);
  ExpectRejected(wrong_hidden, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states");
  // A hostile shape with no bytes ([2^40, 0]) is refused before anything is sized from it.
  v1::ForwardRequest empty_rows = unrouted(1);
  empty_rows.mutable_hidden_states()->set_shape(0, int64_t{1} << 40);
  empty_rows.mutable_hidden_states()->set_shape(1, 0);
  empty_rows.mutable_hidden_states()->clear_data();
  ExpectRejected(empty_rows, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states");
  // M = 0 is valid, as with client-side routing.
  v1::ForwardRequest zero = unrouted(0);
  zero.set_return_routing(true);
  v1::ForwardResponse resp;
  ASSERT_TRUE(Call(zero, &resp).ok());
  EXPECT_THAT(resp.topk_ids().shape(), ::testing::ElementsAre(0, model().topk));
}

TEST(ServiceNoRouterTest, ServerRoutingIsFailedPreconditionWithoutAGate) {
  EngineOptions options;
  options.model = TestModel();
  options.model.router.reset();
  options.model.no_router_reason = "no gate in this test";
  options.num_threads = 1;
  std::unique_ptr<Engine> engine = Engine::Create(options).value();
  EXPECT_FALSE(engine->has_router());
  ServerOptions server_options;
  server_options.listen_addresses = {"127.0.0.1:0"};
  server_options.metrics_address = "";
  std::unique_ptr<MoeServer> server = MoeServer::Start(engine.get(), server_options).value();
  auto stub = v1::MoeService::NewStub(
      grpc::CreateChannel(server->bound_addresses()[0], grpc::InsecureChannelCredentials()));
  v1::ModelInfo info;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  }
  EXPECT_FALSE(info.server_routing());
  EXPECT_EQ(info.router(), "");
  std::mt19937_64 rng(5);
  v1::ForwardRequest r = RandomRequest(rng, 0, 3, options.model.hidden, options.model.num_experts,
                                       options.model.topk, v1::DTYPE_BF16, v1::DTYPE_INT32);
  r.clear_topk_ids();
  r.clear_topk_weights();
  v1::ForwardResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = stub->Forward(&ctx, r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("no gate in this test"));
  EXPECT_THAT(s.error_message(), HasSubstr("send topk_ids and topk_weights"));
}

// ---- the other RPCs ----

TEST_F(ServiceTest, HealthIsServing) {
  auto health = grpc::health::v1::Health::NewStub(*channel_);
  for (const char* service : {"", "moeserve.v1.MoeService"}) {
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = health->Check(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << service << ": " << s.error_message();
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
}

TEST_F(ServiceTest, GetModelInfo) {
  v1::ModelInfo info;
  grpc::ClientContext ctx;
  ASSERT_TRUE(Stub()->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  const ModelConfig& m = model();
  EXPECT_EQ(info.model_name(), "tiny");
  EXPECT_EQ(info.num_layers(), m.num_layers);
  EXPECT_EQ(info.num_experts(), 8);
  EXPECT_EQ(info.topk(), 3);
  EXPECT_EQ(info.hidden(), 128);
  EXPECT_EQ(info.intermediate(), 96);
  EXPECT_THAT(info.accepted_hidden_dtypes(),
              ::testing::UnorderedElementsAre(v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32));
  EXPECT_THAT(info.accepted_topk_ids_dtypes(),
              ::testing::UnorderedElementsAre(v1::DTYPE_INT32, v1::DTYPE_INT64));
  EXPECT_EQ(info.weight_format(), "bf16");
  EXPECT_EQ(info.num_ranks(), 1);
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.max_tokens_per_request(), kMaxTokens);
  EXPECT_EQ(info.max_message_bytes(), kMaxMessageBytes);
  EXPECT_FALSE(info.prepare_finalize().empty());
  EXPECT_FALSE(info.experts().empty());
  EXPECT_EQ(info.activation(), "silu");
  EXPECT_FALSE(info.placement().empty());
  ASSERT_EQ(info.expert_placement_size(), 1);
  EXPECT_EQ(info.expert_placement(0).rank(), 0);
  EXPECT_THAT(info.expert_placement(0).expert_ids(),
              ::testing::ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_EQ(info.moe_layers_size(), m.num_layers);
  EXPECT_TRUE(info.server_routing());
  EXPECT_EQ(info.router(), "softmax_topk(renormalize)");
}

TEST_F(ServiceTest, GetExpertWeights) {
  const int64_t h = model().hidden, n = model().intermediate;
  v1::GetExpertWeightsRequest req;
  req.set_layer(1);
  req.set_expert(5);
  v1::GetExpertWeightsResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = Stub()->GetExpertWeights(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.w13().dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(resp.w13().shape(), ::testing::ElementsAre(2 * n, h));
  EXPECT_EQ(resp.w13().data().size(), static_cast<size_t>(2 * n * h * 2));
  EXPECT_EQ(resp.w2().dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(resp.w2().shape(), ::testing::ElementsAre(h, n));
  EXPECT_EQ(resp.w2().data().size(), static_cast<size_t>(h * n * 2));
  // The same values the reference engine computes with.
  std::vector<uint16_t> w13(2 * n * h), w2(h * n);
  ASSERT_TRUE(reference_->GetExpertWeightsBf16(1, 5, w13.data(), w2.data()).ok());
  EXPECT_EQ(std::memcmp(resp.w13().data().data(), w13.data(), w13.size() * 2), 0);
  EXPECT_EQ(std::memcmp(resp.w2().data().data(), w2.data(), w2.size() * 2), 0);
  bool nonzero = false;
  for (uint16_t v : w2) nonzero = nonzero || (v & 0x7fff) != 0;
  EXPECT_TRUE(nonzero);

  for (auto [layer, expert, field] : {std::tuple<int, int, const char*>{1, 8, "expert"},
                                      {1, -1, "expert"},
                                      {model().num_layers, 0, "layer"},
                                      {-1, 0, "layer"}}) {
    req.set_layer(layer);
    req.set_expert(expert);
    grpc::ClientContext bad_ctx;
    v1::GetExpertWeightsResponse bad;
    s = Stub()->GetExpertWeights(&bad_ctx, req, &bad);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << layer << "/" << expert;
    EXPECT_THAT(s.error_message(), HasSubstr(field));
  }
}

TEST_F(ServiceTest, MetricsMove) {
  const int port = server_->metrics().port();
  ASSERT_GT(port, 0);
  const std::string before = HttpGetMetrics(port);
  ASSERT_THAT(before, HasSubstr("200 OK"));
  EXPECT_EQ(MetricValue(before, "moeserve_model_info",
                        {"model=\"tiny\"", "backend=\"cpu\"", "weight_format=\"bf16\"",
                         "num_ranks=\"1\"", "experts=", "prepare_finalize="}),
            1);
  EXPECT_GE(MetricValue(before, "moeserve_inflight_requests"), 0);
  auto value = [](const std::string& text, const std::string& name,
                  const std::vector<std::string>& labels = {}) {
    return std::max(0.0, MetricValue(text, name, labels));
  };

  constexpr int kCalls = 3;
  constexpr int64_t kTokens = 5;
  for (int i = 0; i < kCalls; ++i) {
    v1::ForwardResponse resp;
    ASSERT_TRUE(Call(Random(kTokens), &resp).ok());
  }
  v1::ForwardRequest bad = Random(2);
  bad.set_layer(-1);
  v1::ForwardResponse resp;
  EXPECT_FALSE(Call(bad, &resp).ok());

  const std::string after = HttpGetMetrics(port);
  const std::vector<std::string> fwd_ok = {"method=\"Forward\"", "code=\"OK\""};
  EXPECT_EQ(value(after, "moeserve_requests_total", fwd_ok) -
                value(before, "moeserve_requests_total", fwd_ok),
            kCalls);
  const std::vector<std::string> fwd_bad = {"method=\"Forward\"", "code=\"INVALID_ARGUMENT\""};
  EXPECT_EQ(value(after, "moeserve_requests_total", fwd_bad) -
                value(before, "moeserve_requests_total", fwd_bad),
            1);
  const std::vector<std::string> fwd = {"method=\"Forward\""};
  EXPECT_EQ(value(after, "moeserve_request_latency_seconds_count", fwd) -
                value(before, "moeserve_request_latency_seconds_count", fwd),
            kCalls + 1);
  EXPECT_GT(value(after, "moeserve_request_latency_seconds_sum", fwd),
            value(before, "moeserve_request_latency_seconds_sum", fwd));
  EXPECT_EQ(value(after, "moeserve_tokens_total") - value(before, "moeserve_tokens_total"),
            kCalls * kTokens);
  for (const char* stage : {"queue", "prepare", "experts", "finalize"}) {
    const std::vector<std::string> l = {std::string("stage=\"") + stage + "\""};
    EXPECT_EQ(value(after, "moeserve_forward_stage_seconds_count", l) -
                  value(before, "moeserve_forward_stage_seconds_count", l),
              kCalls)
        << stage;
  }
  // Sequential calls: one engine step each, one call and kTokens tokens per step.
  EXPECT_EQ(
      value(after, "moeserve_batch_calls_count") - value(before, "moeserve_batch_calls_count"),
      kCalls);
  EXPECT_EQ(value(after, "moeserve_batch_calls_sum") - value(before, "moeserve_batch_calls_sum"),
            kCalls);
  EXPECT_EQ(value(after, "moeserve_batch_tokens_sum") - value(before, "moeserve_batch_tokens_sum"),
            kCalls * kTokens);
  EXPECT_EQ(MetricValue(after, "moeserve_queued_tokens"), 0);
  EXPECT_EQ(MetricValue(after, "moeserve_inflight_requests"), 0);
  EXPECT_EQ(MetricValue(after, "moeserve_batch_lead_steps_total"), 0);  // one lane, no lead
  EXPECT_EQ(MetricValue(after, "moeserve_batch_merging_layers"), 0);    // no --company_wait_us -1
  // Sequential calls merge nothing (earlier tests on this server may have: deltas); without a
  // company wait or a lane lead (the CPU's default) no caller's history is kept, so no
  // turnaround is ever measured.
  EXPECT_GE(MetricValue(after, "moeserve_batch_merged_steps_total"), 0);  // exported
  EXPECT_EQ(value(after, "moeserve_batch_merged_steps_total") -
                value(before, "moeserve_batch_merged_steps_total"),
            0);
  for (const char* phase : {"arrivals", "take", "merge", "engine", "answers"}) {
    const std::vector<std::string> l = {absl::StrCat("phase=\"", phase, "\"")};
    EXPECT_GE(MetricValue(after, "moeserve_batch_merged_step_seconds_total", l), 0) << phase;
    EXPECT_EQ(value(after, "moeserve_batch_merged_step_seconds_total", l) -
                  value(before, "moeserve_batch_merged_step_seconds_total", l),
              0)
        << phase;
  }
  EXPECT_EQ(MetricValue(after, "moeserve_caller_turnaround_seconds_count"), 0);
}

// The batcher's reports of merged steps and turnarounds land in their series.
TEST(MetricsTest, MergedStepPhasesAndTurnarounds) {
  auto metrics = Metrics::Create("127.0.0.1:0");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  MergedStepTimes t;
  t.calls = 3;
  t.arrivals = absl::Microseconds(100);
  t.take = absl::Microseconds(20);
  t.merge = absl::Microseconds(30);
  t.engine = absl::Microseconds(600);
  t.answers = absl::Microseconds(90);
  (*metrics)->OnMergedStep(t);
  (*metrics)->OnMergedStep(t);
  (*metrics)->OnTurnaround(absl::Microseconds(250));
  const std::string text = HttpGetMetrics((*metrics)->port());
  EXPECT_EQ(MetricValue(text, "moeserve_batch_merged_steps_total"), 2);
  const std::pair<const char*, double> phases[] = {{"arrivals", 200e-6},
                                                   {"take", 40e-6},
                                                   {"merge", 60e-6},
                                                   {"engine", 1200e-6},
                                                   {"answers", 180e-6}};
  for (const auto& [phase, seconds] : phases) {
    EXPECT_NEAR(MetricValue(text, "moeserve_batch_merged_step_seconds_total",
                            {absl::StrCat("phase=\"", phase, "\"")}),
                seconds, 1e-9)
        << phase;
  }
  EXPECT_EQ(MetricValue(text, "moeserve_caller_turnaround_seconds_count"), 1);
  EXPECT_NEAR(MetricValue(text, "moeserve_caller_turnaround_seconds_sum"), 250e-6, 1e-9);
}

// A request's tensors as an engine input (views of its bytes): hidden [m, hidden] in `hidden`,
// ids [m, topk] in `ids`, weights FP32.
ForwardInput InputOfRequest(const v1::ForwardRequest& r, const ModelConfig& model, int64_t m,
                            DType hidden, DType ids) {
  ForwardInput in;
  in.layer = r.layer();
  in.hidden_states = TensorView(static_cast<const void*>(r.hidden_states().data().data()), hidden,
                                {m, model.hidden});
  in.topk_ids =
      TensorView(static_cast<const void*>(r.topk_ids().data().data()), ids, {m, model.topk});
  in.topk_weights = TensorView(static_cast<const void*>(r.topk_weights().data().data()),
                               DType::kFP32, {m, model.topk});
  return in;
}

// --stage_timing_every: calls without return_timings run untimed steps (their queue is still
// observed, the engine stages are not) while a call that asks gets its stages measured; the
// answers are the same.
// The test model on the reference experts, for servers a test starts itself.
std::unique_ptr<Engine> ReferenceTestEngine(uint64_t seed) {
  EngineOptions options;
  options.model = TestModel();
  options.seed = seed;
  options.num_threads = 2;
  options.max_tokens_per_request = kMaxTokens;
  options.experts = "reference";
  return Engine::Create(options).value();
}

// `request`'s BF16 answer `response` (M tokens) is the engine's own, bit for bit.
void ExpectEngineAnswer(Engine& engine, const v1::ForwardRequest& request, int64_t m,
                        const v1::ForwardResponse& response) {
  const ModelConfig& model = engine.info().model;
  const ForwardInput in = InputOfRequest(request, model, m, DType::kBF16, DType::kINT32);
  Tensor out = Tensor::Empty(DType::kBF16, {m, model.hidden});
  ASSERT_TRUE(engine.Forward(in, out.view()).ok());
  EXPECT_EQ(response.output().data(), std::string(out.data<char>(), out.nbytes())) << "M=" << m;
}

TEST(ServiceStageTimingTest, UnaskedCallsSkipTheStageTimersAndAskingOnesGetThem) {
  // (return_host_timings: the host clock's totals without the stage timers.)
  std::unique_ptr<Engine> engine = ReferenceTestEngine(12);
  const ModelConfig& model = engine->info().model;
  ServerOptions server_options;
  server_options.listen_addresses = {"127.0.0.1:0"};
  server_options.metrics_address = "127.0.0.1:0";
  server_options.batcher.stage_timing_every = 1000;
  absl::StatusOr<std::unique_ptr<MoeServer>> server =
      MoeServer::Start(engine.get(), server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::MoeService::NewStub(
      grpc::CreateChannel((*server)->bound_addresses()[0], grpc::InsecureChannelCredentials()));
  const int port = (*server)->metrics().port();
  auto count = [port](const char* stage) {
    return std::max(0.0, MetricValue(HttpGetMetrics(port), "moeserve_forward_stage_seconds_count",
                                     {std::string("stage=\"") + stage + "\""}));
  };
  std::mt19937_64 rng(5);
  auto call = [&](bool timings, v1::ForwardResponse* resp, bool host_timings = false) {
    v1::ForwardRequest r = RandomRequest(rng, 0, 3, model.hidden, model.num_experts, model.topk,
                                         v1::DTYPE_BF16, v1::DTYPE_INT32);
    r.set_return_timings(timings);
    r.set_return_host_timings(host_timings);
    grpc::ClientContext ctx;
    grpc::Status s = stub->Forward(&ctx, r, resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ExpectEngineAnswer(*engine, r, 3, *resp);
  };
  const double queue0 = count("queue"), experts0 = count("experts");
  for (int i = 0; i < 4; ++i) {
    v1::ForwardResponse resp;
    call(false, &resp);
    EXPECT_FALSE(resp.has_timings());
  }
  EXPECT_EQ(count("queue") - queue0, 4);
  EXPECT_EQ(count("experts") - experts0, 0);
  v1::ForwardResponse timed;
  call(true, &timed);
  EXPECT_GT(timed.timings().experts_us(), 0);
  EXPECT_GT(timed.timings().total_us(), 0);
  EXPECT_EQ(count("experts") - experts0, 1);
  EXPECT_EQ(count("queue") - queue0, 5);
  // The host clock's timings only: an untimed step, its totals answered.
  const int64_t timed_steps = (*server)->batcher_stats().timed_steps;
  v1::ForwardResponse host;
  call(false, &host, /*host_timings=*/true);
  ASSERT_TRUE(host.has_timings());
  EXPECT_GT(host.timings().total_us(), 0);
  EXPECT_GT(host.timings().engine_us(), 0);
  EXPECT_GE(host.timings().total_us(), host.timings().engine_us());
  EXPECT_EQ(host.timings().experts_us(), 0);
  EXPECT_EQ((*server)->batcher_stats().timed_steps, timed_steps);
  EXPECT_EQ(count("experts") - experts0, 1);
  (*server)->Shutdown(std::chrono::seconds(5));
}

// Every request on gRPC's receiving thread, or every one on a worker (which polls for them, as
// on a GPU engine): the same answers, bit for bit, as the engine's own. A worker runs the step
// of a call that finds the batcher idle itself; gRPC's thread hands every step off.
TEST(ServiceInlineThresholdTest, InlineAndWorkerPathsAnswerAlike) {
  std::unique_ptr<Engine> engine = ReferenceTestEngine(13);
  const ModelConfig& model = engine->info().model;
  for (const int64_t inline_bytes : {int64_t{0}, int64_t{1} << 30}) {
    SCOPED_TRACE(absl::StrCat("inline_request_bytes=", inline_bytes));
    ServerOptions server_options = LocalServerOptions(inline_bytes);
    server_options.batcher.idle_spin = absl::Milliseconds(2);  // the workers poll too
    std::unique_ptr<MoeServer> server = MoeServer::Start(engine.get(), server_options).value();
    auto stub = v1::MoeService::NewStub(
        grpc::CreateChannel(server->bound_addresses()[0], grpc::InsecureChannelCredentials()));
    std::mt19937_64 rng(static_cast<uint64_t>(inline_bytes) + 3);
    for (const int64_t m : {1, 5, 64, 0, 17}) {
      v1::ForwardRequest r =
          RandomRequest(rng, static_cast<int>(m % 2), m, model.hidden, model.num_experts,
                        model.topk, v1::DTYPE_BF16, v1::DTYPE_INT32);
      grpc::ClientContext ctx;
      v1::ForwardResponse resp;
      grpc::Status s = stub->Forward(&ctx, r, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ExpectEngineAnswer(*engine, r, m, resp);
    }
    // One caller: every call with tokens (4 of 5) found the batcher idle, within inline_max_tokens.
    EXPECT_EQ(server->batcher_stats().inline_steps, inline_bytes == 0 ? 4 : 0);
    server->Shutdown(std::chrono::seconds(5));
  }
}

// Two CPU ranks with round-robin placement behind the same service: placement is reported
// and answers still match the one-rank reference.
TEST(ServiceEpTest, TwoRanksMatchReference) {
  EngineOptions options;
  options.model = TestModel();
  options.seed = 11;
  options.num_threads = 2;
  options.max_tokens_per_request = kMaxTokens;
  options.experts = "reference";
  std::unique_ptr<Engine> reference = Engine::Create(options).value();
  options.experts = "blas";
  options.num_ranks = 2;
  options.placement = "round_robin";
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ServerOptions server_options;
  server_options.listen_addresses = {"127.0.0.1:0"};
  server_options.metrics_address = "";
  absl::StatusOr<std::unique_ptr<MoeServer>> server =
      MoeServer::Start(engine->get(), server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->metrics().port(), 0);
  auto stub = v1::MoeService::NewStub(
      grpc::CreateChannel((*server)->bound_addresses()[0], grpc::InsecureChannelCredentials()));
  v1::ModelInfo info;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
  }
  EXPECT_EQ(info.num_ranks(), 2);
  EXPECT_EQ(info.placement(), "round_robin");
  ASSERT_EQ(info.expert_placement_size(), 2);
  EXPECT_THAT(info.expert_placement(0).expert_ids(), ::testing::ElementsAre(0, 2, 4, 6));
  EXPECT_THAT(info.expert_placement(1).expert_ids(), ::testing::ElementsAre(1, 3, 5, 7));

  std::mt19937_64 rng(99);
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32}) {
    for (int64_t m : {1, 5, 40}) {
      v1::ForwardRequest r =
          RandomRequest(rng, 0, m, options.model.hidden, options.model.num_experts,
                        options.model.topk, dtype, v1::DTYPE_INT64);
      r.set_return_timings(true);
      v1::ForwardResponse resp;
      grpc::ClientContext ctx;
      grpc::Status s = stub->Forward(&ctx, r, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_TRUE(resp.has_timings());
      const ForwardInput in =
          InputOfRequest(r, options.model, m, dtype == v1::DTYPE_BF16 ? DType::kBF16 : DType::kFP32,
                         DType::kINT64);
      Tensor out = Tensor::Empty(in.hidden_states.dtype(), {m, options.model.hidden});
      ASSERT_TRUE(reference->Forward(in, out.view()).ok());
      const std::vector<float> want =
          DecodeFloats(std::string(out.data<char>(), out.nbytes()), dtype);
      EXPECT_LT(RelativeL2(DecodeFloats(resp.output().data(), dtype), want),
                dtype == v1::DTYPE_FP32 ? 1e-5 : 1e-2)
          << "M=" << m;
    }
  }
  (*server)->Shutdown(std::chrono::seconds(5));
}

// Shutdown lets an accepted Forward finish (and answer correctly), then refuses new calls.
TEST(ServiceShutdownTest, InflightForwardFinishes) {
  EngineOptions options;
  options.model = TestModel();
  ModelOverrides bigger;  // slow enough with the plain-loop experts to be caught in flight
  bigger.hidden = 512;
  bigger.intermediate = 512;
  options.model = ApplyOverrides(options.model, bigger).value();
  options.experts = "reference";
  options.num_threads = 1;
  std::unique_ptr<Engine> engine = Engine::Create(options).value();
  ServerOptions server_options;
  server_options.listen_addresses = {"127.0.0.1:0"};
  server_options.metrics_address = "127.0.0.1:0";
  server_options.server_threads = 1;
  std::unique_ptr<MoeServer> server = MoeServer::Start(engine.get(), server_options).value();
  auto channel =
      grpc::CreateChannel(server->bound_addresses()[0], grpc::InsecureChannelCredentials());
  auto stub = v1::MoeService::NewStub(channel);

  std::mt19937_64 rng(3);
  const v1::ForwardRequest request =
      RandomRequest(rng, 0, kMaxTokens, options.model.hidden, options.model.num_experts,
                    options.model.topk, v1::DTYPE_FP32, v1::DTYPE_INT32);
  v1::ForwardResponse response;
  grpc::Status status;
  std::thread caller([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    status = stub->Forward(&ctx, request, &response);
  });
  // Wait until the server has accepted the call (or it already finished).
  const int port = server->metrics().port();
  for (int i = 0; i < 6000; ++i) {
    const std::string text = HttpGetMetrics(port);
    if (MetricValue(text, "moeserve_inflight_requests") > 0 ||
        MetricValue(text, "moeserve_requests_total", {"method=\"Forward\""}) > 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  server->Shutdown(std::chrono::seconds(60));
  caller.join();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(response.output().data().size(),
            static_cast<size_t>(kMaxTokens * options.model.hidden * 4));
  double norm = 0;
  for (float v : DecodeFloats(response.output().data(), v1::DTYPE_FP32)) norm += v * v;
  EXPECT_GT(norm, 0);

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ModelInfo info;
  EXPECT_FALSE(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).ok());
}

}  // namespace
}  // namespace moeserve
