#include "server/convert.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/parallel_copy.h"
#include "core/status_macros.h"
#include "moeserve_build_info.h"

namespace moeserve {

absl::StatusOr<DType> DTypeFromProto(int dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kFP16;
    case v1::DTYPE_FP32:
      return DType::kFP32;
    case v1::DTYPE_INT32:
      return DType::kINT32;
    case v1::DTYPE_INT64:
      return DType::kINT64;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ": dtype is DTYPE_UNSPECIFIED; expected one of DTYPE_BF16, "
                       "DTYPE_FP16, DTYPE_FP32, DTYPE_INT32, DTYPE_INT64"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": unknown dtype value ", dtype,
                       "; expected one of DTYPE_BF16 (1), DTYPE_FP16 (2), DTYPE_FP32 (3), "
                       "DTYPE_INT32 (4), DTYPE_INT64 (5)"));
  }
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kFP16:
      return v1::DTYPE_FP16;
    case DType::kFP32:
      return v1::DTYPE_FP32;
    case DType::kINT32:
      return v1::DTYPE_INT32;
    case DType::kINT64:
      return v1::DTYPE_INT64;
    default:
      return v1::DTYPE_UNSPECIFIED;
  }
}

absl::StatusOr<TensorView> TensorViewFromProto(const v1::Tensor& tensor, absl::string_view field) {
  return TensorViewFromParts(tensor.dtype(), tensor.shape(), tensor.data().data(),
                             tensor.data().size(), field);
}

namespace {

// product(shape) * itemsize(dtype), checked: non-negative dims, no overflow (INVALID_ARGUMENT
// naming `field`).
absl::StatusOr<int64_t> TensorBytes(DType dtype, const Shape& shape, absl::string_view field) {
  const int64_t itemsize = static_cast<int64_t>(DTypeSize(dtype));
  // Bytes needed, checked for overflow at every step; the data can never exceed int64 anyway.
  int64_t bytes = itemsize;
  for (int i = 0; i < static_cast<int>(shape.size()); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": shape ", ShapeToString(shape),
                                                     " has negative dim ", shape[i], " at index ",
                                                     i, "; dims must be >= 0"));
    }
  }
  for (int64_t d : shape) {
    if (d == 0) {
      bytes = 0;
      break;
    }
  }
  if (bytes != 0) {
    for (int64_t d : shape) {
      if (__builtin_mul_overflow(bytes, d, &bytes)) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": shape ", ShapeToString(shape), " x ", itemsize, " bytes of ",
                         DTypeName(dtype), " overflows 64-bit sizes"));
      }
    }
  }
  return bytes;
}

}  // namespace

absl::StatusOr<TensorView> TensorViewFromParts(int dtype_value, absl::Span<const int64_t> dims,
                                               const void* data, size_t size,
                                               absl::string_view field) {
  MOESERVE_ASSIGN_OR_RETURN(const DType dtype, DTypeFromProto(dtype_value, field));
  const int64_t itemsize = static_cast<int64_t>(DTypeSize(dtype));
  Shape shape(dims.begin(), dims.end());
  MOESERVE_ASSIGN_OR_RETURN(const int64_t bytes, TensorBytes(dtype, shape, field));
  if (static_cast<int64_t>(size) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": data has ", size, " bytes, expected ",
                                                   bytes, " (shape ", ShapeToString(shape), " x ",
                                                   itemsize, " bytes of ", DTypeName(dtype), ")"));
  }
  // Proto strings and gathered buffers are at least 8-byte aligned; bytes viewed inside a gRPC
  // slice are checked by the caller (ForwardInputFromWire).
  if (reinterpret_cast<uintptr_t>(data) % itemsize != 0) {
    return absl::InternalError(
        absl::StrCat(field, ": data is not ", itemsize, "-byte aligned in server memory"));
  }
  return TensorView(data, dtype, std::move(shape));
}

TensorView AllocateProtoTensor(DType dtype, const Shape& shape, v1::Tensor* tensor) {
  tensor->set_dtype(DTypeToProto(dtype));
  tensor->mutable_shape()->Clear();
  for (int64_t d : shape) tensor->add_shape(d);
  std::string* data = tensor->mutable_data();
  data->resize(static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype));
  return TensorView(static_cast<void*>(data->data()), dtype, shape);
}

