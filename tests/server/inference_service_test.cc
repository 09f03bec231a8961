// The KServe v2 / Open Inference Protocol service in-process on 127.0.0.1:0, driven through the
// stub generated from proto/inference/grpc_service.proto (plain protobuf serialization, as any
// KServe client sends) and through raw byte buffers split at odd offsets: liveness, readiness,
// metadata, ModelInfer answers against an independent reference engine for every datatype, the
// `layer` parameter, refusals naming the field, and the metrics it moves.
#include "server/inference_service.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <chrono>
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
#include "inference/grpc_service.grpc.pb.h"
#include "inference/infer_wire.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/server.h"
#include "tests/server/test_util.h"
#include "tests/testing/shm_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::CoreDType;
using ::moeserve::testing::DecodeFloats;
using ::moeserve::testing::HttpGetMetrics;
using ::moeserve::testing::LocalServerOptions;
using ::moeserve::testing::MetricValue;
using ::moeserve::testing::RandomRequest;
using ::moeserve::testing::ReferenceForward;
using ::moeserve::testing::RelativeL2;
using ::moeserve::testing::ShmObject;
using ::moeserve::testing::TestModel;
using ::testing::HasSubstr;

constexpr int64_t kMaxTokens = 64;

const char* KServeName(v1::DType d) {
  switch (d) {
    case v1::DTYPE_BF16:
      return "BF16";
    case v1::DTYPE_FP16:
      return "FP16";
    case v1::DTYPE_FP32:
      return "FP32";
    case v1::DTYPE_INT32:
      return "INT32";
    default:
      return "INT64";
  }
}

// A moeserve.v1 request's tensors as a KServe ModelInferRequest (raw_input_contents).
inference::ModelInferRequest ToInfer(const v1::ForwardRequest& r, const std::string& model) {
  inference::ModelInferRequest req;
  req.set_model_name(model);
  req.set_id("req-" + std::to_string(r.hidden_states().shape(0)));
  const struct {
    const char* name;
    const v1::Tensor& t;
  } inputs[] = {{"hidden_states", r.hidden_states()},
                {"topk_ids", r.topk_ids()},
                {"topk_weights", r.topk_weights()}};
  for (const auto& in : inputs) {
    auto* t = req.add_inputs();
    t->set_name(in.name);
    t->set_datatype(KServeName(in.t.dtype()));
    for (int64_t d : in.t.shape()) t->add_shape(d);
    req.add_raw_input_contents(in.t.data());
  }
  return req;
}

class InferenceServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EngineOptions options;
    options.model = TestModel();
    options.seed = 5;
    options.experts = "blas";
    options.num_threads = 2;
    options.num_ranks = 2;  // per-rank metrics have two ranks to count
    options.max_tokens_per_request = kMaxTokens;
    engine_ = Engine::Create(options).value().release();
    options.experts = "reference";  // independent oracle, same weights
    options.num_ranks = 1;
    reference_ = Engine::Create(options).value().release();
    ServerOptions server_options;
    server_options.listen_addresses = {"127.0.0.1:0"};
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

  std::unique_ptr<inference::GRPCInferenceService::Stub> Stub() {
    return inference::GRPCInferenceService::NewStub(*channel_);
  }
  const ModelConfig& model() const { return engine_->info().model; }

  v1::ForwardRequest Random(int64_t m, v1::DType dtype, v1::DType ids, int layer) {
    return RandomRequest(rng_, layer, m, model().hidden, model().num_experts, model().topk, dtype,
                         ids);
  }

  grpc::Status Infer(const inference::ModelInferRequest& req, inference::ModelInferResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return Stub()->ModelInfer(&ctx, req, resp);
  }

  static std::vector<float> Expected(const v1::ForwardRequest& r) {
    return ReferenceForward(*reference_, r);
  }

  // `req` fails with `code` and a message containing `text`.
  void ExpectRefused(const inference::ModelInferRequest& req, grpc::StatusCode code,
                     const std::string& text) {
    inference::ModelInferResponse resp;
    grpc::Status s = Infer(req, &resp);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(text));
  }

  static Engine* engine_;
  static Engine* reference_;
  static MoeServer* server_;
  static std::shared_ptr<grpc::Channel>* channel_;
  std::mt19937_64 rng_{77};
};

Engine* InferenceServiceTest::engine_ = nullptr;
Engine* InferenceServiceTest::reference_ = nullptr;
MoeServer* InferenceServiceTest::server_ = nullptr;
std::shared_ptr<grpc::Channel>* InferenceServiceTest::channel_ = nullptr;

