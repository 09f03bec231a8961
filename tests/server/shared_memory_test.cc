// Shared-memory regions end to end over gRPC (--enable_shared_memory, CPU backend): a frontend
// registers POSIX shm objects, sends Forward calls whose tensors name regions and whose answer goes
// into an output region, and compares with an independent reference engine; then every refusal
// (each an exact code and a message naming what was wrong), with the server serving on and no
// region left held afterwards.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/engine.h"
#include "core/model_config.h"
#include "moeserve/v1/moeserve.grpc.pb.h"
#include "server/server.h"
#include "server/service.h"
#include "tests/server/test_util.h"
#include "tests/testing/shm_util.h"

namespace moeserve {
namespace {

using ::moeserve::testing::DecodeFloats;
using ::moeserve::testing::RandomRequest;
using ::moeserve::testing::ReferenceForward;
using ::moeserve::testing::RelativeL2;
using ::moeserve::testing::ShmObject;
using ::moeserve::testing::TestModel;
using ::testing::HasSubstr;

constexpr int64_t kMaxTokens = 64;

// Moves `t`'s bytes to byte `offset` of region `name`, which starts at byte `object_base` of
// `shm`, and names the region instead.
void MoveToRegion(v1::Tensor* t, const ShmObject& shm, const std::string& name, int64_t offset,
                  int64_t object_base = 0) {
  shm.Write(static_cast<size_t>(object_base + offset), t->data().data(), t->data().size());
  t->mutable_region()->set_name(name);
  t->mutable_region()->set_offset(offset);
  t->mutable_region()->set_byte_size(static_cast<int64_t>(t->data().size()));
  t->clear_data();
}

void SetRegion(v1::RegionRef* ref, const std::string& name, int64_t offset, int64_t bytes) {
  ref->set_name(name);
  ref->set_offset(offset);
  ref->set_byte_size(bytes);
}

class SharedMemoryTest : public ::testing::Test {
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
    server_options.metrics_address = "";
    server_options.enable_shared_memory = true;
    server_ = MoeServer::Start(engine_, server_options).value().release();
    server_options.enable_shared_memory = false;
    disabled_server_ = MoeServer::Start(engine_, server_options).value().release();
  }
  static void TearDownTestSuite() {
    delete disabled_server_;
    delete server_;
    delete reference_;
    delete engine_;
  }

  void TearDown() override {
    // Every call let its regions go: all of them unregister.
    grpc::Status s = Unregister("");
    EXPECT_TRUE(s.ok()) << s.error_message();
  }

  static std::unique_ptr<v1::MoeService::Stub> StubFor(const MoeServer& server) {
    return v1::MoeService::NewStub(
        grpc::CreateChannel(server.bound_addresses()[0], grpc::InsecureChannelCredentials()));
  }
  const ModelConfig& model() const { return engine_->info().model; }

  static std::chrono::system_clock::time_point Deadline() {
    return std::chrono::system_clock::now() + std::chrono::seconds(60);
  }

  grpc::Status RegisterSystem(const std::string& name, const std::string& key, int64_t offset,
                              int64_t bytes, v1::MoeService::Stub* stub = nullptr) {
    v1::RegisterSystemSharedMemoryRequest req;
    req.set_name(name);
    req.set_key(key);
    req.set_offset(offset);
    req.set_byte_size(bytes);
    v1::RegisterSharedMemoryResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    return (stub ? stub : stub_.get())->RegisterSystemSharedMemory(&ctx, req, &resp);
  }
  grpc::Status Unregister(const std::string& name, v1::MoeService::Stub* stub = nullptr) {
    v1::UnregisterSharedMemoryRequest req;
    req.set_name(name);
    v1::UnregisterSharedMemoryResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    return (stub ? stub : stub_.get())->UnregisterSharedMemory(&ctx, req, &resp);
  }
  grpc::Status Status(const std::string& name, v1::SharedMemoryStatusResponse* resp,
                      v1::MoeService::Stub* stub = nullptr) {
    v1::SharedMemoryStatusRequest req;
    req.set_name(name);
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    return (stub ? stub : stub_.get())->SharedMemoryStatus(&ctx, req, resp);
  }
  grpc::Status Call(const v1::ForwardRequest& request, v1::ForwardResponse* response,
                    v1::MoeService::Stub* stub = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    return (stub ? stub : stub_.get())->Forward(&ctx, request, response);
  }

