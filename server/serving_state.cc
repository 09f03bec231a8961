#include "server/serving_state.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace moeserve {

ServingState::ServingState(Metrics* metrics, int num_worker_threads, int64_t max_message_bytes,
                           std::function<std::string()> describe_startup)
    : metrics_(metrics),
      max_message_bytes_(max_message_bytes),
      describe_startup_(std::move(describe_startup)),
      workers_(num_worker_threads) {}

ServingState::~ServingState() {
  workers_.Drain();
  batcher_.reset();
}

void ServingState::Attach(Engine* engine, std::unique_ptr<ForwardBatcher> batcher) {
  engine_ = engine;
  batcher_ = std::move(batcher);
  ready_.store(true, std::memory_order_release);
}

absl::Status ServingState::NotReady(absl::string_view method) const {
  const std::string what = describe_startup_ ? describe_startup_() : "starting";
  return absl::UnavailableError(absl::StrCat(
      method, ": moeserve is not ready yet (", what,
      "); retry once the health service reports SERVING (grpc.health.v1, ServerReady)"));
}

void ServingState::SubmitForward(absl::string_view method, const ForwardInput& input,
                                 int64_t message_bytes, absl::Time deadline,
                                 std::function<bool()> cancelled, ForwardDone done) {
  Engine* engine = this->engine();
  if (engine == nullptr) return done(NotReady(method), ForwardAnswer());
  // Shapes before sizing the output (it comes from hidden_states); the batcher checks values.
  // A request over the token limit is refused here, naming hidden_states' M.
  const EngineInfo& info = engine->info();
  if (absl::Status s = ValidateForwardShapes(info.model, info.max_tokens_per_request, input);
      !s.ok()) {
    return done(s, ForwardAnswer());
  }
  if (message_bytes > max_message_bytes_) {
    return done(absl::ResourceExhaustedError(absl::StrCat(
                    method, ": the request is ", message_bytes,
                    " bytes, over the server's max_message_bytes of ", max_message_bytes_,
                    " (enough for max_tokens_per_request=", info.max_tokens_per_request,
                    " tokens of hidden ", info.model.hidden, " in fp32); drop extra fields")),
                ForwardAnswer());
  }
  auto answer = std::make_shared<ForwardAnswer>();
  const int64_t m = input.hidden_states.dim(0);
  answer->dtype = input.hidden_states.dtype();
  answer->shape = {m, info.model.hidden};
  answer->bytes = static_cast<size_t>(NumElements(answer->shape)) * DTypeSize(answer->dtype);
  answer->output = PooledBuffer::Acquire(answer->bytes);  // recycled: no page faults per call
  const TensorView output(answer->output->data(), answer->dtype, answer->shape);
  // Counted here, on a worker, so the batcher's thread only adds them up.
  std::vector<int64_t> rank_tokens;
  if (metrics_ != nullptr) rank_tokens = metrics_->RankTokens(input.topk_ids);
  const int layer = input.layer;
  batcher_->Submit(
      input, output, deadline, std::move(cancelled),
      [this, answer, layer, m, rank_tokens = std::move(rank_tokens), done = std::move(done)](
          const absl::Status& status, const ForwardTimings& timings) {
        if (!status.ok()) return done(status, ForwardAnswer());
        if (metrics_ != nullptr) metrics_->RecordRouting(layer, m, rank_tokens);
        answer->timings = timings;
        done(absl::OkStatus(), std::move(*answer));
      });
}

absl::Time CallDeadline(std::chrono::system_clock::time_point deadline) {
  if (deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

}  // namespace moeserve