TEST_F(InferenceServiceTest, LiveReadyAndMetadata) {
  {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse resp;
    ASSERT_TRUE(Stub()->ServerLive(&ctx, inference::ServerLiveRequest(), &resp).ok());
    EXPECT_TRUE(resp.live());
  }
  {
    grpc::ClientContext ctx;
    inference::ServerReadyResponse resp;
    ASSERT_TRUE(Stub()->ServerReady(&ctx, inference::ServerReadyRequest(), &resp).ok());
    EXPECT_TRUE(resp.ready());
  }
  for (auto [name, version, ready] :
       {std::tuple<const char*, const char*, bool>{"moe_layer_0", "", true},
        {"moe_layer_1", "1", true},
        {"moeserve", "", true},
        {"moe_layer_1", "2", false},
        {"moe_layer_99", "", false},
        {"moe_layer_01", "", false},
        {"llama", "", false}}) {
    grpc::ClientContext ctx;
    inference::ModelReadyRequest req;
    req.set_name(name);
    req.set_version(version);
    inference::ModelReadyResponse resp;
    ASSERT_TRUE(Stub()->ModelReady(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.ready(), ready) << name << " " << version;
  }
  {
    grpc::ClientContext ctx;
    inference::ServerMetadataResponse resp;
    ASSERT_TRUE(Stub()->ServerMetadata(&ctx, inference::ServerMetadataRequest(), &resp).ok());
    EXPECT_EQ(resp.name(), "moeserve");
    EXPECT_FALSE(resp.version().empty());
    // The extensions this server serves (shared memory is off here; InferenceSharedMemoryTest
    // checks it listed when on).
    EXPECT_THAT(resp.extensions(), ::testing::ElementsAre("model_configuration", "parameters"));
  }
  {
    grpc::ClientContext ctx;
    inference::ModelMetadataRequest req;
    req.set_name("moe_layer_1");
    inference::ModelMetadataResponse resp;
    ASSERT_TRUE(Stub()->ModelMetadata(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.name(), "moe_layer_1");
    EXPECT_THAT(resp.versions(), ::testing::ElementsAre("1"));
    ASSERT_EQ(resp.inputs_size(), 3);
    EXPECT_EQ(resp.inputs(0).name(), "hidden_states");
    EXPECT_EQ(resp.inputs(0).datatype(), "BF16");
    EXPECT_THAT(resp.inputs(0).shape(), ::testing::ElementsAre(-1, model().hidden));
    EXPECT_EQ(resp.inputs(1).name(), "topk_ids");
    EXPECT_THAT(resp.inputs(1).shape(), ::testing::ElementsAre(-1, model().topk));
    EXPECT_EQ(resp.inputs(2).name(), "topk_weights");
    EXPECT_EQ(resp.inputs(2).datatype(), "FP32");
    ASSERT_EQ(resp.outputs_size(), 1);
    EXPECT_EQ(resp.outputs(0).name(), "output");
  }
  {
    grpc::ClientContext ctx;
    inference::ModelMetadataRequest req;
    req.set_name("moe_layer_7");
    inference::ModelMetadataResponse resp;
    grpc::Status s = Stub()->ModelMetadata(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("moe_layer_<i>"));
  }
  // The health service knows the KServe service by name.
  auto health = grpc::health::v1::Health::NewStub(*channel_);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(kInferenceServiceName);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

struct Case {
  v1::DType dtype;
  v1::DType ids;
  double tolerance;  // relative L2 against the FP32 reference (output rounded to dtype)
};

TEST_F(InferenceServiceTest, ModelInferMatchesReference) {
  for (const Case& c :
       {Case{v1::DTYPE_BF16, v1::DTYPE_INT32, 1e-2}, Case{v1::DTYPE_FP16, v1::DTYPE_INT64, 1e-2},
        Case{v1::DTYPE_FP32, v1::DTYPE_INT32, 1e-5}}) {
    for (int layer : {0, model().num_layers - 1}) {
      for (int64_t m : {int64_t{1}, int64_t{17}, kMaxTokens}) {
        const v1::ForwardRequest r = Random(m, c.dtype, c.ids, layer);
        inference::ModelInferRequest req = ToInfer(r, "moe_layer_" + std::to_string(layer));
        inference::ModelInferResponse resp;
        grpc::Status s = Infer(req, &resp);
        ASSERT_TRUE(s.ok()) << s.error_message();
        EXPECT_EQ(resp.model_name(), req.model_name());
        EXPECT_EQ(resp.model_version(), "1");
        EXPECT_EQ(resp.id(), req.id());
        ASSERT_EQ(resp.outputs_size(), 1);
        EXPECT_EQ(resp.outputs(0).name(), "output");
        EXPECT_EQ(resp.outputs(0).datatype(), KServeName(c.dtype));
        EXPECT_THAT(resp.outputs(0).shape(), ::testing::ElementsAre(m, model().hidden));
        ASSERT_EQ(resp.raw_output_contents_size(), 1);
        const std::vector<float> got = DecodeFloats(resp.raw_output_contents(0), c.dtype);
        ASSERT_EQ(got.size(), static_cast<size_t>(m * model().hidden));
        EXPECT_LT(RelativeL2(got, Expected(r)), c.tolerance)
            << KServeName(c.dtype) << " layer " << layer << " M=" << m;
      }
    }
  }
}

// Where workers decode requests (--inline_request_bytes >= 0, so they poll), the worker that
// decodes a ModelInfer runs its step when the batcher is idle, as for Forward; with the default
// (-1) every step goes to the scheduling thread. Answers checked either way.
TEST_F(InferenceServiceTest, WorkersRunIdleStepsWhereTheyDecodeRequests) {
  for (const int64_t inline_bytes : {int64_t{0}, int64_t{-1}}) {
    SCOPED_TRACE(absl::StrCat("inline_request_bytes=", inline_bytes));
    const ServerOptions server_options = LocalServerOptions(inline_bytes);
    std::unique_ptr<MoeServer> server = MoeServer::Start(engine_, server_options).value();
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(server->bound_addresses()[0], grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 3; ++i) {
      const v1::ForwardRequest r = Random(1 + 5 * i, v1::DTYPE_BF16, v1::DTYPE_INT32, 0);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      inference::ModelInferResponse resp;
      const grpc::Status s = stub->ModelInfer(&ctx, ToInfer(r, "moe_layer_0"), &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_EQ(resp.raw_output_contents_size(), 1);
      EXPECT_LT(RelativeL2(DecodeFloats(resp.raw_output_contents(0), v1::DTYPE_BF16), Expected(r)),
                1e-2);  // BF16
    }
    EXPECT_EQ(server->batcher_stats().inline_steps, inline_bytes >= 0 ? 3 : 0);
    server->Shutdown(std::chrono::seconds(5));
  }
}

// hidden_states alone: the server routes with the layer's gate, as Forward does. Checked against
// the reference engine (same seed, so the same gate) routing and combining independently.
TEST_F(InferenceServiceTest, HiddenStatesOnlyIsRoutedByTheServer) {
  ASSERT_TRUE(engine_->has_router());
  for (int layer : {0, model().num_layers - 1}) {
    const int64_t m = 13;
    const v1::ForwardRequest r = Random(m, v1::DTYPE_FP32, v1::DTYPE_INT32, layer);
    inference::ModelInferRequest req = ToInfer(r, "moe_layer_" + std::to_string(layer));
    req.mutable_inputs()->DeleteSubrange(1, 2);  // topk_ids, topk_weights
    req.mutable_raw_input_contents()->DeleteSubrange(1, 2);
    inference::ModelInferResponse resp;
    grpc::Status s = Infer(req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.raw_output_contents_size(), 1);
    const std::vector<float> got = DecodeFloats(resp.raw_output_contents(0), v1::DTYPE_FP32);

    const TensorView x(static_cast<const void*>(r.hidden_states().data().data()), DType::kFP32,
                       {m, model().hidden});
    Tensor ids = Tensor::Empty(DType::kINT32, {m, model().topk});
    Tensor weights = Tensor::Empty(DType::kFP32, {m, model().topk});
    ASSERT_TRUE(reference_->Route(layer, x, ids.view(), weights.view()).ok());
    ForwardInput in;
    in.layer = layer;
    in.hidden_states = x;
    in.topk_ids = ids.view();
    in.topk_weights = weights.view();
    Tensor out = Tensor::Empty(DType::kFP32, {m, model().hidden});
    ASSERT_TRUE(reference_->Forward(in, out.view()).ok());
    const std::vector<float> expected(out.data<float>(), out.data<float>() + m * model().hidden);
    ASSERT_EQ(got.size(), expected.size());
    EXPECT_LT(RelativeL2(got, expected), 1e-5) << "layer " << layer;
  }
  // Only one of the two topk inputs is still refused, naming the missing one.
  const v1::ForwardRequest r = Random(2, v1::DTYPE_FP32, v1::DTYPE_INT32, 0);
  inference::ModelInferRequest req = ToInfer(r, "moe_layer_0");
  req.mutable_inputs()->DeleteSubrange(2, 1);
  req.mutable_raw_input_contents()->DeleteSubrange(2, 1);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights: missing");
}

TEST_F(InferenceServiceTest, LayerParameterInputOrderAndTimings) {
  const v1::ForwardRequest r = Random(9, v1::DTYPE_FP32, v1::DTYPE_INT32, 1);
  inference::ModelInferRequest req = ToInfer(r, "moeserve");
  (*req.mutable_parameters())["layer"].set_int64_param(1);
  (*req.mutable_parameters())["return_timings"].set_bool_param(true);
  // Inputs in another order (with their raw contents): matched by name.
  std::swap(*req.mutable_inputs(0), *req.mutable_inputs(2));
  std::swap(*req.mutable_raw_input_contents(0), *req.mutable_raw_input_contents(2));
  req.add_outputs()->set_name("output");
  inference::ModelInferResponse resp;
  grpc::Status s = Infer(req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(resp.raw_output_contents_size(), 1);
  EXPECT_LT(RelativeL2(DecodeFloats(resp.raw_output_contents(0), v1::DTYPE_FP32), Expected(r)),
            1e-5);
  for (const char* key : {"queue_us", "prepare_us", "experts_us", "finalize_us", "total_us"}) {
    ASSERT_TRUE(resp.parameters().contains(key)) << key;
    EXPECT_GE(resp.parameters().at(key).double_param(), 0) << key;
  }
  EXPECT_GT(resp.parameters().at("total_us").double_param(), 0);

  // M = 0 answers an empty output tensor.
  const v1::ForwardRequest empty = Random(0, v1::DTYPE_BF16, v1::DTYPE_INT32, 0);
  s = Infer(ToInfer(empty, "moe_layer_0"), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(resp.outputs(0).shape(), ::testing::ElementsAre(0, model().hidden));
  ASSERT_EQ(resp.raw_output_contents_size(), 1);
  EXPECT_TRUE(resp.raw_output_contents(0).empty());
}

// The request's bytes in slices cut at odd offsets (tensors split and misaligned): the server
// gathers them and answers the same bits as for the contiguous request.
TEST_F(InferenceServiceTest, SplitAndMisalignedSlicesAnswerTheSame) {
  const v1::ForwardRequest r = Random(13, v1::DTYPE_BF16, v1::DTYPE_INT64, 1);
  const inference::ModelInferRequest req = ToInfer(r, "moe_layer_1");
  inference::ModelInferResponse whole;
  ASSERT_TRUE(Infer(req, &whole).ok());
  const std::string bytes = req.SerializeAsString();
  for (size_t cut : {size_t{1}, size_t{7}, size_t{333}}) {
    std::vector<grpc::Slice> slices;
    for (size_t at = 0; at < bytes.size(); at += cut) {
      const size_t n = std::min(cut, bytes.size() - at);
      slices.emplace_back(bytes.data() + at, n);
    }
    const grpc::ByteBuffer request(slices.data(), slices.size());
    grpc::GenericStub stub(*channel_);
    grpc::ClientContext ctx;
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, "/inference.GRPCInferenceService/ModelInfer", grpc::StubOptions(),
                   &request, &response, [&done](grpc::Status s) { done.set_value(s); });
    grpc::Status s = done.get_future().get();
    ASSERT_TRUE(s.ok()) << s.error_message();
    absl::StatusOr<inference_wire::ModelInferResponseView> view =
        inference_wire::DecodeModelInferResponse(response);
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_EQ(view->raw.size(), 1u);
    std::string out(view->raw[0].size, '\0');
    view->raw[0].CopyTo(out.data());
    EXPECT_EQ(out, whole.raw_output_contents(0)) << "cut " << cut;
  }
}

TEST_F(InferenceServiceTest, BadRequestsNameWhatIsWrong) {
  const v1::ForwardRequest r = Random(4, v1::DTYPE_BF16, v1::DTYPE_INT32, 1);
  const inference::ModelInferRequest good = ToInfer(r, "moe_layer_1");
  inference::ModelInferRequest req;

  req = good;
  req.set_model_name("moe_layer_77");
  ExpectRefused(req, grpc::StatusCode::NOT_FOUND, "moe_layer_77");
  req = good;
  req.set_model_version("3");
  ExpectRefused(req, grpc::StatusCode::NOT_FOUND, "version");
  req = good;
  req.set_model_name("moeserve");
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "parameters.layer");
  (*req.mutable_parameters())["layer"].set_int64_param(99);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "parameters.layer");
  req = good;
  (*req.mutable_parameters())["layer"].set_int64_param(0);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "parameters.layer");
  req = good;
  req.mutable_inputs(1)->set_name("expert_ids");
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "expert_ids");
  req = good;
  req.mutable_inputs(2)->set_name("hidden_states");
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "given twice");
  req = good;
  req.mutable_inputs()->RemoveLast();
  req.mutable_raw_input_contents()->RemoveLast();
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "topk_weights: missing");
  req = good;
  req.mutable_raw_input_contents()->RemoveLast();
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "raw_input_contents");
  req = good;
  req.clear_raw_input_contents();
  req.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1.f);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "raw_input_contents");
  req = good;
  req.mutable_inputs(0)->set_datatype("FP64");
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states: datatype 'FP64'");
  req = good;
  req.mutable_inputs(0)->set_datatype("FP32");  // bytes are BF16: half what FP32 needs
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "hidden_states: data has");
  req = good;
  req.mutable_inputs(1)->set_shape(1, model().topk + 1);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids");
  req = good;
  req.add_outputs()->set_name("logits");
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "outputs[0]");
  // Typed contents beside a full set of raw entries were ignored: refused.
  req = good;
  req.mutable_inputs(2)->mutable_contents()->add_fp32_contents(1.f);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "inputs[2] (topk_weights): typed");
  // One output, asked for once, without options this server does not serve (classification
  // was answered with the whole tensor).
  req = good;
  req.add_outputs()->set_name("output");
  req.add_outputs()->set_name("output");
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "outputs[1]: 'output' requested twice");
  req = good;
  (*req.add_outputs()->mutable_parameters())["classification"].set_int64_param(3);
  req.mutable_outputs(0)->set_name("output");
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT,
                "outputs[0].parameters: 'classification' is not supported");
  // A small message of packed dims would expand eightfold when parsed: the header is bounded.
  req = good;
  for (int i = 0; i < (1 << 20) + 16; ++i) req.mutable_inputs(0)->add_shape(1);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "bytes besides raw_input_contents");
  // Values are checked too (same batcher path as Forward).
  req = good;
  int32_t bad_id = model().num_experts;
  std::memcpy(req.mutable_raw_input_contents(1)->data(), &bad_id, 4);
  ExpectRefused(req, grpc::StatusCode::INVALID_ARGUMENT, "topk_ids: value");
  // Over the token limit: RESOURCE_EXHAUSTED naming hidden_states' M.
  ExpectRefused(ToInfer(Random(kMaxTokens + 1, v1::DTYPE_BF16, v1::DTYPE_INT32, 0), "moe_layer_0"),
                grpc::StatusCode::RESOURCE_EXHAUSTED, "hidden_states: M=65");
  // Still serving.
  inference::ModelInferResponse resp;
  EXPECT_TRUE(Infer(good, &resp).ok());
}