namespace {

// The first missing tensor of a ForwardRequest, as INVALID_ARGUMENT; OK if all are present,
// or if hidden_states is and the routing is left to the server (neither topk tensor).
absl::Status CheckForwardTensorsPresent(bool hidden_states, bool topk_ids, bool topk_weights) {
  if (!hidden_states) {
    return absl::InvalidArgumentError("hidden_states: missing; expected a [M, hidden] tensor");
  }
  if (topk_ids != topk_weights) {
    return absl::InvalidArgumentError(absl::StrCat(
        topk_ids ? "topk_weights" : "topk_ids", ": missing while ",
        topk_ids ? "topk_ids" : "topk_weights",
        " is given; send both topk_ids [M, topk] int32/int64 and topk_weights [M, topk] fp32 "
        "(client-side routing) or neither (the server routes with the layer's gate)"));
  }
  return absl::OkStatus();
}

// The installed device upload (InstallDeviceUpload); null until then.
struct DeviceUpload {
  UploadHostPiecesFn upload;
  int device = 0;
  int64_t min_bytes = 0;
};
std::atomic<const DeviceUpload*> device_upload{nullptr};

// `pieces` uploaded to the device, when the installed upload applies and succeeds; null
// otherwise (the caller gathers on the host).
DeviceBytes* MaybeUpload(const std::vector<absl::Span<const uint8_t>>& pieces, size_t size,
                         GatheredBytes* gathered) {
  const DeviceUpload* up = device_upload.load(std::memory_order_acquire);
  if (up == nullptr || static_cast<int64_t>(size) < up->min_bytes) return nullptr;
  ParallelCopier& copier = GatherCopier();
  absl::StatusOr<std::unique_ptr<DeviceBytes>> bytes = up->upload(
      up->device, pieces, size,
      [&copier](int64_t n, const std::function<void(int64_t)>& task) {
        copier.ParallelFor(n, task);
      },
      copier.num_threads());
  if (!bytes.ok()) {
    static std::atomic<bool> noted{false};
    if (!noted.exchange(true)) {
      std::fprintf(stderr,
                   "moeserve: uploading a request to device %d failed (%s); such requests are "
                   "gathered on the host instead\n",
                   up->device, std::string(bytes.status().message()).c_str());
    }
    return nullptr;
  }
  gathered->device.push_back(std::move(*bytes));
  return gathered->device.back().get();
}

// A view of tensor bytes given as pieces of gRPC slices: in place when they are one suitably
// aligned piece, else gathered once (into page-locked memory where the pool pins, so that a
// GPU engine reads it by DMA), or, where `device_ok` and the request is large, uploaded to
// device memory as it is gathered (InstallDeviceUpload).
absl::StatusOr<TensorView> TensorViewFromPieces(
    int dtype_value, absl::Span<const int64_t> shape,
    const std::vector<absl::Span<const uint8_t>>& pieces, size_t size, absl::string_view field,
    GatheredBytes* gathered, bool device_ok = false) {
  // Any non-null, 8-byte aligned address serves for empty data.
  static const uint64_t kEmpty = 0;
  const void* data = nullptr;
  if (pieces.size() <= 1) {
    absl::StatusOr<DType> dtype = DTypeFromProto(dtype_value, field);
    const size_t itemsize = dtype.ok() ? DTypeSize(*dtype) : 1;
    if (pieces.empty() || pieces[0].empty()) {
      data = &kEmpty;
    } else if (reinterpret_cast<uintptr_t>(pieces[0].data()) % itemsize == 0) {
      data = pieces[0].data();
    }
  }
  bool pinned = false;
  if (data == nullptr) {
    size_t total = 0;
    for (auto piece : pieces) total += piece.size();
    if (total != size) {
      return absl::InternalError(
          absl::StrCat(field, ": pieces hold ", total, " bytes, expected ", size));
    }
    if (device_ok) {
      // Shapes first: nothing is uploaded for a request that is refused anyway.
      MOESERVE_ASSIGN_OR_RETURN(TensorView checked,
                                TensorViewFromParts(dtype_value, shape, &kEmpty, size, field));
      if (DeviceBytes* on_device = MaybeUpload(pieces, size, gathered)) {
        return TensorView(on_device->data(), checked.dtype(), checked.shape(), on_device->device());
      }
    }
    gathered->host.push_back(PooledBuffer::Acquire(size));
    GatherPieces(pieces, size, static_cast<uint8_t*>(gathered->host.back()->data()));
    data = gathered->host.back()->data();
    pinned = gathered->host.back()->pinned();
  }
  MOESERVE_ASSIGN_OR_RETURN(TensorView view,
                            TensorViewFromParts(dtype_value, shape, data, size, field));
  if (pinned) view = TensorView(view.raw_data(), view.dtype(), view.shape(), Device::PinnedHost());
  return view;
}

absl::StatusOr<TensorView> TensorViewFromWire(const v1wire::WireTensor& tensor,
                                              absl::string_view field, GatheredBytes* gathered,
                                              bool device_ok = false) {
  return TensorViewFromPieces(tensor.header.dtype(), tensor.header.shape(), tensor.data,
                              tensor.data_size, field, gathered, device_ok);
}

}  // namespace

namespace {
std::atomic<int> gather_threads{0};
std::atomic<bool> gather_streaming_stores{false};
}  // namespace

void SetGatherOptions(int threads, bool streaming_stores) {
  gather_threads.store(threads);
  gather_streaming_stores.store(streaming_stores);
}

