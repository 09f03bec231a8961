// Integer gRPC channel arguments given as text, shared by the server's and moeserve-cli's
// --grpc_channel_args (transport tuning without a rebuild, e.g. grpc.http2.max_frame_size).
#ifndef MOESERVE_PROTO_MOESERVE_V1_CHANNEL_ARGS_H_
#define MOESERVE_PROTO_MOESERVE_V1_CHANNEL_ARGS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moeserve::v1wire {

// "grpc.NAME=INTEGER[,grpc.NAME=INTEGER...]" (empty: none) -> (name, value) pairs in order;
// INVALID_ARGUMENT naming the first entry that is not of that form.
absl::StatusOr<std::vector<std::pair<std::string, int>>> ParseChannelArgs(absl::string_view spec);

}  // namespace moeserve::v1wire

#endif  // MOESERVE_PROTO_MOESERVE_V1_CHANNEL_ARGS_H_
