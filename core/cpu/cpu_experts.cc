#include "core/cpu/cpu_experts.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cpu/moe_ref.h"

namespace moeserve {
namespace {

absl::Status CheckStandardInput(absl::string_view who, const ExpertsApplyArgs& args) {
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  if (p.format != ActivationFormat::kStandard || p.a1q.dtype() != DType::kFP32 ||
      p.a1q.rank() != 2 || p.a1q.dim(1) != w.hidden || !p.a1q.is_contiguous() ||
      p.topk_ids.dtype() != DType::kINT32 || p.topk_ids.rank() != 2 ||
      p.topk_ids.dim(0) != p.a1q.dim(0) || p.topk_weights.shape() != p.topk_ids.shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": expected Standard FP32 a1q [M, ", w.hidden,
                     "] with INT32 ids and FP32 weights [M, topk]; got a1q ", p.a1q.DebugString(),
                     ", ids ", p.topk_ids.DebugString()));
  }
  const int32_t* ids = p.topk_ids.data<int32_t>();
  for (int64_t i = 0; i < p.topk_ids.numel(); ++i) {
    if (ids[i] < -1 || ids[i] >= w.num_local_experts) {
      return absl::InternalError(absl::StrCat(who, ": local expert id ", ids[i],
                                              " out of range [-1, ", w.num_local_experts, ")"));
    }
  }
  return absl::OkStatus();
}

// Route indices (t * topk + k) grouped by local expert, in ascending route order.
std::vector<std::vector<int64_t>> GroupRoutes(const TensorView& topk_ids, int64_t num_experts) {
  std::vector<std::vector<int64_t>> routes(num_experts);
  const int32_t* ids = topk_ids.data<int32_t>();
  for (int64_t r = 0; r < topk_ids.numel(); ++r) {
    if (ids[r] >= 0) routes[ids[r]].push_back(r);
  }
  return routes;
}

}  // namespace

WorkspaceShapes ReferenceExperts::GetWorkspaceShapes(const MoeProblem& p) const {
  WorkspaceShapes s;
  s.workspace13 = {3 * p.intermediate + p.hidden};                   // row scratch + y
  s.workspace2 = {3 * p.intermediate * p.hidden};                    // one expert, FP32
  s.output = {p.num_tokens, p.hidden};
  return s;
}

absl::Status ReferenceExperts::Apply(const ExpertsApplyArgs& args) {
  MOESERVE_RETURN_IF_ERROR(CheckStandardInput(kName, args));
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  const int64_t m = p.a1q.dim(0), k = w.hidden, n = w.intermediate, topk = p.topk_ids.dim(1);
  float* out = args.output.data<float>();
  std::memset(out, 0, sizeof(float) * m * k);
  float* scratch = args.workspace13.data<float>();
  float* y = scratch + 3 * n;
  float* w13 = args.workspace2.data<float>();
  float* w2 = w13 + 2 * n * k;
  const int32_t* ids = p.topk_ids.data<int32_t>();
  const float* weights = p.topk_weights.data<float>();
  const float* a = p.a1q.data<float>();
  for (int64_t e = 0; e < w.num_local_experts; ++e) {
    bool loaded = false;
    for (int64_t r = 0; r < m * topk; ++r) {
      if (ids[r] != e) continue;
      if (!loaded) {
        MOESERVE_RETURN_IF_ERROR(DequantizeExpertToFp32(w, e, w13, w2));
        loaded = true;
      }
      const int64_t t = r / topk;
      kernels::ExpertMlpRowRef(a + t * k, w13, w2, k, n, y, scratch);
      for (int64_t h = 0; h < k; ++h) out[t * k + h] += weights[r] * y[h];
    }
  }
  return absl::OkStatus();
}

BlasExperts::BlasExperts(int num_threads) : pool_(std::make_unique<ThreadPool>(num_threads)) {
  // Parallelism comes from running experts concurrently; keep each sgemm on its caller.
  openblas_set_num_threads(1);
}

WorkspaceShapes BlasExperts::GetWorkspaceShapes(const MoeProblem& p) const {
  const int64_t threads = pool_->num_threads();
  const int64_t rows = std::min<int64_t>(kChunkRows, std::max<int64_t>(1, p.num_tokens * p.topk));
  WorkspaceShapes s;
  // Per thread: gathered rows [rows, K], W13 output [rows, 2N], activation [rows, N],
  // W2 output [rows, K].
  s.workspace13 = {threads, rows * (2 * p.hidden + 3 * p.intermediate)};
  // Per thread: one expert's FP32 weights.
  s.workspace2 = {threads, 3 * p.intermediate * p.hidden};
  s.output = {p.num_tokens, p.topk, p.hidden};
  return s;
}

absl::Status BlasExperts::Apply(const ExpertsApplyArgs& args) {
  MOESERVE_RETURN_IF_ERROR(CheckStandardInput(kName, args));
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  const int64_t m = p.a1q.dim(0), k = w.hidden, n = w.intermediate, topk = p.topk_ids.dim(1);
  float* out = args.output.data<float>();
  const int32_t* ids = p.topk_ids.data<int32_t>();
  for (int64_t r = 0; r < m * topk; ++r) {
    if (ids[r] < 0) std::memset(out + r * k, 0, sizeof(float) * k);  // remote route
  }
  const std::vector<std::vector<int64_t>> routes = GroupRoutes(p.topk_ids, w.num_local_experts);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < w.num_local_experts; ++e) {
    if (!routes[e].empty()) active.push_back(e);
  }
  const int64_t ws13_stride = args.workspace13.dim(1), ws2_stride = args.workspace2.dim(1);
  const int64_t chunk_rows = ws13_stride / (2 * k + 3 * n);
  const float* a = p.a1q.data<float>();
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
    float* x = args.workspace13.data<float>() + thread * ws13_stride;
    float* h1 = x + chunk_rows * k;
    float* act = h1 + chunk_rows * 2 * n;
    float* y = act + chunk_rows * n;
    const std::vector<int64_t>& rs = routes[e];
    for (size_t begin = 0; begin < rs.size(); begin += chunk_rows) {
      const int64_t rows = std::min<int64_t>(chunk_rows, static_cast<int64_t>(rs.size() - begin));
      for (int64_t j = 0; j < rows; ++j) {
        std::memcpy(x + j * k, a + (rs[begin + j] / topk) * k, sizeof(float) * k);
      }
      // h1 [rows, 2N] = x [rows, K] * w13^T, w13 [2N, K].
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, 2 * n, k, 1.0f, x, k, w13, k,
                  0.0f, h1, 2 * n);
      kernels::SiluAndMulRef(h1, rows, n, act);
      // y [rows, K] = act [rows, N] * w2^T, w2 [K, N].
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, k, n, 1.0f, act, n, w2, n, 0.0f,
                  y, k);
      for (int64_t j = 0; j < rows; ++j) {
        std::memcpy(out + rs[begin + j] * k, y + j * k, sizeof(float) * k);
      }
    }
  });
  if (failed) return first_error;
  return absl::OkStatus();
}

}  // namespace moeserve
