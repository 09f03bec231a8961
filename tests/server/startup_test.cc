// Startup in pieces: a server bound before its engine exists (health NOT_SERVING, calls refused
// with UNAVAILABLE saying what the process is doing, then SERVING once the engine is attached),
// the load progress an operator sees, and the message limits derived from the model.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <random>
#include <string>

#include "core/engine.h"
#include "core/model_config.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/limits.h"
#include "server/load_progress.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::HttpGetMetrics;
using ::moeserve::testing::MetricValue;
using ::testing::HasSubstr;

grpc::health::v1::HealthCheckResponse::ServingStatus Health(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << service << ": " << s.error_message();
  return resp.status();
}

// A small CPU engine (hidden 64, 4 experts, top-2, one thread) to attach to a server.
std::unique_ptr<Engine> SmallCpuEngine() {
  EngineOptions engine_options;
  ModelOverrides o;
  o.hidden = 64;
  o.intermediate = 32;
  o.num_experts = 4;
  o.topk = 2;
  engine_options.model = ApplyOverrides(ModelPreset("tiny").value(), o).value();
  engine_options.num_threads = 1;
  return Engine::Create(engine_options).value();
}

// A server with `batcher` (settings "by backend" left negative: the server resolves them before
// the batcher sees them, which refuses negative ones) attaches the small CPU engine and serves.
void ExpectServesOnTheCpu(const ForwardBatcherOptions& batcher) {
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  options.batcher = batcher;
  std::unique_ptr<MoeServer> server = MoeServer::Bind(options).value();
  std::unique_ptr<Engine> engine = SmallCpuEngine();
  absl::Status attached = server->AttachEngine(engine.get());
  EXPECT_TRUE(attached.ok()) << attached;
  EXPECT_TRUE(server->serving());
  server->Shutdown(std::chrono::seconds(5));
}

