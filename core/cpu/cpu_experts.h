// CPU Experts in the Standard format: the plain-loop reference (the oracle) and a BLAS one.
#ifndef MOESERVE_CORE_CPU_CPU_EXPERTS_H_
#define MOESERVE_CORE_CPU_CPU_EXPERTS_H_

#include <memory>
#include <vector>

#include "core/modular_kernel.h"
#include "core/thread_pool.h"

namespace moeserve {

// Plain loops, FP32 accumulation, one route at a time; applies the top-k weights and reduces
// inside Apply (FinalizeWeightAndReduceImpl() is NoOp). Output [M, K]. Weights are
// dequantized to FP32 one expert at a time (exact for BF16 and MXFP8).
class ReferenceExperts final : public Experts {
 public:
  static constexpr absl::string_view kName = "ReferenceExperts";
  absl::string_view name() const override { return kName; }
  ActivationFormats activation_formats() const override {
    return {ActivationFormat::kStandard, ActivationFormat::kStandard};
  }
  bool supports_expert_map() const override { return true; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return DType::kFP32; }
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem& p) const override;
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind::kNoOp);
  }
  absl::Status Apply(const ExpertsApplyArgs& args) override;
};

// Groups routes by expert. An expert with at most gemv_max_rows routes (decode sizes) runs its
// two GEMMs with kernels::ExpertGemv*, which decodes the BF16 / MXFP8 weights in registers
// (no FP32 copy) and reads each weight row once for all of the expert's rows; each GEMM is
// split over blocks of output rows so that every thread streams weights even when only a few
// experts are active. An expert with more routes gets an FP32 copy of its weights (dequantized
// per forward) and OpenBLAS sgemm, in chunks of kChunkRows rows, experts in parallel (BLAS itself
// single threaded). FP32 activations and accumulation on both paths. Output is per route,
// [M, topk, K], unweighted; the weight-and-reduce is delegated to Finalize (Contiguous).
class BlasExperts final : public Experts {
 public:
  static constexpr absl::string_view kName = "BlasExperts";
  static constexpr int64_t kChunkRows = 256;
  // Rows per expert up to which the GEMV path runs (see tests/benchmarks/cpu_experts/RESULTS.md
  // for the crossover against dequantize + sgemm).
  static constexpr int64_t kGemvMaxRows = 256;
  // num_threads <= 0: all hardware threads. gemv_max_rows: 0 sends every expert to the sgemm
  // path (the benchmark's before/after); negative means kGemvMaxRows.
  explicit BlasExperts(int num_threads, int64_t gemv_max_rows = -1);

  absl::string_view name() const override { return kName; }
  ActivationFormats activation_formats() const override {
    return {ActivationFormat::kStandard, ActivationFormat::kStandard};
  }
  bool supports_expert_map() const override { return true; }
  bool supports_weight_format(WeightFormat) const override { return true; }
  DType activation_dtype() const override { return DType::kFP32; }
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem& p) const override;
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind::kDelegate);
  }
  absl::Status Apply(const ExpertsApplyArgs& args) override;
  int64_t gemv_max_rows() const { return gemv_max_rows_; }

 private:
  std::unique_ptr<ThreadPool> pool_;
  int64_t gemv_max_rows_;
};

namespace cpu_experts_internal {

// Shared by BlasExperts and BatchedBlasExperts.

// One expert's rows for RunGemvExperts: x[r] -> hidden FP32 inputs, y[r] -> hidden FP32
// outputs, r < rows.
struct GemvExpertRows {
  int64_t expert = 0;  // local index
  int64_t rows = 0;
  const float* const* x = nullptr;
  float* const* y = nullptr;
};

// Rows of scratch (each 2 * intermediate FP32) RunGemvExperts is given: enough for one wave of
// experts; more rows are processed in several waves.
int64_t GemvScratchRows(int64_t max_rows_total, int64_t gemv_max_rows);

// y = w2 (silu(w13[:I] x) * (w13[I:] x)) for every row of every expert, on the compressed
// weights; each GEMM is split over blocks of output rows on `pool`. scratch holds
// scratch_rows x 2 * intermediate floats; every expert's rows must be <= scratch_rows.
absl::Status RunGemvExperts(ThreadPool& pool, const LayerWeights& w,
                            const std::vector<GemvExpertRows>& experts, float* scratch,
                            int64_t scratch_rows);

// One expert's MLP on FP32 weights with OpenBLAS, for `rows` contiguous rows:
//   h1 [rows, 2N] = x [rows, K] w13^T;  act [rows, N] = silu(gate) * up;  y [rows, K] = act w2^T.
// w13 [2N, K], w2 [K, N] FP32; h1, act are scratch.
void SgemmExpertMlp(const float* x, int64_t rows, int64_t k, int64_t n, const float* w13,
                    const float* w2, float* h1, float* act, float* y);

}  // namespace cpu_experts_internal

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_CPU_EXPERTS_H_
