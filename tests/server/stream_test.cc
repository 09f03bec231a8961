// ForwardStream: layer calls on one bidirectional stream, answered in order, a failed call
// answered with its error while the stream goes on. Driven both by protobuf's generated stub
// (any client) and by the C++ client's ForwardStream.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "clients/cpp/moeserve_client.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::DecodeFloats;
using ::moeserve::testing::LocalServerOptions;
using ::moeserve::testing::RandomRequest;
using ::moeserve::testing::ReferenceForward;
using ::moeserve::testing::RelativeL2;
using ::moeserve::testing::TestModel;
using ::testing::HasSubstr;

constexpr int64_t kMaxTokens = 64;

class StreamTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EngineOptions options;
    options.model = TestModel();
    options.seed = 11;
    options.experts = "blas";
    options.num_threads = 2;
    options.max_tokens_per_request = kMaxTokens;
    engine_ = Engine::Create(options).value().release();
    options.experts = "reference";  // independent oracle, same weights
    reference_ = Engine::Create(options).value().release();
    ServerOptions server_options;
    server_options.listen_addresses = {"127.0.0.1:0"};
    server_options.server_threads = 2;
    server_options.metrics_address = "127.0.0.1:0";
    server_ = MoeServer::Start(engine_, server_options).value().release();
    channel_ = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel(server_->bound_addresses()[0], grpc::InsecureChannelCredentials()));
  }
  static void TearDownTestSuite() {
    delete channel_;
    delete server_;
    delete reference_;
    delete engine_;
  }

  const ModelConfig& model() const { return engine_->info().model; }

  v1::ForwardRequest Random(int64_t m, v1::DType dtype, int layer, const std::string& id) {
    v1::ForwardRequest r = RandomRequest(rng_, layer, m, model().hidden, model().num_experts,
                                         model().topk, dtype, v1::DTYPE_INT32);
    r.set_request_id(id);
    return r;
  }

  static std::vector<float> Expected(const v1::ForwardRequest& request) {
    return ReferenceForward(*reference_, request);
  }

  // Checks an OK answer against the reference (BF16/FP16 1e-2, FP32 1e-5 relative L2).
  static void ExpectCorrect(const v1::ForwardRequest& request, const v1::ForwardResponse& resp) {
    ASSERT_EQ(resp.error_code(), 0) << resp.error_message();
    EXPECT_EQ(resp.request_id(), request.request_id());
    const v1::DType dtype = request.hidden_states().dtype();
    EXPECT_EQ(resp.output().dtype(), dtype);
    const std::vector<float> want = Expected(request);
    double norm = 0;
    for (float v : want) norm += v * v;
    ASSERT_GT(norm, 0) << "reference output is all zeros";
    EXPECT_LT(RelativeL2(DecodeFloats(resp.output().data(), dtype), want),
              dtype == v1::DTYPE_FP32 ? 1e-5 : 1e-2)
        << request.request_id();
  }

  // Writes `r` on `stream`, reads its answer and checks it.
  static void CallAndCheck(
      grpc::ClientReaderWriter<v1::ForwardRequest, v1::ForwardResponse>& stream,
      const v1::ForwardRequest& r) {
    ASSERT_TRUE(stream.Write(r));
    v1::ForwardResponse resp;
    ASSERT_TRUE(stream.Read(&resp));
    ExpectCorrect(r, resp);
  }

  static Engine* engine_;
  static Engine* reference_;
  static MoeServer* server_;
  static std::shared_ptr<grpc::Channel>* channel_;
  std::mt19937_64 rng_{99};
};

Engine* StreamTest::engine_ = nullptr;
Engine* StreamTest::reference_ = nullptr;
MoeServer* StreamTest::server_ = nullptr;
std::shared_ptr<grpc::Channel>* StreamTest::channel_ = nullptr;