TEST_F(InferenceServiceTest, MetricsCountTokensBytesLayersAndRanks) {
  const int port = server_->metrics().port();
  auto value = [](const std::string& text, const std::string& name,
                  const std::vector<std::string>& labels = {}) {
    return std::max(0.0, MetricValue(text, name, labels));
  };
  const std::string before = HttpGetMetrics(port);
  // Tokens routed to expert 0 and 1 only: rank 0 hosts experts 0-3 (contiguous over 2 ranks).
  v1::ForwardRequest r = Random(6, v1::DTYPE_BF16, v1::DTYPE_INT32, 1);
  std::vector<int32_t> ids(6 * model().topk);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % model().topk);
  // topk 3: experts 0, 1, 2 per token, all on rank 0.
  r.mutable_topk_ids()->mutable_data()->assign(reinterpret_cast<const char*>(ids.data()),
                                               ids.size() * 4);
  const inference::ModelInferRequest req = ToInfer(r, "moe_layer_1");
  inference::ModelInferResponse resp;
  ASSERT_TRUE(Infer(req, &resp).ok());
  const std::string after = HttpGetMetrics(port);
  const std::vector<std::string> infer_ok = {"method=\"ModelInfer\"", "code=\"OK\""};
  EXPECT_EQ(value(after, "moeserve_requests_total", infer_ok) -
                value(before, "moeserve_requests_total", infer_ok),
            1);
  EXPECT_EQ(value(after, "moeserve_tokens_total") - value(before, "moeserve_tokens_total"), 6);
  EXPECT_EQ(value(after, "moeserve_layer_tokens_total", {"layer=\"1\""}) -
                value(before, "moeserve_layer_tokens_total", {"layer=\"1\""}),
            6);
  EXPECT_EQ(value(after, "moeserve_rank_tokens_total", {"rank=\"0\""}) -
                value(before, "moeserve_rank_tokens_total", {"rank=\"0\""}),
            6);
  EXPECT_EQ(value(after, "moeserve_rank_tokens_total", {"rank=\"1\""}) -
                value(before, "moeserve_rank_tokens_total", {"rank=\"1\""}),
            0);
  const std::vector<std::string> infer = {"method=\"ModelInfer\""};
  EXPECT_EQ(value(after, "moeserve_received_bytes_total", infer) -
                value(before, "moeserve_received_bytes_total", infer),
            static_cast<double>(req.ByteSizeLong()));
  EXPECT_EQ(value(after, "moeserve_sent_bytes_total", infer) -
                value(before, "moeserve_sent_bytes_total", infer),
            static_cast<double>(resp.ByteSizeLong()));
  EXPECT_EQ(MetricValue(after, "moeserve_serving"), 1);
  EXPECT_EQ(
      MetricValue(after, "moeserve_build_info", {"version=", "commit=", "build_type=", "backend="}),
      1);
}

