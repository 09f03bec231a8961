#include "core/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/cuda/answer_copy.h"
#include "core/cuda/device_packed_layer.h"
#include "core/cuda/grow_only_buffer.h"
#include "core/cuda/split_k_workspace.h"
#include "core/status_macros.h"
#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_routing.cuh"

namespace moeserve {
namespace {

struct DeviceBuffer : GrowOnlyBuffer {
  DeviceBuffer() : GrowOnlyBuffer(Memory::kDevice, 256, /*quarter_slack=*/false) {}
};
struct PinnedBuffer : GrowOnlyBuffer {
  PinnedBuffer() : GrowOnlyBuffer(Memory::kPinnedHost, 4096, /*quarter_slack=*/false) {}
};

cudaStream_t StreamOf(const CudaContext& ctx) { return static_cast<cudaStream_t>(ctx.stream()); }

// Enqueues the device conversion of n FP32 or FP16 values at `src` into BF16 at `dst`
// (round-to-nearest-even); INVALID_ARGUMENT naming `who` for any other dtype.
absl::Status ConvertWireToBf16(absl::string_view who, const void* src, DType wire, uint16_t* dst,
                               int64_t n, cudaStream_t stream) {
  if (wire == DType::kFP32) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        kernels::LaunchConvertFp32ToBf16(static_cast<const float*>(src), dst, n, stream));
  } else if (wire == DType::kFP16) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        kernels::LaunchConvertFp16ToBf16(static_cast<const uint16_t*>(src), dst, n, stream));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": hidden_states must be bf16, fp16 or fp32, got ", DTypeName(wire)));
  }
  return absl::OkStatus();
}

// Threads per rank for the staging copies between request bytes and pinned memory.
constexpr int kStagingCopyThreads = 4;

// A copy-engine node costs a captured step several us at any size, the SMs' PCIe reads and
// writes of page-locked memory well under that for small copies (one token's hidden states
// and answer). MOESERVE_GRAPH_SM_COPY_MAX_BYTES overrides the limit for A/B runs (0: never).
constexpr size_t kGraphSmCopyMaxBytes = size_t{256} << 10;
size_t GraphSmCopyMaxBytes() {
  const char* v = std::getenv("MOESERVE_GRAPH_SM_COPY_MAX_BYTES");
  size_t bytes = 0;
  if (v != nullptr && absl::SimpleAtoi(v, &bytes)) return bytes;
  return kGraphSmCopyMaxBytes;
}

// The reduce's output kind for an answer dtype (FP32, BF16 or FP16: writes_output_dtype).
kernels::ReduceOutput ReduceOutputOf(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return kernels::ReduceOutput::kBf16;
    case DType::kFP16:
      return kernels::ReduceOutput::kFp16;
    default:
      return kernels::ReduceOutput::kFp32;
  }
}

}  // namespace

DevicePackedLayer::~DevicePackedLayer() {
  for (void* p : {w13, w2, static_cast<void*>(w13_scale), static_cast<void*>(w2_scale)}) {
    if (p != nullptr) cudaFree(p);
  }
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<std::shared_ptr<CudaContext>> CudaContext::Create(int device) {
  const int n = CudaDeviceCount();
  if (device < 0 || device >= n) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " requested but ", n, " visible"));
  }
  std::shared_ptr<CudaContext> ctx(new CudaContext());
  ctx->device_ = device;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  MOESERVE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&ctx->num_sms_, cudaDevAttrMultiProcessorCount, device));
  cudaStream_t stream = nullptr;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ctx->stream_ = stream;
  return ctx;
}

CudaContext::~CudaContext() {
  if (stream_ != nullptr) {
    cudaSetDevice(device_);
    cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  }
}

// ---------------------------------------------------------------------------------------------
// Workspaces and stage timing.

namespace {

// One event per boundary mark on the context's stream; elapsed times are read once, after the
// forward's last synchronization, so timing adds no host wait of its own. Marks inside a graph
// record one event per stage, which every replay records again (cudaEventRecordExternal), on a
// side branch of the graph: the event node waits for the work before it, but the work after
// it does not wait for the node, so the kernels keep their programmatic (PDL) edges.
class CudaStageTimer final : public StageTimer {
 public:
  explicit CudaStageTimer(std::shared_ptr<CudaContext> ctx) : ctx_(std::move(ctx)) {}
  ~CudaStageTimer() override {
    cudaSetDevice(ctx_->device());
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    for (cudaEvent_t e : graph_events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : forks_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (join_ != nullptr) cudaEventDestroy(join_);
    if (side_ != nullptr) cudaStreamDestroy(side_);
  }
  void Reset() override {
    marks_.clear();
    used_ = 0;
  }
  absl::Status Mark(Stage stage) override {
    if (!marks_.empty() && marks_.back().stage == stage) return absl::OkStatus();
    return Record(stage);
  }
  absl::Status Stop() override {  // idempotent: the first Stop ends the forward's timing
    if (!marks_.empty() && marks_.back().stage == kNumStages) return absl::OkStatus();
    return Record(kNumStages);
  }
  absl::StatusOr<std::array<double, kNumStages>> ElapsedUs() override {
    std::array<double, kNumStages> us{};
    if (marks_.empty()) return us;
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(marks_.back().event));
    for (size_t i = 0; i + 1 < marks_.size(); ++i) {
      if (marks_[i].stage == kNumStages) continue;  // stopped: no stage ran until the next mark
      float ms = 0;
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaEventElapsedTime(&ms, marks_[i].event, marks_[i + 1].event));
      us[marks_[i].stage] += 1000.0 * ms;
    }
    return us;
  }
  bool marks_in_graphs() const override { return true; }
  absl::Status MarkInGraph(Stage stage) override {
    MOESERVE_ASSIGN_OR_RETURN(cudaEvent_t e, GraphEvent(stage));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
    if (side_ == nullptr) {
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    }
    if (forks_[stage] == nullptr) {
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&forks_[stage], cudaEventDisableTiming));
    }
    // Fork: the side stream joins the capture after the main stream's work so far.
    const cudaStream_t main = StreamOf(*ctx_);
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(forks_[stage], main));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, forks_[stage], 0));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventRecordWithFlags(e, side_, cudaEventRecordExternal));
    forked_ = true;
    return absl::OkStatus();
  }
  absl::Status EndMarksInGraph() override {
    if (!forked_) return absl::OkStatus();
    forked_ = false;
    // Join: a capture must end with every forked stream joined back into its origin.
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(join_, side_));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(StreamOf(*ctx_), join_, 0));
    return absl::OkStatus();
  }
  absl::Status MarkReplayed(Stage stage) override {
    MOESERVE_ASSIGN_OR_RETURN(cudaEvent_t e, GraphEvent(stage));
    marks_.push_back({static_cast<int>(stage), e});
    return absl::OkStatus();
  }

 private:
  struct MarkAt {
    int stage;  // the stage this mark starts; kNumStages: Stop()
    cudaEvent_t event;
  };
  absl::Status Record(int stage) {
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
    if (used_ == events_.size()) {
      cudaEvent_t e = nullptr;
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
      events_.push_back(e);
    }
    cudaEvent_t e = events_[used_++];
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(e, StreamOf(*ctx_)));
    marks_.push_back({stage, e});
    return absl::OkStatus();
  }
  absl::StatusOr<cudaEvent_t> GraphEvent(Stage stage) {
    if (stage < 0 || stage >= kNumStages) {
      return absl::InvalidArgumentError("MarkInGraph: not a stage");
    }
    if (graph_events_[stage] == nullptr) {
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&graph_events_[stage]));
    }
    return graph_events_[stage];
  }
  std::shared_ptr<CudaContext> ctx_;
  std::vector<cudaEvent_t> events_;                     // grow-only pool for host-side marks
  size_t used_ = 0;                                     // events_ used since Reset
  std::array<cudaEvent_t, kNumStages> graph_events_{};  // recorded by graphs' event nodes
  // The side branch of a capture: its stream, the fork points, the join.
  cudaStream_t side_ = nullptr;
  std::array<cudaEvent_t, kNumStages> forks_{};
  cudaEvent_t join_ = nullptr;
  bool forked_ = false;  // a capture forked and has not joined yet
  std::vector<MarkAt> marks_;
};

