// CPU Experts in the Standard format: the plain-loop reference (the oracle) and a BLAS one.
#ifndef MOESERVE_CORE_CPU_CPU_EXPERTS_H_
#define MOESERVE_CORE_CPU_CPU_EXPERTS_H_

#include <memory>

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

// Groups routes by expert and runs each expert's two GEMMs with OpenBLAS sgemm on FP32
// copies of its weights (dequantized per forward, only for experts that have routes), in
// chunks of kChunkRows rows. Experts run in parallel on a thread pool (BLAS itself single
// threaded). Output is per route, [M, topk, K], unweighted; the weight-and-reduce is delegated
// to Finalize (Contiguous).
class BlasExperts final : public Experts {
 public:
  static constexpr absl::string_view kName = "BlasExperts";
  static constexpr int64_t kChunkRows = 256;
  // num_threads <= 0: all hardware threads.
  explicit BlasExperts(int num_threads);

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

 private:
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_CPU_EXPERTS_H_