// Triton's ModelConfig, what perf_analyzer reads before sending load: the tensors of
// ModelMetadata with Triton's DataType, no batch dimension (max_batch_size 0); unknown models
// NOT_FOUND.
TEST_F(InferenceServiceTest, ModelConfigDescribesTheModels) {
  for (const char* name : {"moe_layer_1", "moeserve"}) {
    grpc::ClientContext ctx;
    inference::ModelConfigRequest req;
    req.set_name(name);
    inference::ModelConfigResponse resp;
    const grpc::Status s = Stub()->ModelConfig(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const inference::ModelConfig& c = resp.config();
    EXPECT_EQ(c.name(), name);
    EXPECT_EQ(c.max_batch_size(), 0);
    ASSERT_EQ(c.input_size(), 3);
    EXPECT_EQ(c.input(0).name(), "hidden_states");
    EXPECT_EQ(c.input(0).data_type(), inference::TYPE_BF16);
    EXPECT_THAT(c.input(0).dims(), ::testing::ElementsAre(-1, model().hidden));
    EXPECT_EQ(c.input(1).data_type(), inference::TYPE_INT32);
    EXPECT_THAT(c.input(1).dims(), ::testing::ElementsAre(-1, model().topk));
    EXPECT_EQ(c.input(2).data_type(), inference::TYPE_FP32);
    ASSERT_EQ(c.output_size(), 1);
    EXPECT_EQ(c.output(0).name(), "output");
    EXPECT_THAT(c.output(0).dims(), ::testing::ElementsAre(-1, model().hidden));
  }
  grpc::ClientContext ctx;
  inference::ModelConfigRequest req;
  req.set_name("llama");
  inference::ModelConfigResponse resp;
  const grpc::Status s = Stub()->ModelConfig(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("moe_layer_"));
}

// ---- Shared memory (the protocol's extension over moeserve's RegionRegistry) ----

// Names `param`'s region for a KServe input or requested output.
void SetShm(google::protobuf::Map<std::string, inference::InferParameter>* p,
            const std::string& region, int64_t offset, int64_t bytes) {
  (*p)["shared_memory_region"].set_string_param(region);
  (*p)["shared_memory_byte_size"].set_int64_param(bytes);
  if (offset != 0) (*p)["shared_memory_offset"].set_int64_param(offset);
}

// Moves input `i` of `req` (raw bytes) into `shm` at `offset` of region `region` (which starts at
// byte `object_base` of the object) and drops its raw_input_contents entry.
void MoveInputToShm(inference::ModelInferRequest* req, int i, const ShmObject& shm,
                    const std::string& region, int64_t offset, int64_t object_base = 0) {
  int raw = 0;  // raw entry of input i: inputs before it that are not in shared memory
  for (int j = 0; j < i; ++j) {
    if (!req->inputs(j).parameters().contains("shared_memory_region")) ++raw;
  }
  const std::string bytes = req->raw_input_contents(raw);
  shm.Write(static_cast<size_t>(object_base + offset), bytes.data(), bytes.size());
  SetShm(req->mutable_inputs(i)->mutable_parameters(), region, offset,
         static_cast<int64_t>(bytes.size()));
  req->mutable_raw_input_contents()->DeleteSubrange(raw, 1);
}

class InferenceSharedMemoryTest : public InferenceServiceTest {
 protected:
  static constexpr int64_t kBudget = 48 << 10;  // max_queued_bytes of the budget server
  static void SetUpTestSuite() {
    InferenceServiceTest::SetUpTestSuite();  // engine_, reference_, server_ (shared memory off)
    ServerOptions options;
    options.listen_addresses = {"127.0.0.1:0"};
    options.metrics_address = "";
    options.enable_shared_memory = true;
    shm_server_ = MoeServer::Start(engine_, options).value().release();
    options.max_queued_bytes = kBudget;
    budget_server_ = MoeServer::Start(engine_, options).value().release();
  }
  static void TearDownTestSuite() {
    delete budget_server_;
    delete shm_server_;
    InferenceServiceTest::TearDownTestSuite();
  }
  void TearDown() override {
    // Every call let its regions go: all of them unregister.
    for (MoeServer* s : {shm_server_, budget_server_}) {
      EXPECT_TRUE(s->service().mutable_regions()->Unregister("").ok());
    }
  }
  static std::unique_ptr<inference::GRPCInferenceService::Stub> StubFor(const MoeServer& server) {
    return inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(server.bound_addresses()[0], grpc::InsecureChannelCredentials()));
  }
  static grpc::Status RegisterSystem(inference::GRPCInferenceService::Stub* stub,
                                     const std::string& name, const std::string& key,
                                     uint64_t offset, uint64_t bytes) {
    inference::SystemSharedMemoryRegisterRequest req;
    req.set_name(name);
    req.set_key(key);
    req.set_offset(offset);
    req.set_byte_size(bytes);
    inference::SystemSharedMemoryRegisterResponse resp;
    grpc::ClientContext ctx;
    return stub->SystemSharedMemoryRegister(&ctx, req, &resp);
  }
  static grpc::Status UnregisterSystem(inference::GRPCInferenceService::Stub* stub,
                                       const std::string& name) {
    inference::SystemSharedMemoryUnregisterRequest req;
    req.set_name(name);
    inference::SystemSharedMemoryUnregisterResponse resp;
    grpc::ClientContext ctx;
    return stub->SystemSharedMemoryUnregister(&ctx, req, &resp);
  }
  static grpc::Status InferOn(inference::GRPCInferenceService::Stub* stub,
                              const inference::ModelInferRequest& req,
                              inference::ModelInferResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub->ModelInfer(&ctx, req, resp);
  }
  // `req` fails on `stub` with `code` and a message containing every `parts`.
  static void ExpectRefusedOn(inference::GRPCInferenceService::Stub* stub,
                              const inference::ModelInferRequest& req, grpc::StatusCode code,
                              const std::vector<std::string>& parts) {
    inference::ModelInferResponse resp;
    const grpc::Status s = InferOn(stub, req, &resp);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    for (const std::string& p : parts) EXPECT_THAT(s.error_message(), HasSubstr(p));
  }

  static MoeServer* shm_server_;
  static MoeServer* budget_server_;
};