TEST(StartupTest, BoundBeforeTheEngineThenServing) {
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "127.0.0.1:0";
  options.enable_get_expert_weights = true;  // refused while loading all the same
  options.enable_shared_memory = true;
  std::string phase = "loading weights: layer 3 of 8";
  absl::StatusOr<std::unique_ptr<MoeServer>> server =
      MoeServer::Bind(options, [&phase] { return phase; });
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel =
      grpc::CreateChannel((*server)->bound_addresses()[0], grpc::InsecureChannelCredentials());
  using HC = grpc::health::v1::HealthCheckResponse;
  for (const char* service : {"", "moeserve.v1.MoeService", "inference.GRPCInferenceService"}) {
    EXPECT_EQ(Health(channel, service), HC::NOT_SERVING) << service;
  }
  EXPECT_FALSE((*server)->serving());
  // Metrics answer while loading.
  const std::string text = HttpGetMetrics((*server)->metrics().port());
  EXPECT_EQ(MetricValue(text, "moeserve_serving"), 0);
  EXPECT_EQ(MetricValue(text, "moeserve_build_info", {"version="}), 1);

  // Every call that needs the engine: UNAVAILABLE, saying what the process is doing.
  auto stub = v1::MoeService::NewStub(channel);
  std::mt19937_64 rng(1);
  const v1::ForwardRequest request =
      testing::RandomRequest(rng, 0, 2, 64, 4, 2, v1::DTYPE_BF16, v1::DTYPE_INT32);
  {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    grpc::Status s = stub->Forward(&ctx, request, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), HasSubstr("layer 3 of 8"));
    EXPECT_THAT(s.error_message(), HasSubstr("SERVING"));
  }
  {
    grpc::ClientContext ctx;
    v1::ModelInfo info;
    EXPECT_EQ(stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  {  // ForwardStream: the stream stays open, the message answers UNAVAILABLE.
    grpc::ClientContext ctx;
    auto stream = stub->ForwardStream(&ctx);
    ASSERT_TRUE(stream->Write(request));
    v1::ForwardResponse answer;
    ASSERT_TRUE(stream->Read(&answer));
    EXPECT_EQ(answer.error_code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
    EXPECT_THAT(answer.error_message(), HasSubstr("layer 3 of 8"));
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
  {
    grpc::ClientContext ctx;
    v1::GetExpertWeightsRequest req;
    v1::GetExpertWeightsResponse resp;
    grpc::Status s = stub->GetExpertWeights(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    auto reader = stub->StreamExpertWeights(&ctx, v1::StreamExpertWeightsRequest());
    v1::ExpertWeightsChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  {
    grpc::ClientContext ctx;
    v1::SharedMemoryStatusResponse resp;
    grpc::Status s = stub->SharedMemoryStatus(&ctx, v1::SharedMemoryStatusRequest(), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("SharedMemoryStatus"));
  }
  auto kserve = inference::GRPCInferenceService::NewStub(channel);
  {
    grpc::ClientContext ctx;
    inference::ServerLiveResponse resp;
    ASSERT_TRUE(kserve->ServerLive(&ctx, inference::ServerLiveRequest(), &resp).ok());
    EXPECT_TRUE(resp.live());
  }
  {
    grpc::ClientContext ctx;
    inference::ServerReadyResponse resp;
    ASSERT_TRUE(kserve->ServerReady(&ctx, inference::ServerReadyRequest(), &resp).ok());
    EXPECT_FALSE(resp.ready());
  }
  {
    grpc::ClientContext ctx;
    inference::ModelInferRequest req;
    req.set_model_name("moe_layer_0");
    inference::ModelInferResponse resp;
    grpc::Status s = kserve->ModelInfer(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), HasSubstr("ModelInfer"));
  }

  // The engine arrives: SERVING, and the same call is answered.
  std::unique_ptr<Engine> engine = SmallCpuEngine();
  phase = "weights loaded";
  ASSERT_TRUE((*server)->AttachEngine(engine.get()).ok());
  EXPECT_FALSE((*server)->AttachEngine(engine.get()).ok());  // once
  EXPECT_TRUE((*server)->serving());
  for (const char* service : {"", "moeserve.v1.MoeService", "inference.GRPCInferenceService"}) {
    EXPECT_EQ(Health(channel, service), HC::SERVING) << service;
  }
  {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    grpc::Status s = stub->Forward(&ctx, request, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.output().data().size(), 2u * 64u * 2u);
  }
  {
    grpc::ClientContext ctx;
    inference::ServerReadyResponse resp;
    ASSERT_TRUE(kserve->ServerReady(&ctx, inference::ServerReadyRequest(), &resp).ok());
    EXPECT_TRUE(resp.ready());
  }
  EXPECT_EQ(MetricValue(HttpGetMetrics((*server)->metrics().port()), "moeserve_serving"), 1);
  (*server)->Shutdown(std::chrono::seconds(5));
  EXPECT_FALSE((*server)->serving());
}

// inline_request_bytes -2 (the binary's default) is "by backend": every request decoded on a
// polling worker on a GPU, on gRPC's thread on the CPU; any other value is kept.
TEST(StartupTest, InlineRequestBytesByBackend) {
  EXPECT_EQ(ResolveInlineRequestBytes(kInlineRequestBytesByBackend, "cuda"), 0);
  EXPECT_EQ(ResolveInlineRequestBytes(kInlineRequestBytesByBackend, "cpu"), -1);
  for (const int64_t set : {int64_t{-1}, int64_t{0}, int64_t{1} << 20}) {
    EXPECT_EQ(ResolveInlineRequestBytes(set, "cuda"), set);
    EXPECT_EQ(ResolveInlineRequestBytes(set, "cpu"), set);
  }
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  options.inline_request_bytes = kInlineRequestBytesByBackend - 1;
  absl::StatusOr<std::unique_ptr<MoeServer>> bad = MoeServer::Start(nullptr, options);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), ::testing::HasSubstr("-2 (by backend)"));
}

// A negative idle_spin is "by backend": polling on a GPU (where a wake-up is a third of a
// one-token call), none on the CPU; a set value is kept on both.
TEST(StartupTest, IdleSpinByBackend) {
  EXPECT_EQ(ResolveIdleSpin(absl::Microseconds(-1), "cpu"), absl::ZeroDuration());
  EXPECT_EQ(ResolveIdleSpin(absl::Microseconds(-1), "cuda"), kGpuIdleSpin);
  EXPECT_GT(kGpuIdleSpin, absl::ZeroDuration());
  EXPECT_EQ(ResolveIdleSpin(absl::Microseconds(300), "cpu"), absl::Microseconds(300));
  EXPECT_EQ(ResolveIdleSpin(absl::ZeroDuration(), "cuda"), absl::ZeroDuration());

  // The server resolves it before the batcher sees it (which refuses a negative one).
  ForwardBatcherOptions batcher;
  batcher.idle_spin = absl::Microseconds(-1);
  ExpectServesOnTheCpu(batcher);
}

// A negative lane_lead is "by backend" too: a lead on a GPU (two lanes), none on the CPU; a set
// value is kept on both, and the server resolves it before the batcher (which refuses < 0).
TEST(StartupTest, LaneLeadByBackend) {
  EXPECT_EQ(ResolveLaneLead(absl::Microseconds(-1), "cpu"), absl::ZeroDuration());
  EXPECT_EQ(ResolveLaneLead(absl::Microseconds(-1), "cuda"), kGpuLaneLead);
  EXPECT_GT(kGpuLaneLead, absl::ZeroDuration());
  EXPECT_EQ(ResolveLaneLead(absl::Microseconds(300), "cpu"), absl::Microseconds(300));
  EXPECT_EQ(ResolveLaneLead(absl::ZeroDuration(), "cuda"), absl::ZeroDuration());

  ForwardBatcherOptions batcher;
  batcher.lane_lead = absl::Microseconds(-1);
  ExpectServesOnTheCpu(batcher);
}

TEST(StartupTest, CompanyWaitByBackend) {
  for (const char* backend : {"cpu", "cuda"}) {
    SCOPED_TRACE(backend);
    const bool gpu = std::string_view(backend) != "cpu";
    ForwardBatcherOptions o;
    o.company_wait = absl::Microseconds(-1);
    ResolveCompanyWait(backend, &o);
    EXPECT_EQ(o.company_wait_auto, gpu);
    EXPECT_EQ(o.company_wait, gpu ? kAutoCompanyWait : absl::ZeroDuration());
    EXPECT_TRUE(ForwardBatcher::CheckOptions(o).ok());
    // As configured: untouched.
    ForwardBatcherOptions fixed;
    fixed.company_wait = absl::Microseconds(700);
    ResolveCompanyWait(backend, &fixed);
    EXPECT_EQ(fixed.company_wait, absl::Microseconds(700));
    EXPECT_FALSE(fixed.company_wait_auto);
  }
  // A server told "by backend" starts on the CPU engine.
  ForwardBatcherOptions batcher;
  batcher.company_wait = absl::Microseconds(-1);
  ExpectServesOnTheCpu(batcher);
}

TEST(StartupTest, ShutdownWithoutAnEngine) {
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  std::unique_ptr<MoeServer> server = MoeServer::Bind(options).value();
  server->Shutdown(std::chrono::milliseconds(0));
  EXPECT_FALSE(server->AttachEngine(nullptr).ok());
}

// A real engine load reports its plan, every shard and a finish; a cancel stops the next load.
TEST(LoadProgressTest, ReportsPlanShardsAndCancel) {
  char* text = nullptr;
  size_t size = 0;
  std::FILE* log = open_memstream(&text, &size);
  ASSERT_NE(log, nullptr);
  std::unique_ptr<Metrics> metrics = Metrics::Create("127.0.0.1:0").value();
  LoadProgress progress(log, metrics.get(), std::chrono::milliseconds(0));
  EXPECT_EQ(progress.Describe(), "preparing to load weights");
  EngineOptions options;
  ModelOverrides o;
  o.num_layers = 3;
  o.hidden = 64;
  o.intermediate = 32;
  o.num_experts = 4;
  o.topk = 2;
  options.model = ApplyOverrides(ModelPreset("tiny").value(), o).value();
  options.num_ranks = 2;
  options.num_threads = 2;
  options.load_observer = &progress;
  std::unique_ptr<Engine> engine = Engine::Create(options).value();
  // 2 ranks x 3 layers x 2 experts x (3 x 64 x 32) BF16 values.
  const int64_t bytes = 2 * 3 * 2 * 3 * 64 * 32 * 2;
  EXPECT_EQ(progress.shards_loaded(), 6);
  EXPECT_EQ(progress.loaded_bytes(), bytes);
  EXPECT_THAT(progress.Describe(), HasSubstr("starting the expert-parallel ranks"));
  progress.Finish();
  EXPECT_EQ(progress.Describe(), "weights loaded");
  std::fflush(log);
  const std::string lines(text, size);
  EXPECT_THAT(lines, HasSubstr("loading weights: 0.00 GiB of expert weights"));
  EXPECT_THAT(lines, HasSubstr("(6 layer shards)"));
  EXPECT_THAT(lines, HasSubstr("layer 1 of 6"));
  EXPECT_THAT(lines, HasSubstr("layer 6 of 6"));
  EXPECT_THAT(lines, HasSubstr("GiB/s"));
  EXPECT_THAT(lines, HasSubstr("weights loaded"));
  const std::string m = HttpGetMetrics(metrics->port());
  EXPECT_EQ(MetricValue(m, "moeserve_weights_planned_bytes"), bytes);
  EXPECT_EQ(MetricValue(m, "moeserve_weights_loaded_bytes"), bytes);
  EXPECT_GT(MetricValue(m, "moeserve_weights_load_seconds"), 0);

  LoadProgress cancelled(nullptr, nullptr);
  cancelled.Cancel();
  options.load_observer = &cancelled;
  absl::StatusOr<std::unique_ptr<Engine>> none = Engine::Create(options);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kCancelled) << none.status();
  std::fclose(log);
  std::free(text);
}

// ---- message limits ----

ModelConfig Model(int64_t hidden, int64_t intermediate, int topk) {
  ModelConfig m = ModelPreset("tiny").value();
  ModelOverrides o;
  o.hidden = hidden;
  o.intermediate = intermediate;
  o.topk = topk;
  o.num_experts = std::max(8, topk);
  return ApplyOverrides(m, o).value();
}

TEST(MessageLimitsTest, DerivedLimitCarriesTheAdvertisedTokens) {
  // DeepSeek-V3-sized: 8192 tokens of hidden 7168 do not fit in the old 64 MiB default.
  const ModelConfig m = Model(7168, 2048, 8);
  MessageLimits l = ResolveMessageLimits(m, 8192, 0).value();
  EXPECT_EQ(l.max_tokens_per_request, 8192);
  EXPECT_TRUE(l.note.empty());
  EXPECT_EQ(l.max_message_bytes, MaxForwardMessageBytes(m, 8192));
  EXPECT_GE(l.max_message_bytes, 8192 * 7168 * 4);
  EXPECT_GT(l.max_message_bytes, int64_t{64} << 20);
  EXPECT_GT(l.grpc_limit_bytes, l.max_message_bytes);
  EXPECT_LE(l.grpc_limit_bytes, kGrpcMaxMessageBytes);
  // One expert's weights fit too.
  EXPECT_GE(l.max_message_bytes, ExpertWeightsMessageBytes(m));
}

TEST(MessageLimitsTest, TokenLimitLoweredToFit) {
  const ModelConfig m = Model(7168, 2048, 8);
  // An explicit 64 MiB limit: fewer tokens, and a line saying so.
  MessageLimits l = ResolveMessageLimits(m, 8192, int64_t{96} << 20).value();
  EXPECT_LT(l.max_tokens_per_request, 8192);
  EXPECT_GT(l.max_tokens_per_request, 3000);
  EXPECT_LE(MaxForwardMessageBytes(m, l.max_tokens_per_request), int64_t{96} << 20);
  EXPECT_GT(MaxForwardMessageBytes(m, l.max_tokens_per_request + 1), int64_t{96} << 20);
  EXPECT_EQ(l.max_message_bytes, int64_t{96} << 20);
  EXPECT_THAT(l.note, HasSubstr("--max_tokens_per_request lowered from 8192 to"));
  EXPECT_THAT(l.note, HasSubstr("--max_message_bytes"));
  // Without --max_message_bytes, a token limit beyond gRPC's own 2 GiB ceiling is refused,
  // naming the flag (issue 14: limits that cannot hold end the process).
  absl::StatusOr<MessageLimits> huge = ResolveMessageLimits(m, 1 << 20, 0);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("--max_tokens_per_request"));
  EXPECT_THAT(huge.status().message(), HasSubstr("2 GiB"));
}

