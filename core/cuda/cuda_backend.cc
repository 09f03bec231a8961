#include "core/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/cuda/grow_only_buffer.h"
#include "core/status_macros.h"
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

}  // namespace

class CudaContext {
 public:
  int device = 0;
  int num_sms = 0;
  cudaStream_t stream = nullptr;
  // Prepare -> Experts.
  DeviceBuffer hidden, ids, weights, batched_a1q, slot, counts;
  PinnedBuffer pin_in, pin_out;
  // Experts -> Finalize.
  DeviceBuffer routing, intermediate, fused, final_out;
  TensorView fused_output;  // device, set by the Experts' Apply
  ~CudaContext() {
    if (stream != nullptr) {
      cudaSetDevice(device);
      cudaStreamDestroy(stream);
    }
  }
};

struct DevicePackedLayer {
  WeightFormat format = WeightFormat::kBF16;
  int64_t num_local_experts = 0;
  kernels::MoePackedLayout layout;
  void* w13 = nullptr;
  void* w2 = nullptr;
  uint8_t* w13_scale = nullptr;
  uint8_t* w2_scale = nullptr;
  ~DevicePackedLayer() {
    for (void* p : {w13, w2, static_cast<void*>(w13_scale), static_cast<void*>(w2_scale)}) {
      if (p != nullptr) cudaFree(p);
    }
  }
};

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

absl::StatusOr<std::shared_ptr<CudaContext>> CreateCudaContext(int device) {
  const int n = CudaDeviceCount();
  if (device < 0 || device >= n) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", device, " requested but ", n, " visible"));
  }
  auto ctx = std::make_shared<CudaContext>();
  ctx->device = device;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  MOESERVE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&ctx->num_sms, cudaDevAttrMultiProcessorCount, device));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
  return ctx;
}

void* CudaContextStream(const CudaContext& ctx) { return ctx.stream; }
TensorView CudaContextFusedOutput(const CudaContext& ctx) { return ctx.fused_output; }

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
  DeviceBuffer raw, raw_scale;
  auto pack = [&](const TensorView& v, const TensorView& s, bool w13) -> absl::Status {
    MOESERVE_ASSIGN_OR_RETURN(void* d, raw.Get(v.nbytes()));
    // Async on the context's stream: a plain cudaMemcpy from pageable memory may return before
    // the DMA lands, and the pack kernel runs on a non-blocking stream.
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d, v.raw_data(), v.nbytes(), cudaMemcpyHostToDevice, ctx.stream));
    uint8_t* ds = nullptr;
    if (fp8) {
      MOESERVE_ASSIGN_OR_RETURN(void* p, raw_scale.Get(s.nbytes()));
      ds = static_cast<uint8_t*>(p);
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(ds, s.raw_data(), s.nbytes(), cudaMemcpyHostToDevice, ctx.stream));
    }
    if (w13) {
      MOESERVE_CUDA_RETURN_IF_ERROR(
          kernels::LaunchPackMoeW13(d, ds, e, l, esize, out->w13, out->w13_scale, ctx.stream));
    } else {
      MOESERVE_CUDA_RETURN_IF_ERROR(
          kernels::LaunchPackMoeW2(d, ds, e, l, esize, out->w2, out->w2_scale, ctx.stream));
    }
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(ctx.stream));
    return absl::OkStatus();
  };
  MOESERVE_RETURN_IF_ERROR(pack(w.w13, w.w13_scale, true));
  MOESERVE_RETURN_IF_ERROR(pack(w.w2, w.w2_scale, false));
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
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device));
  std::shared_ptr<DeviceWeightStore> store(new DeviceWeightStore());
  store->device_ = ctx.device;
  for (const LayerWeights* w : layers) {
    if (w == nullptr) continue;
    MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<DevicePackedLayer> p, UploadLayer(*w, ctx));
    store->device_bytes_ += PackedBytes(*p);
    store->layers_.emplace_back(w, std::move(p));
  }
  return store;
}

absl::StatusOr<std::shared_ptr<DeviceWeightStore>> DeviceWeightStore::Create(
    const ExpertWeightStore& host, const CudaContext& ctx) {
  std::vector<const LayerWeights*> layers;
  for (int l = 0; l < host.config().num_layers; ++l) {
    if (const LayerWeights* w = host.layer(l); w != nullptr) layers.push_back(w);
  }
  return CreateFromLayers(layers, ctx);
}

