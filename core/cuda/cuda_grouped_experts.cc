#include "core/cuda/cuda_grouped_experts.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/device_packed_layer.h"
#include "core/cuda/split_k_workspace.h"
#include "core/status_macros.h"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_grouped_sm90.cuh"
#include "kernels/cuda/moe_routing.cuh"

namespace moeserve {

absl::Status CudaGroupedSm90Supported(int device) {
  if (const char* why = kernels::MoeGroupedSm90Unsupported(device)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grouped GEMM (cuda_grouped_sm90) unavailable on CUDA device ", device, ": ", why));
  }
  return absl::OkStatus();
}

int64_t CudaGroupedCrossoverRoutes(int64_t hidden, int64_t intermediate, WeightFormat format) {
  // Average routes per expert from which the grouped path won, per (hidden, intermediate) and
  // weight format, measured on an H200 with 32 experts, top-8 (tests/benchmarks/cuda/RESULTS.md,
  // 2026-12-01): BF16 decode won at 16 routes per expert (64 tokens, the decode kernels at
  // 95-97% of the HBM floor) and lost from 32, until its wgmma tiles (2026-12-02: 128 tokens, seed
  // 717 against 786 us; 256 tokens 746 against 814 us, DSV3 696 against 761 us; with a hot expert
  // even): grouped from 65. MXFP8 decode (half the weight bytes of the
  // grouped path's BF16 copy) wins up to 64 since its 64-token warpgroup-MMA tile (2026-12-02:
  // 256 tokens, seed 615 against 810 us, DSV3 590 against 775 us) and loses at 128 (512 tokens,
  // 1036 against 879 us): grouped from 65.
  struct Row {
    int64_t hidden, intermediate, bf16_routes, mxfp8_routes;
  };
  static constexpr Row kTable[] = {
      {3072, 5120, 65, 65},  // seed layer
      {7168, 2048, 65, 65},  // DeepSeek-V3
  };
  // Nearest measured shape by weight elements per expert.
  auto distance = [&](const Row& r) {
    return std::abs(std::log(static_cast<double>(r.hidden) * r.intermediate /
                             (static_cast<double>(hidden) * intermediate)));
  };
  const Row* best = &kTable[0];
  for (const Row& r : kTable) {
    if (distance(r) < distance(*best)) best = &r;
  }
  return format == WeightFormat::kMXFP8 ? best->mxfp8_routes : best->bf16_routes;
}

namespace {

cudaStream_t StreamOf(const CudaContext& ctx) { return static_cast<cudaStream_t>(ctx.stream()); }

constexpr int64_t kAlignBytes = 256;
int64_t AlignUp(int64_t x) { return (x + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// A layer's plain BF16 copy for the grouped GEMM (device memory, owned); MXFP8 layers are
// dequantized into it.
struct PlainLayer {
  void* w13 = nullptr;
  void* w2 = nullptr;
  ~PlainLayer() {
    if (w13 != nullptr) cudaFree(w13);
    if (w2 != nullptr) cudaFree(w2);
  }
};

// Every layer's copy for one DeviceWeightStore, shared by all the Experts made over that store
// (an engine's lanes share their rank's weights, so they share this copy too).
struct PlainStore {
  int device = 0;
  std::vector<std::unique_ptr<PlainLayer>> layers;  // per layer; null: no experts there
  ~PlainStore() {
    cudaSetDevice(device);
    layers.clear();
  }
};

// The copy of `weights`, made on ctx's stream the first time it is asked for and kept while any
// Experts holds it. Null (OK) when it would take more than 3/4 of the free device memory and
// `must` is false; RESOURCE_EXHAUSTED naming the sizes when `must`.
absl::StatusOr<std::shared_ptr<const PlainStore>> SharedPlainStore(
    const std::shared_ptr<const DeviceWeightStore>& weights, const CudaContext& ctx,
    absl::string_view who, bool must) {
  static std::mutex mu;
  static auto* cache = new std::vector<
      std::pair<std::weak_ptr<const DeviceWeightStore>, std::weak_ptr<const PlainStore>>>();
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<const PlainStore> found;
  for (auto it = cache->begin(); it != cache->end();) {
    std::shared_ptr<const DeviceWeightStore> w = it->first.lock();
    std::shared_ptr<const PlainStore> p = it->second.lock();
    if (w == nullptr || p == nullptr) {
      it = cache->erase(it);
      continue;
    }
    if (w == weights) found = p;
    ++it;
  }
  if (found != nullptr) return found;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device()));
  int64_t need = 0;
  for (int i = 0; i < weights->num_layers(); ++i) {
    const DevicePackedLayer* l = weights->layer(i);
    if (l == nullptr) continue;
    need +=
        l->num_local_experts *
        (kernels::PlainW13ElemsPerExpert(l->layout) + kernels::PlainW2ElemsPerExpert(l->layout)) *
        2;
  }
  size_t free_bytes = 0, total_bytes = 0;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (need > static_cast<int64_t>(free_bytes) / 4 * 3) {
    if (!must) return std::shared_ptr<const PlainStore>();
    return absl::ResourceExhaustedError(absl::StrCat(
        who, ": the grouped GEMM's BF16 weight copy needs ", need, " bytes on ",
        DeviceName(ctx.tensor_device()), ", more than 3/4 of the ", free_bytes, " free"));
  }
  auto store = std::make_shared<PlainStore>();
  store->device = ctx.device();
  store->layers.resize(weights->num_layers());
  const cudaStream_t stream = StreamOf(ctx);
  for (int i = 0; i < weights->num_layers(); ++i) {
    const DevicePackedLayer* l = weights->layer(i);
    if (l == nullptr) continue;
    auto p = std::make_unique<PlainLayer>();
    const int64_t e = l->num_local_experts;
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&p->w13, e * kernels::PlainW13ElemsPerExpert(l->layout) * 2));
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&p->w2, e * kernels::PlainW2ElemsPerExpert(l->layout) * 2));
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchUnpackMoeWeightsPlain(
        l->w13, l->w13_scale, l->w2, l->w2_scale, e, l->layout,
        l->format == WeightFormat::kMXFP8 ? 1 : 2, p->w13, p->w2, stream));
    store->layers[i] = std::move(p);
  }
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  cache->emplace_back(weights, store);
  return std::shared_ptr<const PlainStore>(std::move(store));
}

