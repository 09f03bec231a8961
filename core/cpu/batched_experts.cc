#include "core/cpu/batched_experts.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cpu/moe_ref.h"

namespace moeserve {
namespace {

absl::Status CheckBatchedInput(absl::string_view who, const ExpertsApplyArgs& args) {
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  if (p.format != ActivationFormat::kBatchedExperts || p.a1q.dtype() != DType::kFP32 ||
      p.a1q.rank() != 3 || p.a1q.dim(0) != w.num_local_experts || p.a1q.dim(2) != w.hidden ||
      !p.a1q.is_contiguous() || p.expert_num_tokens.dtype() != DType::kINT32 ||
      p.expert_num_tokens.rank() != 1 || p.expert_num_tokens.dim(0) != w.num_local_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": expected BatchedExperts FP32 a1q [", w.num_local_experts, ", max_tokens, ",
        w.hidden, "] and INT32 expert_num_tokens [", w.num_local_experts, "]; got a1q ",
        p.a1q.DebugString(), ", expert_num_tokens ", p.expert_num_tokens.DebugString()));
  }
  const int32_t* n = p.expert_num_tokens.data<int32_t>();
  for (int64_t e = 0; e < w.num_local_experts; ++e) {
    if (n[e] < 0 || n[e] > p.a1q.dim(1)) {
      return absl::InternalError(absl::StrCat(who, ": expert_num_tokens[", e, "]=", n[e],
                                              " outside [0, ", p.a1q.dim(1), "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

WorkspaceShapes BatchedReferenceExperts::GetWorkspaceShapes(const MoeProblem& p) const {
  WorkspaceShapes s;
  s.workspace13 = {3 * p.intermediate + p.hidden};
  s.workspace2 = {3 * p.intermediate * p.hidden};
  s.output = {p.num_tokens, p.hidden};
  return s;
}

absl::Status BatchedReferenceExperts::Apply(const ExpertsApplyArgs& args) {
  MOESERVE_RETURN_IF_ERROR(CheckBatchedInput(kName, args));
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  const int64_t m = p.problem.num_tokens, k = w.hidden, n = w.intermediate;
  const int64_t cap = p.a1q.dim(1);
  if (p.topk_ids.rank() != 2 || p.topk_ids.dim(0) != m || p.topk_ids.dtype() != DType::kINT32 ||
      p.topk_weights.shape() != p.topk_ids.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(
        kName, ": reduces in Apply, so it needs the records' ids and weights [", m,
        ", topk]; got ", p.topk_ids.DebugString()));
  }
  const int64_t topk = p.topk_ids.dim(1);
  float* out = args.output.data<float>();
  if (args.output.nbytes() > 0) std::memset(out, 0, args.output.nbytes());
  float* scratch = args.workspace13.data<float>();
  float* y = scratch + 3 * n;
  float* w13 = args.workspace2.data<float>();
  float* w2 = w13 + 2 * n * k;
  const int32_t* ids = p.topk_ids.data<int32_t>();
  const float* weights = p.topk_weights.data<float>();
  const int32_t* counts = p.expert_num_tokens.data<int32_t>();
  for (int64_t e = 0; e < w.num_local_experts; ++e) {
    if (counts[e] == 0) continue;
    MOESERVE_RETURN_IF_ERROR(DequantizeExpertToFp32(w, e, w13, w2));
    int64_t row = 0;
    for (int64_t r = 0; r < m * topk; ++r) {
      if (ids[r] != e) continue;
      if (row >= counts[e]) {
        return absl::InternalError(absl::StrCat(kName, ": expert ", e, " has more routes than its ",
                                                counts[e], " rows"));
      }
      const float* x = p.a1q.data<float>() + (e * cap + row++) * k;
      kernels::ExpertMlpRowRef(x, w13, w2, k, n, y, scratch);
      float* o = out + (r / topk) * k;
      for (int64_t h = 0; h < k; ++h) o[h] += weights[r] * y[h];
    }
    if (row != counts[e]) {
      return absl::InternalError(absl::StrCat(kName, ": expert ", e, " has ", counts[e],
                                              " rows but ", row, " routes"));
    }
  }
  return absl::OkStatus();
}

BatchedBlasExperts::BatchedBlasExperts(int num_threads)
    : pool_(std::make_unique<ThreadPool>(num_threads)) {
  openblas_set_num_threads(1);
}

WorkspaceShapes BatchedBlasExperts::GetWorkspaceShapes(const MoeProblem& p) const {
  const int64_t threads = pool_->num_threads();
  const int64_t rows = std::min<int64_t>(kChunkRows, std::max<int64_t>(1, p.max_num_tokens));
  WorkspaceShapes s;
  // Per thread: W13 output [rows, 2N] and activation [rows, N].
  s.workspace13 = {threads, rows * 3 * p.intermediate};
  // Per thread: one expert's FP32 weights.
  s.workspace2 = {threads, 3 * p.intermediate * p.hidden};
  s.output = {p.num_local_experts, p.max_num_tokens, p.hidden};
  return s;
}

absl::Status BatchedBlasExperts::Apply(const ExpertsApplyArgs& args) {
  MOESERVE_RETURN_IF_ERROR(CheckBatchedInput(kName, args));
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  const int64_t k = w.hidden, n = w.intermediate, cap = p.a1q.dim(1);
  if (args.output.shape() != Shape{w.num_local_experts, cap, k}) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": output must be [",
                                                   w.num_local_experts, ", ", cap, ", ", k,
                                                   "], got ", args.output.DebugString()));
  }
  const int32_t* counts = p.expert_num_tokens.data<int32_t>();
  std::vector<int64_t> active;
  for (int64_t e = 0; e < w.num_local_experts; ++e) {
    if (counts[e] > 0) active.push_back(e);
  }
  const int64_t ws13_stride = args.workspace13.dim(1), ws2_stride = args.workspace2.dim(1);
  const int64_t chunk_rows = ws13_stride / (3 * n);
  std::atomic<bool> failed{false};
  absl::Status first_error;
  std::mutex error_mu;
  pool_->ParallelFor(static_cast<int64_t>(active.size()), [&](int64_t i, int thread) {
    const int64_t e = active[i];
    float* w13 = args.workspace2.data<float>() + thread * ws2_stride;
    float* w2 = w13 + 2 * n * k;
    if (absl::Status s = DequantizeExpertToFp32(w, e, w13, w2); !s.ok()) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!failed.exchange(true)) first_error = s;
      return;
    }
    float* h1 = args.workspace13.data<float>() + thread * ws13_stride;
    float* act = h1 + chunk_rows * 2 * n;
    const float* x = p.a1q.data<float>() + e * cap * k;
    float* y = args.output.data<float>() + e * cap * k;
    for (int64_t begin = 0; begin < counts[e]; begin += chunk_rows) {
      const int64_t rows = std::min<int64_t>(chunk_rows, counts[e] - begin);
      // h1 [rows, 2N] = x [rows, K] * w13^T; y [rows, K] = act [rows, N] * w2^T.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, 2 * n, k, 1.0f,
                  x + begin * k, k, w13, k, 0.0f, h1, 2 * n);
      kernels::SiluAndMulRef(h1, rows, n, act);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, k, n, 1.0f, act, n, w2, n,
                  0.0f, y + begin * k, k);
    }
  });
  if (failed) return first_error;
  return absl::OkStatus();
}

}  // namespace moeserve
