// The server follows the engine's health: NOT_SERVING while the engine is unhealthy (e.g. NCCL
// communicators aborted after a timeout), SERVING again once Engine::Recover() succeeds.
#include <chrono>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/server.h"

namespace moeserve {
namespace {

using Status = grpc::health::v1::HealthCheckResponse::ServingStatus;

Status Check(grpc::Channel& channel, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      std::shared_ptr<grpc::Channel>(&channel, [](grpc::Channel*) {}));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_TRUE(stub->Check(&ctx, req, &resp).ok());
  return resp.status();
}

// Polls until the health service reports `want` for both names, or 10 s pass.
bool WaitFor(grpc::Channel& channel, Status want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Check(channel, "") == want && Check(channel, kMoeServiceName) == want) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::unique_ptr<Engine> TinyEngine() {
  EngineOptions options;
  options.model = ModelPreset("tiny").value();
  options.backend = "cpu";
  options.num_threads = 1;
  return Engine::Create(options).value();
}

TEST(ServerHealthTest, NotServingWhileEngineUnhealthyThenRecovers) {
  auto engine = TinyEngine();
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  options.health_poll = std::chrono::milliseconds(20);
  options.recover_after = std::chrono::milliseconds(0);  // stay unhealthy until told
  auto server = MoeServer::Start(engine.get(), options).value();
  auto channel =
      grpc::CreateChannel(server->bound_addresses()[0], grpc::InsecureChannelCredentials());
  ASSERT_TRUE(WaitFor(*channel, grpc::health::v1::HealthCheckResponse::SERVING));

  engine->MarkUnhealthyForTesting(absl::UnavailableError("injected: communicator aborted"));
  ASSERT_TRUE(WaitFor(*channel, grpc::health::v1::HealthCheckResponse::NOT_SERVING));
  EXPECT_FALSE(server->serving());
  // The public API refuses work while unhealthy instead of hanging.
  auto stub = v1::MoeService::NewStub(channel);
  v1::ForwardRequest req;
  req.set_layer(0);
  for (auto* t :
       {req.mutable_hidden_states(), req.mutable_topk_ids(), req.mutable_topk_weights()}) {
    t->add_shape(0);
  }
  req.mutable_hidden_states()->set_dtype(v1::DTYPE_BF16);
  req.mutable_hidden_states()->add_shape(engine->info().model.hidden);
  req.mutable_topk_ids()->set_dtype(v1::DTYPE_INT32);
  req.mutable_topk_ids()->add_shape(engine->info().model.topk);
  req.mutable_topk_weights()->set_dtype(v1::DTYPE_FP32);
  req.mutable_topk_weights()->add_shape(engine->info().model.topk);
  v1::ForwardResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_EQ(stub->Forward(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAVAILABLE);

  ASSERT_TRUE(engine->Recover().ok());
  ASSERT_TRUE(WaitFor(*channel, grpc::health::v1::HealthCheckResponse::SERVING));
  server->Shutdown(std::chrono::milliseconds(100));
  EXPECT_FALSE(server->serving());
}

TEST(ServerHealthTest, RecoversOnItsOwn) {
  auto engine = TinyEngine();
  ServerOptions options;
  options.listen_addresses = {"127.0.0.1:0"};
  options.metrics_address = "";
  options.health_poll = std::chrono::milliseconds(20);
  options.recover_after = std::chrono::milliseconds(200);
  auto server = MoeServer::Start(engine.get(), options).value();
  auto channel =
      grpc::CreateChannel(server->bound_addresses()[0], grpc::InsecureChannelCredentials());
  engine->MarkUnhealthyForTesting(absl::UnavailableError("injected"));
  ASSERT_TRUE(WaitFor(*channel, grpc::health::v1::HealthCheckResponse::NOT_SERVING));
  // Recover() succeeds on a CPU engine, so the watcher brings it back.
  ASSERT_TRUE(WaitFor(*channel, grpc::health::v1::HealthCheckResponse::SERVING));
  EXPECT_TRUE(engine->healthy());
}

}  // namespace
}  // namespace moeserve
