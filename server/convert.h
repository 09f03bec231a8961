// The one place that translates between the wire API (moeserve.v1 protos) and core types.
//
// Tensor views made from a proto point into that proto's `data` bytes: the proto must outlive
// the view and must not be modified while the view is in use.
#ifndef MOESERVE_SERVER_CONVERT_H_
#define MOESERVE_SERVER_CONVERT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/device_upload.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/memory_region.h"
#include "core/parallel_copy.h"
#include "core/tensor.h"
#include "inference/grpc_service.pb.h"
#include "inference/infer_wire.h"
#include "moeserve/v1/forward_wire.h"
#include "moeserve/v1/moeserve.pb.h"
#include "server/buffer_pool.h"

namespace moeserve {

// Wire dtype -> core dtype. INVALID_ARGUMENT naming `field` for DTYPE_UNSPECIFIED and for
// values this build does not know (proto3 keeps unknown enum values as plain ints).
absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field);
// Core dtype -> wire dtype; DTYPE_UNSPECIFIED for dtypes the wire API does not carry.
v1::DType DTypeToProto(DType dtype);

// A read-only view of `tensor`'s bytes. Checks (INVALID_ARGUMENT naming `field`): known dtype,
// non-negative dims, no overflow of product(shape) * itemsize, and data length equal to
// product(shape) * itemsize. Rank and model-specific checks are left to the caller
// (ValidateForwardInput).
absl::StatusOr<TensorView> TensorViewFromProto(const v1::Tensor& tensor, absl::string_view field);
// The same checks on a tensor given as parts: `size` bytes at `data` (not owned).
absl::StatusOr<TensorView> TensorViewFromParts(int dtype, absl::Span<const int64_t> shape,
                                               const void* data, size_t size,
                                               absl::string_view field);

// Sets `tensor`'s dtype and shape and sizes its data to hold them; returns a writable view of
// that data so the producer writes straight into the reply (no extra copy). The view stays
// valid until `tensor`'s data is next modified.
TensorView AllocateProtoTensor(DType dtype, const Shape& shape, v1::Tensor* tensor);

// The request's layer and tensors as a ForwardInput viewing `request` (see the file comment).
// A request with hidden_states but neither topk_ids nor topk_weights asks the server to route:
// its topk_ids and topk_weights views are left empty. Only one of them is INVALID_ARGUMENT.
absl::StatusOr<ForwardInput> ForwardInputFromProto(const v1::ForwardRequest& request);

// Copies `pieces` back to back into `dst` (`size` bytes in all): one ParallelCopier shared by
// every caller, from 2 MB on over up to 4 threads by default (SetGatherOptions; one core copies
// about 10 GB/s, so 14.7 MB would take 1.5 ms alone), optionally with streaming stores (the
// bytes are read next by the engine's DMA or copy, not from this core's caches). Blocks until
// done; thread-safe.
void GatherPieces(const std::vector<absl::Span<const uint8_t>>& pieces, size_t size, uint8_t* dst);
// The copier GatherPieces (and the device upload) runs on: process-wide, made at first use.
ParallelCopier& GatherCopier();
// Threads GatherPieces copies large requests on (0: auto, min(4, cores / 2)) and whether they
// write with StreamingCopy. Takes effect only before the first gather (the server's flags set
// it at startup).
void SetGatherOptions(int threads, bool streaming_stores);

// Large request tensors the engine reads in device memory (hidden_states of a GPU engine) are
// uploaded as they are gathered (core/device_upload.h) from `min_bytes` on, to device
// `device`, with `upload` (the backend's BackendProvider::upload_host_pieces). Installed once,
// before calls come (later calls are ignored); min_bytes <= 0 or a null `upload`: never. An
// upload that fails falls back to the host gather (noted once on stderr).
void InstallDeviceUpload(UploadHostPiecesFn upload, int device, int64_t min_bytes);

// Storage for request tensors whose bytes had to be gathered: in recycled host buffers
// (16-byte aligned, page-locked for a GPU engine) or uploaded to device memory.
struct GatheredBytes {
  std::vector<std::unique_ptr<PooledBuffer>> host;
  std::vector<std::unique_ptr<DeviceBytes>> device;
};
// As ForwardInputFromProto, for a request decoded from gRPC slices: a tensor whose bytes sit in
// one slice, aligned to its itemsize, is viewed in place; any other is copied once into a buffer
// appended to `gathered`. The views need `request` and `gathered` alive and unmodified.
absl::StatusOr<ForwardInput> ForwardInputFromWire(const v1wire::ForwardRequestView& request,
                                                  GatheredBytes* gathered);