MoeServer* InferenceSharedMemoryTest::shm_server_ = nullptr;
MoeServer* InferenceSharedMemoryTest::budget_server_ = nullptr;

// tritonclient's flow: register system regions through the KServe RPCs, put the inputs there
// (all of them, or some beside raw_input_contents), ask for the output in a region, and read it
// from there: equal to the reference engine within the dtype's tolerance (relative L2: BF16 1e-2,
// FP32 1e-5), an empty raw_output_contents entry, the region echoed on the output. The regions are
// visible through moeserve.v1's SharedMemoryStatus too (one registry).
TEST_F(InferenceSharedMemoryTest, SystemShmInAndOutMatchesReference) {
  auto stub = StubFor(*shm_server_);
  ShmObject in(1 << 20), out(1 << 20);
  ASSERT_TRUE(in.ok() && out.ok());
  // The input region starts 4096 bytes into its object (Triton's offset).
  ASSERT_TRUE(RegisterSystem(stub.get(), "in", in.key(), 4096, (1 << 20) - 4096).ok());
  ASSERT_TRUE(RegisterSystem(stub.get(), "out", out.key(), 0, 1 << 20).ok());
  {
    // Shared memory on: its extension is listed (CUDA's only on the cuda backend).
    grpc::ClientContext ctx;
    inference::ServerMetadataResponse resp;
    ASSERT_TRUE(stub->ServerMetadata(&ctx, inference::ServerMetadataRequest(), &resp).ok());
    EXPECT_THAT(resp.extensions(), ::testing::Contains("system_shared_memory"));
    EXPECT_THAT(resp.extensions(), ::testing::Not(::testing::Contains("cuda_shared_memory")));
  }
  {
    inference::SystemSharedMemoryStatusRequest req;
    inference::SystemSharedMemoryStatusResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->SystemSharedMemoryStatus(&ctx, req, &resp).ok());
    ASSERT_EQ(resp.regions().size(), 2u);
    EXPECT_EQ(resp.regions().at("in").key(), in.key());
    EXPECT_EQ(resp.regions().at("in").offset(), 4096u);
    EXPECT_EQ(resp.regions().at("in").byte_size(), uint64_t{(1 << 20) - 4096});
    auto v1stub = v1::MoeService::NewStub(
        grpc::CreateChannel(shm_server_->bound_addresses()[0], grpc::InsecureChannelCredentials()));
    v1::SharedMemoryStatusRequest v1req;
    v1::SharedMemoryStatusResponse v1resp;
    grpc::ClientContext ctx2;
    ASSERT_TRUE(v1stub->SharedMemoryStatus(&ctx2, v1req, &v1resp).ok());
    EXPECT_EQ(v1resp.regions_size(), 2);
    inference::CudaSharedMemoryStatusResponse cuda;
    grpc::ClientContext ctx3;
    ASSERT_TRUE(
        stub->CudaSharedMemoryStatus(&ctx3, inference::CudaSharedMemoryStatusRequest(), &cuda)
            .ok());
    EXPECT_TRUE(cuda.regions().empty());
  }
  for (const Case& c :
       {Case{v1::DTYPE_BF16, v1::DTYPE_INT32, 1e-2}, Case{v1::DTYPE_FP32, v1::DTYPE_INT64, 1e-5}}) {
    for (int in_shm : {0b111, 0b001, 0b110}) {  // which inputs live in the region
      const int64_t m = 1 + static_cast<int64_t>(rng_() % kMaxTokens);
      const v1::ForwardRequest r = Random(m, c.dtype, c.ids, 1);
      inference::ModelInferRequest req = ToInfer(r, "moe_layer_1");
      int64_t at = 8;  // misaligned for none of the dtypes; each tensor 64-byte aligned after
      for (int i = 0; i < 3; ++i) {
        if ((in_shm >> i & 1) == 0) continue;
        MoveInputToShm(&req, i, in, "in", at, 4096);
        at +=
            (req.inputs(i).parameters().at("shared_memory_byte_size").int64_param() + 63) / 64 * 64;
      }
      const int64_t itemsize = c.dtype == v1::DTYPE_FP32 ? 4 : 2;
      const int64_t out_bytes = m * model().hidden * itemsize;
      const int64_t out_offset = 256;
      auto* o = req.add_outputs();
      o->set_name("output");
      SetShm(o->mutable_parameters(), "out", out_offset, out_bytes + 4096);  // room to spare
      inference::ModelInferResponse resp;
      const grpc::Status s = InferOn(stub.get(), req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_EQ(resp.outputs_size(), 1);
      // One raw_output_contents entry per output, as Triton sends: empty for a region.
      ASSERT_EQ(resp.raw_output_contents_size(), 1);
      EXPECT_TRUE(resp.raw_output_contents(0).empty());
      EXPECT_THAT(resp.outputs(0).shape(), ::testing::ElementsAre(m, model().hidden));
      EXPECT_EQ(resp.outputs(0).parameters().at("shared_memory_region").string_param(), "out");
      EXPECT_EQ(resp.outputs(0).parameters().at("shared_memory_byte_size").int64_param(),
                out_bytes);
      const std::vector<float> got = DecodeFloats(
          std::string(reinterpret_cast<const char*>(out.data()) + out_offset, out_bytes), c.dtype);
      EXPECT_LT(RelativeL2(got, Expected(r)), c.tolerance)
          << KServeName(c.dtype) << " M=" << m << " inputs in shm " << in_shm;
      // Output as raw bytes while the inputs are in the region.
      req.clear_outputs();
      resp.Clear();
      ASSERT_TRUE(InferOn(stub.get(), req, &resp).ok());
      ASSERT_EQ(resp.raw_output_contents_size(), 1);
      EXPECT_LT(RelativeL2(DecodeFloats(resp.raw_output_contents(0), c.dtype), Expected(r)),
                c.tolerance);
    }
  }
  EXPECT_TRUE(UnregisterSystem(stub.get(), "in").ok());
  EXPECT_TRUE(UnregisterSystem(stub.get(), "").ok());
  EXPECT_TRUE(shm_server_->service().regions()->Status("").value().empty());
}