class CudaWorkspaceAllocator final : public WorkspaceAllocator {
 public:
  explicit CudaWorkspaceAllocator(std::shared_ptr<CudaContext> ctx) : ctx_(std::move(ctx)) {}
  Device device() const override { return ctx_->tensor_device(); }
  absl::StatusOr<TensorView> Get(Slot slot, DType dtype, const Shape& shape) override {
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
    const size_t bytes = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
    MOESERVE_ASSIGN_OR_RETURN(void* p, buffers_[slot].Get(bytes));
    return TensorView(p, dtype, shape, device());
  }
  std::unique_ptr<StageTimer> MakeStageTimer() const override {
    return std::make_unique<CudaStageTimer>(ctx_);
  }
  void ReleaseSuperseded() override {
    bool any = false;
    for (const DeviceBuffer& buffer : buffers_) any = any || buffer.superseded_bytes() > 0;
    if (!any) return;  // the usual case: no call at all
    cudaSetDevice(ctx_->device());
    for (DeviceBuffer& buffer : buffers_) buffer.ReleaseSuperseded();
  }
  absl::StatusOr<std::unique_ptr<StepGraph>> Capture(
      const std::function<absl::Status()>& enqueue) override;

 private:
  std::shared_ptr<CudaContext> ctx_;
  DeviceBuffer buffers_[kNumSlots];
};

class CudaStepGraph final : public StepGraph {
 public:
  CudaStepGraph(std::shared_ptr<CudaContext> ctx, cudaGraph_t graph, cudaGraphExec_t exec)
      : ctx_(std::move(ctx)), graph_(graph), exec_(exec) {}
  ~CudaStepGraph() override {
    cudaSetDevice(ctx_->device());
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  absl::Status Launch() override {
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, StreamOf(*ctx_)));
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
};

absl::StatusOr<std::unique_ptr<StepGraph>> CudaWorkspaceAllocator::Capture(
    const std::function<absl::Status()>& enqueue) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
  const cudaStream_t stream = StreamOf(*ctx_);
  // Thread-local: other lanes' threads may allocate meanwhile; this thread may not.
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status enqueued = enqueue();
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!enqueued.ok() || ended != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();  // a failed capture leaves no sticky error behind
    if (!enqueued.ok()) return enqueued;
    return absl::InternalError(absl::StrCat("cudaStreamEndCapture: ", cudaGetErrorString(ended)));
  }
  cudaGraphExec_t exec = nullptr;
  if (const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0); e != cudaSuccess) {
    cudaGraphDestroy(graph);
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaGraphInstantiate: ", cudaGetErrorString(e)));
  }
  return std::make_unique<CudaStepGraph>(ctx_, graph, exec);
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkspaceAllocator>> CreateCudaWorkspaceAllocator(
    std::shared_ptr<CudaContext> ctx) {
  if (ctx == nullptr) return absl::InvalidArgumentError("CudaWorkspaceAllocator: no context");
  return std::make_unique<CudaWorkspaceAllocator>(std::move(ctx));
}

// ---------------------------------------------------------------------------------------------
// Weights.

namespace {

absl::StatusOr<std::unique_ptr<DevicePackedLayer>> UploadLayer(const LayerWeights& w,
                                                               const CudaContext& ctx) {
  const bool fp8 = w.format == WeightFormat::kMXFP8;
  const int64_t e = w.num_local_experts, h = w.hidden, n = w.intermediate;
  const int esize = fp8 ? 1 : 2;
  if (w.w13.nbytes() != static_cast<size_t>(e * 2 * n * h * esize) ||
      w.w2.nbytes() != static_cast<size_t>(e * h * n * esize)) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceWeightStore: weights ",
                                                   w.w13.DebugString(), " / ", w.w2.DebugString(),
                                                   " do not match E=", e, " H=", h, " I=", n));
  }
  auto out = std::make_unique<DevicePackedLayer>();
  out->format = w.format;
  out->num_local_experts = e;
  out->layout = kernels::MakeMoePackedLayout(h, n);
  const auto& l = out->layout;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&out->w13, e * l.w13_elems_per_expert() * esize));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&out->w2, e * l.w2_elems_per_expert() * esize));
  if (fp8) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMalloc(reinterpret_cast<void**>(&out->w13_scale), e * l.w13_scales_per_expert()));
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMalloc(reinterpret_cast<void**>(&out->w2_scale), e * l.w2_scales_per_expert()));
  }
  // Raw copies go through one temporary, one tensor at a time.
  DeviceBuffer raw, raw_scale, max_code;
  int32_t* d_max_code = nullptr;
  if (fp8) {
    MOESERVE_ASSIGN_OR_RETURN(void* p, max_code.Get(sizeof(int32_t)));
    d_max_code = static_cast<int32_t*>(p);
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d_max_code, 0, sizeof(int32_t), StreamOf(ctx)));
  }
  auto pack = [&](const TensorView& v, const TensorView& s, bool w13) -> absl::Status {
    MOESERVE_ASSIGN_OR_RETURN(void* d, raw.Get(v.nbytes()));
    // Async on the context's stream: a plain cudaMemcpy from pageable memory may return before
    // the DMA lands, and the pack kernel runs on a non-blocking stream.
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d, v.raw_data(), v.nbytes(), cudaMemcpyHostToDevice, StreamOf(ctx)));
    uint8_t* ds = nullptr;
    if (fp8) {
      MOESERVE_ASSIGN_OR_RETURN(void* p, raw_scale.Get(s.nbytes()));
      ds = static_cast<uint8_t*>(p);
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(ds, s.raw_data(), s.nbytes(), cudaMemcpyHostToDevice, StreamOf(ctx)));
    }
    if (w13) {
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchPackMoeW13(
          d, ds, e, l, esize, out->w13, out->w13_scale, StreamOf(ctx), d_max_code));
    } else {
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchPackMoeW2(
          d, ds, e, l, esize, out->w2, out->w2_scale, StreamOf(ctx), d_max_code));
    }
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(StreamOf(ctx)));
    return absl::OkStatus();
  };
  MOESERVE_RETURN_IF_ERROR(pack(w.w13, w.w13_scale, true));
  MOESERVE_RETURN_IF_ERROR(pack(w.w2, w.w2_scale, false));
  if (fp8) {  // pack() synchronized the stream
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(&out->max_scale_code, d_max_code, sizeof(int32_t), cudaMemcpyDeviceToHost));
  }
  return out;
}