// The tensors of one Forward call that live in shared-memory regions, each holding its region
// (a lease) until Release() or destruction. Release before answering the call, so that a client
// unregistering a region right after the answer is not refused.
struct ForwardRegions {
  CallLeases leases;  // one per region, shared by the call's tensors in it
  std::vector<RegionTensor> inputs;
  std::optional<RegionTensor> output;
  void Release();
};

// As above, for a request whose tensors may name a region (Tensor.region instead of data):
// resolved in `regions` into `held` (viewed in place where possible, see RegionTensor). A tensor
// with both data and a region is refused (INVALID_ARGUMENT); so is any region when `regions` is
// null (FAILED_PRECONDITION naming --enable_shared_memory). `device_hidden_ok`: the engine reads
// hidden_states in device memory (a CUDA region's bytes in place). `device_routing_ok`: it also
// reads and checks topk ids (INT32) and weights there (EngineInfo::device_routing); they are
// viewed in place only when both are in CUDA regions, else both are host copies.
absl::StatusOr<ForwardInput> ForwardInputFromWire(const v1wire::ForwardRequestView& request,
                                                  GatheredBytes* gathered,
                                                  const RegionRegistry* regions,
                                                  bool device_hidden_ok, ForwardRegions* held,
                                                  bool device_routing_ok = false);

// The request's output_region, when it names one, resolved for writing `dtype` `shape` (the
// answer) into held->output; INVALID_ARGUMENT if it overlaps one of the call's input regions,
// FAILED_PRECONDITION when `regions` is null. `device_ok`: the engine writes device memory.
absl::Status ResolveOutputRegion(const v1::ForwardRequest& header, const RegionRegistry* regions,
                                 DType dtype, const Shape& shape, bool device_ok,
                                 ForwardRegions* held);

// The refusal for a shared-memory request to a server that has it off.
absl::Status SharedMemoryDisabledError(absl::string_view what);

RegionRef RegionRefFromProto(const v1::RegionRef& ref);
void RegionInfoToProto(const RegionInfo& info, v1::SharedMemoryRegionStatus* out);

// Engine description -> ModelInfo. `max_message_bytes` is the server's gRPC message limit.
// router / server_routing tell whether requests may leave the routing to the server.
void EngineInfoToProto(const EngineInfo& info, int64_t max_message_bytes, v1::ModelInfo* out);

// KServe v2 / Open Inference Protocol (proto/inference/grpc_service.proto).
// One model per MoE layer, "moe_layer_<i>", and "moeserve" taking the layer from the request
// parameter `layer`; every model has the one version "1".
inline constexpr char kKServeLayerModelPrefix[] = "moe_layer_";
inline constexpr char kKServeModelName[] = "moeserve";
inline constexpr char kKServeModelVersion[] = "1";
inline constexpr char kKServeOutputName[] = "output";

// KServe datatype names ("BF16", "FP16", "FP32", "INT32", "INT64") <-> core dtypes;
// INVALID_ARGUMENT naming `field` for any other name.
absl::StatusOr<DType> DTypeFromKServe(absl::string_view datatype, absl::string_view field);
absl::string_view DTypeToKServe(DType dtype);

// The MoE layer a model name means. NOT_FOUND (listing the models) for an unknown name, a dense
// or out-of-range layer, or a version other than "" / "1". With `parameters` (ModelInfer): for
// "moeserve" the `layer` parameter is required (INVALID_ARGUMENT naming it), for
// "moe_layer_<i>" it may repeat i. Without (metadata, readiness): -1 for "moeserve".
absl::StatusOr<int> ModelLayerFromKServe(
    const ModelConfig& model, absl::string_view name, absl::string_view version,
    const google::protobuf::Map<std::string, inference::InferParameter>* parameters);

