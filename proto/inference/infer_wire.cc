#include "inference/infer_wire.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moeserve::inference_wire {

namespace {

constexpr uint32_t kRawInputContents = 7;   // ModelInferRequest.raw_input_contents
constexpr uint32_t kRawOutputContents = 6;  // ModelInferResponse.raw_output_contents

template <typename View>
absl::StatusOr<View> Decode(const grpc::ByteBuffer& buffer, uint32_t number,
                            absl::string_view message) {
  absl::StatusOr<v1wire::SplitMessage> split = v1wire::SplitBytesField(buffer, number, message);
  if (!split.ok()) return split.status();
  View view;
  if (!view.header.ParseFromString(split->rest)) {
    return absl::InvalidArgumentError(absl::StrCat("malformed ", message,
                                                   ": a field could not be parsed (bad UTF-8 in a "
                                                   "name, a truncated or mistyped field)"));
  }
  view.raw = std::move(split->occurrences);
  view.slices = std::move(split->slices);
  return view;
}

template <typename Message>
absl::StatusOr<grpc::ByteBuffer> Encode(const Message& header, int raw_size, uint32_t number,
                                        const std::vector<grpc::Slice>& raw,
                                        absl::string_view field) {
  if (raw_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be empty in the header (the bytes come as slices)"));
  }
  return v1wire::EncodeWithBytesField(header.SerializeAsString(), number, raw);
}

}  // namespace

absl::StatusOr<ModelInferRequestView> DecodeModelInferRequest(const grpc::ByteBuffer& buffer) {
  return Decode<ModelInferRequestView>(buffer, kRawInputContents, "inference.ModelInferRequest");
}

absl::StatusOr<ModelInferResponseView> DecodeModelInferResponse(const grpc::ByteBuffer& buffer) {
  return Decode<ModelInferResponseView>(buffer, kRawOutputContents, "inference.ModelInferResponse");
}

absl::StatusOr<grpc::ByteBuffer> EncodeModelInferResponse(
    const inference::ModelInferResponse& header, const std::vector<grpc::Slice>& raw) {
  return Encode(header, header.raw_output_contents_size(), kRawOutputContents, raw,
                "raw_output_contents");
}

absl::StatusOr<grpc::ByteBuffer> EncodeModelInferRequest(const inference::ModelInferRequest& header,
                                                         const std::vector<grpc::Slice>& raw) {
  return Encode(header, header.raw_input_contents_size(), kRawInputContents, raw,
                "raw_input_contents");
}

}  // namespace moeserve::inference_wire