int64_t PackedBytes(const DevicePackedLayer& p) {
  const int64_t esize = p.format == WeightFormat::kMXFP8 ? 1 : 2;
  int64_t b = p.num_local_experts *
              (p.layout.w13_elems_per_expert() + p.layout.w2_elems_per_expert()) * esize;
  if (esize == 1) {
    b += p.num_local_experts * (p.layout.w13_scales_per_expert() + p.layout.w2_scales_per_expert());
  }
  return b;
}

}  // namespace

DeviceWeightStore::~DeviceWeightStore() {
  cudaSetDevice(device_);
  layers_.clear();
}

absl::StatusOr<std::shared_ptr<DeviceWeightStore>> DeviceWeightStore::CreateFromLayers(
    const std::vector<const LayerWeights*>& layers, const CudaContext& ctx) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device()));
  std::shared_ptr<DeviceWeightStore> store(new DeviceWeightStore());
  store->device_ = ctx.device();
  store->layers_.resize(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] == nullptr) continue;
    MOESERVE_ASSIGN_OR_RETURN(store->layers_[i], UploadLayer(*layers[i], ctx));
    store->device_bytes_ += PackedBytes(*store->layers_[i]);
  }
  return store;
}

absl::StatusOr<std::shared_ptr<DeviceWeightStore>> DeviceWeightStore::Create(
    const ExpertWeightStore& host, const CudaContext& ctx) {
  std::vector<const LayerWeights*> layers(host.config().num_layers, nullptr);
  for (int l = 0; l < host.config().num_layers; ++l) layers[l] = host.layer(l);
  return CreateFromLayers(layers, ctx);
}

const DevicePackedLayer* DeviceWeightStore::layer(int index) const {
  if (index < 0 || index >= static_cast<int>(layers_.size())) return nullptr;
  return layers_[index].get();
}

absl::StatusOr<const DevicePackedLayer*> DeviceWeightStore::ResidentLayer(
    int index, const LayerWeights* host, absl::string_view caller) const {
  const DevicePackedLayer* resident = layer(index);
  if (resident == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(caller, ": layer ", index,
                     " has no experts resident on the device (upload them with "
                     "DeviceWeightStore first)"));
  }
  const auto& l = resident->layout;
  if (host != nullptr && (host->num_local_experts != resident->num_local_experts ||
                          host->hidden != l.hidden || host->intermediate != l.intermediate)) {
    return absl::InternalError(absl::StrCat(caller, ": device weights of layer ", index,
                                            " do not match the host layer handed in"));
  }
  return resident;
}

// ---------------------------------------------------------------------------------------------
// PrepareAndFinalize.

namespace {

class CudaNoEpPrepareAndFinalize final : public PrepareAndFinalize {
 public:
  CudaNoEpPrepareAndFinalize(std::shared_ptr<CudaContext> ctx, int64_t max_num_tokens,
                             ActivationFormat format)
      : ctx_(std::move(ctx)),
        max_num_tokens_(max_num_tokens),
        format_(format),
        sm_copy_max_bytes_(GraphSmCopyMaxBytes()) {
    quant_.activation_dtype = DType::kBF16;
  }
  absl::string_view name() const override {
    return format_ == ActivationFormat::kStandard ? "CudaNoEpPrepareAndFinalize"
                                                  : "CudaNoEpBatchedPrepareAndFinalize";
  }
  ActivationFormat activation_format() const override { return format_; }
  std::optional<DType> topk_indices_dtype() const override { return DType::kINT32; }
  int64_t max_num_tokens_per_rank() const override { return max_num_tokens_; }
  int num_dispatchers() const override { return 1; }
  const QuantConfig& quant_config() const override { return quant_; }
  bool writes_output_dtype(DType dtype) const override {
    return dtype == DType::kFP32 || dtype == DType::kBF16 || dtype == DType::kFP16;
  }
  bool accepts_device_tensors() const override { return true; }
  // Standard only: BatchedExperts sizes its buffers from counts of host ids.
  bool accepts_device_routing() const override { return format_ == ActivationFormat::kStandard; }

  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override;
  absl::Status Finalize(const TensorView& output, const TensorView& fused_expert_output,
                        const PreparedActivations& prepared,
                        const TopKWeightAndReduce& weight_and_reduce) override;

  // Graphs: the Standard format only (BatchedExperts sizes its buffers from the host's counts).
  bool supports_graphs() const override { return format_ == ActivationFormat::kStandard; }
  absl::StatusOr<bool> StageInputs(const PrepareArgs& args, int64_t padded_tokens,
                                   int64_t capacity_tokens) override;
  absl::Status PrepareStaged(const PrepareArgs& args, int64_t padded_tokens,
                             PreparedActivations* out) override;
  absl::Status FinalizeStaged(DType dtype, Device output_device,
                              const TensorView& fused_expert_output,
                              const PreparedActivations& prepared,
                              const TopKWeightAndReduce& weight_and_reduce) override;
  absl::Status CollectOutput(const TensorView& output, StageTimer* timer) override;

 private:
  // Where the staged block of `padded` rows keeps its parts: [x (wire dtype) | ids | weights].
  struct StagedLayout {
    size_t ids = 0, weights = 0, bytes = 0;
  };
  static StagedLayout LayoutOf(int64_t padded, int64_t k, int64_t topk, DType wire) {
    StagedLayout l;
    l.ids = (static_cast<size_t>(padded * k) * DTypeSize(wire) + 15) / 16 * 16;
    l.weights = l.ids + (static_cast<size_t>(padded * topk) * 4 + 15) / 16 * 16;
    l.bytes = l.weights + static_cast<size_t>(padded * topk) * 4;
    return l;
  }
  // The global -> local id map of Prepare, into `local`; counts per local expert when given.
  absl::Status MapIds(const PrepareArgs& args, int32_t* local, std::vector<int32_t>* counts);
  static bool DeviceRouting(const PrepareArgs& args) {
    return !args.topk_ids.device().is_host() || !args.topk_weights.device().is_host();
  }
  // Device routing: enqueues the copy of args' ids and weights into out_ids / out_weights
  // [padded, topk] (device), checked on the way (kernels::LaunchStageRouting); the verdict is
  // read by RoutingVerdict after the forward's wait.
  absl::Status StageDeviceRouting(const PrepareArgs& args, int64_t padded, int32_t* out_ids,
                                  float* out_weights);
  // After the stream's wait: INVALID_ARGUMENT for the first bad route StageDeviceRouting found
  // in this forward, else OK (also when the routing was host memory).
  absl::Status RoutingVerdict();
  // Finalize's end: waits for `stream`, moves a staged answer into place, then the verdict.
  absl::Status FinishAnswer(cudaStream_t stream);
  // Frees what the buffers' growths replaced (GrowOnlyBuffer::ReleaseSuperseded; waits for the
  // device): at the start of a step, when this PrepareAndFinalize's earlier work is done.
  void ReleaseSuperseded();