// The request's inputs hidden_states, topk_ids, topk_weights (any order, by name) as a
// ForwardInput for `layer`, viewing `request`'s slices where aligned and gathering otherwise
// (as ForwardInputFromWire). INVALID_ARGUMENT naming the input for unknown, repeated or missing
// inputs, typed `contents` (raw_input_contents only), a raw count other than the input count,
// a datatype or byte length that does not fit, and a requested output other than "output".
// Neither topk input (hidden_states only) leaves the routing to the server, as in
// ForwardInputFromWire: the topk views stay empty.
absl::StatusOr<ForwardInput> ForwardInputFromKServe(
    const inference_wire::ModelInferRequestView& request, int layer, GatheredBytes* gathered);

// KServe shared memory: the parameters shared_memory_region (string), shared_memory_byte_size
// (int64 or uint64, required with a region) and shared_memory_offset (int64 or uint64, default
// 0) of one input or requested output. nullopt when none is set; INVALID_ARGUMENT naming
// `field` and the parameter for a wrong type, a missing region or size, or a negative value.
absl::StatusOr<std::optional<RegionRef>> RegionRefFromKServe(
    const google::protobuf::Map<std::string, inference::InferParameter>& parameters,
    absl::string_view field);
// Whether any input or requested output of `header` names a shared-memory region (the caller
// checks the peer before resolving them).
bool KServeUsesSharedMemory(const inference::ModelInferRequest& header);
// As above, where inputs may live in shared-memory regions (RegionRefFromKServe): those are
// resolved in `regions` into `held` as ForwardInputFromWire resolves Tensor.region, and have no
// raw_input_contents entry. Any region when `regions` is null: FAILED_PRECONDITION naming
// --enable_shared_memory.
absl::StatusOr<ForwardInput> ForwardInputFromKServe(
    const inference_wire::ModelInferRequestView& request, int layer, GatheredBytes* gathered,
    const RegionRegistry* regions, bool device_hidden_ok, ForwardRegions* held);
// The requested output "output", when its parameters name a region, resolved for writing
// `dtype` `shape` into held->output (as ResolveOutputRegion). Unlike an input's, an output's
// shared_memory_byte_size is the room given (as in Triton): at least shape x itemsize
// (INVALID_ARGUMENT "too small" otherwise), of which the answer takes the first bytes.
absl::Status ResolveKServeOutputRegion(const inference::ModelInferRequest& header,
                                       const RegionRegistry* regions, DType dtype,
                                       const Shape& shape, bool device_ok, ForwardRegions* held);
// The KServe parameter names.
inline constexpr char kKServeShmRegion[] = "shared_memory_region";
inline constexpr char kKServeShmByteSize[] = "shared_memory_byte_size";
inline constexpr char kKServeShmOffset[] = "shared_memory_offset";

// ModelMetadata of model `name`: inputs hidden_states [-1, hidden] BF16, topk_ids [-1, topk]
// INT32, topk_weights [-1, topk] FP32; output [-1, hidden] BF16 (the preferred datatypes; FP16 /
// FP32 hidden states and INT64 ids are accepted too, and the output follows hidden_states).
void ModelMetadataToKServe(const EngineInfo& info, absl::string_view name,
                           inference::ModelMetadataResponse* out);
// ModelConfig (Triton's extension, read by perf_analyzer) of model `name`: ModelMetadataToKServe's
// tensors with Triton's DataType, platform and backend "moeserve", max_batch_size 0.
void ModelConfigToKServe(const EngineInfo& info, absl::string_view name,
                         inference::ModelConfig* out);
// name "moeserve", version "<version>+<git describe>", and the protocol extensions served:
// model_configuration and parameters always, system_shared_memory with `regions` (shared memory
// on), cuda_shared_memory where those regions take CUDA handles (the cuda backend).
void ServerMetadataToKServe(const RegionRegistry* regions, inference::ServerMetadataResponse* out);

// The routing a forward was combined with, for ForwardResponse (return_routing): topk_ids as
// INT32 [M, topk] (INT64 ids narrowed: they are < num_experts) and topk_weights FP32 [M, topk].
void RoutingToProto(const ForwardInput& input, v1::Tensor* topk_ids, v1::Tensor* topk_weights);

// Engine timings plus the server's own queueing and total time -> StageTimings.
// queue_us = server_queue_us (waiting for a worker) + timings.queue_us (waiting for the engine).
void ForwardTimingsToProto(const ForwardTimings& timings, double server_queue_us, double total_us,
                           v1::StageTimings* out);

}  // namespace moeserve

#endif  // MOESERVE_SERVER_CONVERT_H_
