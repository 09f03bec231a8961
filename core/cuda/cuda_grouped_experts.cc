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

int64_t CudaGroupedCrossoverRoutes(int64_t hidden, int64_t intermediate, WeightFormat format,
                                   bool fp8_activations) {
  // Average routes per expert from which the grouped path won, per (hidden, intermediate) and
  // weight format, measured on an H200 with 32 experts, top-8 (tests/benchmarks/cuda/RESULTS.md,
  // 2026-12-01): BF16 decode won at 16 routes per expert (64 tokens, the decode kernels at
  // 95-97% of the HBM floor) and lost from 32, until its wgmma tiles (2026-12-02: 128 tokens, seed
  // 717 against 786 us; 256 tokens 746 against 814 us, DSV3 696 against 761 us; with a hot expert
  // even): grouped from 65. MXFP8 decode (half the weight bytes of the
  // grouped path's BF16 copy) wins up to 64 since its 64-token warpgroup-MMA tile (2026-12-02:
  // 256 tokens, seed 615 against 810 us, DSV3 590 against 775 us) and loses at 128 (512 tokens,
  // 1036 against 879 us): grouped from 65.
  // W8A8 (the grouped GEMM reads FP8 weights too; 2026-12-03 10:20, three routings): the decode
  // kernels win at 16 routes per expert balanced (64 tokens: seed 426 against 469 us, DSV3 394
  // against 428) and lose with spread counts (random: 489 against 453, DSV3 452 against 428);
  // from 32 routes the W8A8 path wins every routing (128 tokens: 470 against 508 / 655 / 756):
  // grouped from 17.
  struct Row {
    int64_t hidden, intermediate, bf16_routes, mxfp8_routes, w8a8_routes;
  };
  static constexpr Row kTable[] = {
      {3072, 5120, 65, 65, 17},  // seed layer
      {7168, 2048, 65, 65, 17},  // DeepSeek-V3
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
  if (format != WeightFormat::kMXFP8) return best->bf16_routes;
  return fp8_activations ? best->w8a8_routes : best->mxfp8_routes;
}

namespace {

cudaStream_t StreamOf(const CudaContext& ctx) { return static_cast<cudaStream_t>(ctx.stream()); }

constexpr int64_t kAlignBytes = 256;
int64_t AlignUp(int64_t x) { return (x + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// workspace2 starts with the routing: counts [e], offsets [e + 1], sorted routes and slots [rows]
// each, then the align's scratch (kernels::MoeAlignScratchInts), each part 256-byte aligned.
int64_t RoutingIndexBytes(int64_t e, int64_t rows) { return AlignUp((2 * e + 2 + 2 * rows) * 4); }
int64_t RoutingBytes(int64_t e, int64_t rows) {
  return RoutingIndexBytes(e, rows) +
         AlignUp(kernels::MoeAlignScratchInts(rows, static_cast<int>(e)) * 4);
}

// A layer's plain copy for the grouped GEMM (device memory, owned): BF16 (MXFP8 layers
// dequantized into it), or for W8A8 an MXFP8 layer's plain E4M3 values with one FP32 scale per
// row per 128 K (kernels::LaunchUnpackMoeWeightsPlainFp8).
struct PlainLayer {
  bool fp8 = false;
  void* w13 = nullptr;  // BF16 or E4M3
  void* w2 = nullptr;
  float* w13_scale = nullptr;  // fp8 only
  float* w2_scale = nullptr;
  ~PlainLayer() {
    for (void* p : {w13, w2, static_cast<void*>(w13_scale), static_cast<void*>(w2_scale)}) {
      if (p != nullptr) cudaFree(p);
    }
  }
};

// Device bytes of a layer's plain copy.
int64_t PlainLayerBytes(const DevicePackedLayer& l, bool fp8) {
  if (fp8) {
    const int64_t elems =
        kernels::PlainFp8W13ElemsPerExpert(l.layout) + kernels::PlainFp8W2ElemsPerExpert(l.layout);
    return l.num_local_experts * (elems + elems / kernels::kMoeFp8ScaleK * 4);
  }
  return l.num_local_experts *
         (kernels::PlainW13ElemsPerExpert(l.layout) + kernels::PlainW2ElemsPerExpert(l.layout)) * 2;
}

// Every layer's copy for one DeviceWeightStore, shared by all the Experts made over that store
// (an engine's lanes share their rank's weights, so they share this copy too). `fp8`: MXFP8
// layers in the W8A8 layout (BF16 layers stay BF16).
struct PlainStore {
  int device = 0;
  bool fp8 = false;
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
    absl::string_view who, bool must, bool fp8) {
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
    if (w == weights && p->fp8 == fp8) found = p;
    ++it;
  }
  if (found != nullptr) return found;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(ctx.device()));
  int64_t need = 0;
  for (int i = 0; i < weights->num_layers(); ++i) {
    const DevicePackedLayer* l = weights->layer(i);
    if (l == nullptr) continue;
    need += PlainLayerBytes(*l, fp8 && l->format == WeightFormat::kMXFP8);
  }
  size_t free_bytes = 0, total_bytes = 0;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (need > static_cast<int64_t>(free_bytes) / 4 * 3) {
    if (!must) return std::shared_ptr<const PlainStore>();
    return absl::ResourceExhaustedError(
        absl::StrCat(who, ": the grouped GEMM's ", fp8 ? "FP8" : "BF16", " weight copy needs ",
                     need, " bytes on ", DeviceName(ctx.tensor_device()), ", more than 3/4 of the ",
                     free_bytes, " free"));
  }
  auto store = std::make_shared<PlainStore>();
  store->device = ctx.device();
  store->fp8 = fp8;
  store->layers.resize(weights->num_layers());
  const cudaStream_t stream = StreamOf(ctx);
  for (int i = 0; i < weights->num_layers(); ++i) {
    const DevicePackedLayer* l = weights->layer(i);
    if (l == nullptr) continue;
    auto p = std::make_unique<PlainLayer>();
    const int64_t e = l->num_local_experts;
    if (fp8 && l->format == WeightFormat::kMXFP8) {
      p->fp8 = true;
      const int64_t n13 = e * kernels::PlainFp8W13ElemsPerExpert(l->layout);
      const int64_t n2 = e * kernels::PlainFp8W2ElemsPerExpert(l->layout);
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&p->w13, n13));
      MOESERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&p->w2, n2));
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMalloc(&p->w13_scale, n13 / kernels::kMoeFp8ScaleK * sizeof(float)));
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMalloc(&p->w2_scale, n2 / kernels::kMoeFp8ScaleK * sizeof(float)));
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchUnpackMoeWeightsPlainFp8(
          static_cast<const uint8_t*>(l->w13), l->w13_scale, static_cast<const uint8_t*>(l->w2),
          l->w2_scale, e, l->layout, static_cast<uint8_t*>(p->w13), p->w13_scale,
          static_cast<uint8_t*>(p->w2), p->w2_scale, stream));
      store->layers[i] = std::move(p);
      continue;
    }
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
  // W8A8 (MXFP8 layers with options_.fp8_activations), in the same workspace13: E4M3 [rows, K1]
  //   quantized rows, then the BF16 W2 output [rows, H] | BF16 [rows, 2 Ip] W13 output | E4M3
  //   [rows, K2] quantized intermediate; workspace2 also holds their FP32 scales (rows * (K1 +
  //   K2) / 128) after the CUTLASS workspace.
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem& p) const override {
    const int64_t rows = std::max<int64_t>(p.num_tokens * p.topk, 1);
    const auto l = kernels::MakeMoePackedLayout(p.hidden, p.intermediate);
    const int64_t ip = l.intermediate_padded;
    const int64_t h = p.hidden;
    WorkspaceShapes s;
    int64_t row_elems = std::max(h + 3 * ip, ip + 2 * h);
    int64_t scales = 0;
    if (options_.fp8_activations) {
      const int64_t k1 = kernels::Fp8PaddedK(l.hidden_padded), k2 = kernels::Fp8PaddedK(ip);
      row_elems = std::max(row_elems, Fp8RegionA(h, k1) + 2 * ip + k2 / 2);
      scales = AlignUp(rows * (k1 + k2) / kernels::kMoeFp8ScaleK * 4);
    }
    s.workspace13 = {rows, row_elems};
    s.workspace13_dtype = DType::kBF16;
    const int64_t e = p.num_local_experts;
    const int64_t routing = RoutingBytes(e, rows);
    s.workspace2 = {(routing + GemmWorkspaceBytes(e) + scales) / 4 + 1};
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
    size_t bytes = kernels::MoeGroupedSm90WorkspaceBytes(static_cast<int>(e), ctx_->num_sms());
    if (options_.fp8_activations) {
      bytes = std::max(
          bytes, kernels::MoeGroupedSm90Fp8WorkspaceBytes(static_cast<int>(e), ctx_->num_sms()));
    }
    return AlignUp(static_cast<int64_t>(bytes));
  }
  // BF16 elements per row of the W8A8 region that holds the quantized rows, then the W2 output.
  static int64_t Fp8RegionA(int64_t h, int64_t k1) { return std::max(h, k1 / 2); }
  absl::Status RunGroupedFp8(const ExpertsApplyArgs& args, const DevicePackedLayer& layer,
                             const PlainLayer& plain, int32_t* counts, int32_t* offsets,
                             int32_t* sorted, int32_t* slot, void* gemm_ws, size_t gemm_ws_bytes);
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
  absl::Status supported = CudaGroupedSm90Supported(ctx_->device());
  if (!supported.ok()) {
    if (must) return supported;
    return absl::OkStatus();  // crossover: the decode kernels serve every call
  }
  MOESERVE_ASSIGN_OR_RETURN(
      plain_, SharedPlainStore(weights_, *ctx_, name(), must, options_.fp8_activations));
  grouped_available_ = plain_ != nullptr;
  return absl::OkStatus();
}