  std::shared_ptr<CudaContext> ctx_;
  int64_t max_num_tokens_;
  ActivationFormat format_;
  // Graph path: staged copies between page-locked and device memory of at most this many bytes
  // run on the SMs (kernels::LaunchCopyBytes), larger ones on a copy engine.
  size_t sm_copy_max_bytes_;
  QuantConfig quant_;
  std::vector<int32_t> host_counts_;
  // Graph path: buffers sized once for graph_capacity_ rows of graph_hidden_ (4-byte elements)
  // and graph_topk_, so their addresses never change under a captured graph.
  int64_t graph_capacity_ = 0, graph_hidden_ = 0, graph_topk_ = 0;
  int64_t graph_rows_ = 0;  // rows staged by the last StageInputs
  void* g_pin_in_ = nullptr;
  void* g_dev_in_ = nullptr;
  void* g_dev_x_ = nullptr;
  void* g_dev_out_ = nullptr;
  void* g_pin_out_ = nullptr;
  DeviceBuffer g_dev_in_buf_, g_dev_x_buf_, g_dev_out_buf_;
  PinnedBuffer g_pin_in_buf_, g_pin_out_buf_;
  // Prepare's outputs (valid until the next Prepare) and Finalize's reduce target.
  DeviceBuffer hidden_, wire_, ids_, weights_, batched_a1q_, align_, reduced_;
  PinnedBuffer staging_;
  int32_t* slot_ = nullptr;  // batched: route -> row within its expert, into align_
  // Device routing's report (page-locked, written by the device) and what it is about.
  PinnedBuffer report_buf_;
  kernels::RoutingReport* report_ = nullptr;
  bool verdict_pending_ = false;
  DeviceBuffer device_map_;               // the expert map device routing applies
  std::vector<int32_t> device_map_host_;  // what device_map_ holds
  int64_t report_topk_ = 1, report_num_experts_ = 0;
  ParallelCopier copier_{kStagingCopyThreads};
  AnswerCopy answer_{&copier_};
};

absl::Status CudaNoEpPrepareAndFinalize::MapIds(const PrepareArgs& args, int32_t* local,
                                                std::vector<int32_t>* counts) {
  // Global -> local ids (the engine range-checked the ids; this guards the map lookup).
  const int64_t n = args.topk_ids.numel(), e = args.num_local_experts;
  const int32_t* g = args.topk_ids.data<int32_t>();
  const bool has_map = !args.expert_map.empty();
  if (counts != nullptr) counts->assign(e, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (g[i] < 0 || g[i] >= args.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": topk_ids[", i, "] = ", g[i],
                                                     " not in [0, ", args.num_experts, ")"));
    }
    const int32_t l = has_map ? args.expert_map.data<int32_t>()[g[i]] : g[i];
    if (l < -1 || l >= e) {
      return absl::InternalError(absl::StrCat(name(), ": local expert ", l, " out of range"));
    }
    local[i] = l;
    if (counts != nullptr && l >= 0) ++(*counts)[l];
  }
  return absl::OkStatus();
}

absl::Status CudaNoEpPrepareAndFinalize::StageDeviceRouting(const PrepareArgs& args, int64_t padded,
                                                            int32_t* out_ids, float* out_weights) {
  const TensorView& ids = args.topk_ids;
  const TensorView& w = args.topk_weights;
  if (ids.device().space != MemorySpace::kCuda || w.device().space != MemorySpace::kCuda ||
      format_ != ActivationFormat::kStandard) {
    return absl::InvalidArgumentError(absl::StrCat(
        name(),
        ": device routing needs topk_ids and topk_weights both in device memory and the "
        "Standard format, got ",
        ids.DebugString(), " and ", w.DebugString()));
  }
  const int32_t* d_map = nullptr;
  if (!args.expert_map.empty()) {
    // The rank's map is fixed: on the device once (again only if another map comes).
    const TensorView& map = args.expert_map;
    if (map.dtype() != DType::kINT32 || map.numel() != args.num_experts ||
        !map.device().is_host() || !map.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": expert_map must be host INT32 [",
                                                     args.num_experts, "], got ",
                                                     map.DebugString()));
    }
    const int32_t* host = map.data<int32_t>();
    const size_t bytes = static_cast<size_t>(map.numel()) * 4;
    MOESERVE_ASSIGN_OR_RETURN(void* p, device_map_.Get(bytes));
    if (!std::equal(host, host + map.numel(), device_map_host_.begin(), device_map_host_.end())) {
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
      device_map_host_.assign(host, host + map.numel());
    }
    d_map = static_cast<const int32_t*>(p);
  }
  if (report_ == nullptr) {
    MOESERVE_ASSIGN_OR_RETURN(void* p, report_buf_.Get(sizeof(kernels::RoutingReport)));
    report_ = static_cast<kernels::RoutingReport*>(p);
  }
  const int64_t m = ids.dim(0), topk = ids.dim(1);
  report_topk_ = topk;
  report_num_experts_ = args.num_experts;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchStageRouting(
      ids.data<int32_t>(), w.data<float>(), m, static_cast<int>(topk), padded,
      static_cast<int>(args.num_experts), d_map, static_cast<int>(args.num_local_experts),
      kMaxAbsTopkWeight, out_ids, out_weights, report_, StreamOf(*ctx_)));
  verdict_pending_ = true;
  return absl::OkStatus();
}

absl::Status CudaNoEpPrepareAndFinalize::RoutingVerdict() {
  if (!verdict_pending_) return absl::OkStatus();
  verdict_pending_ = false;
  const kernels::RoutingReport report = *report_;
  if (report.bad_id_route >= 0) {
    return BadTopkIdError(report.bad_id_value, report.bad_id_route, report_topk_,
                          report_num_experts_);
  }
  if (report.bad_weight_route >= 0) {
    return BadTopkWeightError(report.bad_weight_value, report.bad_weight_route, report_topk_);
  }
  return absl::OkStatus();
}

void CudaNoEpPrepareAndFinalize::ReleaseSuperseded() {
  for (GrowOnlyBuffer* b : std::initializer_list<GrowOnlyBuffer*>{
           &g_dev_in_buf_, &g_dev_x_buf_, &g_dev_out_buf_, &g_pin_in_buf_, &g_pin_out_buf_,
           &hidden_, &wire_, &ids_, &weights_, &batched_a1q_, &align_, &reduced_, &staging_,
           &report_buf_, &device_map_}) {
    b->ReleaseSuperseded();
  }
  answer_.ReleaseSuperseded();
}