// --max_queued_bytes below one valid call's request + answer: a note at startup naming the
// flag and the largest M that fits (such calls are refused however idle the server is).
TEST(MessageLimitsTest, HeldBytesNoteNamesTheLargestCallThatFits) {
  const ModelConfig m = Model(7168, 2048, 8);
  const int64_t budget = int64_t{512} << 20;
  const auto call = [&](int64_t tokens) {
    return MaxForwardMessageBytes(m, tokens) + MaxForwardAnswerBytes(m, tokens);
  };
  EXPECT_LE(call(8192), budget);
  EXPECT_EQ(HeldBytesNote(m, 8192, budget), "");
  EXPECT_EQ(HeldBytesNote(m, 16384, 0), "");  // no limit
  const std::string note = HeldBytesNote(m, 16384, budget);
  int64_t fits = 0;
  while (call(fits + 1) <= budget) ++fits;
  EXPECT_GT(fits, 8192);
  EXPECT_LT(fits, 16384);
  EXPECT_THAT(note, HasSubstr("--max_queued_bytes=536870912"));
  EXPECT_THAT(note, HasSubstr("one Forward of M=16384 fp32"));
  EXPECT_THAT(note, HasSubstr(absl::StrCat("fp32 calls fit up to M=", fits, " ")));
  // Sizes saturate instead of overflowing for any token count a flag may give.
  EXPECT_EQ(MaxForwardMessageBytes(m, INT64_MAX / 2), INT64_MAX);
  EXPECT_EQ(MaxForwardAnswerBytes(m, INT64_MAX / 2), INT64_MAX);
  EXPECT_THAT(HeldBytesNote(m, INT64_MAX / 2, budget), HasSubstr("fp32 calls fit up to M="));
}