  v1::ForwardRequest Random(int64_t m, v1::DType dtype = v1::DTYPE_BF16,
                            v1::DType ids = v1::DTYPE_INT32, int layer = 1) {
    return RandomRequest(rng_, layer, m, model().hidden, model().num_experts, model().topk, dtype,
                         ids);
  }

  // The reference engine's answer to `request` (its tensors carrying data), as floats.
  static std::vector<float> Expected(const v1::ForwardRequest& request) {
    return ReferenceForward(*reference_, request);
  }

  // A request whose three tensors live in region `name` (starting at byte `object_base` of
  // `shm`) from region byte `base` on (hidden, ids, weights one after another, 64-byte aligned),
  // answering into `out_name` at `out_offset`. `expected` gets the reference's answer. Returns
  // the bytes the inputs take.
  int64_t PlaceInRegion(v1::ForwardRequest* r, const ShmObject& shm, const std::string& name,
                        int64_t base, const std::string& out_name, int64_t out_offset,
                        std::vector<float>* expected, int64_t object_base = 0) {
    *expected = Expected(*r);
    int64_t at = base;
    for (v1::Tensor* t :
         {r->mutable_hidden_states(), r->mutable_topk_ids(), r->mutable_topk_weights()}) {
      const int64_t n = static_cast<int64_t>(t->data().size());
      MoveToRegion(t, shm, name, at, object_base);
      at += (n + 63) / 64 * 64;
    }
    const int64_t m = r->hidden_states().shape(0);
    const int64_t itemsize = r->hidden_states().dtype() == v1::DTYPE_FP32 ? 4 : 2;
    SetRegion(r->mutable_output_region(), out_name, out_offset, m * model().hidden * itemsize);
    return at - base;
  }

  // `request` fails with `code` and a message containing every `parts`; the server serves on.
  void ExpectRejected(const v1::ForwardRequest& request, grpc::StatusCode code,
                      const std::vector<std::string>& parts) {
    v1::ForwardResponse resp;
    const grpc::Status s = Call(request, &resp);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    for (const std::string& p : parts) EXPECT_THAT(s.error_message(), HasSubstr(p));
    EXPECT_FALSE(resp.has_output());
    ExpectStillServing();
  }