class CudaGroupedExperts final : public Experts {
 public:
  CudaGroupedExperts(std::shared_ptr<CudaContext> ctx,
                     std::shared_ptr<const DeviceWeightStore> weights,
                     CudaGroupedExpertsOptions options)
      : ctx_(std::move(ctx)), weights_(std::move(weights)), options_(std::move(options)) {}

  absl::Status Init();

  absl::string_view name() const override { return options_.name; }
  ActivationFormats activation_formats() const override {
    return {ActivationFormat::kStandard, ActivationFormat::kStandard};
  }
  bool supports_expert_map() const override { return true; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return DType::kBF16; }
  // workspace13 (BF16): grouped [rows, H] gathered rows / W2 output | [rows, 2 Ip] W13 output |
  //   [rows, Ip] SiLU-and-mul; decode [rows, Ip] W13 output | FP32 [rows, H] per route.
  // workspace2 (INT32): the routing (counts | offsets | sorted | slot), then the grouped GEMM's
  //   argument arrays and CUTLASS workspace. output: FP32 [M, H], reduced.
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem& p) const override {
    const int64_t rows = std::max<int64_t>(p.num_tokens * p.topk, 1);
    const int64_t ip = kernels::MakeMoePackedLayout(p.hidden, p.intermediate).intermediate_padded;
    const int64_t h = p.hidden;
    WorkspaceShapes s;
    s.workspace13 = {rows, std::max(h + 3 * ip, ip + 2 * h)};
    s.workspace13_dtype = DType::kBF16;
    const int64_t e = p.num_local_experts;
    const int64_t routing = AlignUp((2 * e + 2 + 2 * rows) * 4);
    s.workspace2 = {(routing + GemmWorkspaceBytes(e)) / 4 + 1};
    s.workspace2_dtype = DType::kINT32;
    s.output = {p.num_tokens, p.hidden};
    return s;
  }
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind::kNoOp);
  }
  absl::Status Apply(const ExpertsApplyArgs& args) override;
  // Kernels only, sized by the problem (the grouped GEMM reads its counts on the device).
  bool supports_graphs() const override { return true; }

 private:
  int64_t GemmWorkspaceBytes(int64_t e) const {
    if (!grouped_available_) return 0;
    return AlignUp(static_cast<int64_t>(
        kernels::MoeGroupedSm90WorkspaceBytes(static_cast<int>(e), ctx_->num_sms())));
  }
  absl::Status RunGrouped(const ExpertsApplyArgs& args, const DevicePackedLayer& layer,
                          const PlainLayer& plain, int32_t* counts, int32_t* offsets,
                          int32_t* sorted, int32_t* slot, void* gemm_ws, size_t gemm_ws_bytes);
  absl::Status RunDecode(const ExpertsApplyArgs& args, const DevicePackedLayer& layer,
                         int32_t* counts, int32_t* offsets, int32_t* sorted);

  std::shared_ptr<CudaContext> ctx_;
  std::shared_ptr<const DeviceWeightStore> weights_;
  CudaGroupedExpertsOptions options_;
  std::unique_ptr<SplitKWorkspace> split_k_;  // the decode kernels', this instance's stream
  bool grouped_available_ = false;
  std::shared_ptr<const PlainStore> plain_;  // null: the decode path only
};

