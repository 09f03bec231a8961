// moeserve.v1 Forward messages read from and written to gRPC byte buffers without copying the
// tensor bytes.
//
// The wire format is exactly moeserve.v1's (any protobuf client interoperates). Decoding walks
// the protobuf encoding across the buffer's slices: every tensor's `data` comes back as pieces
// pointing into those slices (kept alive by the decoded object); every other field is handed to
// protobuf's own parser, so dtype, shape, request_id, timings and unknown fields get protobuf's
// semantics (last-one-wins scalars, merged repeated submessages, packed or unpacked shapes,
// UTF-8 checks). Encoding writes small header slices around data slices the caller provides.
//
// Thread-safety: the functions are pure; decoded objects are immutable values.
#ifndef MOESERVE_PROTO_MOESERVE_V1_FORWARD_WIRE_H_
#define MOESERVE_PROTO_MOESERVE_V1_FORWARD_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "moeserve/v1/moeserve.pb.h"

namespace moeserve::v1wire {

// One Tensor field as decoded: `header` holds dtype and shape (data empty); `data` the pieces
// of the last `data` occurrence, in order, pointing into the decoded object's slices.
struct WireTensor {
  bool present = false;  // the field occurred at least once
  v1::Tensor header;
  std::vector<absl::Span<const uint8_t>> data;
  size_t data_size = 0;  // sum of the pieces' sizes

  // The data as one span if it sits in a single piece (or is empty); else an empty optional-like
  // result: returns false and leaves *out untouched.
  bool SinglePiece(absl::Span<const uint8_t>* out) const;
  // Copies the data to `dst` (data_size bytes).
  void CopyTo(void* dst) const;
};

// A decoded ForwardRequest. `header` has every field except the three tensors; the tensors'
// data point into `slices`, which this object owns: keep it alive while using them. Move-only:
// moving keeps the slices in place, a copy would not (small slices hold their bytes inline).
struct ForwardRequestView {
  ForwardRequestView() = default;
  ForwardRequestView(ForwardRequestView&&) = default;
  ForwardRequestView& operator=(ForwardRequestView&&) = default;

  v1::ForwardRequest header;
  WireTensor hidden_states;
  WireTensor topk_ids;
  WireTensor topk_weights;
  std::vector<grpc::Slice> slices;
};

// A decoded ForwardResponse; as ForwardRequestView.
struct ForwardResponseView {
  ForwardResponseView() = default;
  ForwardResponseView(ForwardResponseView&&) = default;
  ForwardResponseView& operator=(ForwardResponseView&&) = default;

  v1::ForwardResponse header;  // request_id and timings; output left empty
  WireTensor output;
  std::vector<grpc::Slice> slices;
};

// The most shape dims a request tensor may list (the service takes rank 2); DecodeForwardRequest
// refuses more before it stores any.
inline constexpr int64_t kMaxTensorDims = 8;

// Decoders. INVALID_ARGUMENT with a description for anything protobuf's parser would reject
// (truncation, bad varints or tags, lengths past the end, unmatched groups, invalid UTF-8 in a
// string, found here first so that protobuf logs nothing), and for an int32 field (`layer`, a
// tensor's `dtype`) whose varint does not fit int32, which protobuf would silently truncate
// (2^40 would read as 0), and for a request tensor of more than kMaxTensorDims dims. Never
// reads outside the buffer. The buffer's slices are referenced,
// not copied.
absl::StatusOr<ForwardRequestView> DecodeForwardRequest(const grpc::ByteBuffer& buffer);
absl::StatusOr<ForwardResponseView> DecodeForwardResponse(const grpc::ByteBuffer& buffer);
// The same over already dumped slices (taken by value: they are refcounted).
absl::StatusOr<ForwardRequestView> DecodeForwardRequest(std::vector<grpc::Slice> slices);
absl::StatusOr<ForwardResponseView> DecodeForwardResponse(std::vector<grpc::Slice> slices);

// Encoders. `header` supplies every field; the `data` of its tensors must be empty (the bytes
// come from the data slices instead; an empty slice means no data). The result references the
// data slices (refcounted) and copies only the framing. Data slices over 2 GiB - 1 are refused
// (INVALID_ARGUMENT), as protobuf would.
absl::StatusOr<grpc::ByteBuffer> EncodeForwardRequest(const v1::ForwardRequest& header,
                                                      const grpc::Slice& hidden_states_data,
                                                      const grpc::Slice& topk_ids_data,
                                                      const grpc::Slice& topk_weights_data);
absl::StatusOr<grpc::ByteBuffer> EncodeForwardResponse(const v1::ForwardResponse& header,
                                                       const grpc::Slice& output_data);

// Generic pieces for other messages carrying large bytes fields (e.g. the KServe v2
// ModelInferRequest's raw_input_contents).

// One occurrence of a bytes field: pieces pointing into the decoded object's slices.
struct WireBytes {
  std::vector<absl::Span<const uint8_t>> data;
  size_t size = 0;  // sum of the pieces' sizes
  // As WireTensor::SinglePiece / CopyTo.
  bool SinglePiece(absl::Span<const uint8_t>* out) const;
  void CopyTo(void* dst) const;
};

// A message split in two: every occurrence of the top-level LEN field `number`, in order, as
// pieces into `slices` (owned; move-only as ForwardRequestView), and the raw encoding of every
// other top-level field in `rest`, for protobuf to parse into the message's header.
struct SplitMessage {
  SplitMessage() = default;
  SplitMessage(SplitMessage&&) = default;
  SplitMessage& operator=(SplitMessage&&) = default;

  std::vector<WireBytes> occurrences;
  std::string rest;
  std::vector<grpc::Slice> slices;
};
// INVALID_ARGUMENT naming `message` for anything protobuf's parser would reject (the fields in
// `rest` are only checked for framing: parse them to check the rest).
absl::StatusOr<SplitMessage> SplitBytesField(const grpc::ByteBuffer& buffer, uint32_t number,
                                             absl::string_view message);
// `head` (a serialized message without field `number`) followed by one occurrence of LEN field
// `number` per data slice (referenced, not copied). INVALID_ARGUMENT for a slice over 2 GiB - 1.
absl::StatusOr<grpc::ByteBuffer> EncodeWithBytesField(std::string head, uint32_t number,
                                                      const std::vector<grpc::Slice>& data);

// A slice that owns `bytes` (moved, not copied); freed when gRPC drops the last reference.
grpc::Slice SliceFromString(std::string bytes);
// A slice over `size` bytes at `data` that owns `owner` (whatever keeps `data` alive); `owner`
// is destroyed, on any thread, when gRPC drops the last reference.
template <typename T>
grpc::Slice SliceOwning(void* data, size_t size, std::unique_ptr<T> owner) {
  return grpc::Slice(
      data, size, [](void* p) { delete static_cast<T*>(p); }, owner.release());
}

}  // namespace moeserve::v1wire

#endif  // MOESERVE_PROTO_MOESERVE_V1_FORWARD_WIRE_H_