  void ExpectStillServing() {
    v1::ForwardRequest r = Random(3);
    v1::ForwardResponse resp;
    const grpc::Status s = Call(r, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_LT(RelativeL2(DecodeFloats(resp.output().data(), v1::DTYPE_BF16), Expected(r)), 1e-2);
  }

  static Engine* engine_;
  static Engine* reference_;
  static MoeServer* server_;
  static MoeServer* disabled_server_;
  std::unique_ptr<v1::MoeService::Stub> stub_ = StubFor(*server_);
  std::mt19937_64 rng_{std::random_device{}()};
};

Engine* SharedMemoryTest::engine_ = nullptr;
Engine* SharedMemoryTest::reference_ = nullptr;
MoeServer* SharedMemoryTest::server_ = nullptr;
MoeServer* SharedMemoryTest::disabled_server_ = nullptr;

// ---- correctness ----

struct DTypeCase {
  v1::DType dtype;
  v1::DType ids;
  double tolerance;  // relative L2 against the reference engine
};

TEST_F(SharedMemoryTest, RegionInRegionOutMatchesReference) {
  ShmObject in(1 << 20), out(1 << 20);
  ASSERT_TRUE(in.ok() && out.ok());
  // The inputs' region starts 4096 + 24 bytes into its object: offsets are the region's.
  ASSERT_TRUE(RegisterSystem("in", in.key(), 4096 + 24, (1 << 20) - 8192).ok());
  ASSERT_TRUE(RegisterSystem("out", out.key(), 0, 1 << 20).ok());
  for (const DTypeCase& c : {DTypeCase{v1::DTYPE_BF16, v1::DTYPE_INT32, 1e-2},
                             DTypeCase{v1::DTYPE_FP16, v1::DTYPE_INT64, 1e-2},
                             DTypeCase{v1::DTYPE_FP32, v1::DTYPE_INT32, 1e-5},
                             DTypeCase{v1::DTYPE_FP32, v1::DTYPE_INT64, 1e-5}}) {
    for (int64_t m : {1, 7, 33}) {
      v1::ForwardRequest r = Random(m, c.dtype, c.ids, /*layer=*/static_cast<int>(m % 2));
      r.set_request_id("shm-" + std::to_string(m));
      std::vector<float> want;
      PlaceInRegion(&r, in, "in", 640, "out", 128 * m, &want, /*object_base=*/4096 + 24);
      // Stale bytes where the answer goes: the server must overwrite all of them.
      std::memset(out.data(), 0x7f, out.size());
      v1::ForwardResponse resp;
      const grpc::Status s = Call(r, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(resp.request_id(), "shm-" + std::to_string(m));
      // The reply names dtype and shape; the bytes are in the output region.
      EXPECT_EQ(resp.output().dtype(), c.dtype);
      EXPECT_THAT(resp.output().shape(), ::testing::ElementsAre(m, model().hidden));
      EXPECT_TRUE(resp.output().data().empty());
      const int64_t bytes = r.output_region().byte_size();
      const std::vector<float> got = DecodeFloats(
          std::string(reinterpret_cast<const char*>(out.data()) + 128 * m, bytes), c.dtype);
      double norm = 0;
      for (float v : want) norm += v * v;
      ASSERT_GT(norm, 0) << "reference output is all zeros";
      EXPECT_LT(RelativeL2(got, want), c.tolerance) << v1::DType_Name(c.dtype) << " M=" << m;
      // Bytes around the answer untouched.
      EXPECT_EQ(out.data()[128 * m - 1], std::byte{0x7f});
      EXPECT_EQ(out.data()[128 * m + bytes], std::byte{0x7f});
    }
  }
  v1::SharedMemoryStatusResponse status;
  ASSERT_TRUE(Status("", &status).ok());
  ASSERT_EQ(status.regions_size(), 2);
  EXPECT_EQ(status.regions(0).name(), "in");
  EXPECT_EQ(status.regions(0).kind(), "system");
  EXPECT_EQ(status.regions(0).key(), in.key());
  EXPECT_EQ(status.regions(0).offset(), 4096 + 24);
  EXPECT_EQ(status.regions(0).byte_size(), (1 << 20) - 8192);
  EXPECT_EQ(status.regions(0).calls_in_flight(), 0);
}

// Regions and inline bytes mix per tensor: hidden states by region, routing inline, the answer
// inline; and the reverse.
TEST_F(SharedMemoryTest, RegionsAndInlineTensorsMix) {
  ShmObject shm(1 << 16);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem("x", shm.key(), 0, 1 << 16).ok());
  {
    v1::ForwardRequest r = Random(5);
    const std::vector<float> want = Expected(r);
    MoveToRegion(r.mutable_hidden_states(), shm, "x", 0);
    v1::ForwardResponse resp;
    ASSERT_TRUE(Call(r, &resp).ok());
    EXPECT_LT(RelativeL2(DecodeFloats(resp.output().data(), v1::DTYPE_BF16), want), 1e-2);
  }
  {
    v1::ForwardRequest r = Random(4, v1::DTYPE_FP32, v1::DTYPE_INT64);
    const std::vector<float> want = Expected(r);
    MoveToRegion(r.mutable_topk_ids(), shm, "x", 8);  // 8-byte aligned int64
    MoveToRegion(r.mutable_topk_weights(), shm, "x", 1000);
    SetRegion(r.mutable_output_region(), "x", 4096, 4 * model().hidden * 4);
    v1::ForwardResponse resp;
    ASSERT_TRUE(Call(r, &resp).ok());
    EXPECT_TRUE(resp.output().data().empty());
    const std::vector<float> got = DecodeFloats(
        std::string(reinterpret_cast<const char*>(shm.data()) + 4096, 4 * model().hidden * 4),
        v1::DTYPE_FP32);
    EXPECT_LT(RelativeL2(got, want), 1e-5);
  }
}

// Offsets that are not a multiple of the item size are served (copied once), not refused.
TEST_F(SharedMemoryTest, MisalignedOffsetsAreServed) {
  ShmObject shm(1 << 16);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem("x", shm.key(), 1, (1 << 16) - 1).ok());
  v1::ForwardRequest r = Random(6, v1::DTYPE_FP32);
  std::vector<float> want;
  // Region byte 2 is object byte 3: no FP32 tensor here is 4-byte aligned.
  PlaceInRegion(&r, shm, "x", 2, "x", 20001, &want, /*object_base=*/1);
  v1::ForwardResponse resp;
  ASSERT_TRUE(Call(r, &resp).ok());
  const std::vector<float> got = DecodeFloats(
      std::string(reinterpret_cast<const char*>(shm.data()) + 1 + 20001, 6 * model().hidden * 4),
      v1::DTYPE_FP32);
  EXPECT_LT(RelativeL2(got, want), 1e-5);
}

// Concurrent callers, each with its own output slice of one region, share engine steps.
TEST_F(SharedMemoryTest, ConcurrentCallersEachGetTheirAnswer) {
  constexpr int kCallers = 6;
  constexpr int64_t kSlot = 1 << 16;
  ShmObject shm(kCallers * 2 * kSlot);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem("x", shm.key(), 0, kCallers * 2 * kSlot).ok());
  std::vector<v1::ForwardRequest> requests(kCallers);
  std::vector<std::vector<float>> want(kCallers);
  for (int i = 0; i < kCallers; ++i) {
    requests[i] = Random(2 + i);
    PlaceInRegion(&requests[i], shm, "x", 2 * i * kSlot, "x", (2 * i + 1) * kSlot, &want[i]);
  }
  std::vector<std::thread> threads;
  std::vector<grpc::Status> statuses(kCallers);
  for (int round = 0; round < 5; ++round) {
    threads.clear();
    for (int i = 0; i < kCallers; ++i) {
      threads.emplace_back([&, i] {
        v1::ForwardResponse resp;
        statuses[i] = Call(requests[i], &resp);
      });
    }
    for (auto& t : threads) t.join();
    for (int i = 0; i < kCallers; ++i) {
      ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
      const std::vector<float> got =
          DecodeFloats(std::string(reinterpret_cast<const char*>(shm.data()) + (2 * i + 1) * kSlot,
                                   requests[i].output_region().byte_size()),
                       v1::DTYPE_BF16);
      EXPECT_LT(RelativeL2(got, want[i]), 1e-2) << "caller " << i;
    }
  }
}