absl::Status CudaGroupedExperts::Init() {
  MOESERVE_ASSIGN_OR_RETURN(split_k_, SplitKWorkspace::Create(ctx_->device()));
  const bool must = options_.path == CudaGroupedExpertsOptions::Path::kGrouped;
  const absl::Status supported = CudaGroupedSm90Supported(ctx_->device());
  if (!supported.ok()) {
    if (must) return supported;
    return absl::OkStatus();  // crossover: the decode kernels serve every call
  }
  MOESERVE_ASSIGN_OR_RETURN(plain_, SharedPlainStore(weights_, *ctx_, name(), must));
  grouped_available_ = plain_ != nullptr;
  return absl::OkStatus();
}

absl::Status CudaGroupedExperts::Apply(const ExpertsApplyArgs& args) {
  const PreparedActivations& p = *args.prepared;
  const DevicePackedLayer* layer = weights_->layer(args.layer);
  if (layer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(), ": layer ", args.layer,
                     " has no experts resident on the device (upload them with "
                     "DeviceWeightStore first)"));
  }
  const auto& l = layer->layout;
  const int64_t h = l.hidden, e = layer->num_local_experts;
  if (args.weights != nullptr &&
      (args.weights->num_local_experts != e || args.weights->hidden != h ||
       args.weights->intermediate != l.intermediate)) {
    return absl::InternalError(absl::StrCat(name(), ": device weights of layer ", args.layer,
                                            " do not match the host layer handed in"));
  }
  const Device gpu = ctx_->tensor_device();
  if (p.format != ActivationFormat::kStandard || p.a1q.dtype() != DType::kBF16 ||
      p.a1q.rank() != 2 || p.a1q.dim(1) != h || h % 8 != 0 || p.a1q.device() != gpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        name(), ": expected BF16 a1q [M, ", h, "] on ", DeviceName(gpu),
        " (hidden a multiple of 8) in the Standard format, got ", p.a1q.DebugString()));
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
  const PlainLayer* plain =
      plain_ != nullptr && args.layer < static_cast<int>(plain_->layers.size())
          ? plain_->layers[args.layer].get()
          : nullptr;
  const bool must = options_.path == CudaGroupedExpertsOptions::Path::kGrouped;
  if (must && plain == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(), ": layer ", args.layer, " has no BF16 copy for the grouped GEMM"));
  }
  const int64_t m = p.problem.num_tokens, topk = p.problem.topk, rows = m * topk;
  if (rows == 0) return absl::OkStatus();
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx_->device()));
  const cudaStream_t stream = StreamOf(*ctx_);
  auto* counts = args.workspace2.data<int32_t>();
  int32_t* offsets = counts + e;
  int32_t* sorted = offsets + e + 1;
  int32_t* slot = sorted + rows;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(p.topk_ids.data<int32_t>(), rows,
                                                        static_cast<int>(e), counts, offsets,
                                                        sorted, slot, stream));
  const bool grouped =
      plain != nullptr &&
      (must || rows >= CudaGroupedCrossoverRoutes(h, l.intermediate, layer->format) * e);
  if (grouped) {
    const int64_t routing = AlignUp((2 * e + 2 + 2 * rows) * 4);
    char* ws2 = static_cast<char*>(args.workspace2.raw_data());
    return RunGrouped(args, *layer, *plain, counts, offsets, sorted, slot, ws2 + routing,
                      args.workspace2.nbytes() - routing);
  }
  return RunDecode(args, *layer, counts, offsets, sorted);
}

