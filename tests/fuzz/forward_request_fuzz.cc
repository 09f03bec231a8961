// libFuzzer target: a Forward request's bytes, as any client could send them, through what the
// server does before the engine runs: forward_wire's decoder (over slices cut where the input
// says), the tensor views (ForwardInputFromWire) and the model checks (ValidateForwardShapes,
// ValidateForwardInput). Besides no crash, no sanitizer report and no leak, it checks:
//  - the decoder agrees with protobuf: what protobuf refuses is refused (the decoder refuses
//    more only for int32 fields that do not fit, which protobuf truncates);
//  - an accepted request re-encodes (EncodeForwardRequest) to bytes that decode to the same
//    fields;
//  - a request the checks accept has consistent sizes (what the server then allocates).
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/engine.h"
#include "core/model_config.h"
#include "moeserve/v1/forward_wire.h"
#include "moeserve/v1/moeserve.pb.h"
#include "server/convert.h"

namespace {

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_forward_request: violated: %s\n", what);
    std::abort();
  }
}

// A small model, so that the fuzzer reaches valid shapes: hidden 4, topk 2 of 4 experts, layers
// 0 and 1.
const moeserve::ModelConfig& Model() {
  static const moeserve::ModelConfig* model = [] {
    auto* m = new moeserve::ModelConfig();
    m->name = "fuzz";
    m->num_layers = 2;
    m->num_experts = 4;
    m->topk = 2;
    m->hidden = 4;
    m->intermediate = 4;
    return m;
  }();
  return *model;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // protobuf (the oracle below) logs a line for every invalid UTF-8 string it parses.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeserve;
  // The first byte picks where the bytes are cut into slices (gRPC hands them over in pieces).
  size_t cut_every = 0;
  if (size > 0) {
    cut_every = data[0] % 17;
    ++data;
    --size;
  }
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  std::vector<grpc::Slice> slices;
  if (cut_every == 0) {
    slices.emplace_back(bytes.data(), bytes.size());
  } else {
    for (size_t at = 0; at < bytes.size(); at += cut_every) {
      slices.emplace_back(bytes.data() + at, std::min(cut_every, bytes.size() - at));
    }
  }
  absl::StatusOr<v1wire::ForwardRequestView> view = v1wire::DecodeForwardRequest(slices);
  v1::ForwardRequest pb;
  const bool pb_ok = pb.ParseFromString(bytes);
  if (!pb_ok) Check(!view.ok(), "the decoder accepts what protobuf refuses");
  if (!view.ok()) {
    Check(view.status().code() == absl::StatusCode::kInvalidArgument, "refusal not INVALID_ARG");
    return 0;
  }
  Check(pb_ok, "protobuf refuses what the decoder accepts");
  Check(view->header.layer() == pb.layer(), "layer differs from protobuf's");
  Check(view->header.request_id() == pb.request_id(), "request_id differs from protobuf's");
  Check(view->header.return_timings() == pb.return_timings() &&
            view->header.return_routing() == pb.return_routing(),
        "a bool field differs from protobuf's");
  Check(view->header.has_output_region() == pb.has_output_region() &&
            view->header.output_region().SerializeAsString() ==
                pb.output_region().SerializeAsString(),
        "output_region differs from protobuf's");
  // Tensor headers (the decoder's own parser for dtype and shape, protobuf's for the rest).
  const v1wire::WireTensor* tensors[] = {&view->hidden_states, &view->topk_ids,
                                         &view->topk_weights};
  const v1::Tensor* pb_tensors[] = {&pb.hidden_states(), &pb.topk_ids(), &pb.topk_weights()};
  const bool pb_has[] = {pb.has_hidden_states(), pb.has_topk_ids(), pb.has_topk_weights()};
  for (int i = 0; i < 3; ++i) {
    Check(tensors[i]->present == pb_has[i], "tensor presence differs from protobuf's");
    Check(tensors[i]->header.dtype() == pb_tensors[i]->dtype(), "dtype differs from protobuf's");
    Check(tensors[i]->header.shape_size() == pb_tensors[i]->shape_size(),
          "shape rank differs from protobuf's");
    for (int d = 0; d < pb_tensors[i]->shape_size(); ++d) {
      Check(tensors[i]->header.shape(d) == pb_tensors[i]->shape(d),
            "shape differs from protobuf's");
    }
    Check(tensors[i]->header.has_region() == pb_tensors[i]->has_region() &&
              tensors[i]->header.region().SerializeAsString() ==
                  pb_tensors[i]->region().SerializeAsString(),
          "tensor region differs from protobuf's");
    Check(tensors[i]->data_size == pb_tensors[i]->data().size(), "data size differs");
  }

  // Round trip through the encoder.
  auto data_of = [](const v1wire::WireTensor& t) {
    std::string d(t.data_size, '\0');
    t.CopyTo(d.data());
    return d;
  };
  v1::ForwardRequest header = view->header;
  if (view->hidden_states.present) *header.mutable_hidden_states() = view->hidden_states.header;
  if (view->topk_ids.present) *header.mutable_topk_ids() = view->topk_ids.header;
  if (view->topk_weights.present) *header.mutable_topk_weights() = view->topk_weights.header;
  absl::StatusOr<grpc::ByteBuffer> encoded =
      v1wire::EncodeForwardRequest(header, v1wire::SliceFromString(data_of(view->hidden_states)),
                                   v1wire::SliceFromString(data_of(view->topk_ids)),
                                   v1wire::SliceFromString(data_of(view->topk_weights)));
  Check(encoded.ok(), "a decoded request does not encode");
  absl::StatusOr<v1wire::ForwardRequestView> again = v1wire::DecodeForwardRequest(*encoded);
  Check(again.ok(), "an encoded request does not decode");
  Check(again->header.layer() == view->header.layer() &&
            again->header.request_id() == view->header.request_id() &&
            again->header.return_timings() == view->header.return_timings(),
        "round trip changed a scalar field");
  Check(data_of(again->hidden_states) == data_of(view->hidden_states) &&
            data_of(again->topk_ids) == data_of(view->topk_ids) &&
            data_of(again->topk_weights) == data_of(view->topk_weights),
        "round trip changed tensor data");

  // What the server does next.
  GatheredBytes gathered;
  absl::StatusOr<ForwardInput> input = ForwardInputFromWire(*view, &gathered);
  if (!input.ok()) return 0;
  if (!ValidateForwardShapes(Model(), /*max_tokens=*/64, *input).ok()) return 0;
  const int64_t m = input->hidden_states.dim(0);
  Check(m >= 0 && m <= 64, "M outside [0, max_tokens]");
  Check(input->hidden_states.nbytes() ==
            static_cast<size_t>(m * Model().hidden) * DTypeSize(input->hidden_states.dtype()),
        "hidden_states size");
  if (!ValidateForwardInput(Model(), 64, *input).ok()) return 0;
  for (int64_t i = 0; i < m * Model().topk; ++i) {
    const float w = input->topk_weights.data<float>()[i];
    Check(w == w && w <= kMaxAbsTopkWeight && w >= -kMaxAbsTopkWeight, "weight accepted");
  }
  return 0;
}