absl::Status CudaNoEpPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                 PreparedActivations* out) {
  MOESERVE_RETURN_IF_ERROR(CheckPrepareArgsLayout(name(), args));
  const TensorView& x = args.hidden_states;
  const int64_t m = x.dim(0), k = x.dim(1), topk = args.topk_ids.dim(1);
  const int64_t e = args.num_local_experts;
  if (m > max_num_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name(), ": ", m, " tokens exceed max_num_tokens_per_rank=", max_num_tokens_));
  }
  if (k % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": hidden must be a multiple of 8 on the CUDA path, got ", k));
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
  ReleaseSuperseded();
  const cudaStream_t stream = StreamOf(*ctx_);
  const Device gpu = ctx_->tensor_device();
  // The input crosses in its own dtype (one staged copy); the quantization hook, BF16
  // activations (exact for BF16, round-to-nearest-even otherwise), runs on the device. A strided
  // view is converted on the host instead.
  const DType wire = x.is_contiguous() ? x.dtype() : DType::kBF16;
  const size_t x_bytes = m * k * 2, wire_bytes = m * k * DTypeSize(wire);
  const size_t id_bytes = m * topk * 4, w_bytes = m * topk * 4;
  MOESERVE_ASSIGN_OR_RETURN(void* pin, staging_.Get(wire_bytes + id_bytes + w_bytes + 64));
  auto* pin_x = static_cast<uint8_t*>(pin);
  auto* pin_ids = reinterpret_cast<int32_t*>(pin_x + (wire_bytes + 15) / 16 * 16);
  auto* pin_w = reinterpret_cast<float*>(pin_ids + m * topk);
  // Input in device memory (a client's CUDA region) is copied device to device; page-locked
  // input (a registered shared-memory region) straight from where it is, without staging.
  const bool device_x = x.device().space == MemorySpace::kCuda;
  if (device_x && !x.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": hidden_states in device memory must be contiguous"));
  }
  const bool direct_x = m > 0 && x.is_contiguous() &&
                        (device_x || x.device().space == MemorySpace::kPinnedHost ||
                         IsPinnedHostPointer(x.raw_data()));
  if (direct_x) {
    // Nothing to stage.
  } else if (x.is_contiguous()) {
    copier_.Copy(pin_x, x.raw_data(), wire_bytes);
  } else {
    MOESERVE_RETURN_IF_ERROR(
        ConvertTensor(x, TensorView(pin_x, DType::kBF16, {m, k}, Device::PinnedHost())));
  }
  const bool device_routing = DeviceRouting(args);
  verdict_pending_ = false;
  if (!device_routing) {
    MOESERVE_RETURN_IF_ERROR(MapIds(args, pin_ids, &host_counts_));
    std::memcpy(pin_w, args.topk_weights.raw_data(), w_bytes);
  }
  MOESERVE_ASSIGN_OR_RETURN(void* d_x, hidden_.Get(x_bytes));
  MOESERVE_ASSIGN_OR_RETURN(void* d_ids, ids_.Get(id_bytes));
  MOESERVE_ASSIGN_OR_RETURN(void* d_w, weights_.Get(w_bytes));
  if (m > 0) {
    // One contiguous pinned block (or the input where it is); three copies (then the conversion,
    // for FP16 / FP32 input).
    void* d_wire = d_x;
    if (wire != DType::kBF16) {
      MOESERVE_ASSIGN_OR_RETURN(d_wire, wire_.Get(wire_bytes));
    }
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_wire, direct_x ? x.raw_data() : pin_x, wire_bytes,
                        device_x ? cudaMemcpyDefault : cudaMemcpyHostToDevice, stream));
    if (wire != DType::kBF16) {
      MOESERVE_RETURN_IF_ERROR(
          ConvertWireToBf16(name(), d_wire, wire, static_cast<uint16_t*>(d_x), m * k, stream));
    }
    if (device_routing) {
      MOESERVE_RETURN_IF_ERROR(
          StageDeviceRouting(args, m, static_cast<int32_t*>(d_ids), static_cast<float*>(d_w)));
    } else {
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(d_ids, pin_ids, id_bytes, cudaMemcpyHostToDevice, stream));
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(d_w, pin_w, w_bytes, cudaMemcpyHostToDevice, stream));
    }
  }
  out->format = format_;
  out->a1q_scale = TensorView();
  out->topk_ids = TensorView(d_ids, DType::kINT32, {m, topk}, gpu);
  out->topk_weights = TensorView(d_w, DType::kFP32, {m, topk}, gpu);
  out->problem = NoEpProblem(args, m, k, topk);
  if (format_ == ActivationFormat::kStandard) {
    out->a1q = TensorView(d_x, DType::kBF16, {m, k}, gpu);
    out->expert_num_tokens = TensorView();
    return absl::OkStatus();
  }
  // BatchedExperts: rows grouped by expert on the device; capacity = the largest expert's
  // routes, known here from the host ids, so nothing is ever dropped.
  int64_t max_tokens = 1;
  for (int32_t n : host_counts_) max_tokens = std::max<int64_t>(max_tokens, n);
  if (e > kernels::kMoeAlignMaxExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", e, " local experts exceed ", kernels::kMoeAlignMaxExperts));
  }
  MOESERVE_ASSIGN_OR_RETURN(void* d_a, batched_a1q_.Get(e * max_tokens * k * 2));
  // [counts (e) | offsets (e + 1) | pad | sorted routes | slot per route]
  MOESERVE_ASSIGN_OR_RETURN(void* d_align, align_.Get((2 * e + 2 + 2 * m * topk) * 4 + 4));
  auto* counts = static_cast<int32_t*>(d_align);
  int32_t* sorted = counts + 2 * e + 2;
  slot_ = sorted + m * topk;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(static_cast<int32_t*>(d_ids), m * topk,
                                                        static_cast<int>(e), counts, counts + e + 1,
                                                        sorted, slot_, stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchPermuteToBatched(
      static_cast<uint16_t*>(d_x), static_cast<int32_t*>(d_ids), slot_, m, static_cast<int>(topk),
      k, static_cast<int>(e), max_tokens, static_cast<uint16_t*>(d_a), stream));
  out->a1q = TensorView(d_a, DType::kBF16, {e, max_tokens, k}, gpu);
  out->expert_num_tokens = TensorView(counts, DType::kINT32, {e}, gpu);
  out->problem.max_num_tokens = max_tokens;
  return absl::OkStatus();
}