void InstallDeviceUpload(UploadHostPiecesFn upload, int device, int64_t min_bytes) {
  if (!upload || min_bytes <= 0 || device_upload.load() != nullptr) return;
  auto* up = new DeviceUpload{std::move(upload), device, min_bytes};  // process-wide, kept
  const DeviceUpload* expected = nullptr;
  if (!device_upload.compare_exchange_strong(expected, up)) delete up;
}

ParallelCopier& GatherCopier() {
  // One copier for every gRPC thread; concurrent gathers take turns on its threads.
  static ParallelCopier* copier = [] {
    int threads = gather_threads.load();
    if (threads <= 0) {  // auto: half the cores, at most 8 (measured on a 16-core H200 host)
      threads = std::max(1, std::min(8, static_cast<int>(std::thread::hardware_concurrency()) / 2));
    }
    // MOESERVE_GATHER_PARALLEL_MIN_BYTES: from what size a request's pieces are gathered on
    // several threads (default two 1 MiB chunks); a tuning knob, measured before it is a flag.
    size_t min_parallel = ParallelCopier::kGatherMinParallelBytes;
    const char* env = std::getenv("MOESERVE_GATHER_PARALLEL_MIN_BYTES");
    size_t bytes = 0;
    if (env != nullptr && absl::SimpleAtoi(env, &bytes)) min_parallel = bytes;
    return new ParallelCopier(threads, gather_streaming_stores.load(), min_parallel);
  }();
  return *copier;
}

void GatherPieces(const std::vector<absl::Span<const uint8_t>>& pieces, size_t size, uint8_t* dst) {
  GatherCopier().Gather(pieces, size, dst);
}

absl::Status SharedMemoryDisabledError(absl::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": shared memory is off on this server; start it with ",
                   "--enable_shared_memory to use shared-memory regions"));
}

RegionRef RegionRefFromProto(const v1::RegionRef& ref) {
  RegionRef out;
  out.name = ref.name();
  out.offset = ref.offset();
  out.byte_size = ref.byte_size();
  return out;
}

void RegionInfoToProto(const RegionInfo& info, v1::SharedMemoryRegionStatus* out) {
  out->set_name(info.name);
  out->set_kind(std::string(RegionKindName(info.kind)));
  out->set_key(info.key);
  out->set_offset(info.offset);
  out->set_byte_size(info.byte_size);
  out->set_device_id(info.device_id);
  out->set_calls_in_flight(info.calls_in_flight);
}

void ForwardRegions::Release() {
  for (RegionTensor& t : inputs) t.Release();
  if (output.has_value()) output->Release();
  leases.Clear();
}

namespace {

// A wire tensor that names a region: dtype and shape checked as for data, then resolved in
// `regions` (into held->inputs).
absl::StatusOr<TensorView> TensorViewFromRegion(const v1wire::WireTensor& tensor,
                                                absl::string_view field,
                                                const RegionRegistry* regions, RegionAccess access,
                                                bool device_ok, ForwardRegions* held,
                                                bool defer_copy = false) {
  if (tensor.data_size > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": both data (", tensor.data_size,
                     " bytes) and region are set; expected one of them"));
  }
  if (regions == nullptr || held == nullptr) {
    return SharedMemoryDisabledError(absl::StrCat(field, ".region"));
  }
  MOESERVE_ASSIGN_OR_RETURN(const DType dtype, DTypeFromProto(tensor.header.dtype(), field));
  const Shape shape(tensor.header.shape().begin(), tensor.header.shape().end());
  MOESERVE_RETURN_IF_ERROR(TensorBytes(dtype, shape, field).status());
  MOESERVE_ASSIGN_OR_RETURN(
      RegionTensor t,
      RegionTensor::Resolve(*regions, RegionRefFromProto(tensor.header.region()), dtype, shape,
                            access, device_ok, absl::StrCat(field, ".region"), &held->leases,
                            defer_copy));
  held->inputs.push_back(std::move(t));
  return held->inputs.back().view();
}

}  // namespace

absl::StatusOr<ForwardInput> ForwardInputFromWire(const v1wire::ForwardRequestView& request,
                                                  GatheredBytes* gathered) {
  return ForwardInputFromWire(request, gathered, nullptr, false, nullptr);
}

