#include "inference/infer_wire.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moeserve::inference_wire {

namespace {

constexpr uint32_t kRawInputContents = 7;   // ModelInferRequest.raw_input_contents
constexpr uint32_t kRawOutputContents = 6;  // ModelInferResponse.raw_output_contents

template <typename View>
absl::StatusOr<View> Decode(v1wire::SplitMessage split, absl::string_view message) {
  View view;
  if (!view.header.ParseFromString(split.rest)) {
    return absl::InvalidArgumentError(absl::StrCat("malformed ", message,
                                                   ": a field could not be parsed (bad UTF-8 in a "
                                                   "name, a truncated or mistyped field)"));
  }
  view.raw = std::move(split.occurrences);
  view.slices = std::move(split.slices);
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
  // Everything but raw_input_contents (names, shapes, parameters) before protobuf parses it: a
  // small message of packed dims would otherwise expand eightfold into int64 shapes.
  absl::StatusOr<v1wire::SplitMessage> split =
      v1wire::SplitBytesField(buffer, kRawInputContents, "inference.ModelInferRequest");
  if (!split.ok()) return split.status();
  if (split->rest.size() > kMaxModelInferHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("inference.ModelInferRequest: ", split->rest.size(),
                     " bytes besides raw_input_contents, more than ", kMaxModelInferHeaderBytes,
                     " (names, shapes and parameters); tensor bytes go in raw_input_contents"));
  }
  return Decode<ModelInferRequestView>(*std::move(split), "inference.ModelInferRequest");
}

absl::StatusOr<ModelInferResponseView> DecodeModelInferResponse(const grpc::ByteBuffer& buffer) {
  absl::StatusOr<v1wire::SplitMessage> split =
      v1wire::SplitBytesField(buffer, kRawOutputContents, "inference.ModelInferResponse");
  if (!split.ok()) return split.status();
  return Decode<ModelInferResponseView>(*std::move(split), "inference.ModelInferResponse");
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