absl::Status CudaNoEpPrepareAndFinalize::Finalize(const TensorView& output,
                                                  const TensorView& fused_expert_output,
                                                  const PreparedActivations& prepared,
                                                  const TopKWeightAndReduce& weight_and_reduce) {
  const int64_t m = prepared.problem.num_tokens, k = prepared.problem.hidden;
  const int64_t topk = prepared.problem.topk, e = prepared.problem.num_local_experts;
  if (output.rank() != 2 || output.dim(0) != m || output.dim(1) != k ||
      !writes_output_dtype(output.dtype()) || !output.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": output must be FP32/BF16/FP16 [", m,
                                                   ", ", k, "], got ", output.DebugString()));
  }
  if (m == 0) return absl::OkStatus();
  if (fused_expert_output.device() != ctx_->tensor_device() ||
      fused_expert_output.dtype() != DType::kFP32) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": expert output must be FP32 on ",
                                                   DeviceName(ctx_->tensor_device()), ", got ",
                                                   fused_expert_output.DebugString()));
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
  const cudaStream_t stream = StreamOf(*ctx_);
  const auto* fused = fused_expert_output.data<float>();
  const auto* w = prepared.topk_weights.data<float>();
  const auto* ids = prepared.topk_ids.data<int32_t>();
  const float* answer = fused;
  switch (ResolveWeightAndReduce(weight_and_reduce.kind(), format_)) {
    case TopKWeightAndReduce::Kind::kNoOp:
      if (fused_expert_output.numel() != m * k) {
        return absl::InvalidArgumentError(absl::StrCat(name(), ": NoOp reduce needs [", m, ", ", k,
                                                       "] expert output, got ",
                                                       fused_expert_output.DebugString()));
      }
      break;
    case TopKWeightAndReduce::Kind::kContiguous: {
      if (format_ != ActivationFormat::kStandard) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": Contiguous reduce needs Standard-format expert output"));
      }
      // Rounded to the answer's dtype as it is stored: the copy alone follows.
      MOESERVE_ASSIGN_OR_RETURN(void* d_out, reduced_.Get(output.nbytes()));
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceContiguous(
          fused, w, ids, m, static_cast<int>(topk), k, static_cast<int>(e), d_out,
          ReduceOutputOf(output.dtype()), stream));
      MOESERVE_RETURN_IF_ERROR(answer_.EnqueueInOutputDtype(d_out, output, stream));
      return FinishAnswer(stream);
    }
    case TopKWeightAndReduce::Kind::kNaiveBatched: {
      if (format_ != ActivationFormat::kBatchedExperts) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": NaiveBatched reduce needs BatchedExperts output"));
      }
      MOESERVE_ASSIGN_OR_RETURN(void* d_out, reduced_.Get(m * k * 4));
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceNaiveBatched(
          fused, w, ids, slot_, m, static_cast<int>(topk), k, static_cast<int>(e),
          prepared.problem.max_num_tokens, static_cast<float*>(d_out), stream));
      answer = static_cast<float*>(d_out);
      break;
    }
    case TopKWeightAndReduce::Kind::kDelegate:
      return absl::InternalError("unresolved TopKWeightAndReduce");
  }
  MOESERVE_RETURN_IF_ERROR(answer_.Enqueue(answer, output, stream));
  return FinishAnswer(stream);
}

absl::Status CudaNoEpPrepareAndFinalize::FinishAnswer(cudaStream_t stream) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  answer_.Finish();
  return RoutingVerdict();
}

absl::StatusOr<bool> CudaNoEpPrepareAndFinalize::StageInputs(const PrepareArgs& args,
                                                             int64_t padded_tokens,
                                                             int64_t capacity_tokens) {
  MOESERVE_RETURN_IF_ERROR(CheckPrepareArgsLayout(name(), args));
  const TensorView& x = args.hidden_states;
  const int64_t m = x.dim(0), k = x.dim(1), topk = args.topk_ids.dim(1);
  // Strided input: the eager path converts it. Device (a CUDA region) or page-locked (a
  // registered shared-memory region) input is copied straight into the device staging here,
  // outside the graph; the graph then copies only the routing (PrepareStaged).
  if (!x.is_contiguous()) return false;
  const bool direct_x = x.device().space != MemorySpace::kHost;
  const DType wire = x.dtype();
  if (wire != DType::kBF16 && wire != DType::kFP16 && wire != DType::kFP32) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": hidden_states must be bf16, fp16 or fp32, got ", DTypeName(wire)));
  }
  if (k % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": hidden must be a multiple of 8 on the CUDA path, got ", k));
  }
  if (m > padded_tokens || padded_tokens > capacity_tokens) {
    return absl::InternalError(absl::StrCat(name(), ": staging ", m, " tokens as ", padded_tokens,
                                            " of ", capacity_tokens));
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
  ReleaseSuperseded();
  if (graph_capacity_ == 0) {
    // Once: every later size fits, so no captured address ever moves.
    const size_t in = LayoutOf(capacity_tokens, k, topk, DType::kFP32).bytes;
    const size_t rows = static_cast<size_t>(capacity_tokens * k);
    MOESERVE_ASSIGN_OR_RETURN(g_pin_in_, g_pin_in_buf_.Get(in));
    MOESERVE_ASSIGN_OR_RETURN(g_dev_in_, g_dev_in_buf_.Get(in));
    MOESERVE_ASSIGN_OR_RETURN(g_dev_x_, g_dev_x_buf_.Get(rows * 2));
    MOESERVE_ASSIGN_OR_RETURN(g_dev_out_, g_dev_out_buf_.Get(rows * 4));
    MOESERVE_ASSIGN_OR_RETURN(g_pin_out_, g_pin_out_buf_.Get(rows * 4));
    graph_capacity_ = capacity_tokens;
    graph_hidden_ = k;
    graph_topk_ = topk;
  } else if (capacity_tokens != graph_capacity_ || k != graph_hidden_ || topk != graph_topk_) {
    return false;  // sized for another shape: eager
  }
  const StagedLayout l = LayoutOf(padded_tokens, k, topk, wire);
  auto* base = static_cast<uint8_t*>(g_pin_in_);
  const size_t x_bytes = static_cast<size_t>(m * k) * DTypeSize(wire);
  if (!direct_x) {
    copier_.Copy(base, x.raw_data(), x_bytes);
  } else if (x_bytes > 0) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(g_dev_in_, x.raw_data(), x_bytes, cudaMemcpyDefault, StreamOf(*ctx_)));
  }
  verdict_pending_ = false;
  graph_rows_ = m;
  if (DeviceRouting(args)) {
    // Checked and padded on the device, straight into the device staging (outside the graph).
    auto* dev = static_cast<uint8_t*>(g_dev_in_);
    MOESERVE_RETURN_IF_ERROR(StageDeviceRouting(args, padded_tokens,
                                                reinterpret_cast<int32_t*>(dev + l.ids),
                                                reinterpret_cast<float*>(dev + l.weights)));
    return true;
  }
  auto* ids = reinterpret_cast<int32_t*>(base + l.ids);
  auto* w = reinterpret_cast<float*>(base + l.weights);
  MOESERVE_RETURN_IF_ERROR(MapIds(args, ids, nullptr));
  std::memcpy(w, args.topk_weights.raw_data(), static_cast<size_t>(m * topk) * 4);
  // Padding routes go nowhere and weigh nothing; padding rows of x are never read.
  std::fill(ids + m * topk, ids + padded_tokens * topk, -1);
  std::fill(w + m * topk, w + padded_tokens * topk, 0.0f);
  return true;
}