// Every bad shared-memory request is refused with its code and a message naming what was wrong;
// the server serves on.
TEST_F(InferenceSharedMemoryTest, RefusalsNameWhatIsWrong) {
  auto stub = StubFor(*shm_server_);
  ShmObject shm(1 << 16);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem(stub.get(), "r", shm.key(), 0, 1 << 16).ok());
  const v1::ForwardRequest r = Random(4, v1::DTYPE_BF16, v1::DTYPE_INT32, 0);
  const int64_t hidden_bytes = 4 * model().hidden * 2;
  inference::ModelInferRequest good = ToInfer(r, "moe_layer_0");
  MoveInputToShm(&good, 0, shm, "r", 0);
  const auto with_hidden = [&](const std::string& region, int64_t offset, int64_t bytes) {
    inference::ModelInferRequest req = good;
    SetShm(req.mutable_inputs(0)->mutable_parameters(), region, offset, bytes);
    if (offset == 0) req.mutable_inputs(0)->mutable_parameters()->erase("shared_memory_offset");
    return req;
  };
  using Code = grpc::StatusCode;
  ExpectRefusedOn(stub.get(), with_hidden("nope", 0, hidden_bytes), Code::INVALID_ARGUMENT,
                  {"hidden_states.parameters.shared_memory_region",
                   "no shared-memory region "
                   "named 'nope'"});
  ExpectRefusedOn(stub.get(), with_hidden("r", (1 << 16) - 64, hidden_bytes),
                  Code::INVALID_ARGUMENT, {"lie outside the region's registered 65536 bytes"});
  ExpectRefusedOn(stub.get(), with_hidden("r", 0, hidden_bytes - 2), Code::INVALID_ARGUMENT,
                  {"byte_size " + std::to_string(hidden_bytes - 2), "does not match the tensor",
                   "= " + std::to_string(hidden_bytes)});
  {  // a negative size, a region without a size, a size without a region
    inference::ModelInferRequest req = good;
    (*req.mutable_inputs(0)->mutable_parameters())["shared_memory_byte_size"].set_int64_param(-1);
    ExpectRefusedOn(stub.get(), req, Code::INVALID_ARGUMENT,
                    {"shared_memory_byte_size", "non-negative"});
    req.mutable_inputs(0)->mutable_parameters()->erase("shared_memory_byte_size");
    ExpectRefusedOn(stub.get(), req, Code::INVALID_ARGUMENT, {"shared_memory_byte_size: required"});
    req = ToInfer(r, "moe_layer_0");
    (*req.mutable_inputs(1)->mutable_parameters())["shared_memory_byte_size"].set_int64_param(8);
    ExpectRefusedOn(stub.get(), req, Code::INVALID_ARGUMENT,
                    {"inputs[1] (topk_ids)", "without shared_memory_region"});
  }
  {  // raw_input_contents still carrying the input that moved to the region
    inference::ModelInferRequest req = good;
    req.mutable_raw_input_contents()->Add(std::string(hidden_bytes, '\0'));
    ExpectRefusedOn(stub.get(), req, Code::INVALID_ARGUMENT,
                    {"raw_input_contents: 3 entries for 3 inputs (1 in shared memory)"});
  }
  {  // an output region that is too small, or overlaps an input
    inference::ModelInferRequest req = good;
    auto* o = req.add_outputs();
    o->set_name("output");
    SetShm(o->mutable_parameters(), "r", 1024, hidden_bytes - 2);
    ExpectRefusedOn(stub.get(), req, Code::INVALID_ARGUMENT,
                    {"outputs[0] (output).parameters.shared_memory_byte_size",
                     "too small for the output", "= " + std::to_string(hidden_bytes)});
    SetShm(o->mutable_parameters(), "r", (1 << 16) - hidden_bytes + 2, hidden_bytes);
    ExpectRefusedOn(stub.get(), req, Code::INVALID_ARGUMENT,
                    {"outputs[0] (output).parameters.shared_memory_region",
                     "lie outside the region's registered 65536 bytes"});
    SetShm(o->mutable_parameters(), "r", 64, hidden_bytes);
    ExpectRefusedOn(stub.get(), req, Code::INVALID_ARGUMENT,
                    {"overlap hidden_states", "needs bytes of its own"});
  }
  {  // registration refusals, through the shared registry's checks
    EXPECT_EQ(RegisterSystem(stub.get(), "r", shm.key(), 0, 16).error_code(), Code::ALREADY_EXISTS);
    EXPECT_EQ(RegisterSystem(stub.get(), "x", "/moeserve_no_such_key", 0, 16).error_code(),
              Code::NOT_FOUND);
    grpc::Status s = RegisterSystem(stub.get(), "x", shm.key(), 1 << 15, 1 << 16);
    EXPECT_EQ(s.error_code(), Code::INVALID_ARGUMENT) << s.error_message();
    s = RegisterSystem(stub.get(), "x", shm.key(), uint64_t{1} << 63, 16);
    EXPECT_EQ(s.error_code(), Code::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("offset"));
    inference::CudaSharedMemoryRegisterRequest req;
    req.set_name("g");
    req.set_raw_handle(std::string(64, '\0'));
    req.set_byte_size(16);
    inference::CudaSharedMemoryRegisterResponse resp;
    grpc::ClientContext ctx;
    s = stub->CudaSharedMemoryRegister(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), Code::FAILED_PRECONDITION) << s.error_message();  // CPU backend
    EXPECT_EQ(UnregisterSystem(stub.get(), "nope").error_code(), Code::NOT_FOUND);
    inference::CudaSharedMemoryUnregisterRequest ureq;
    ureq.set_name("r");  // a system region
    inference::CudaSharedMemoryUnregisterResponse uresp;
    grpc::ClientContext ctx2;
    s = stub->CudaSharedMemoryUnregister(&ctx2, ureq, &uresp);
    EXPECT_EQ(s.error_code(), Code::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("'r' is a system region, not a cuda one"));
  }
  // An unregistered region is unknown to the next call.
  ASSERT_TRUE(UnregisterSystem(stub.get(), "r").ok());
  ExpectRefusedOn(stub.get(), good, Code::INVALID_ARGUMENT, {"no shared-memory region named 'r'"});
  // Still serving, and nothing is held.
  inference::ModelInferResponse resp;
  ASSERT_TRUE(InferOn(stub.get(), ToInfer(r, "moe_layer_0"), &resp).ok());
  // (Held bytes go back once gRPC is done with the call, just after the client has the answer.)
  for (int i = 0; i < 200 && shm_server_->service().held_bytes() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(shm_server_->service().held_bytes(), 0);
}