// Layer after layer, mixed sizes and dtypes, one request then its answer.
TEST_F(StreamTest, CallsAnsweredInOrderAndCorrect) {
  auto stub = v1::MoeService::NewStub(*channel_);
  grpc::ClientContext ctx;
  auto stream = stub->ForwardStream(&ctx);
  const v1::DType dtypes[] = {v1::DTYPE_BF16, v1::DTYPE_FP16, v1::DTYPE_FP32};
  int n = 0;
  for (int step = 0; step < 2; ++step) {
    for (int layer = 0; layer < model().num_layers; ++layer) {
      const v1::ForwardRequest r =
          Random(1 + (n * 7) % 40, dtypes[n % 3], layer, "call-" + std::to_string(n));
      ++n;
      ASSERT_NO_FATAL_FAILURE(CallAndCheck(*stream, r));
    }
  }
  stream->WritesDone();
  grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A stream's calls are decoded on a worker. Where workers decode Forward requests too
// (inline_request_bytes >= 0) a call that finds the batcher idle runs its step there; by
// default every step goes to the scheduling thread.
TEST_F(StreamTest, WorkersRunIdleStepsWhereTheyDecodeForwardRequests) {
  for (const int64_t inline_bytes : {int64_t{0}, int64_t{-1}}) {
    SCOPED_TRACE(absl::StrCat("inline_request_bytes=", inline_bytes));
    const ServerOptions server_options = LocalServerOptions(inline_bytes);
    std::unique_ptr<MoeServer> server = MoeServer::Start(engine_, server_options).value();
    auto stub = v1::MoeService::NewStub(
        grpc::CreateChannel(server->bound_addresses()[0], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    auto stream = stub->ForwardStream(&ctx);
    for (int i = 0; i < 3; ++i) {
      const v1::ForwardRequest r = Random(1 + 5 * i, v1::DTYPE_BF16, 0, "w-" + std::to_string(i));
      ASSERT_NO_FATAL_FAILURE(CallAndCheck(*stream, r));
    }
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_EQ(server->batcher_stats().inline_steps, inline_bytes >= 0 ? 3 : 0);
    server->Shutdown(std::chrono::seconds(5));
  }
}

// Many requests written before any answer is read: answers still come in request order, even
// though the batcher may run (and finish) them in other orders.
TEST_F(StreamTest, PipelinedCallsKeepRequestOrder) {
  auto stub = v1::MoeService::NewStub(*channel_);
  grpc::ClientContext ctx;
  auto stream = stub->ForwardStream(&ctx);
  std::vector<v1::ForwardRequest> requests;
  requests.reserve(40);
  for (int i = 0; i < 40; ++i) {
    // Large then small calls, so that later calls could finish first if order were not kept.
    requests.push_back(Random(i % 2 == 0 ? 60 : 1, v1::DTYPE_BF16, i % model().num_layers,
                              "p-" + std::to_string(i)));
  }
  std::thread writer([&] {
    for (const auto& r : requests) ASSERT_TRUE(stream->Write(r));
    stream->WritesDone();
  });
  for (const auto& r : requests) {
    v1::ForwardResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ExpectCorrect(r, resp);
  }
  writer.join();
  v1::ForwardResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  EXPECT_TRUE(stream->Finish().ok());
}

// A bad call answers with its own error (code and message); the calls around it succeed.
TEST_F(StreamTest, FailedCallDoesNotEndTheStream) {
  auto stub = v1::MoeService::NewStub(*channel_);
  grpc::ClientContext ctx;
  auto stream = stub->ForwardStream(&ctx);
  const v1::ForwardRequest good1 = Random(5, v1::DTYPE_BF16, 0, "good-1");
  v1::ForwardRequest bad_id = Random(3, v1::DTYPE_BF16, 0, "bad-expert");
  reinterpret_cast<int32_t*>(bad_id.mutable_topk_ids()->mutable_data()->data())[4] =
      model().num_experts;  // one past the last expert
  v1::ForwardRequest bad_layer = Random(2, v1::DTYPE_FP32, 0, "bad-layer");
  bad_layer.set_layer(model().num_layers);
  v1::ForwardRequest too_many = Random(kMaxTokens + 1, v1::DTYPE_BF16, 0, "too-many");
  const v1::ForwardRequest good2 = Random(9, v1::DTYPE_FP16, 1, "good-2");
  for (const v1::ForwardRequest* r : std::initializer_list<const v1::ForwardRequest*>{
           &good1, &bad_id, &bad_layer, &too_many, &good2}) {
    ASSERT_TRUE(stream->Write(*r));
  }
  v1::ForwardResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  ExpectCorrect(good1, resp);
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.request_id(), "bad-expert");
  EXPECT_EQ(resp.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(resp.error_message(), HasSubstr("topk_ids"));
  EXPECT_FALSE(resp.has_output());
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.request_id(), "bad-layer");
  EXPECT_EQ(resp.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(resp.error_message(), HasSubstr("layer"));
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.request_id(), "too-many");
  EXPECT_EQ(resp.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_TRUE(stream->Read(&resp));
  ExpectCorrect(good2, resp);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// An unparseable message is one failed call too.
TEST_F(StreamTest, UnparseableMessageIsAnsweredWithInvalidArgument) {
  grpc::GenericStub generic(*channel_);
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto call = generic.PrepareCall(&ctx, "/moeserve.v1.MoeService/ForwardStream", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  const std::string garbage = "\x12\xff\xff\xff\xff\x0f";  // a length past the end
  grpc::Slice slice(garbage.data(), garbage.size());
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  grpc::ByteBuffer answer;
  call->Read(&answer, reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  v1::ForwardResponse resp;
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(answer.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  ASSERT_TRUE(resp.ParseFromString(bytes));
  EXPECT_EQ(resp.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(resp.error_message(), HasSubstr("ForwardRequest"));
  call->WritesDone(reinterpret_cast<void*>(4));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_TRUE(status.ok()) << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

// A client that goes away mid-stream (calls in flight, answers unread) leaves the server
// serving.
TEST_F(StreamTest, CancelledStreamLeavesServerServing) {
  auto stub = v1::MoeService::NewStub(*channel_);
  for (int round = 0; round < 3; ++round) {
    grpc::ClientContext ctx;
    auto stream = stub->ForwardStream(&ctx);
    for (int i = 0; i < 20; ++i) {
      ASSERT_TRUE(stream->Write(Random(kMaxTokens, v1::DTYPE_FP32, 0, "c")));
    }
    ctx.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  grpc::ClientContext ctx;
  auto stream = stub->ForwardStream(&ctx);
  const v1::ForwardRequest r = Random(4, v1::DTYPE_BF16, 1, "after");
  ASSERT_NO_FATAL_FAILURE(CallAndCheck(*stream, r));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// The C++ client's unary Forward, blocking at once, polling past the answer (1 s) and polling
// less than a call takes (1 us, then blocking): the same correct answers, and a refused call's
// status either way.
TEST_F(StreamTest, CppClientForwardPollsOrBlocks) {
  for (absl::Duration spin : {absl::ZeroDuration(), absl::Seconds(1), absl::Microseconds(1)}) {
    client::MoeClientOptions options;
    options.spin_wait = spin;
    auto client = client::MoeClient::Create(server_->bound_addresses()[0], options).value();
    for (int i = 0; i < 4; ++i) {
      const v1::ForwardRequest r =
          Random(1 + 9 * i, i % 2 ? v1::DTYPE_FP32 : v1::DTYPE_BF16, i % model().num_layers,
                 absl::StrCat("spin-", absl::FormatDuration(spin), "-", i));
      absl::StatusOr<client::ForwardResult> result = client->Forward(r);
      ASSERT_TRUE(result.ok()) << absl::FormatDuration(spin) << ": " << result.status();
      v1::ForwardResponse resp;
      *resp.mutable_output() = result->output;
      resp.set_request_id(result->request_id);
      ExpectCorrect(r, resp);
    }
    v1::ForwardRequest bad = Random(2, v1::DTYPE_BF16, 0, "spin-bad");
    bad.set_layer(-1);
    absl::StatusOr<client::ForwardResult> refused = client->Forward(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << absl::FormatDuration(spin);
  }
}

// The C++ client's ForwardStream: answers in order, per-call errors as statuses, the stream's
// end as OUT_OF_RANGE, and a clean Finish.
TEST_F(StreamTest, CppClientStream) {
  auto client = client::MoeClient::Create(server_->bound_addresses()[0]).value();
  auto stream = client->OpenForwardStream().value();
  std::vector<v1::ForwardRequest> requests;
  requests.reserve(6);
  for (int i = 0; i < 6; ++i) {
    requests.push_back(Random(1 + 5 * i, i % 2 ? v1::DTYPE_FP32 : v1::DTYPE_BF16,
                              i % model().num_layers, "cpp-" + std::to_string(i)));
  }
  v1::ForwardRequest bad = Random(2, v1::DTYPE_BF16, 0, "cpp-bad");
  bad.set_layer(-1);
  for (const auto& r : requests) {
    ASSERT_TRUE(stream->Write(client::MoeClient::EncodeForwardRequest(r).value()).ok());
  }
  ASSERT_TRUE(stream->Write(client::MoeClient::EncodeForwardRequest(bad).value()).ok());
  for (const auto& r : requests) {
    absl::StatusOr<client::ForwardResult> result = stream->Read();
    ASSERT_TRUE(result.ok()) << result.status();
    v1::ForwardResponse resp;
    *resp.mutable_output() = result->output;
    resp.set_request_id(result->request_id);
    ExpectCorrect(r, resp);
  }
  absl::StatusOr<client::ForwardResult> failed = stream->Read();
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(failed.status().message(), HasSubstr("layer"));
  stream->WritesDone();
  EXPECT_EQ(stream->Read().status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(stream->Finish().ok());
  // A stream dropped unfinished is cancelled by its destructor, without hanging.
  auto abandoned = client->OpenForwardStream().value();
  ASSERT_TRUE(abandoned->Write(client::MoeClient::EncodeForwardRequest(requests[0]).value()).ok());
}

}  // namespace
}  // namespace moeserve