const DevicePackedLayer* DeviceWeightStore::Find(const LayerWeights* host_layer) const {
  for (const auto& [k, v] : layers_) {
    if (k == host_layer) return v.get();
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// PrepareAndFinalize.

namespace {

class CudaNoEpPrepareAndFinalize final : public PrepareAndFinalize {
 public:
  CudaNoEpPrepareAndFinalize(std::shared_ptr<CudaContext> ctx, int64_t max_num_tokens,
                             ActivationFormat format)
      : ctx_(std::move(ctx)), max_num_tokens_(max_num_tokens), format_(format) {
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

  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override;
  absl::Status Finalize(const TensorView& output, const TensorView& fused_expert_output,
                        const PreparedActivations& prepared,
                        const TopKWeightAndReduce& weight_and_reduce) override;

 private:
  std::shared_ptr<CudaContext> ctx_;
  int64_t max_num_tokens_;
  ActivationFormat format_;
  QuantConfig quant_;
  std::vector<int32_t> host_counts_;
};

absl::Status CudaNoEpPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                 PreparedActivations* out) {
  const TensorView& x = args.hidden_states;
  if (x.rank() != 2 || args.topk_ids.rank() != 2 || args.topk_ids.dim(0) != x.dim(0) ||
      args.topk_weights.shape() != args.topk_ids.shape() ||
      args.topk_ids.dtype() != DType::kINT32 || args.topk_weights.dtype() != DType::kFP32 ||
      !args.topk_ids.is_contiguous() || !args.topk_weights.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name(),
        ": expected hidden_states [M, K], topk_ids INT32 [M, topk], topk_weights FP32 "
        "[M, topk]; got ",
        x.DebugString(), ", ", args.topk_ids.DebugString(), ", ", args.topk_weights.DebugString()));
  }
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
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device));
  CudaContext& c = *ctx_;
  const size_t x_bytes = m * k * 2, id_bytes = m * topk * 4, w_bytes = m * topk * 4;
  MOESERVE_ASSIGN_OR_RETURN(void* pin, c.pin_in.Get(x_bytes + id_bytes + w_bytes + 64));
  auto* pin_x = static_cast<uint8_t*>(pin);
  auto* pin_ids = reinterpret_cast<int32_t*>(pin_x + (x_bytes + 15) / 16 * 16);
  auto* pin_w = reinterpret_cast<float*>(pin_ids + m * topk);
  // Quantization hook: BF16 activations (exact for BF16 input, round-to-nearest otherwise).
  TensorView pin_x_view(pin_x, DType::kBF16, {m, k});
  if (x.dtype() == DType::kBF16 && x.is_contiguous()) {
    std::memcpy(pin_x, x.raw_data(), x_bytes);
  } else {
    MOESERVE_RETURN_IF_ERROR(ConvertTensor(x, pin_x_view));
  }
  // Global -> local ids.
  const int32_t* g = args.topk_ids.data<int32_t>();
  const bool has_map = !args.expert_map.empty();
  host_counts_.assign(e, 0);
  for (int64_t i = 0; i < m * topk; ++i) {
    if (g[i] < 0 || g[i] >= args.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": topk_ids[", i, "] = ", g[i],
                                                     " not in [0, ", args.num_experts, ")"));
    }
    const int32_t l = has_map ? args.expert_map.data<int32_t>()[g[i]] : g[i];
    if (l < -1 || l >= e) {
      return absl::InternalError(absl::StrCat(name(), ": local expert ", l, " out of range"));
    }
    pin_ids[i] = l;
    if (l >= 0) ++host_counts_[l];
  }
  std::memcpy(pin_w, args.topk_weights.raw_data(), w_bytes);
  MOESERVE_ASSIGN_OR_RETURN(void* d_x, c.hidden.Get(x_bytes));
  MOESERVE_ASSIGN_OR_RETURN(void* d_ids, c.ids.Get(id_bytes));
  MOESERVE_ASSIGN_OR_RETURN(void* d_w, c.weights.Get(w_bytes));
  if (m > 0) {
    // One contiguous pinned block; three copies.
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_x, pin_x, x_bytes, cudaMemcpyHostToDevice, c.stream));
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_ids, pin_ids, id_bytes, cudaMemcpyHostToDevice, c.stream));
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_w, pin_w, w_bytes, cudaMemcpyHostToDevice, c.stream));
  }
  out->format = format_;
  out->a1q_scale = TensorView();
  out->topk_ids = TensorView(d_ids, DType::kINT32, {m, topk});
  out->topk_weights = TensorView(d_w, DType::kFP32, {m, topk});
  out->problem = MoeProblem{.num_tokens = m,
                            .hidden = k,
                            .intermediate = args.intermediate,
                            .topk = topk,
                            .num_experts = args.num_experts,
                            .num_local_experts = e,
                            .max_num_tokens = m};
  if (format_ == ActivationFormat::kStandard) {
    out->a1q = TensorView(d_x, DType::kBF16, {m, k});
    out->expert_num_tokens = TensorView();
    return absl::OkStatus();
  }
  // BatchedExperts: rows grouped by expert on the device; capacity = the largest expert's
  // routes, known here from the host ids, so nothing is ever dropped.
  int64_t max_tokens = 1;
  for (int32_t n : host_counts_) max_tokens = std::max<int64_t>(max_tokens, n);
  MOESERVE_ASSIGN_OR_RETURN(void* d_a, c.batched_a1q.Get(e * max_tokens * k * 2));
  MOESERVE_ASSIGN_OR_RETURN(void* d_counts, c.counts.Get((2 * e + 2) * 4));
  MOESERVE_ASSIGN_OR_RETURN(void* d_slot, c.slot.Get(2 * m * topk * 4 + 4));
  auto* counts = static_cast<int32_t*>(d_counts);
  auto* slot = static_cast<int32_t*>(d_slot);
  if (e > kernels::kMoeAlignMaxExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", e, " local experts exceed ", kernels::kMoeAlignMaxExperts));
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(static_cast<int32_t*>(d_ids), m * topk,
                                                        static_cast<int>(e), counts, counts + e + 1,
                                                        slot + m * topk, slot, c.stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchPermuteToBatched(
      static_cast<uint16_t*>(d_x), static_cast<int32_t*>(d_ids), slot, m, static_cast<int>(topk), k,
      static_cast<int>(e), max_tokens, static_cast<uint16_t*>(d_a), c.stream));
  out->a1q = TensorView(d_a, DType::kBF16, {e, max_tokens, k});
  out->expert_num_tokens = TensorView(counts, DType::kINT32, {e});
  out->problem.max_num_tokens = max_tokens;
  return absl::OkStatus();
}