// A server started without --enable_shared_memory refuses every shared-memory RPC and any
// ModelInfer tensor in a region with FAILED_PRECONDITION naming the flag; plain calls are served.
TEST_F(InferenceSharedMemoryTest, DisabledServerRefusesNamingTheFlag) {
  auto stub = Stub();  // server_: shared memory off
  using Code = grpc::StatusCode;
  const auto expect_flag = [](const grpc::Status& s) {
    EXPECT_EQ(s.error_code(), Code::FAILED_PRECONDITION) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("--enable_shared_memory"));
  };
  expect_flag(RegisterSystem(stub.get(), "a", "/x", 0, 16));
  expect_flag(UnregisterSystem(stub.get(), ""));
  {
    grpc::ClientContext ctx;
    inference::SystemSharedMemoryStatusResponse resp;
    expect_flag(
        stub->SystemSharedMemoryStatus(&ctx, inference::SystemSharedMemoryStatusRequest(), &resp));
  }
  {
    grpc::ClientContext ctx;
    inference::CudaSharedMemoryStatusResponse resp;
    expect_flag(
        stub->CudaSharedMemoryStatus(&ctx, inference::CudaSharedMemoryStatusRequest(), &resp));
  }
  {
    grpc::ClientContext ctx;
    inference::CudaSharedMemoryRegisterRequest req;
    req.set_name("g");
    req.set_raw_handle(std::string(64, '\0'));
    req.set_byte_size(16);
    inference::CudaSharedMemoryRegisterResponse resp;
    expect_flag(stub->CudaSharedMemoryRegister(&ctx, req, &resp));
  }
  {
    grpc::ClientContext ctx;
    inference::CudaSharedMemoryUnregisterResponse resp;
    expect_flag(stub->CudaSharedMemoryUnregister(
        &ctx, inference::CudaSharedMemoryUnregisterRequest(), &resp));
  }
  const v1::ForwardRequest r = Random(2, v1::DTYPE_BF16, v1::DTYPE_INT32, 0);
  ShmObject shm(8192);
  ASSERT_TRUE(shm.ok());
  inference::ModelInferRequest in_region = ToInfer(r, "moe_layer_0");
  MoveInputToShm(&in_region, 0, shm, "a", 0);
  ExpectRefusedOn(stub.get(), in_region, Code::FAILED_PRECONDITION,
                  {"hidden_states.parameters.shared_memory_region", "--enable_shared_memory"});
  inference::ModelInferRequest out_region = ToInfer(r, "moe_layer_0");
  auto* o = out_region.add_outputs();
  o->set_name("output");
  SetShm(o->mutable_parameters(), "a", 0, 2 * model().hidden * 2);
  ExpectRefusedOn(
      stub.get(), out_region, Code::FAILED_PRECONDITION,
      {"outputs[0] (output).parameters.shared_memory_region", "--enable_shared_memory"});
  inference::ModelInferResponse resp;
  EXPECT_TRUE(Infer(ToInfer(r, "moe_layer_0"), &resp).ok());
}

// A non-loopback IPv4 address of this host, or "" when it has none.
std::string NonLoopbackIpv4() {
  ifaddrs* addrs = nullptr;
  if (getifaddrs(&addrs) != 0) return "";
  std::string found;
  for (ifaddrs* a = addrs; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN];
    const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) continue;
    if (std::string(text).rfind("127.", 0) != 0) found = text;
  }
  freeifaddrs(addrs);
  return found;
}