absl::StatusOr<ForwardInput> ForwardInputFromWire(const v1wire::ForwardRequestView& request,
                                                  GatheredBytes* gathered,
                                                  const RegionRegistry* regions,
                                                  bool device_hidden_ok, ForwardRegions* held,
                                                  bool device_routing_ok) {
  ForwardInput input;
  input.layer = request.header.layer();
  MOESERVE_RETURN_IF_ERROR(CheckForwardTensorsPresent(
      request.hidden_states.present, request.topk_ids.present, request.topk_weights.present));
  // Staged copies out of regions are filled together at the end (one wait per region).
  const auto view = [&](const v1wire::WireTensor& tensor, absl::string_view field,
                        RegionAccess access, bool device_ok) -> absl::StatusOr<TensorView> {
    if (tensor.header.has_region()) {
      return TensorViewFromRegion(tensor, field, regions, access, device_ok, held,
                                  /*defer_copy=*/true);
    }
    return TensorViewFromWire(
        tensor, field, gathered,
        // server-side routing reads hidden_states on the host
        device_ok && &tensor == &request.hidden_states && request.topk_ids.present);
  };
  MOESERVE_ASSIGN_OR_RETURN(input.hidden_states, view(request.hidden_states, "hidden_states",
                                                      RegionAccess::kRead, device_hidden_ok));
  if (!request.topk_ids.present) {  // server-side routing
    if (held != nullptr)
      MOESERVE_RETURN_IF_ERROR(RegionTensor::FillPending(absl::MakeSpan(held->inputs)));
    return input;
  }
  // Expert ids index tables once validated: a private copy, which the client cannot change
  // between the check and the use. Weights are read on the host in place (a value changed after
  // the check only changes that token's answer). Routing the engine reads on the device is read
  // in place there: its check copies each value once and uses that copy.
  // (return_routing echoes them from the host.)
  const bool routing_on_device = device_routing_ok && !request.header.return_routing() &&
                                 request.topk_ids.header.has_region() &&
                                 request.topk_weights.header.has_region() &&
                                 request.topk_ids.header.dtype() == v1::DTYPE_INT32;
  MOESERVE_ASSIGN_OR_RETURN(
      input.topk_ids,
      view(request.topk_ids, "topk_ids",
           routing_on_device ? RegionAccess::kRead : RegionAccess::kSnapshot, routing_on_device));
  const bool ids_on_device = !input.topk_ids.device().is_host();
  MOESERVE_ASSIGN_OR_RETURN(input.topk_weights, view(request.topk_weights, "topk_weights",
                                                     RegionAccess::kRead, ids_on_device));
  if (routing_on_device && (!ids_on_device || input.topk_weights.device().is_host())) {
    // Ids in a system region (host memory the client can write: viewed in place, they could
    // change between the check and the use), or in a CUDA region with the weights in host
    // memory (one space for both): the ids as a private host copy.
    RegionTensor& ids = held->inputs[held->inputs.size() - 2];
    MOESERVE_ASSIGN_OR_RETURN(
        ids, RegionTensor::Resolve(*regions, ids.ref(), DType::kINT32, input.topk_ids.shape(),
                                   RegionAccess::kSnapshot, false, "topk_ids.region", &held->leases,
                                   /*defer_copy=*/true));
    input.topk_ids = ids.view();
  }
  if (held != nullptr)
    MOESERVE_RETURN_IF_ERROR(RegionTensor::FillPending(absl::MakeSpan(held->inputs)));
  return input;
}

namespace {

// `ref` resolved for writing the answer into held->output; INVALID_ARGUMENT if it overlaps one
// of the call's input regions.
absl::Status ResolveOutputRegionRef(const RegionRegistry& regions, const RegionRef& ref,
                                    absl::string_view field, DType dtype, const Shape& shape,
                                    bool device_ok, ForwardRegions* held) {
  MOESERVE_ASSIGN_OR_RETURN(RegionTensor out,
                            RegionTensor::Resolve(regions, ref, dtype, shape, RegionAccess::kWrite,
                                                  device_ok, field, &held->leases));
  for (const RegionTensor& in : held->inputs) {
    if (out.Overlaps(in)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": bytes [", out.ref().offset, ", ", out.ref().offset + out.ref().byte_size,
          ") of region '", out.ref().name, "' overlap ", in.field(), " (bytes [", in.ref().offset,
          ", ", in.ref().offset + in.ref().byte_size, ") of region '", in.ref().name,
          "'); the answer needs bytes of its own"));
    }
  }
  held->output = std::move(out);
  return absl::OkStatus();
}

}  // namespace

absl::Status ResolveOutputRegion(const v1::ForwardRequest& header, const RegionRegistry* regions,
                                 DType dtype, const Shape& shape, bool device_ok,
                                 ForwardRegions* held) {
  if (!header.has_output_region()) return absl::OkStatus();
  if (regions == nullptr) return SharedMemoryDisabledError("output_region");
  return ResolveOutputRegionRef(*regions, RegionRefFromProto(header.output_region()),
                                "output_region", dtype, shape, device_ok, held);
}

absl::StatusOr<ForwardInput> ForwardInputFromProto(const v1::ForwardRequest& request) {
  ForwardInput input;
  input.layer = request.layer();
  MOESERVE_RETURN_IF_ERROR(CheckForwardTensorsPresent(
      request.has_hidden_states(), request.has_topk_ids(), request.has_topk_weights()));
  MOESERVE_ASSIGN_OR_RETURN(input.hidden_states,
                            TensorViewFromProto(request.hidden_states(), "hidden_states"));
  if (!request.has_topk_ids()) return input;  // server-side routing
  MOESERVE_ASSIGN_OR_RETURN(input.topk_ids, TensorViewFromProto(request.topk_ids(), "topk_ids"));
  MOESERVE_ASSIGN_OR_RETURN(input.topk_weights,
                            TensorViewFromProto(request.topk_weights(), "topk_weights"));
  return input;
}