absl::Status CudaNoEpPrepareAndFinalize::Finalize(const TensorView& output, const TensorView&,
                                                  const PreparedActivations& prepared,
                                                  const TopKWeightAndReduce& war) {
  CudaContext& c = *ctx_;
  const int64_t m = prepared.problem.num_tokens, k = prepared.problem.hidden;
  const int64_t topk = prepared.problem.topk, e = prepared.problem.num_local_experts;
  if (output.rank() != 2 || output.dim(0) != m || output.dim(1) != k ||
      output.dtype() != DType::kFP32 || !output.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": output must be FP32 [", m, ", ", k,
                                                   "], got ", output.DebugString()));
  }
  if (m == 0) return absl::OkStatus();
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(c.device));
  const size_t bytes = m * k * 4;
  MOESERVE_ASSIGN_OR_RETURN(void* d_out, c.final_out.Get(bytes));
  const auto* fused = c.fused_output.data<float>();
  const auto* w = prepared.topk_weights.data<float>();
  const auto* ids = prepared.topk_ids.data<int32_t>();
  switch (war.kind()) {
    case TopKWeightAndReduce::Kind::kNoOp:
      d_out = const_cast<float*>(fused);
      break;
    case TopKWeightAndReduce::Kind::kDelegate:
    case TopKWeightAndReduce::Kind::kContiguous:
      if (format_ != ActivationFormat::kStandard) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": Contiguous reduce needs Standard-format expert output"));
      }
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceContiguous(
          fused, w, ids, m, static_cast<int>(topk), k, static_cast<int>(e),
          static_cast<float*>(d_out), c.stream));
      break;
    case TopKWeightAndReduce::Kind::kNaiveBatched: {
      if (format_ != ActivationFormat::kBatchedExperts) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": NaiveBatched reduce needs BatchedExperts output"));
      }
      MOESERVE_ASSIGN_OR_RETURN(void* d_slot, c.slot.Get(0));
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceNaiveBatched(
          fused, w, ids, static_cast<int32_t*>(d_slot), m, static_cast<int>(topk), k,
          static_cast<int>(e), prepared.problem.max_num_tokens, static_cast<float*>(d_out),
          c.stream));
      break;
    }
  }
  MOESERVE_ASSIGN_OR_RETURN(void* pin, c.pin_out.Get(bytes));
  MOESERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pin, d_out, bytes, cudaMemcpyDeviceToHost, c.stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(c.stream));
  std::memcpy(output.raw_data(), pin, bytes);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// Experts.

