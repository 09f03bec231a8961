#include "core/cpu/batched_experts.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/cpu_experts.h"
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
    return absl::InvalidArgumentError(
        absl::StrCat(kName, ": reduces in Apply, so it needs the records' ids and weights [", m,
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
        return absl::InternalError(
            absl::StrCat(kName, ": expert ", e, " has more routes than its ", counts[e], " rows"));
      }
      const float* x = p.a1q.data<float>() + (e * cap + row++) * k;
      kernels::ExpertMlpRowRef(x, w13, w2, k, n, y, scratch);
      float* o = out + (r / topk) * k;
      for (int64_t h = 0; h < k; ++h) o[h] += weights[r] * y[h];
    }
    if (row != counts[e]) {
      return absl::InternalError(
          absl::StrCat(kName, ": expert ", e, " has ", counts[e], " rows but ", row, " routes"));
    }
  }
  return absl::OkStatus();
}

namespace {

// BatchedBlasExperts' workspace13: per-thread sgemm buffers (only when an expert can have more
// than gemv_max_rows rows), then the GEMV scratch.
struct BatchedLayout {
  int64_t chunk_rows = 0;
  int64_t thread_floats = 0;  // per thread: h1 [rows, 2N] and act [rows, N]
  int64_t gemv_rows = 0;
  bool sgemm = false;
  int64_t Workspace13(int64_t threads, int64_t n) const {
    return threads * thread_floats + gemv_rows * 2 * n;
  }
};

BatchedLayout MakeBatchedLayout(int64_t experts, int64_t cap, int64_t n, int64_t gemv_max_rows) {
  BatchedLayout l;
  cap = std::max<int64_t>(1, cap);
  l.sgemm = cap > gemv_max_rows;
  l.chunk_rows = std::min<int64_t>(BatchedBlasExperts::kChunkRows, cap);
  l.thread_floats = l.sgemm ? l.chunk_rows * 3 * n : 0;
  l.gemv_rows = cpu_experts_internal::GemvScratchRows(
      experts * std::min(cap, std::max<int64_t>(0, gemv_max_rows)), gemv_max_rows);
  return l;
}

}  // namespace

BatchedBlasExperts::BatchedBlasExperts(int num_threads, int64_t gemv_max_rows)
    : pool_(std::make_unique<ThreadPool>(num_threads)),
      gemv_max_rows_(gemv_max_rows < 0 ? kGemvMaxRows : gemv_max_rows) {
  openblas_set_num_threads(1);
}

WorkspaceShapes BatchedBlasExperts::GetWorkspaceShapes(const MoeProblem& p) const {
  const int64_t threads = pool_->num_threads();
  const BatchedLayout l =
      MakeBatchedLayout(p.num_local_experts, p.max_num_tokens, p.intermediate, gemv_max_rows_);
  WorkspaceShapes s;
  s.workspace13 = {l.Workspace13(threads, p.intermediate)};
  // Per thread: one expert's FP32 weights, for the sgemm path only.
  s.workspace2 = {l.sgemm ? threads * 3 * p.intermediate * p.hidden : 0};
  s.output = {p.num_local_experts, p.max_num_tokens, p.hidden};
  return s;
}

absl::Status BatchedBlasExperts::Apply(const ExpertsApplyArgs& args) {
  MOESERVE_RETURN_IF_ERROR(CheckBatchedInput(kName, args));
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  const int64_t k = w.hidden, n = w.intermediate, cap = p.a1q.dim(1);
  if (args.output.shape() != Shape{w.num_local_experts, cap, k}) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": output must be [", w.num_local_experts,
                                                   ", ", cap, ", ", k, "], got ",
                                                   args.output.DebugString()));
  }
  const int64_t threads = pool_->num_threads();
  const BatchedLayout layout = MakeBatchedLayout(w.num_local_experts, cap, n, gemv_max_rows_);
  if (args.workspace13.numel() < layout.Workspace13(threads, n) ||
      (layout.sgemm && args.workspace2.numel() < threads * 3 * n * k)) {
    return absl::InternalError(absl::StrCat(kName, ": workspaces ", args.workspace13.DebugString(),
                                            ", ", args.workspace2.DebugString(), " too small for ",
                                            w.num_local_experts, " x ", cap, " rows"));
  }
  const int32_t* counts = p.expert_num_tokens.data<int32_t>();
  const float* a = p.a1q.data<float>();
  float* out = args.output.data<float>();

  // Few rows: GEMV on the compressed weights, reading and writing the batched rows in place.
  std::vector<int64_t> large;
  std::vector<cpu_experts_internal::GemvExpertRows> small;
  int64_t small_rows = 0;
  for (int64_t e = 0; e < w.num_local_experts; ++e) {
    if (counts[e] == 0) continue;
    if (counts[e] > gemv_max_rows_) {
      large.push_back(e);
    } else {
      small.push_back({e, counts[e], nullptr, nullptr});
      small_rows += counts[e];
    }
  }
  if (!small.empty()) {
    std::vector<const float*> x(small_rows);
    std::vector<float*> y(small_rows);
    int64_t next = 0;
    for (cpu_experts_internal::GemvExpertRows& g : small) {
      g.x = x.data() + next;
      g.y = y.data() + next;
      for (int64_t r = 0; r < g.rows; ++r) {
        x[next] = a + (g.expert * cap + r) * k;
        y[next++] = out + (g.expert * cap + r) * k;
      }
    }
    MOESERVE_RETURN_IF_ERROR(cpu_experts_internal::RunGemvExperts(
        *pool_, w, small, args.workspace13.data<float>() + threads * layout.thread_floats,
        layout.gemv_rows));
  }
  if (large.empty()) return absl::OkStatus();

  // Many rows: FP32 copy of the weights + sgemm.
  const int64_t chunk_rows = layout.chunk_rows;
  return pool_->ParallelForStatus(static_cast<int64_t>(large.size()), [&](int64_t i, int thread) {
    const int64_t e = large[i];
    float* w13 = args.workspace2.data<float>() + thread * 3 * n * k;
    float* w2 = w13 + 2 * n * k;
    MOESERVE_RETURN_IF_ERROR(DequantizeExpertToFp32(w, e, w13, w2));
    float* h1 = args.workspace13.data<float>() + thread * layout.thread_floats;
    float* act = h1 + chunk_rows * 2 * n;
    const float* x = a + e * cap * k;
    float* y = out + e * cap * k;
    for (int64_t begin = 0; begin < counts[e]; begin += chunk_rows) {
      const int64_t rows = std::min<int64_t>(chunk_rows, counts[e] - begin);
      cpu_experts_internal::SgemmExpertMlp(x + begin * k, rows, k, n, w13, w2, h1, act,
                                           y + begin * k);
    }
    return absl::OkStatus();
  });
}

}  // namespace moeserve
