// The KServe v2 / Open Inference Protocol service in-process on 127.0.0.1:0, driven through the
// stub generated from proto/inference/grpc_service.proto (plain protobuf serialization, as any
// KServe client sends) and through raw byte buffers split at odd offsets: liveness, readiness,
// metadata, ModelInfer answers against an independent reference engine for every datatype, the
// `layer` parameter, refusals naming the field, and the metrics it moves.
#include "server/inference_service.h"

#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/model_config.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "inference/infer_wire.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::DecodeFloats;
using ::moeserve::testing::HttpGetMetrics;
using ::moeserve::testing::MetricValue;
using ::moeserve::testing::RandomRequest;
using ::moeserve::testing::RelativeL2;
using ::testing::HasSubstr;

constexpr int64_t kMaxTokens = 64;

ModelConfig TestModel() {
  ModelConfig model = ModelPreset("tiny").value();
  ModelOverrides o;
  o.num_experts = 8;
  o.topk = 3;
  o.hidden = 128;
  o.intermediate = 96;
  return ApplyOverrides(model, o).value();
}

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

DType CoreDType(v1::DType d) {
  switch (d) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kFP16;
    case v1::DTYPE_INT32:
      return DType::kINT32;
    case v1::DTYPE_INT64:
      return DType::kINT64;
    default:
      return DType::kFP32;
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
    const auto view = [](const v1::Tensor& t) {
      return TensorView(static_cast<const void*>(t.data().data()), CoreDType(t.dtype()),
                        Shape(t.shape().begin(), t.shape().end()));
    };
    ForwardInput in;
    in.layer = r.layer();
    in.hidden_states = view(r.hidden_states());
    in.topk_ids = view(r.topk_ids());
    in.topk_weights = view(r.topk_weights());
    Tensor out = Tensor::Empty(in.hidden_states.dtype(), in.hidden_states.shape());
    absl::Status s = reference_->Forward(in, out.view());
    EXPECT_TRUE(s.ok()) << s;
    return DecodeFloats(std::string(out.data<char>(), out.nbytes()), r.hidden_states().dtype());
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

}  // namespace
}  // namespace moeserve