class CudaExpertsImpl final : public Experts {
 public:
  CudaExpertsImpl(std::shared_ptr<CudaContext> ctx,
                  std::shared_ptr<const DeviceWeightStore> weights, ActivationFormat format)
      : ctx_(std::move(ctx)), weights_(std::move(weights)), format_(format) {}

  absl::string_view name() const override {
    return format_ == ActivationFormat::kStandard ? "CudaExperts" : "CudaBatchedExperts";
  }
  ActivationFormats activation_formats() const override { return {format_, format_}; }
  bool supports_expert_map() const override { return true; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return DType::kBF16; }
  // Device memory lives in the shared CudaContext: ModularKernel's host buffers stay empty.
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem&) const override {
    WorkspaceShapes s;
    s.workspace13 = {0};
    s.workspace2 = {0};
    s.output = {0};
    return s;
  }
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(format_ == ActivationFormat::kStandard
                                       ? TopKWeightAndReduce::Kind::kContiguous
                                       : TopKWeightAndReduce::Kind::kNaiveBatched);
  }
  absl::Status Apply(const ExpertsApplyArgs& args) override;

 private:
  std::shared_ptr<CudaContext> ctx_;
  std::shared_ptr<const DeviceWeightStore> weights_;
  ActivationFormat format_;
};

absl::Status CudaExpertsImpl::Apply(const ExpertsApplyArgs& args) {
  const PreparedActivations& p = *args.prepared;
  const DevicePackedLayer* layer = weights_->Find(args.weights);
  if (layer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(),
                     ": layer weights are not resident on the device (upload them with "
                     "DeviceWeightStore first)"));
  }
  const auto& l = layer->layout;
  const int64_t h = l.hidden, e = layer->num_local_experts;
  if (p.format != format_ || p.a1q.dtype() != DType::kBF16 || p.a1q.dim(p.a1q.rank() - 1) != h ||
      h % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": expected BF16 a1q with hidden ", h, " (a multiple of 8) in format ",
                     ActivationFormatName(format_), ", got ", p.a1q.DebugString()));
  }
  if (e > 2048) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": at most 2048 local experts"));
  }
  CudaContext& c = *ctx_;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(c.device));
  const int64_t m = p.problem.num_tokens, topk = p.problem.topk;
  kernels::MoeGemmParams g1;
  g1.mxfp8 = layer->format == WeightFormat::kMXFP8;
  g1.num_experts = static_cast<int>(e);
  g1.layout = l;
  kernels::MoeGemmParams g2 = g1;
  int64_t rows = 0;  // rows of the intermediate / fused output
  if (format_ == ActivationFormat::kStandard) {
    rows = m * topk;
    MOESERVE_ASSIGN_OR_RETURN(void* ws, c.routing.Get((2 * e + 2 + 2 * rows) * 4));
    auto* counts = static_cast<int32_t*>(ws);
    int32_t* offsets = counts + e;
    int32_t* sorted = offsets + e + 1;
    int32_t* slot = sorted + rows;
    MOESERVE_ASSIGN_OR_RETURN(void* fused, c.fused.Get(std::max<int64_t>(rows, 1) * h * 4));
    c.fused_output = TensorView(fused, DType::kFP32, {m, topk, h});
    if (rows == 0) return absl::OkStatus();
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(p.topk_ids.data<int32_t>(), rows,
                                                          static_cast<int>(e), counts, offsets,
                                                          sorted, slot, c.stream));
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
    MOESERVE_ASSIGN_OR_RETURN(void* fused, c.fused.Get(std::max<int64_t>(rows, 1) * h * 4));
    c.fused_output = TensorView(fused, DType::kFP32, {e, max_tokens, h});
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
  MOESERVE_ASSIGN_OR_RETURN(
      void* inter, c.intermediate.Get(std::max<int64_t>(rows, 1) * l.intermediate_padded * 2));
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
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedGemm(g1, c.num_sms, c.stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedGemm(g2, c.num_sms, c.stream));
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
  return std::make_unique<CudaExpertsImpl>(std::move(ctx), std::move(weights), format);
}

}  // namespace moeserve