// ---- refusals ----

TEST_F(SharedMemoryTest, RegisterRefusals) {
  ShmObject shm(8192);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem("a", shm.key(), 0, 8192).ok());
  // Duplicate name.
  grpc::Status s = RegisterSystem("a", shm.key(), 0, 16);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(s.error_message(), HasSubstr("'a' is already registered"));
  // A key that does not exist.
  s = RegisterSystem("b", "/moeserve_no_such_object_for_test", 0, 16);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("/moeserve_no_such_object_for_test"));
  // A range larger than the object (fstat).
  s = RegisterSystem("b", shm.key(), 4096, 4097);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("exceeds the 8192 bytes of shared-memory object"));
  // Malformed key, empty name, non-positive size.
  EXPECT_EQ(RegisterSystem("b", "../etc/passwd", 0, 16).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(RegisterSystem("", shm.key(), 0, 16).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(RegisterSystem("b", shm.key(), 0, 0).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Unknown names for Unregister and Status.
  EXPECT_EQ(Unregister("zzz").error_code(), grpc::StatusCode::NOT_FOUND);
  v1::SharedMemoryStatusResponse status;
  EXPECT_EQ(Status("zzz", &status).error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(Status("", &status).ok());
  EXPECT_EQ(status.regions_size(), 1);
}

TEST_F(SharedMemoryTest, CudaRegionRefusals) {
  v1::RegisterCudaSharedMemoryRequest req;
  req.set_name("g");
  req.set_device_id(0);
  req.set_byte_size(1 << 20);
  v1::RegisterSharedMemoryResponse resp;
  // A handle of the wrong length.
  req.set_raw_handle(std::string(60, '\x01'));
  {
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->RegisterCudaSharedMemory(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("raw_handle: got 60 bytes, expected a 64-byte"));
  }
  // A well-formed handle on the CPU backend.
  req.set_raw_handle(std::string(64, '\x01'));
  {
    grpc::ClientContext ctx;
    const grpc::Status s = stub_->RegisterCudaSharedMemory(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("CUDA shared-memory regions need"));
  }
  v1::SharedMemoryStatusResponse status;
  ASSERT_TRUE(Status("", &status).ok());
  EXPECT_EQ(status.regions_size(), 0);
}

TEST_F(SharedMemoryTest, ForwardRefusals) {
  ShmObject shm(1 << 16), small(4096);
  ASSERT_TRUE(shm.ok() && small.ok());
  ASSERT_TRUE(RegisterSystem("x", shm.key(), 0, 1 << 16).ok());
  ASSERT_TRUE(RegisterSystem("small", small.key(), 0, 4096).ok());
  std::vector<float> want;
  const auto base = [&] {
    v1::ForwardRequest r = Random(4);
    PlaceInRegion(&r, shm, "x", 0, "x", 32768, &want);
    return r;
  };
  {  // Sanity: the base request is served.
    v1::ForwardResponse resp;
    ASSERT_TRUE(Call(base(), &resp).ok());
  }
  {  // Unknown region name.
    v1::ForwardRequest r = base();
    r.mutable_hidden_states()->mutable_region()->set_name("nope");
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT,
                   {"hidden_states.region", "no shared-memory region named 'nope'"});
  }
  {  // Range outside the registered region (offset, then size past the end, then negative).
    v1::ForwardRequest r = base();
    r.mutable_topk_weights()->mutable_region()->set_offset((1 << 16) - 8);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT,
                   {"topk_weights.region in region 'x'", "outside the region's registered 65536"});
    r = base();
    SetRegion(r.mutable_hidden_states()->mutable_region(), "small", 0, 4 * model().hidden * 2);
    r.mutable_hidden_states()->mutable_region()->set_offset(4096 - 512);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, {"hidden_states.region in region"});
    r = base();
    r.mutable_topk_ids()->mutable_region()->set_offset(-4);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, {"topk_ids.region", "must be >= 0"});
  }
  {  // byte_size not matching shape x dtype.
    v1::ForwardRequest r = base();
    r.mutable_hidden_states()->mutable_region()->set_byte_size(4 * model().hidden * 2 - 2);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT,
                   {"hidden_states.region: byte_size 1022 does not match the tensor: shape "
                    "[4, 128] x 2 bytes of bf16 = 1024"});
    r = base();
    r.mutable_output_region()->set_byte_size(4 * model().hidden * 4);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT,
                   {"output_region: byte_size 2048 does not match"});
  }
  {  // data and region both set.
    v1::ForwardRequest r = base();
    r.mutable_topk_ids()->set_data(std::string(4 * 3 * 4, '\0'));
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT,
                   {"topk_ids: both data (48 bytes) and region are set"});
  }
  {  // The output overlapping an input: refused, the inputs untouched.
    v1::ForwardRequest r = base();
    // Bytes [16, 16 + 1024) past the ids' start: clear of hidden_states, over topk_ids.
    r.mutable_output_region()->set_offset(r.topk_ids().region().offset() + 16);
    std::vector<std::byte> before(shm.data(), shm.data() + 32768);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT,
                   {"output_region", "overlap topk_ids", "needs bytes of its own"});
    EXPECT_EQ(std::memcmp(before.data(), shm.data(), before.size()), 0);
  }
  {  // Model checks still apply to region tensors (and let the region go).
    v1::ForwardRequest r = base();
    r.set_layer(99);
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, {"layer"});
  }
  {  // Expert ids out of range, read from the region.
    v1::ForwardRequest r = base();
    *shm.at<int32_t>(r.topk_ids().region().offset() + 4) = 1000;
    ExpectRejected(r, grpc::StatusCode::INVALID_ARGUMENT, {"topk_ids: value 1000"});
  }
  v1::SharedMemoryStatusResponse status;
  ASSERT_TRUE(Status("", &status).ok());
  for (const auto& region : status.regions()) EXPECT_EQ(region.calls_in_flight(), 0);
}