TEST(MessageLimitsTest, RefusesLimitsThatCannotWork) {
  const ModelConfig m = Model(7168, 2048, 8);
  for (auto [tokens, bytes, flag] :
       {std::tuple<int64_t, int64_t, const char*>{0, 0, "--max_tokens_per_request"},
        {16, -1, "--max_message_bytes"},
        {16, 1000, "--max_message_bytes"},
        {16, int64_t{1} << 32, "--max_message_bytes"}}) {
    absl::StatusOr<MessageLimits> l = ResolveMessageLimits(m, tokens, bytes);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << tokens << " " << bytes;
    EXPECT_THAT(l.status().message(), HasSubstr(flag));
  }
}

// Over the token limit but under gRPC's limit: refused naming hidden_states' M, not with
// gRPC's generic "larger than max".
TEST(MessageLimitsTest, OversizedRequestNamesTheField) {
  EngineOptions engine_options;
  engine_options.model = Model(256, 64, 2);
  engine_options.num_threads = 1;
  const MessageLimits limits = ResolveMessageLimits(engine_options.model, 16, 0).value();
  engine_options.max_tokens_per_request = limits.max_tokens_per_request;
  std::unique_ptr<Engine> engine = Engine::Create(engine_options).value();
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  options.max_message_bytes = limits.max_message_bytes;
  options.grpc_limit_bytes = limits.grpc_limit_bytes;
  std::unique_ptr<MoeServer> server = MoeServer::Start(engine.get(), options).value();
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  auto stub = v1::MoeService::NewStub(grpc::CreateCustomChannel(
      server->bound_addresses()[0], grpc::InsecureChannelCredentials(), args));
  std::mt19937_64 rng(2);
  const ModelConfig& m = engine_options.model;
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32}) {
    v1::ForwardRequest r =
        testing::RandomRequest(rng, 0, 20, m.hidden, m.num_experts, m.topk, dtype, v1::DTYPE_INT64);
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    grpc::Status s = stub->Forward(&ctx, r, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(s.error_message(), HasSubstr("hidden_states: M=20"));
    EXPECT_THAT(s.error_message(), HasSubstr("16"));
    EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr("larger than max")));
  }
  // Within the token limit but padded past max_message_bytes: refused naming the limit.
  v1::ForwardRequest r = testing::RandomRequest(rng, 0, 4, m.hidden, m.num_experts, m.topk,
                                                v1::DTYPE_BF16, v1::DTYPE_INT32);
  r.set_request_id(std::string(limits.max_message_bytes, 'x'));
  grpc::ClientContext ctx;
  v1::ForwardResponse resp;
  grpc::Status s = stub->Forward(&ctx, r, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("max_message_bytes"));
  server->Shutdown(std::chrono::seconds(5));
}

}  // namespace
}  // namespace moeserve