void EngineInfoToProto(const EngineInfo& info, int64_t max_message_bytes, v1::ModelInfo* out) {
  const ModelConfig& m = info.model;
  out->set_model_name(m.name);
  out->set_num_layers(m.num_layers);
  out->set_num_experts(m.num_experts);
  out->set_topk(m.topk);
  out->set_hidden(static_cast<int32_t>(m.hidden));
  out->set_intermediate(static_cast<int32_t>(m.intermediate));
  out->clear_accepted_hidden_dtypes();
  for (DType d : info.hidden_dtypes) out->add_accepted_hidden_dtypes(DTypeToProto(d));
  out->clear_accepted_topk_ids_dtypes();
  for (DType d : info.topk_ids_dtypes) out->add_accepted_topk_ids_dtypes(DTypeToProto(d));
  out->set_weight_format(std::string(WeightFormatName(info.weight_format)));
  out->set_num_ranks(info.num_ranks);
  out->set_backend(info.backend);
  out->set_max_tokens_per_request(info.max_tokens_per_request);
  out->set_prepare_finalize(info.prepare_finalize);
  out->set_experts(info.experts);
  out->set_activation("silu");
  out->set_max_message_bytes(max_message_bytes);
  out->set_placement(info.placement);
  out->clear_expert_placement();
  for (size_t r = 0; r < info.rank_experts.size(); ++r) {
    v1::ExpertPlacement* p = out->add_expert_placement();
    p->set_rank(static_cast<int32_t>(r));
    for (int e : info.rank_experts[r]) p->add_expert_ids(e);
  }
  out->clear_moe_layers();
  if (m.moe_layers.empty()) {
    for (int l = 0; l < m.num_layers; ++l) out->add_moe_layers(l);
  } else {
    for (int l : m.moe_layers) out->add_moe_layers(l);
  }
  out->set_router(info.router);
  out->set_server_routing(!info.router.empty());
}

void RoutingToProto(const ForwardInput& input, v1::Tensor* topk_ids, v1::Tensor* topk_weights) {
  const TensorView& ids = input.topk_ids;
  const TensorView out_ids = AllocateProtoTensor(DType::kINT32, ids.shape(), topk_ids);
  const int64_t n = ids.numel();
  if (ids.dtype() == DType::kINT64) {
    for (int64_t i = 0; i < n; ++i) {
      out_ids.data<int32_t>()[i] = static_cast<int32_t>(ids.data<int64_t>()[i]);
    }
  } else if (n > 0) {
    std::memcpy(out_ids.raw_data(), ids.raw_data(), n * 4);
  }
  const TensorView out_w =
      AllocateProtoTensor(DType::kFP32, input.topk_weights.shape(), topk_weights);
  if (n > 0) std::memcpy(out_w.raw_data(), input.topk_weights.raw_data(), n * 4);
}

void ForwardTimingsToProto(const ForwardTimings& timings, double server_queue_us, double total_us,
                           v1::StageTimings* out) {
  out->set_queue_us(server_queue_us + timings.queue_us);
  out->set_prepare_us(timings.stages.prepare_us);
  out->set_experts_us(timings.stages.experts_us);
  out->set_finalize_us(timings.stages.finalize_us);
  out->set_engine_us(timings.engine_us);
  out->set_host_stage_us(timings.stages.host_stage_us);
  out->set_host_launch_us(timings.stages.host_launch_us);
  out->set_host_collect_us(timings.stages.host_collect_us);
  out->set_host_timer_us(timings.stages.host_timer_us);
  out->set_total_us(total_us);
}

// ---------------------------------------------------------------------------------------------
// KServe v2 / Open Inference Protocol.

absl::StatusOr<DType> DTypeFromKServe(absl::string_view datatype, absl::string_view field) {
  if (datatype == "BF16") return DType::kBF16;
  if (datatype == "FP16") return DType::kFP16;
  if (datatype == "FP32") return DType::kFP32;
  if (datatype == "INT32") return DType::kINT32;
  if (datatype == "INT64") return DType::kINT64;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": datatype '", datatype,
                   "' not accepted; expected one of BF16, FP16, FP32 (hidden_states), INT32, "
                   "INT64 (topk_ids), FP32 (topk_weights)"));
}

absl::string_view DTypeToKServe(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kFP16:
      return "FP16";
    case DType::kFP32:
      return "FP32";
    case DType::kINT32:
      return "INT32";
    case DType::kINT64:
      return "INT64";
    default:
      return "";
  }
}

