// KServe v2 ModelInfer messages read from and written to gRPC byte buffers without copying the
// tensor bytes (raw_input_contents / raw_output_contents), as moeserve/v1/forward_wire.h does
// for Forward. Every other field is parsed by protobuf.
//
// Thread-safety: the functions are pure; decoded objects are immutable values.
#ifndef MOESERVE_PROTO_INFERENCE_INFER_WIRE_H_
#define MOESERVE_PROTO_INFERENCE_INFER_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "inference/grpc_service.pb.h"
#include "moeserve/v1/forward_wire.h"

namespace moeserve::inference_wire {

// A decoded ModelInferRequest: `header` has every field but raw_input_contents, whose entries
// are `raw` (in order), pointing into `slices`. Move-only (see v1wire::ForwardRequestView).
struct ModelInferRequestView {
  ModelInferRequestView() = default;
  ModelInferRequestView(ModelInferRequestView&&) = default;
  ModelInferRequestView& operator=(ModelInferRequestView&&) = default;

  inference::ModelInferRequest header;
  std::vector<v1wire::WireBytes> raw;
  std::vector<grpc::Slice> slices;
};

// Most bytes a ModelInferRequest may hold besides raw_input_contents (names, shapes, parameters:
// a few hundred bytes in practice).
inline constexpr size_t kMaxModelInferHeaderBytes = size_t{1} << 20;

// INVALID_ARGUMENT describing what protobuf's parser would reject, or a header (everything but
// raw_input_contents) over kMaxModelInferHeaderBytes.
absl::StatusOr<ModelInferRequestView> DecodeModelInferRequest(const grpc::ByteBuffer& buffer);

// `header` (its raw_output_contents must be empty) followed by one raw_output_contents entry per
// slice (referenced, not copied).
absl::StatusOr<grpc::ByteBuffer> EncodeModelInferResponse(
    const inference::ModelInferResponse& header, const std::vector<grpc::Slice>& raw);

// The same pair for the request (clients, tests) and the response (clients, tests).
absl::StatusOr<grpc::ByteBuffer> EncodeModelInferRequest(const inference::ModelInferRequest& header,
                                                         const std::vector<grpc::Slice>& raw);
struct ModelInferResponseView {
  ModelInferResponseView() = default;
  ModelInferResponseView(ModelInferResponseView&&) = default;
  ModelInferResponseView& operator=(ModelInferResponseView&&) = default;

  inference::ModelInferResponse header;
  std::vector<v1wire::WireBytes> raw;
  std::vector<grpc::Slice> slices;
};
absl::StatusOr<ModelInferResponseView> DecodeModelInferResponse(const grpc::ByteBuffer& buffer);

}  // namespace moeserve::inference_wire

#endif  // MOESERVE_PROTO_INFERENCE_INFER_WIRE_H_