absl::Status CudaNoEpPrepareAndFinalize::PrepareStaged(const PrepareArgs& args,
                                                       int64_t padded_tokens,
                                                       PreparedActivations* out) {
  const int64_t k = args.hidden_states.dim(1), topk = args.topk_ids.dim(1);
  const DType wire = args.hidden_states.dtype();
  if (graph_capacity_ == 0 || padded_tokens > graph_capacity_ || k != graph_hidden_ ||
      topk != graph_topk_) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(), ": PrepareStaged before StageInputs"));
  }
  const cudaStream_t stream = StreamOf(*ctx_);
  const Device gpu = ctx_->tensor_device();
  const StagedLayout l = LayoutOf(padded_tokens, k, topk, wire);
  // What StageInputs put on the device itself (device or page-locked hidden states; device
  // routing) does not cross here.
  const size_t from = args.hidden_states.device().space != MemorySpace::kHost ? l.ids : 0;
  const size_t to = DeviceRouting(args) ? l.ids : l.bytes;
  if (to > from && to - from <= sm_copy_max_bytes_) {
    // Small: the SMs read the page-locked staging (no copy-engine node in the graph).
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchCopyBytes(static_cast<uint8_t*>(g_dev_in_) + from,
                                                           static_cast<uint8_t*>(g_pin_in_) + from,
                                                           to - from, stream));
  } else if (to > from) {
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<uint8_t*>(g_dev_in_) + from,
                                                  static_cast<uint8_t*>(g_pin_in_) + from,
                                                  to - from, cudaMemcpyHostToDevice, stream));
  }
  auto* d_in = static_cast<uint8_t*>(g_dev_in_);
  void* d_x = d_in;
  if (wire != DType::kBF16) {
    d_x = g_dev_x_;
    MOESERVE_RETURN_IF_ERROR(ConvertWireToBf16(name(), d_in, wire, static_cast<uint16_t*>(d_x),
                                               padded_tokens * k, stream));
  }
  out->format = ActivationFormat::kStandard;
  out->a1q = TensorView(d_x, DType::kBF16, {padded_tokens, k}, gpu);
  out->a1q_scale = TensorView();
  out->topk_ids = TensorView(d_in + l.ids, DType::kINT32, {padded_tokens, topk}, gpu);
  out->topk_weights = TensorView(d_in + l.weights, DType::kFP32, {padded_tokens, topk}, gpu);
  out->expert_num_tokens = TensorView();
  out->problem = NoEpProblem(args, padded_tokens, k, topk);
  return absl::OkStatus();
}

absl::Status CudaNoEpPrepareAndFinalize::FinalizeStaged(
    DType dtype, Device output_device, const TensorView& fused_expert_output,
    const PreparedActivations& prepared, const TopKWeightAndReduce& weight_and_reduce) {
  const int64_t p = prepared.problem.num_tokens, k = prepared.problem.hidden;
  const int64_t topk = prepared.problem.topk, e = prepared.problem.num_local_experts;
  if (!writes_output_dtype(dtype) || p > graph_capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": cannot stage ", p, " rows of ", DTypeName(dtype)));
  }
  const cudaStream_t stream = StreamOf(*ctx_);
  const size_t out_bytes = static_cast<size_t>(p * k) * DTypeSize(dtype);
  const bool host_output = output_device.space == MemorySpace::kHost;
  // Small host answers: the SMs write the page-locked staging (no copy-engine node in the
  // graph). Else the answer waits in g_dev_out_: CollectOutput copies it straight to a device or
  // page-locked output, and for other host outputs the graph's last node copies it to staging.
  void* const target = host_output && out_bytes <= sm_copy_max_bytes_ ? g_pin_out_ : g_dev_out_;
  const bool then_to_staging = host_output && target == g_dev_out_;
  const float* answer = fused_expert_output.data<float>();
  switch (ResolveWeightAndReduce(weight_and_reduce.kind(), format_)) {
    case TopKWeightAndReduce::Kind::kNoOp:
      if (fused_expert_output.numel() != p * k) {
        return absl::InvalidArgumentError(absl::StrCat(name(), ": NoOp reduce needs [", p, ", ", k,
                                                       "] expert output, got ",
                                                       fused_expert_output.DebugString()));
      }
      if (dtype != DType::kFP32) {
        MOESERVE_RETURN_IF_ERROR(ConvertAnswerOnDevice(answer, dtype, target, p * k, stream));
      } else if (target == g_pin_out_) {
        MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchCopyBytes(target, answer, out_bytes, stream));
      } else {
        MOESERVE_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(target, answer, out_bytes, cudaMemcpyDeviceToDevice, stream));
      }
      break;
    case TopKWeightAndReduce::Kind::kContiguous:
      // The reduce rounds to the answer's dtype as it stores: no FP32 answer in memory, no
      // conversion kernel after it.
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceContiguous(
          answer, prepared.topk_weights.data<float>(), prepared.topk_ids.data<int32_t>(), p,
          static_cast<int>(topk), k, static_cast<int>(e), target, ReduceOutputOf(dtype), stream));
      break;
    default:
      return absl::FailedPreconditionError(
          absl::StrCat(name(), ": the graph path reduces Standard-format expert output only"));
  }
  if (then_to_staging) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(g_pin_out_, g_dev_out_, out_bytes, cudaMemcpyDeviceToHost, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaNoEpPrepareAndFinalize::CollectOutput(const TensorView& output,
                                                       StageTimer* timer) {
  if (!output.is_contiguous() || output.rank() != 2 || output.dim(0) != graph_rows_ ||
      output.dim(1) != graph_hidden_) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": the staged answer has ", graph_rows_,
                                                   " rows for contiguous [", graph_rows_, ", ",
                                                   graph_hidden_, "], got ", output.DebugString()));
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
  if (output.device().space != MemorySpace::kHost) {  // FinalizeStaged left it in g_dev_out_
    if (output.nbytes() > 0) {
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(output.raw_data(), g_dev_out_, output.nbytes(),
                                                    cudaMemcpyDefault, StreamOf(*ctx_)));
    }
    // Nothing but the wait is left: the timer's last event goes in before it (recorded after,
    // it would cost a second wait).
    if (timer != nullptr) MOESERVE_RETURN_IF_ERROR(timer->Stop());
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(StreamOf(*ctx_)));
    return RoutingVerdict();
  }
  // The graph's last node put the answer in g_pin_out_: the last event goes in before the wait
  // here too (the host copy below is not timed).
  if (timer != nullptr) MOESERVE_RETURN_IF_ERROR(timer->Stop());
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(StreamOf(*ctx_)));
  MOESERVE_RETURN_IF_ERROR(RoutingVerdict());
  copier_.Copy(output.raw_data(), g_pin_out_, output.nbytes());
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Experts.

class CudaExpertsImpl final : public Experts {
 public:
  CudaExpertsImpl(std::shared_ptr<CudaContext> ctx,
                  std::shared_ptr<const DeviceWeightStore> weights, ActivationFormat format,
                  std::unique_ptr<SplitKWorkspace> split_k)
      : ctx_(std::move(ctx)),
        weights_(std::move(weights)),
        format_(format),
        split_k_(std::move(split_k)) {}