namespace {

std::string ModelNamesHelp(const ModelConfig& model) {
  return absl::StrCat("models are '", kKServeLayerModelPrefix, "<i>' for the MoE layers i (",
                      model.moe_layers.empty() ? absl::StrCat("0..", model.num_layers - 1)
                                               : absl::StrJoin(model.moe_layers, ","),
                      ") and '", kKServeModelName, "' with the request parameter 'layer'");
}

// An integer parameter (int64, uint64, or a string of digits), or nullopt-like false.
absl::StatusOr<int64_t> IntParameter(const inference::InferParameter& p, absl::string_view name) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      return p.int64_param();
    case inference::InferParameter::kUint64Param:
      if (p.uint64_param() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) break;
      return static_cast<int64_t>(p.uint64_param());
    case inference::InferParameter::kStringParam: {
      int64_t v;
      if (absl::SimpleAtoi(p.string_param(), &v)) return v;
      break;
    }
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("parameters.", name, ": expected an integer (int64_param)"));
}

}  // namespace

absl::StatusOr<int> ModelLayerFromKServe(
    const ModelConfig& model, absl::string_view name, absl::string_view version,
    const google::protobuf::Map<std::string, inference::InferParameter>* parameters) {
  if (!version.empty() && version != kKServeModelVersion) {
    return absl::NotFoundError(absl::StrCat("model '", name, "' version '", version,
                                            "': no such version; the only version is '",
                                            kKServeModelVersion, "' (or empty)"));
  }
  std::optional<int64_t> param_layer;
  if (parameters != nullptr) {
    auto it = parameters->find("layer");
    if (it != parameters->end()) {
      MOESERVE_ASSIGN_OR_RETURN(param_layer, IntParameter(it->second, "layer"));
    }
  }
  if (name == kKServeModelName) {
    if (parameters == nullptr) return -1;  // metadata and readiness of the whole model
    if (!param_layer.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameters.layer: required for model '", kKServeModelName,
                       "' (the MoE layer index, int64_param); or call model '",
                       kKServeLayerModelPrefix, "<i>'"));
    }
    if (*param_layer < 0 || *param_layer >= model.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("parameters.layer: got ", *param_layer,
                                                     ", expected a value in [0, ", model.num_layers,
                                                     ")"));
    }
    return static_cast<int>(*param_layer);
  }
  absl::string_view rest = name;
  int layer = -1;
  if (!absl::ConsumePrefix(&rest, kKServeLayerModelPrefix) || !absl::SimpleAtoi(rest, &layer) ||
      absl::StrCat(layer) != rest || !model.IsMoeLayer(layer)) {
    return absl::NotFoundError(
        absl::StrCat("model '", name, "': no such model; ", ModelNamesHelp(model)));
  }
  if (param_layer.has_value() && *param_layer != layer) {
    return absl::InvalidArgumentError(absl::StrCat("parameters.layer: got ", *param_layer,
                                                   " for model '", name, "' (layer ", layer,
                                                   "); leave it out or make them agree"));
  }
  return layer;
}

namespace {

// A non-negative integer parameter (int64_param or uint64_param up to INT64_MAX).
absl::StatusOr<int64_t> KServeIntParameter(const inference::InferParameter& p,
                                           absl::string_view field, absl::string_view name) {
  if (p.parameter_choice_case() == inference::InferParameter::kInt64Param && p.int64_param() >= 0) {
    return p.int64_param();
  }
  if (p.parameter_choice_case() == inference::InferParameter::kUint64Param &&
      p.uint64_param() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return static_cast<int64_t>(p.uint64_param());
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".parameters.", name, ": expected a non-negative int64_param (or uint64_param)"));
}

}  // namespace

absl::StatusOr<std::optional<RegionRef>> RegionRefFromKServe(
    const google::protobuf::Map<std::string, inference::InferParameter>& parameters,
    absl::string_view field) {
  const auto region = parameters.find(kKServeShmRegion);
  const auto size = parameters.find(kKServeShmByteSize);
  const auto offset = parameters.find(kKServeShmOffset);
  if (region == parameters.end()) {
    if (size != parameters.end() || offset != parameters.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".parameters: ", kKServeShmByteSize, " / ", kKServeShmOffset, " without ",
          kKServeShmRegion, "; name the region or leave the shared-memory parameters out"));
    }
    return std::nullopt;
  }
  if (region->second.parameter_choice_case() != inference::InferParameter::kStringParam ||
      region->second.string_param().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".parameters.", kKServeShmRegion,
                                                   ": expected a non-empty string_param"));
  }
  if (size == parameters.end()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".parameters.", kKServeShmByteSize,
                                                   ": required with ", kKServeShmRegion));
  }
  RegionRef ref;
  ref.name = region->second.string_param();
  MOESERVE_ASSIGN_OR_RETURN(ref.byte_size,
                            KServeIntParameter(size->second, field, kKServeShmByteSize));
  if (offset != parameters.end()) {
    MOESERVE_ASSIGN_OR_RETURN(ref.offset,
                              KServeIntParameter(offset->second, field, kKServeShmOffset));
  }
  return ref;
}

bool KServeUsesSharedMemory(const inference::ModelInferRequest& header) {
  for (const auto& in : header.inputs()) {
    if (in.parameters().contains(kKServeShmRegion)) return true;
  }
  for (const auto& out : header.outputs()) {
    if (out.parameters().contains(kKServeShmRegion)) return true;
  }
  return false;
}

