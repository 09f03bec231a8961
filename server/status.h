// The one mapping from absl::Status (core's errors) to grpc::Status (the wire).
#ifndef MOESERVE_SERVER_STATUS_H_
#define MOESERVE_SERVER_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace moeserve {

// Same code (absl and gRPC share the canonical numbering), same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace moeserve

#endif  // MOESERVE_SERVER_STATUS_H_