TEST_F(SharedMemoryTest, DisabledServerRefusesEverythingNamingTheFlag) {
  ShmObject shm(8192);
  ASSERT_TRUE(shm.ok());
  auto stub = StubFor(*disabled_server_);
  grpc::Status s = RegisterSystem("a", shm.key(), 0, 8192, stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("--enable_shared_memory"));
  s = Unregister("a", stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  v1::SharedMemoryStatusResponse status;
  s = Status("", &status, stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  {
    v1::RegisterCudaSharedMemoryRequest req;
    req.set_name("g");
    req.set_raw_handle(std::string(64, '\0'));
    req.set_byte_size(16);
    v1::RegisterSharedMemoryResponse resp;
    grpc::ClientContext ctx;
    s = stub->RegisterCudaSharedMemory(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("--enable_shared_memory"));
  }
  // A Forward naming a region, and one naming only an output region.
  v1::ForwardRequest r = Random(2);
  v1::ForwardRequest out_only = r;
  MoveToRegion(r.mutable_hidden_states(), shm, "a", 0);
  v1::ForwardResponse resp;
  s = Call(r, &resp, stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("hidden_states.region"));
  EXPECT_THAT(s.error_message(), HasSubstr("--enable_shared_memory"));
  SetRegion(out_only.mutable_output_region(), "a", 0, 2 * model().hidden * 2);
  s = Call(out_only, &resp, stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("output_region"));
  // Plain calls are served.
  ASSERT_TRUE(Call(Random(2), &resp, stub.get()).ok());
}

TEST(IsSameHostPeer, LoopbackAndUnixOnly) {
  for (const char* peer : {"unix:/run/moeserve.sock", "unix:", "unix-abstract:x",
                           "ipv4:127.0.0.1:50051", "ipv4:127.1.2.3:1", "ipv6:[::1]:50051",
                           "ipv6:%5B::1%5D:50051", "ipv6:[::ffff:127.0.0.1]:80"}) {
    EXPECT_TRUE(IsSameHostPeer(peer)) << peer;
  }
  for (const char* peer : {"ipv4:10.0.0.5:50051", "ipv4:128.0.0.1:1", "ipv6:[2001:db8::1]:5",
                           "ipv6:[::2]:1", "ipv6:%5B::ffff:10.0.0.1%5D:1", "", "127.0.0.1:5"}) {
    EXPECT_FALSE(IsSameHostPeer(peer)) << peer;
  }
}

// A region a queued call holds cannot be unregistered (FAILED_PRECONDITION, nothing removed); once
// the call is answered it can. The call waits in the batcher (max_batch_delay) long enough for the
// check; the test waits on the server's own count, not on time.
TEST_F(SharedMemoryTest, UnregisterWhileACallUsesTheRegionIsRefused) {
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
  ASSERT_TRUE(RegisterSystem("busy", shm.key(), 0, 1 << 16, stub.get()).ok());
  v1::ForwardRequest r = Random(4);
  std::vector<float> want;
  PlaceInRegion(&r, shm, "busy", 0, "busy", 32768, &want);
  auto call = std::async(std::launch::async, [&] {
    v1::ForwardResponse resp;
    return Call(r, &resp, stub.get());
  });
  // Wait until the server holds the region for the call.
  int64_t in_flight = 0;
  for (int i = 0; i < 2000 && in_flight == 0; ++i) {
    v1::SharedMemoryStatusResponse status;
    ASSERT_TRUE(Status("busy", &status, stub.get()).ok());
    in_flight = status.regions(0).calls_in_flight();
    if (in_flight == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(in_flight, 1);
  grpc::Status s = Unregister("busy", stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("'busy' (1 calls in flight)"));
  s = Unregister("", stub.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // The call completes correctly, and then the region goes.
  ASSERT_TRUE(call.get().ok());
  const std::vector<float> got = DecodeFloats(
      std::string(reinterpret_cast<const char*>(shm.data()) + 32768, 4 * model().hidden * 2),
      v1::DTYPE_BF16);
  EXPECT_LT(RelativeL2(got, want), 1e-2);
  s = Unregister("busy", stub.get());
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A client that shrinks its object below a registered region: the next call naming the region
// is refused (FAILED_PRECONDITION) instead of the server touching the mapping past the
// object's end (SIGBUS); the server serves on.
TEST_F(SharedMemoryTest, ARegionWhoseObjectShrankIsRefused) {
  ShmObject shm(1 << 16);
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(RegisterSystem("shrunk", shm.key(), 0, 1 << 16).ok());
  v1::ForwardRequest r = Random(4);
  std::vector<float> want;
  PlaceInRegion(&r, shm, "shrunk", 32768, "shrunk", 0, &want);
  v1::ForwardResponse resp;
  ASSERT_TRUE(Call(r, &resp).ok());  // intact: served
  ASSERT_TRUE(shm.Truncate(4096));
  ExpectRejected(r, grpc::StatusCode::FAILED_PRECONDITION,
                 {"shared-memory object " + shm.key() + " shrank to 4096 bytes",
                  "below the registered range [0, 65536)"});
  EXPECT_TRUE(Unregister("shrunk").ok());
}

// return_routing with the routing in a region: the echo is read from the region before the
// call lets it go, so an Unregister that succeeds the moment the call releases it never races
// the echo (it once read the weights after the release: a use after unmap). Each round spins
// Unregister while the call runs; every call answers with exactly the routing it sent.
TEST_F(SharedMemoryTest, ReturnRoutingFromARegionUnregisteredAtTheAnswer) {
  ShmObject shm(1 << 16);
  ASSERT_TRUE(shm.ok());
  for (int round = 0; round < 100; ++round) {
    ASSERT_TRUE(RegisterSystem("echo", shm.key(), 0, 1 << 16).ok());
    v1::ForwardRequest r = Random(4);
    const std::string ids = r.topk_ids().data();
    const std::string weights = r.topk_weights().data();
    MoveToRegion(r.mutable_topk_ids(), shm, "echo", 0);
    MoveToRegion(r.mutable_topk_weights(), shm, "echo", 4096);
    r.set_return_routing(true);
    v1::ForwardResponse resp;
    auto call = std::async(std::launch::async, [&] { return Call(r, &resp); });
    grpc::Status unregistered;
    do {
      unregistered = Unregister("echo");
    } while (unregistered.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    ASSERT_TRUE(unregistered.ok()) << unregistered.error_message();
    const grpc::Status s = call.get();
    if (!s.ok()) {
      // Unregistered before the call resolved its regions: refused as an unknown region.
      ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      continue;
    }
    ASSERT_EQ(resp.topk_ids().data(), ids) << "round " << round;
    ASSERT_EQ(resp.topk_weights().data(), weights) << "round " << round;
  }
}

}  // namespace
}  // namespace moeserve
