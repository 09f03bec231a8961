// CPU Experts in the BatchedExperts format: a1q [E_local, max_tokens, K] where local expert e's
// first expert_num_tokens[e] rows are valid.
#ifndef MOESERVE_CORE_CPU_BATCHED_EXPERTS_H_
#define MOESERVE_CORE_CPU_BATCHED_EXPERTS_H_

#include <memory>

#include "core/modular_kernel.h"
#include "core/thread_pool.h"

namespace moeserve {

// Plain loops, FP32, one row at a time. Applies the top-k weights and reduces inside Apply
// (FinalizeWeightAndReduceImpl() is NoOp), so it needs the prepared records' ids/weights
// [M_recv, topk]: expert e's rows are its routes in (record, k) order. Output [M_recv, K].
class BatchedReferenceExperts final : public Experts {
 public:
  static constexpr absl::string_view kName = "BatchedReferenceExperts";
  absl::string_view name() const override { return kName; }
  ActivationFormats activation_formats() const override {
    return {ActivationFormat::kBatchedExperts, ActivationFormat::kBatchedExperts};
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

// Each local expert's valid rows are used in place (no gather: the batched layout is already
// grouped). An expert with at most gemv_max_rows rows runs through kernels::ExpertGemv* on its
// compressed weights, each GEMM split over blocks of output rows across the thread pool (as in
// BlasExperts); one with more gets an FP32 copy of its weights and OpenBLAS sgemm in chunks of
// kChunkRows rows, experts in parallel. Output [E_local, max_tokens, K] unweighted, rows past
// expert_num_tokens unspecified; the weight-and-reduce is delegated to Finalize (NaiveBatched).
class BatchedBlasExperts final : public Experts {
 public:
  static constexpr absl::string_view kName = "BatchedBlasExperts";
  static constexpr int64_t kChunkRows = 256;
  static constexpr int64_t kGemvMaxRows = 256;  // as BlasExperts::kGemvMaxRows
  // num_threads <= 0: all hardware threads. gemv_max_rows: 0 sends every expert to the sgemm
  // path; negative means kGemvMaxRows.
  explicit BatchedBlasExperts(int num_threads, int64_t gemv_max_rows = -1);
  absl::string_view name() const override { return kName; }
  ActivationFormats activation_formats() const override {
    return {ActivationFormat::kBatchedExperts, ActivationFormat::kBatchedExperts};
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

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_BATCHED_EXPERTS_H_
