#include "server/limits.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checked_math.h"

namespace moeserve {

namespace {

// Bytes of one token's tensors in the widest accepted request.
int64_t TokenBytes(const ModelConfig& model) {
  return model.hidden * 4 + int64_t{model.topk} * (8 + 4);
}

std::string MiB(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

}  // namespace

int64_t MaxForwardMessageBytes(const ModelConfig& model, int64_t tokens) {
  // Saturates: the flags may ask for any token count (a note then prints what it needs).
  const std::optional<int64_t> bytes = CheckedMul(std::max<int64_t>(tokens, 0), TokenBytes(model));
  if (!bytes.has_value() || *bytes > INT64_MAX - kMessageOverheadBytes) return INT64_MAX;
  return *bytes + kMessageOverheadBytes;
}

int64_t MaxForwardAnswerBytes(const ModelConfig& model, int64_t tokens) {
  const std::optional<int64_t> bytes =
      CheckedProduct({std::max<int64_t>(tokens, 0), model.hidden, 4});
  if (!bytes.has_value() || *bytes > INT64_MAX - kMessageOverheadBytes) return INT64_MAX;
  return *bytes + kMessageOverheadBytes;
}

std::string HeldBytesNote(const ModelConfig& model, int64_t max_tokens, int64_t max_queued_bytes) {
  if (max_queued_bytes <= 0 || max_tokens <= 0) return "";
  const auto call_bytes = [&](int64_t tokens) {
    const int64_t request = MaxForwardMessageBytes(model, tokens);
    const int64_t answer = MaxForwardAnswerBytes(model, tokens);
    return request > INT64_MAX - answer ? INT64_MAX : request + answer;
  };
  if (call_bytes(max_tokens) <= max_queued_bytes) return "";
  // The most tokens whose fp32 call fits: each token adds its request and answer bytes to the
  // two messages' overhead (the sizes above, unsaturated below max_tokens).
  const int64_t per_token = TokenBytes(model) + model.hidden * 4;
  const int64_t fits = std::clamp<int64_t>(
      (max_queued_bytes - 2 * kMessageOverheadBytes) / per_token, 0, max_tokens - 1);
  return absl::StrCat("note: --max_queued_bytes=", max_queued_bytes,
                      " is below what one Forward of M=", max_tokens, " fp32 holds (",
                      MiB(call_bytes(max_tokens)),
                      " of request and answer): such calls are refused however idle the server "
                      "is; fp32 calls fit up to M=",
                      fits, " (BF16 about twice that). Raise --max_queued_bytes to serve them");
}

int64_t ExpertWeightsMessageBytes(const ModelConfig& model) {
  return 3 * model.hidden * model.intermediate * 2 + kMessageOverheadBytes;
}

absl::StatusOr<MessageLimits> ResolveMessageLimits(const ModelConfig& model,
                                                   int64_t requested_max_tokens,
                                                   int64_t requested_max_message_bytes) {
  if (requested_max_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_tokens_per_request: got ", requested_max_tokens, ", expected > 0"));
  }
  if (requested_max_message_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes: got ", requested_max_message_bytes,
                     ", expected > 0, or 0 to derive it from the model"));
  }
  MessageLimits limits;
  const int64_t weights_bytes = ExpertWeightsMessageBytes(model);
  int64_t cap = requested_max_message_bytes;
  std::string cap_name = absl::StrCat("--max_message_bytes=", requested_max_message_bytes);
  if (cap == 0) {
    cap = kGrpcMaxMessageBytes;
    cap_name = "gRPC's 2 GiB message limit";
  }
  if (cap > kGrpcMaxMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes: got ", requested_max_message_bytes,
                     ", expected at most ", kGrpcMaxMessageBytes, " (gRPC's limit)"));
  }
  const int64_t fit = (cap - kMessageOverheadBytes) / TokenBytes(model);
  if (fit < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes: ", cap, " bytes cannot carry one token of hidden ",
                     model.hidden, "; expected at least ", MaxForwardMessageBytes(model, 1)));
  }
  if (requested_max_message_bytes == 0 && fit < requested_max_tokens) {
    // No message size was asked for: a token limit beyond what gRPC can carry is a mistake in
    // --max_tokens_per_request itself (its step buffers would not fit either), not something
    // to lower quietly.
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_tokens_per_request: got ", requested_max_tokens, ", but a request of [M, ",
        model.hidden, "] fp32 hidden states must fit in ", cap_name, ": expected at most ", fit,
        " (or give --max_message_bytes to have the token limit lowered to fit it)"));
  }
  limits.max_tokens_per_request = std::min(requested_max_tokens, fit);
  if (limits.max_tokens_per_request < requested_max_tokens) {
    limits.note = absl::StrCat("--max_tokens_per_request lowered from ", requested_max_tokens,
                               " to ", limits.max_tokens_per_request, ": a request of [M, ",
                               model.hidden, "] fp32 hidden states must fit in ", cap_name, " (",
                               MiB(MaxForwardMessageBytes(model, requested_max_tokens)),
                               " needed for M=", requested_max_tokens, ")");
  }
  limits.max_message_bytes =
      requested_max_message_bytes > 0
          ? requested_max_message_bytes
          : std::max(MaxForwardMessageBytes(model, limits.max_tokens_per_request), weights_bytes);
  // Twice the limit (and at least 64 MiB more) before gRPC itself refuses, so an oversized
  // request usually reaches the service and is refused naming the field.
  limits.grpc_limit_bytes =
      std::min(kGrpcMaxMessageBytes,
               std::max(2 * limits.max_message_bytes, limits.max_message_bytes + (64 << 20)));
  return limits;
}

}  // namespace moeserve
