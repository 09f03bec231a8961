// The gRPC message-size limit and the per-request token limit, made to agree before the server
// binds: the largest valid request must fit in a message, so the limit is derived from the
// model's hidden size and the token limit (or the token limit lowered to fit a given limit).
#ifndef MOESERVE_SERVER_LIMITS_H_
#define MOESERVE_SERVER_LIMITS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/model_config.h"

namespace moeserve {

// Headroom for everything in a message but tensor bytes (field tags, dtypes, shapes, names,
// ids, timings, KServe metadata and parameters).
// 4 KiB: small enough that a 64 KiB --max_message_bytes (tests that force StreamExpertWeights)
// still carries tokens.
inline constexpr int64_t kMessageOverheadBytes = 4 << 10;
// gRPC's hard ceiling on one message (an int).
inline constexpr int64_t kGrpcMaxMessageBytes = (int64_t{1} << 31) - 1;

// Bytes of the largest valid Forward (or ModelInfer) request of `tokens` tokens: FP32 hidden
// states, INT64 ids, FP32 weights, plus kMessageOverheadBytes. Answers are never larger.
int64_t MaxForwardMessageBytes(const ModelConfig& model, int64_t tokens);
// Bytes of the largest Forward answer of `tokens` tokens (FP32 output) plus
// kMessageOverheadBytes. Both saturate at INT64_MAX.
int64_t MaxForwardAnswerBytes(const ModelConfig& model, int64_t tokens);
// Non-empty when --max_queued_bytes (> 0) is below what one valid Forward of `max_tokens` fp32
// tokens holds (request + answer): a line saying so and up to what M calls fit. Such a call is
// refused (RESOURCE_EXHAUSTED naming the flag) on an idle server too.
std::string HeldBytesNote(const ModelConfig& model, int64_t max_tokens, int64_t max_queued_bytes);
// Bytes of one GetExpertWeights answer (BF16 w13 and w2) plus kMessageOverheadBytes.
int64_t ExpertWeightsMessageBytes(const ModelConfig& model);

struct MessageLimits {
  int64_t max_tokens_per_request = 0;  // what the engine is given
  int64_t max_message_bytes = 0;       // the logical limit (reported in ModelInfo)
  // What gRPC is told: above max_message_bytes so that a request a little over the limits
  // reaches the service and is refused naming its field (hidden_states' M) instead of with
  // gRPC's generic "message larger than max"; at most kGrpcMaxMessageBytes.
  int64_t grpc_limit_bytes = 0;
  // Non-empty when the token limit was lowered: one line saying from what, to what and why.
  std::string note;
};

// `requested_max_message_bytes` 0: derived (the largest valid request and the expert weights
// answer). Otherwise it is kept and the token limit lowered, if needed, so the largest valid
// request fits (a given size may be below one expert's weights: GetExpertWeights then refuses
// and points to StreamExpertWeights, which sends them in chunks). INVALID_ARGUMENT (naming the
// flag) for non-positive tokens, a negative size, a size too small for a single token, or (no
// size given) a token limit whose largest request would not fit in gRPC's 2 GiB.
absl::StatusOr<MessageLimits> ResolveMessageLimits(const ModelConfig& model,
                                                   int64_t requested_max_tokens,
                                                   int64_t requested_max_message_bytes);

}  // namespace moeserve

#endif  // MOESERVE_SERVER_LIMITS_H_