absl::Status CudaGroupedExperts::Apply(const ExpertsApplyArgs& args) {
  const PreparedActivations& p = *args.prepared;
  MOESERVE_ASSIGN_OR_RETURN(const DevicePackedLayer* layer,
                            weights_->ResidentLayer(args.layer, args.weights, name()));
  const auto& l = layer->layout;
  const int64_t h = l.hidden, e = layer->num_local_experts;
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
  int32_t* align_scratch = reinterpret_cast<int32_t*>(
      static_cast<char*>(args.workspace2.raw_data()) + RoutingIndexBytes(e, rows));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(p.topk_ids.data<int32_t>(), rows,
                                                        static_cast<int>(e), counts, offsets,
                                                        sorted, slot, stream, align_scratch));
  const bool grouped =
      plain != nullptr &&
      (must ||
       rows >= CudaGroupedCrossoverRoutes(h, l.intermediate, layer->format, plain->fp8) * e);
  if (grouped) {
    const int64_t routing = RoutingBytes(e, rows);
    char* ws2 = static_cast<char*>(args.workspace2.raw_data());
    if (plain->fp8) {
      return RunGroupedFp8(args, *layer, *plain, counts, offsets, sorted, slot, ws2 + routing,
                           args.workspace2.nbytes() - routing);
    }
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

absl::Status CudaGroupedExperts::RunGroupedFp8(const ExpertsApplyArgs& args,
                                               const DevicePackedLayer& layer,
                                               const PlainLayer& plain, int32_t* counts,
                                               int32_t* offsets, int32_t* sorted, int32_t* slot,
                                               void* gemm_ws, size_t gemm_ws_bytes) {
  const PreparedActivations& p = *args.prepared;
  const auto& l = layer.layout;
  const int64_t h = l.hidden, ip = l.intermediate_padded;
  const int64_t k1 = kernels::Fp8PaddedK(l.hidden_padded), k2 = kernels::Fp8PaddedK(ip);
  const int e = static_cast<int>(layer.num_local_experts);
  const int64_t m = p.problem.num_tokens, topk = p.problem.topk, rows = m * topk;
  const cudaStream_t stream = StreamOf(*ctx_);
  // workspace13 as GetWorkspaceShapes lays it out; every region starts 16-byte aligned.
  auto* ws13 = args.workspace13.data<uint16_t>();
  auto* a1q = reinterpret_cast<uint8_t*>(ws13);                // E4M3 [rows, K1], then:
  uint16_t* d2 = ws13;                                         // BF16 [rows, H]
  uint16_t* d1 = ws13 + rows * Fp8RegionA(h, k1);              // BF16 [rows, 2 Ip]
  auto* a2q = reinterpret_cast<uint8_t*>(d1 + rows * 2 * ip);  // E4M3 [rows, K2]
  const size_t cutlass_bytes = static_cast<size_t>(GemmWorkspaceBytes(e));
  if (gemm_ws_bytes < cutlass_bytes + rows * (k1 + k2) / kernels::kMoeFp8ScaleK * 4) {
    return absl::InternalError(absl::StrCat(name(), ": workspace2 too small for W8A8"));
  }
  float* a1s = reinterpret_cast<float*>(static_cast<char*>(gemm_ws) + cutlass_bytes);
  float* a2s = a1s + rows * (k1 / kernels::kMoeFp8ScaleK);
  MOESERVE_CUDA_RETURN_IF_ERROR(
      kernels::LaunchMoeGatherQuantizeRows(p.a1q.data<uint16_t>(), sorted, counts, offsets, e, rows,
                                           static_cast<int>(topk), h, a1q, a1s, stream));
  kernels::MoeGroupedSm90Fp8Gemm g1;
  g1.num_experts = e;
  g1.expert_counts = counts;
  g1.expert_offsets = offsets;
  g1.n = 2 * ip;
  g1.k = k1;
  g1.a = a1q;
  g1.a_scale = a1s;
  g1.b = static_cast<const uint8_t*>(plain.w13);
  g1.b_scale = plain.w13_scale;
  g1.b_expert_stride = kernels::PlainFp8W13ElemsPerExpert(l);
  g1.d = d1;
  g1.ldd = 2 * ip;
  g1.total_rows_hint = rows;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedSm90Fp8Gemm(
      g1, gemm_ws, cutlass_bytes, ctx_->device(), ctx_->num_sms(), stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(
      kernels::LaunchMoeSiluMulQuantize(d1, counts, offsets, e, rows, ip, a2q, a2s, stream));
  kernels::MoeGroupedSm90Fp8Gemm g2 = g1;
  g2.n = h;
  g2.k = k2;
  g2.a = a2q;
  g2.a_scale = a2s;
  g2.b = static_cast<const uint8_t*>(plain.w2);
  g2.b_scale = plain.w2_scale;
  g2.b_expert_stride = kernels::PlainFp8W2ElemsPerExpert(l);
  g2.d = d2;
  g2.ldd = h;
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeGroupedSm90Fp8Gemm(
      g2, gemm_ws, cutlass_bytes, ctx_->device(), ctx_->num_sms(), stream));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeUnpermuteReduce(
      d2, p.topk_ids.data<int32_t>(), p.topk_weights.data<float>(), offsets, slot, m,
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
  g2.weights_before_wait = true;  // W2 reads the counts W13 read
  g1.weights_before_wait = true;  // W13 follows the align of these ids
  g1.route_ids = p.topk_ids.data<int32_t>();
  g1.num_routes = rows;
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