absl::Status ResolveKServeOutputRegion(const inference::ModelInferRequest& header,
                                       const RegionRegistry* regions, DType dtype,
                                       const Shape& shape, bool device_ok, ForwardRegions* held) {
  for (int i = 0; i < header.outputs_size(); ++i) {
    const std::string field = absl::StrCat("outputs[", i, "] (", header.outputs(i).name(), ")");
    MOESERVE_ASSIGN_OR_RETURN(std::optional<RegionRef> ref,
                              RegionRefFromKServe(header.outputs(i).parameters(), field));
    if (!ref.has_value()) continue;
    if (regions == nullptr) {
      return SharedMemoryDisabledError(absl::StrCat(field, ".parameters.", kKServeShmRegion));
    }
    // As Triton: an output's byte size is the room given (perf_analyzer passes
    // --output-shared-memory-size); the answer takes the first shape x itemsize bytes of it.
    const int64_t needed = NumElements(shape) * static_cast<int64_t>(DTypeSize(dtype));
    if (ref->byte_size < needed) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".parameters.", kKServeShmByteSize, ": ", ref->byte_size,
                       " bytes are too small for the output: shape ", ShapeToString(shape), " x ",
                       DTypeSize(dtype), " bytes of ", DTypeName(dtype), " = ", needed));
    }
    ref->byte_size = needed;
    return ResolveOutputRegionRef(*regions, *ref,
                                  absl::StrCat(field, ".parameters.", kKServeShmRegion), dtype,
                                  shape, device_ok, held);
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardInput> ForwardInputFromKServe(
    const inference_wire::ModelInferRequestView& request, int layer, GatheredBytes* gathered) {
  return ForwardInputFromKServe(request, layer, gathered, nullptr, false, nullptr);
}

absl::StatusOr<ForwardInput> ForwardInputFromKServe(
    const inference_wire::ModelInferRequestView& request, int layer, GatheredBytes* gathered,
    const RegionRegistry* regions, bool device_hidden_ok, ForwardRegions* held) {
  const inference::ModelInferRequest& h = request.header;
  // Inputs in shared memory have no raw_input_contents entry.
  std::vector<std::optional<RegionRef>> refs(h.inputs_size());
  size_t raw_inputs = 0;
  for (int i = 0; i < h.inputs_size(); ++i) {
    MOESERVE_ASSIGN_OR_RETURN(
        refs[i], RegionRefFromKServe(h.inputs(i).parameters(),
                                     absl::StrCat("inputs[", i, "] (", h.inputs(i).name(), ")")));
    if (!refs[i].has_value()) ++raw_inputs;
  }
  // Typed contents are refused even beside a full set of raw entries (they were ignored there).
  for (int i = 0; i < h.inputs_size(); ++i) {
    if (h.inputs(i).has_contents()) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs[", i, "] (", h.inputs(i).name(),
                       "): typed `contents` are not accepted; send every input's bytes in "
                       "raw_input_contents (or a shared-memory region)"));
    }
  }
  if (request.raw.size() != raw_inputs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_input_contents: ", request.raw.size(), " entries for ", h.inputs_size(), " inputs (",
        h.inputs_size() - static_cast<int>(raw_inputs),
        " in shared memory); expected one per input, in the order of inputs, except those in "
        "shared memory"));
  }
  for (int i = 0; i < h.outputs_size(); ++i) {
    if (h.outputs(i).name() != kKServeOutputName) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "]: unknown output '", h.outputs(i).name(),
                       "'; the model has one output, '", kKServeOutputName, "'"));
    }
    if (i > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "]: '", kKServeOutputName,
                       "' requested twice; the model has one output, requested at most once"));
    }
    // Only a shared-memory region is an output option here (e.g. `classification`, top-k
    // classes instead of the tensor, is not served: refused, not ignored).
    for (const auto& [key, value] : h.outputs(i).parameters()) {
      if (key != kKServeShmRegion && key != kKServeShmByteSize && key != kKServeShmOffset) {
        return absl::InvalidArgumentError(absl::StrCat(
            "outputs[", i, "].parameters: '", key, "' is not supported; expected only ",
            kKServeShmRegion, ", ", kKServeShmByteSize, " and ", kKServeShmOffset));
      }
    }
  }
  ForwardInput input;
  input.layer = layer;
  const char* const names[] = {"hidden_states", "topk_ids", "topk_weights"};
  TensorView* const views[] = {&input.hidden_states, &input.topk_ids, &input.topk_weights};
  bool seen[3] = {false, false, false};
  size_t raw = 0;  // the next raw_input_contents entry
  // Server-side routing (no topk_ids) reads hidden_states on the host: no upload then.
  bool client_routing = false;
  for (int i = 0; i < h.inputs_size(); ++i) client_routing |= h.inputs(i).name() == names[1];
  for (int i = 0; i < h.inputs_size(); ++i) {
    const inference::ModelInferRequest::InferInputTensor& in = h.inputs(i);
    int which = -1;
    for (int j = 0; j < 3; ++j) {
      if (in.name() == names[j]) which = j;
    }
    if (which < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs[", i, "]: unknown input '", in.name(),
                       "'; expected hidden_states, topk_ids and topk_weights"));
    }
    if (seen[which]) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs[", i, "]: input '", in.name(), "' given twice"));
    }
    seen[which] = true;
    MOESERVE_ASSIGN_OR_RETURN(const DType dtype, DTypeFromKServe(in.datatype(), names[which]));
    if (!refs[i].has_value()) {
      MOESERVE_ASSIGN_OR_RETURN(
          *views[which],
          TensorViewFromPieces(DTypeToProto(dtype), in.shape(), request.raw[raw].data,
                               request.raw[raw].size, names[which], gathered,
                               which == 0 && device_hidden_ok && client_routing));
      ++raw;
      continue;
    }
    const std::string field = absl::StrCat(names[which], ".parameters.", kKServeShmRegion);
    if (regions == nullptr || held == nullptr) return SharedMemoryDisabledError(field);
    const Shape shape(in.shape().begin(), in.shape().end());
    MOESERVE_RETURN_IF_ERROR(TensorBytes(dtype, shape, names[which]).status());
    // As ForwardInputFromWire: expert ids are snapshotted (validated once, then used), hidden
    // states may be read in place on the device.
    const RegionAccess access = which == 1 ? RegionAccess::kSnapshot : RegionAccess::kRead;
    MOESERVE_ASSIGN_OR_RETURN(
        RegionTensor t,
        RegionTensor::Resolve(*regions, *refs[i], dtype, shape, access,
                              which == 0 && device_hidden_ok, field, &held->leases));
    held->inputs.push_back(std::move(t));
    *views[which] = held->inputs.back().view();
  }
  MOESERVE_RETURN_IF_ERROR(CheckForwardTensorsPresent(seen[0], seen[1], seen[2]));
  return input;
}