absl::Status CudaGroupedExperts::RunGrouped(const ExpertsApplyArgs& args,
                                            const DevicePackedLayer& layer, const PlainLayer& plain,
                                            int32_t* counts, int32_t* offsets, int32_t* sorted,
                                            int32_t* slot, void* gemm_ws, size_t gemm_ws_bytes) {
  const PreparedActivations& p = *args.prepared;
  const auto& l = layer.layout;
  const int64_t h = l.hidden, ip = l.intermediate_padded, hp = l.hidden_padded;
  const int e = static_cast<int>(layer.num_local_experts);
  const int64_t m = p.problem.num_tokens, topk = p.problem.topk, rows = m * topk;
  const cudaStream_t stream = StreamOf(*ctx_);
  auto* ws13 = args.workspace13.data<uint16_t>();
  uint16_t* x_rows = ws13;                    // [rows, H]: gathered rows, then the W2 output
  uint16_t* d1 = ws13 + rows * h;             // [rows, 2 Ip]
  uint16_t* a2 = ws13 + rows * (h + 2 * ip);  // [rows, Ip]
  const int32_t* served = offsets + e;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGatherRows(
      p.a1q.data<uint16_t>(), sorted, served, rows, static_cast<int>(topk), h, x_rows, stream));
  kernels::MoeGroupedSm90Gemm g1;
  g1.num_experts = e;
  g1.expert_counts = counts;
  g1.expert_offsets = offsets;
  g1.n = 2 * ip;
  g1.k = h;
  g1.a = x_rows;
  g1.lda = h;
  g1.b = static_cast<const uint16_t*>(plain.w13);
  g1.ldb = hp;
  g1.b_expert_stride = kernels::PlainW13ElemsPerExpert(l);
  g1.d = d1;
  g1.ldd = 2 * ip;
  g1.total_rows_hint = rows;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedSm90Gemm(
      g1, gemm_ws, gemm_ws_bytes, ctx_->device(), ctx_->num_sms(), stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeSiluMul(d1, served, rows, ip, a2, stream));
  kernels::MoeGroupedSm90Gemm g2 = g1;
  g2.n = h;
  g2.k = ip;
  g2.a = a2;
  g2.lda = ip;
  g2.b = static_cast<const uint16_t*>(plain.w2);
  g2.ldb = ip;
  g2.b_expert_stride = kernels::PlainW2ElemsPerExpert(l);
  g2.d = x_rows;
  g2.ldd = h;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedSm90Gemm(
      g2, gemm_ws, gemm_ws_bytes, ctx_->device(), ctx_->num_sms(), stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeUnpermuteReduce(
      x_rows, p.topk_ids.data<int32_t>(), p.topk_weights.data<float>(), offsets, slot, m,
      static_cast<int>(topk), h, e, args.output.data<float>(), stream));
  return absl::OkStatus();
}

absl::Status CudaGroupedExperts::RunDecode(const ExpertsApplyArgs& args,
                                           const DevicePackedLayer& layer, int32_t* counts,
                                           int32_t* offsets, int32_t* sorted) {
  const PreparedActivations& p = *args.prepared;
  const auto& l = layer.layout;
  const int64_t h = l.hidden, ip = l.intermediate_padded;
  const int e = static_cast<int>(layer.num_local_experts);
  const int64_t m = p.problem.num_tokens, topk = p.problem.topk, rows = m * topk;
  const cudaStream_t stream = StreamOf(*ctx_);
  auto* inter = args.workspace13.data<uint16_t>();                 // [rows, Ip] BF16
  float* per_route = reinterpret_cast<float*>(inter + rows * ip);  // [rows, H] FP32
  kernels::MoeGemmParams g1;
  g1.mxfp8 = layer.format == WeightFormat::kMXFP8;
  g1.mxfp8_max_scale_code = layer.max_scale_code;
  g1.num_experts = e;
  g1.layout = l;
  g1.expert_counts = counts;
  g1.expert_offsets = offsets;
  g1.max_rows_hint = rows;
  g1.total_rows_hint = rows;
  kernels::MoeGemmParams g2 = g1;
  g1.kind = kernels::MoeGemmKind::kGateUpSilu;
  g1.weights = layer.w13;
  g1.scales = layer.w13_scale;
  g1.gather = sorted;
  g1.gather_div = static_cast<int>(topk);
  g1.act = p.a1q.data<uint16_t>();
  g1.act_stride = h;
  g1.out = inter;
  g1.out_stride = ip;
  g2.kind = kernels::MoeGemmKind::kDown;
  g2.weights = layer.w2;
  g2.scales = layer.w2_scale;
  g2.act = inter;
  g2.act_stride = ip;
  g2.scatter = sorted;
  g2.out = per_route;
  g2.out_stride = h;
  g1.split_workspace = g2.split_workspace = split_k_ != nullptr ? split_k_->data() : nullptr;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedGemm(g1, ctx_->num_sms(), stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedGemm(g2, ctx_->num_sms(), stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceContiguous(
      per_route, p.topk_weights.data<float>(), p.topk_ids.data<int32_t>(), m,
      static_cast<int>(topk), h, e, args.output.data<float>(), stream));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Experts>> CreateCudaGroupedExperts(
    std::shared_ptr<CudaContext> ctx, std::shared_ptr<const DeviceWeightStore> weights,
    const CudaGroupedExpertsOptions& options) {
  if (ctx == nullptr || weights == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, ": needs a context and a DeviceWeightStore"));
  }
  auto experts = std::make_unique<CudaGroupedExperts>(std::move(ctx), std::move(weights), options);
  MOESERVE_RETURN_IF_ERROR(experts->Init());
  return experts;
}

}  // namespace moeserve
