// The client library and moeserve-cli against a fake MoeService that misbehaves on purpose:
// a ForwardStream that stops answering (the stream's deadline must end it), one that breaks
// after a few answers (the CLI counts one error and the rest as not sent), and an
// expert-weights stream that begins with w2 (DATA_LOSS, not an empty w13).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "clients/cpp/moeserve_client.h"
#include "moeserve/v1/moeserve.grpc.pb.h"

namespace moeserve {
namespace {

constexpr int kHidden = 8;

class FakeMoeService final : public v1::MoeService::Service {
 public:
  // kFailAtEnd: answers every call, then ends the stream with an error once the client closes.
  enum class Stream { kSilent, kBreakAfterFive, kFailAtEnd };
  std::atomic<Stream> stream_mode{Stream::kSilent};

  grpc::Status GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                            v1::ModelInfo* info) override {
    info->set_model_name("fake");
    info->set_num_layers(1);
    info->set_num_experts(4);
    info->set_topk(2);
    info->set_hidden(kHidden);
    info->set_intermediate(16);
    info->set_max_tokens_per_request(64);
    info->add_moe_layers(0);
    info->add_accepted_hidden_dtypes(v1::DTYPE_BF16);
    info->add_accepted_topk_ids_dtypes(v1::DTYPE_INT32);
    return grpc::Status::OK;
  }

  grpc::Status ForwardStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::ForwardResponse, v1::ForwardRequest>* stream) override {
    v1::ForwardRequest request;
    int answered = 0;
    while (stream->Read(&request)) {
      if (stream_mode.load() == Stream::kSilent) {
        // Never answers; returns once the client gives up (its deadline cancels the call).
        while (!context->IsCancelled()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client gave up");
      }
      if (answered == 5 && stream_mode.load() == Stream::kBreakAfterFive) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake server gone");
      }
      const int64_t m =
          request.hidden_states().shape_size() > 0 ? request.hidden_states().shape(0) : 0;
      v1::ForwardResponse response;
      response.set_request_id(request.request_id());
      response.mutable_output()->set_dtype(v1::DTYPE_BF16);
      response.mutable_output()->add_shape(m);
      response.mutable_output()->add_shape(kHidden);
      response.mutable_output()->set_data(std::string(static_cast<size_t>(m) * kHidden * 2, '\0'));
      if (!stream->Write(response)) break;
      ++answered;
    }
    if (stream_mode.load() == Stream::kFailAtEnd) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "fake server failed the stream at its end");
    }
    return grpc::Status::OK;
  }

  grpc::Status StreamExpertWeights(grpc::ServerContext*, const v1::StreamExpertWeightsRequest*,
                                   grpc::ServerWriter<v1::ExpertWeightsChunk>* writer) override {
    v1::ExpertWeightsChunk chunk;  // w2 only: no w13 at all
    chunk.set_tensor("w2");
    chunk.set_dtype(v1::DTYPE_BF16);
    chunk.add_shape(kHidden);
    chunk.add_shape(16);
    chunk.set_offset(0);
    chunk.set_data(std::string(kHidden * 16 * 2, '\0'));
    writer->Write(chunk);
    return grpc::Status::OK;
  }
};

class FakeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = absl::StrCat("127.0.0.1:", port);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  // Runs moeserve-cli with `args` against the fake (under coreutils' timeout, so that a hang
  // fails the test instead of stalling it); returns its output and exit code.
  std::pair<std::string, int> Cli(const std::string& args, absl::Duration* took) {
    const std::string command =
        absl::StrCat("timeout 30 ", MOESERVE_CLI_PATH, " ", args, " --target ", target_, " 2>&1");
    const absl::Time start = absl::Now();
    FILE* p = popen(command.c_str(), "r");
    std::string out;
    char buf[4096];
    for (size_t n; p != nullptr && (n = std::fread(buf, 1, sizeof(buf), p)) > 0;)
      out.append(buf, n);
    const int status = p != nullptr ? pclose(p) : -1;
    *took = absl::Now() - start;
    return {out, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
  }

  FakeMoeService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
};

// The library: a stream opened with a deadline ends at it when the server stops answering.
TEST_F(FakeServerTest, StreamDeadlineEndsASilentStream) {
  auto client = client::MoeClient::Create(target_).value();
  auto stream = client->OpenForwardStream(absl::Seconds(1)).value();
  v1::ForwardRequest request;
  request.mutable_hidden_states()->set_dtype(v1::DTYPE_BF16);
  const std::string bytes = request.SerializeAsString();
  grpc::Slice slice(bytes);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(stream->Write(grpc::ByteBuffer(&slice, 1)).ok());
  const absl::StatusOr<client::ForwardResult> answer = stream->Read();
  EXPECT_FALSE(answer.ok());
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// moeserve-cli load --stream against a silent server: done by --max_seconds + --deadline with
// one DEADLINE_EXCEEDED, the calls after it not sent (it once waited forever in Read).
TEST_F(FakeServerTest, CliStreamEndsAtItsDeadline) {
  absl::Duration took;
  const auto [out, rc] = Cli(
      "load --stream --concurrency 1 --requests 3 --tokens 2 --max_seconds 1 --deadline 1s", &took);
  ASSERT_NE(rc, 124) << "moeserve-cli hung:\n" << out;
  EXPECT_LT(took, absl::Seconds(15)) << out;
  EXPECT_NE(out.find("ok=0 errors=1 not_sent=2"), std::string::npos) << out;
  EXPECT_NE(out.find("DEADLINE_EXCEEDED"), std::string::npos) << out;
}

// A stream that breaks after five answers: one error (the server's), the rest not sent (they
// were once each counted as a FAILED_PRECONDITION error and the final status twice, so that
// not_sent went negative).
TEST_F(FakeServerTest, CliCountsABrokenStreamOnce) {
  service_.stream_mode = FakeMoeService::Stream::kBreakAfterFive;
  absl::Duration took;
  const auto [out, rc] =
      Cli("load --stream --concurrency 1 --requests 100 --tokens 2 --max_seconds 20", &took);
  ASSERT_NE(rc, 124) << "moeserve-cli hung:\n" << out;
  EXPECT_NE(out.find("ok=5 errors=1 not_sent=94"), std::string::npos) << out;
  EXPECT_NE(out.find("fake server gone"), std::string::npos) << out;
  EXPECT_EQ(out.find("FAILED_PRECONDITION"), std::string::npos) << out;
}

// A stream that answers every call and then fails at its end: the stream's error is counted,
// but every call was made (not_sent was -1: the error was taken as one of the calls).
TEST_F(FakeServerTest, CliCountsAStreamErrorAfterItsCallsWithoutUsingACall) {
  service_.stream_mode = FakeMoeService::Stream::kFailAtEnd;
  absl::Duration took;
  const auto [out, code] =
      Cli("load --stream --concurrency 1 --requests 7 --tokens 2 --max_seconds 20", &took);
  EXPECT_NE(out.find("ok=7 errors=1 not_sent=0"), std::string::npos) << out;
  EXPECT_NE(code, 0) << out;
}

// An expert-weights stream without w13 is DATA_LOSS, not an answer with an empty w13.
TEST_F(FakeServerTest, ExpertWeightsStreamWithoutW13IsDataLoss) {
  auto client = client::MoeClient::Create(target_).value();
  const auto got = client->StreamExpertWeights(0, 0, 1 << 20);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_NE(got.status().message().find("began with w2"), std::string::npos) << got.status();
}

}  // namespace
}  // namespace moeserve
