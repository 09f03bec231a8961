#include "server/serving_state.h"

#include <functional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moeserve {

ServingState::ServingState(Metrics* metrics, int num_worker_threads, int64_t max_message_bytes,
                           std::shared_ptr<const BearerTokens> auth,
                           std::function<std::string()> describe_startup)
    : metrics_(metrics),
      max_message_bytes_(max_message_bytes),
      auth_(std::move(auth)),
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

absl::Status ServingState::Authorize(const grpc::ServerContextBase& context,
                                     absl::string_view method) const {
  if (auth_ == nullptr) return absl::OkStatus();
  return auth_->Check(context.client_metadata(), method);
}

absl::Status ServingState::NotReady(absl::string_view method) const {
  const std::string what = describe_startup_ ? describe_startup_() : "starting";
  return absl::UnavailableError(absl::StrCat(
      method, ": moeserve is not ready yet (", what,
      "); retry once the health service reports SERVING (grpc.health.v1, ServerReady)"));
}

void ServingState::SubmitForward(absl::string_view method, const ForwardInput& input,
                                 int64_t message_bytes, absl::Time deadline,
                                 std::function<bool()> cancelled, ForwardDone done,
                                 std::optional<TensorView> region_output, CallSource source) {
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
  TensorView output;
  if (region_output.has_value()) {
    answer->bytes = 0;
    output = *region_output;
  } else {
    answer->output = PooledBuffer::Acquire(answer->bytes);  // recycled: no page faults per call
    // A page-locked answer buffer is written by DMA (a GPU engine), without staging.
    output = TensorView(answer->output->data(), answer->dtype, answer->shape,
                        answer->output->pinned() ? Device::PinnedHost() : Device::Host());
  }
  // Counted here, before the batcher, so its thread only adds them up (ids in a CUDA region
  // are not read on the host: those calls count toward the layer only).
  std::vector<int64_t> rank_tokens;
  if (metrics_ != nullptr && input.topk_ids.device().is_host()) {
    rank_tokens = metrics_->RankTokens(input.topk_ids);
  }
  const int layer = input.layer;
  batcher_->Submit(
      input, output, deadline, std::move(cancelled),
      [this, answer, layer, m, rank_tokens = std::move(rank_tokens), done = std::move(done)](
          const absl::Status& status, const ForwardTimings& timings) {
        if (!status.ok()) return done(status, ForwardAnswer());
        if (metrics_ != nullptr) metrics_->RecordRouting(layer, m, rank_tokens);
        answer->timings = timings;
        done(absl::OkStatus(), std::move(*answer));
      },
      source);
}

absl::Status RouteOnServer(Engine& engine, ForwardInput* input,
                           std::unique_ptr<PooledBuffer>* routing) {
  const EngineInfo& info = engine.info();
  const TensorView& x = input->hidden_states;
  if (!x.device().is_host()) {
    return absl::InvalidArgumentError(
        "hidden_states: server-side routing reads host memory, but hidden_states is in a CUDA "
        "region; send topk_ids and topk_weights, or the hidden states in a system region");
  }
  // Sized only for a hidden_states that Route will accept; anything else is refused there
  // (before the routing buffers are touched).
  const int64_t rows =
      x.rank() == 2 && x.dim(1) == info.model.hidden && x.dim(0) <= info.max_tokens_per_request
          ? x.dim(0)
          : 0;
  const int64_t routes = rows * info.model.topk;
  *routing = PooledBuffer::Acquire(static_cast<size_t>(routes) * 8);
  char* base = static_cast<char*>((*routing)->data());
  input->topk_ids = TensorView(base, DType::kINT32, {rows, info.model.topk});
  input->topk_weights = TensorView(base + routes * 4, DType::kFP32, {rows, info.model.topk});
  return engine.Route(input->layer, x, input->topk_ids, input->topk_weights);
}

uint64_t CallerKey(absl::string_view peer, absl::string_view within) {
  const uint64_t key = std::hash<std::string>()(absl::StrCat(peer, "/", within));
  return key == 0 ? 1 : key;
}

absl::Time CallDeadline(std::chrono::system_clock::time_point deadline) {
  if (deadline >= std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

}  // namespace moeserve