  absl::string_view name() const override {
    return format_ == ActivationFormat::kStandard ? "CudaExperts" : "CudaBatchedExperts";
  }
  ActivationFormats activation_formats() const override { return {format_, format_}; }
  bool supports_expert_map() const override { return true; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return DType::kBF16; }
  // workspace13: the W13 output after SiLU-and-mul, BF16 [rows, intermediate padded];
  // workspace2: the routing of the Standard format (INT32 counts | offsets | sorted | slot);
  // output: FP32 per route [M, topk, K] (Standard) or per expert row [E, max_tokens, K].
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem& p) const override {
    const bool standard = format_ == ActivationFormat::kStandard;
    const int64_t rows = standard ? p.num_tokens * p.topk : p.num_local_experts * p.max_num_tokens;
    WorkspaceShapes s;
    s.workspace13 = {std::max<int64_t>(rows, 1),
                     kernels::MakeMoePackedLayout(p.hidden, p.intermediate).intermediate_padded};
    s.workspace13_dtype = DType::kBF16;
    s.workspace2 = {standard ? 2 * p.num_local_experts + 2 + 2 * rows : 1};
    s.workspace2_dtype = DType::kINT32;
    s.output = standard ? Shape{p.num_tokens, p.topk, p.hidden}
                        : Shape{p.num_local_experts, p.max_num_tokens, p.hidden};
    return s;
  }
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(format_ == ActivationFormat::kStandard
                                       ? TopKWeightAndReduce::Kind::kContiguous
                                       : TopKWeightAndReduce::Kind::kNaiveBatched);
  }
  absl::Status Apply(const ExpertsApplyArgs& args) override;
  // Standard: align, two GEMMs, all sized by the problem. Batched: its capacity comes from the
  // host's counts.
  bool supports_graphs() const override { return format_ == ActivationFormat::kStandard; }

 private:
  std::shared_ptr<CudaContext> ctx_;
  std::shared_ptr<const DeviceWeightStore> weights_;
  ActivationFormat format_;
  std::unique_ptr<SplitKWorkspace> split_k_;  // the GEMMs', this instance's stream only
};

absl::Status CudaExpertsImpl::Apply(const ExpertsApplyArgs& args) {
  const PreparedActivations& p = *args.prepared;
  MOESERVE_ASSIGN_OR_RETURN(const DevicePackedLayer* layer,
                            weights_->ResidentLayer(args.layer, args.weights, name()));
  const auto& l = layer->layout;
  const int64_t h = l.hidden, e = layer->num_local_experts;
  const Device gpu = ctx_->tensor_device();
  if (p.format != format_ || p.a1q.dtype() != DType::kBF16 || p.a1q.dim(p.a1q.rank() - 1) != h ||
      h % 8 != 0 || p.a1q.device() != gpu) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": expected BF16 a1q on ", DeviceName(gpu), " with hidden ", h,
                     " (a multiple of 8) in format ", ActivationFormatName(format_), ", got ",
                     p.a1q.DebugString()));
  }
  if (e > 2048) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": at most 2048 local experts"));
  }
  const WorkspaceShapes need = GetWorkspaceShapes(p.problem);
  if (args.output.device() != gpu || args.output.dtype() != DType::kFP32 ||
      args.output.shape() != need.output || args.workspace13.device() != gpu ||
      args.workspace13.numel() < NumElements(need.workspace13) || args.workspace2.device() != gpu ||
      args.workspace2.numel() < NumElements(need.workspace2)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": workspaces ", args.workspace13.DebugString(), ", ",
                     args.workspace2.DebugString(), " and output ", args.output.DebugString(),
                     " do not fit GetWorkspaceShapes() on ", DeviceName(gpu)));
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
  const cudaStream_t stream = StreamOf(*ctx_);
  const int64_t m = p.problem.num_tokens, topk = p.problem.topk;
  kernels::MoeGemmParams g1;
  g1.mxfp8 = layer->format == WeightFormat::kMXFP8;
  g1.num_experts = static_cast<int>(e);
  g1.layout = l;
  kernels::MoeGemmParams g2 = g1;
  void* fused = args.output.raw_data();
  int64_t rows = 0;  // rows of the intermediate / fused output
  if (format_ == ActivationFormat::kStandard) {
    rows = m * topk;
    if (rows == 0) return absl::OkStatus();
    auto* counts = args.workspace2.data<int32_t>();
    int32_t* offsets = counts + e;
    int32_t* sorted = offsets + e + 1;
    int32_t* slot = sorted + rows;
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(p.topk_ids.data<int32_t>(), rows,
                                                          static_cast<int>(e), counts, offsets,
                                                          sorted, slot, stream));
    g1.expert_counts = g2.expert_counts = counts;
    g1.expert_offsets = g2.expert_offsets = offsets;
    g1.gather = sorted;
    g1.gather_div = static_cast<int>(topk);
    g1.act = p.a1q.data<uint16_t>();
    g1.act_stride = h;
    g2.scatter = sorted;
    g2.out = fused;
    g1.max_rows_hint = g2.max_rows_hint = rows;
  } else {
    const int64_t max_tokens = p.a1q.dim(1);
    rows = e * max_tokens;
    if (m == 0) return absl::OkStatus();
    g1.expert_counts = g2.expert_counts = p.expert_num_tokens.data<int32_t>();
    g1.offset_stride = g2.offset_stride = max_tokens;
    g1.count_cap = g2.count_cap = static_cast<int32_t>(max_tokens);
    g1.act = p.a1q.data<uint16_t>();
    g1.act_stride = h;
    g2.out = fused;
    g1.max_rows_hint = g2.max_rows_hint = max_tokens;
  }
  const int64_t routes = std::max<int64_t>(1, std::min(rows, m * topk));
  g1.total_rows_hint = g2.total_rows_hint = routes;
  void* inter = args.workspace13.raw_data();
  g1.kind = kernels::MoeGemmKind::kGateUpSilu;
  g1.weights = layer->w13;
  g1.scales = layer->w13_scale;
  g1.out = inter;
  g1.out_stride = l.intermediate_padded;
  g2.kind = kernels::MoeGemmKind::kDown;
  g2.weights = layer->w2;
  g2.scales = layer->w2_scale;
  g2.act = static_cast<const uint16_t*>(inter);
  g2.act_stride = l.intermediate_padded;
  g2.out_stride = h;
  g1.split_workspace = g2.split_workspace = split_k_ != nullptr ? split_k_->data() : nullptr;
  // W2 reads the counts W13 read: it may fetch its first weights while W13 drains. In the
  // Standard format W13 follows the align of its ids, so it may count them itself and fetch its
  // first weights while the align (and the copy before it) runs.
  g2.weights_before_wait = true;
  if (format_ == ActivationFormat::kStandard) {
    g1.weights_before_wait = true;
    g1.route_ids = p.topk_ids.data<int32_t>();
    g1.num_routes = rows;
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedGemm(g1, ctx_->num_sms(), stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedGemm(g2, ctx_->num_sms(), stream));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> CreateCudaNoEpPrepareAndFinalize(
    std::shared_ptr<CudaContext> ctx, int64_t max_num_tokens, ActivationFormat format) {
  if (ctx == nullptr) return absl::InvalidArgumentError("CudaNoEpPrepareAndFinalize: no context");
  return std::make_unique<CudaNoEpPrepareAndFinalize>(std::move(ctx), max_num_tokens, format);
}

absl::StatusOr<std::unique_ptr<Experts>> CreateCudaExperts(
    std::shared_ptr<CudaContext> ctx, std::shared_ptr<const DeviceWeightStore> weights,
    ActivationFormat format) {
  if (ctx == nullptr || weights == nullptr) {
    return absl::InvalidArgumentError("CudaExperts: needs a context and a DeviceWeightStore");
  }
  MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<SplitKWorkspace> split_k,
                            SplitKWorkspace::Create(ctx->device()));
  return std::make_unique<CudaExpertsImpl>(std::move(ctx), std::move(weights), format,
                                           std::move(split_k));
}

}  // namespace moeserve