void ModelMetadataToKServe(const EngineInfo& info, absl::string_view name,
                           inference::ModelMetadataResponse* out) {
  const ModelConfig& m = info.model;
  out->set_name(std::string(name));
  out->add_versions(std::string(kKServeModelVersion));
  out->set_platform("moeserve");
  auto add = [](auto* list, const char* tensor, const char* datatype,
                std::initializer_list<int64_t> shape) {
    auto* t = list->Add();
    t->set_name(tensor);
    t->set_datatype(datatype);
    for (int64_t d : shape) t->add_shape(d);
  };
  // One datatype per tensor in the protocol: the preferred one (the others are accepted too:
  // hidden_states FP16/FP32, topk_ids INT64).
  add(out->mutable_inputs(), "hidden_states", "BF16", {-1, m.hidden});
  add(out->mutable_inputs(), "topk_ids", "INT32", {-1, m.topk});
  add(out->mutable_inputs(), "topk_weights", "FP32", {-1, m.topk});
  add(out->mutable_outputs(), kKServeOutputName, "BF16", {-1, m.hidden});
}

void ModelConfigToKServe(const EngineInfo& info, absl::string_view name,
                         inference::ModelConfig* out) {
  inference::ModelMetadataResponse meta;
  ModelMetadataToKServe(info, name, &meta);
  const auto data_type = [](const std::string& datatype) {
    if (datatype == "BF16") return inference::TYPE_BF16;
    if (datatype == "FP16") return inference::TYPE_FP16;
    if (datatype == "FP32") return inference::TYPE_FP32;
    if (datatype == "INT32") return inference::TYPE_INT32;
    return inference::TYPE_INT64;
  };
  out->set_name(meta.name());
  out->set_platform(meta.platform());
  out->set_backend("moeserve");
  out->set_max_batch_size(0);  // no batch dimension of Triton's: M is part of the shapes
  for (const auto& t : meta.inputs()) {
    inference::ModelInput* in = out->add_input();
    in->set_name(t.name());
    in->set_data_type(data_type(t.datatype()));
    for (int64_t d : t.shape()) in->add_dims(d);
  }
  for (const auto& t : meta.outputs()) {
    inference::ModelOutput* o = out->add_output();
    o->set_name(t.name());
    o->set_data_type(data_type(t.datatype()));
    for (int64_t d : t.shape()) o->add_dims(d);
  }
}

void ServerMetadataToKServe(const RegionRegistry* regions, inference::ServerMetadataResponse* out) {
  out->set_name("moeserve");
  out->set_version(absl::StrCat(build_info::kVersion, "+", build_info::kCommit));
  out->add_extensions("model_configuration");
  out->add_extensions("parameters");
  if (regions != nullptr) {
    out->add_extensions("system_shared_memory");
    if (regions->backend() == Backend::kCuda) out->add_extensions("cuda_shared_memory");
  }
}

}  // namespace moeserve