// Regions name this host's memory: a client reaching the server through a non-loopback address
// is refused (PERMISSION_DENIED naming its address), for the RPCs and for ModelInfer. Skipped on
// a host without a non-loopback IPv4 address.
TEST_F(InferenceSharedMemoryTest, NonLocalPeerIsRefused) {
  const std::string ip = NonLoopbackIpv4();
  if (ip.empty()) GTEST_SKIP() << "no non-loopback IPv4 address on this host";
  ServerOptions options;
  options.listen_addresses = {ip + ":0"};
  options.metrics_address = "";
  options.enable_shared_memory = true;
  auto server = MoeServer::Start(engine_, options);
  if (!server.ok()) GTEST_SKIP() << "cannot listen on " << ip << ": " << server.status();
  auto stub = StubFor(**server);
  ShmObject shm(8192);
  ASSERT_TRUE(shm.ok());
  grpc::Status s = RegisterSystem(stub.get(), "a", shm.key(), 0, 8192);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("SystemSharedMemoryRegister"));
  EXPECT_THAT(s.error_message(), HasSubstr("ipv4:" + ip));
  // Registered from the inside, named from the outside.
  ASSERT_TRUE((*server)->service().mutable_regions()->RegisterSystem("a", shm.key(), 0, 8192).ok());
  const v1::ForwardRequest r = Random(2, v1::DTYPE_BF16, v1::DTYPE_INT32, 0);
  inference::ModelInferRequest req = ToInfer(r, "moe_layer_0");
  MoveInputToShm(&req, 0, shm, "a", 0);
  ExpectRefusedOn(stub.get(), req, grpc::StatusCode::PERMISSION_DENIED,
                  {"ModelInfer", "host only"});
  inference::ModelInferResponse resp;
  EXPECT_TRUE(InferOn(stub.get(), ToInfer(r, "moe_layer_0"), &resp).ok());
}

// A region a queued ModelInfer holds cannot be unregistered through either protocol
// (FAILED_PRECONDITION naming it); once the call is answered it can. The call waits in the
// batcher (max_batch_delay); the test waits on the registry's count, not on time.
TEST_F(InferenceSharedMemoryTest, UnregisterWhileAModelInferUsesTheRegionIsRefused) {
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  options.enable_shared_memory = true;
  options.batcher.max_batch_delay = absl::Seconds(3);
  auto slow = MoeServer::Start(engine_, options);
  ASSERT_TRUE(slow.ok()) << slow.status();
  auto stub = StubFor(**slow);
  ShmObject shm(1 << 16);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem(stub.get(), "busy", shm.key(), 0, 1 << 16).ok());
  const v1::ForwardRequest r = Random(4, v1::DTYPE_BF16, v1::DTYPE_INT32, 1);
  inference::ModelInferRequest req = ToInfer(r, "moe_layer_1");
  MoveInputToShm(&req, 0, shm, "busy", 0);
  auto* o = req.add_outputs();
  o->set_name("output");
  SetShm(o->mutable_parameters(), "busy", 32768, 4 * model().hidden * 2);
  auto call = std::async(std::launch::async, [&] {
    inference::ModelInferResponse resp;
    return InferOn(stub.get(), req, &resp);
  });
  int64_t in_flight = 0;
  for (int i = 0; i < 2000 && in_flight == 0; ++i) {
    in_flight = (*slow)->service().regions()->Status("busy").value()[0].calls_in_flight;
    if (in_flight == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(in_flight, 1);
  grpc::Status s = UnregisterSystem(stub.get(), "busy");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("'busy' (1 calls in flight)"));
  s = UnregisterSystem(stub.get(), "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(call.get().ok());
  const std::vector<float> got = DecodeFloats(
      std::string(reinterpret_cast<const char*>(shm.data()) + 32768, 4 * model().hidden * 2),
      v1::DTYPE_BF16);
  EXPECT_LT(RelativeL2(got, Expected(r)), 1e-2);
  s = UnregisterSystem(stub.get(), "busy");
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// ModelInfer is admitted under the same max_queued_bytes budget as Forward: a request whose
// bytes, or bytes plus answer, pass it is refused at once with RESOURCE_EXHAUSTED naming the
// limit; an answer into a shared-memory region takes no budget; nothing stays held.
TEST_F(InferenceSharedMemoryTest, ModelInferSharesTheQueuedBytesBudget) {
  auto stub = StubFor(*budget_server_);
  const std::string limit = "max_queued_bytes=" + std::to_string(kBudget);
  // 128 tokens FP32: 64 KiB of hidden states alone.
  ExpectRefusedOn(stub.get(), ToInfer(Random(128, v1::DTYPE_FP32, v1::DTYPE_INT32, 0), "moeserve"),
                  grpc::StatusCode::RESOURCE_EXHAUSTED, {"ModelInfer", "this request", limit});
  // 64 tokens FP32: 33 KiB in fits, 32 KiB more for the answer does not.
  const v1::ForwardRequest r = Random(64, v1::DTYPE_FP32, v1::DTYPE_INT32, 0);
  const inference::ModelInferRequest req = ToInfer(r, "moe_layer_0");
  ExpectRefusedOn(stub.get(), req, grpc::StatusCode::RESOURCE_EXHAUSTED,
                  {"ModelInfer", "this call alone holds", "(its answer: 32768)", limit});
  // A refused call's request bytes are given back when gRPC is done with the call, which may
  // be just after the client has its status (seen on a loaded 2-core machine).
  auto wait_released = [&] {
    for (int i = 0; i < 200 && budget_server_->service().held_bytes() != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  wait_released();
  ASSERT_EQ(budget_server_->service().held_bytes(), 0);
  // The answer into a region: admitted, and right.
  ShmObject shm(1 << 16);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem(stub.get(), "out", shm.key(), 0, 1 << 16).ok());
  inference::ModelInferRequest to_region = req;
  auto* o = to_region.add_outputs();
  o->set_name("output");
  SetShm(o->mutable_parameters(), "out", 0, 64 * model().hidden * 4);
  inference::ModelInferResponse resp;
  grpc::Status s = InferOn(stub.get(), to_region, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_LT(RelativeL2(DecodeFloats(std::string(reinterpret_cast<const char*>(shm.data()),
                                                64 * model().hidden * 4),
                                    v1::DTYPE_FP32),
                       Expected(r)),
            1e-5);
  // Smaller calls are served; the budget is all given back.
  ASSERT_TRUE(InferOn(stub.get(),
                      ToInfer(Random(8, v1::DTYPE_FP32, v1::DTYPE_INT32, 0), "moe_layer_0"), &resp)
                  .ok());
  wait_released();
  EXPECT_EQ(budget_server_->service().held_bytes(), 0);
}

}  // namespace
}  // namespace moeserve
