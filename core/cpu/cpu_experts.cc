#include "core/cpu/cpu_experts.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"
#include "kernels/cpu/expert_gemv.h"
#include "kernels/cpu/moe_ref.h"
#include "kernels/cpu/mxfp8.h"

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

namespace cpu_experts_internal {
namespace {

// Output rows of one GEMV work item: 128 weight rows (256 KiB of BF16 at hidden 1024) keep the
// per-item overhead small while giving each thread several items per expert.
constexpr int64_t kGemvBlockRows = 128;
// Scratch rows for one wave of GEMV experts (at least one expert's worth).
constexpr int64_t kGemvWaveRows = 512;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t GemvScratchRows(int64_t max_rows_total, int64_t gemv_max_rows) {
  if (gemv_max_rows <= 0) return 0;
  return std::min(std::max<int64_t>(0, max_rows_total), std::max(kGemvWaveRows, gemv_max_rows));
}

absl::Status RunGemvExperts(ThreadPool& pool, const LayerWeights& w,
                            const std::vector<GemvExpertRows>& experts, float* scratch,
                            int64_t scratch_rows) {
  const int64_t k = w.hidden, n = w.intermediate;
  const bool mxfp8 = w.format == WeightFormat::kMXFP8;
  if (!mxfp8 && w.format != WeightFormat::kBF16) {
    return absl::InternalError(absl::StrCat("unknown weight format ", static_cast<int>(w.format)));
  }
  if (mxfp8 && (w.w13_scale.raw_data() == nullptr || w.w2_scale.raw_data() == nullptr)) {
    return absl::InternalError("mxfp8 weights without their E8M0 scales");
  }
  for (const GemvExpertRows& g : experts) {
    if (g.expert < 0 || g.expert >= w.num_local_experts || g.rows > scratch_rows) {
      return absl::InternalError(absl::StrCat("GEMV expert ", g.expert, " with ", g.rows,
                                              " rows (scratch ", scratch_rows, " rows)"));
    }
  }
  const int64_t w13_elems = 2 * n * k, w2_elems = k * n;
  const int64_t w13_blocks = 2 * n * kernels::Mxfp8ScaleBlocks(k);
  const int64_t w2_blocks = k * kernels::Mxfp8ScaleBlocks(n);
  // First GEMM: h [rows, 2N] = x W13^T, weight rows [j0, j1) of W13 [2N, K].
  auto w13_gemv = [&](const GemvExpertRows& g, int64_t j0, int64_t j1, float* const* h) {
    if (mxfp8) {
      kernels::ExpertGemvMxfp8(w.w13.data<uint8_t>() + g.expert * w13_elems,
                               w.w13_scale.data<uint8_t>() + g.expert * w13_blocks, k, j0, j1, g.x,
                               g.rows, h);
    } else {
      kernels::ExpertGemvBf16(w.w13.data<uint16_t>() + g.expert * w13_elems, k, j0, j1, g.x, g.rows,
                              h);
    }
  };
  // Second GEMM: y [rows, K] = act W2^T, weight rows [j0, j1) of W2 [K, N].
  auto w2_gemv = [&](const GemvExpertRows& g, int64_t j0, int64_t j1, const float* const* act) {
    if (mxfp8) {
      kernels::ExpertGemvMxfp8(w.w2.data<uint8_t>() + g.expert * w2_elems,
                               w.w2_scale.data<uint8_t>() + g.expert * w2_blocks, n, j0, j1, act,
                               g.rows, g.y);
    } else {
      kernels::ExpertGemvBf16(w.w2.data<uint16_t>() + g.expert * w2_elems, n, j0, j1, act, g.rows,
                              g.y);
    }
  };
  const int64_t blocks13 = CeilDiv(2 * n, kGemvBlockRows), blocks2 = CeilDiv(k, kGemvBlockRows);
  std::vector<float*> h;        // scratch row pointers of the current wave
  std::vector<int64_t> offset;  // first scratch row of each expert of the wave
  for (size_t begin = 0; begin < experts.size();) {
    // A wave: as many experts as the scratch holds.
    size_t end = begin;
    int64_t rows = 0;
    offset.clear();
    while (end < experts.size() && rows + experts[end].rows <= scratch_rows) {
      offset.push_back(rows);
      rows += experts[end++].rows;
    }
    const int64_t count = static_cast<int64_t>(end - begin);
    h.resize(rows);
    for (int64_t r = 0; r < rows; ++r) h[r] = scratch + r * 2 * n;
    pool.ParallelFor(count * blocks13, [&](int64_t item, int) {
      const int64_t i = item / blocks13, j0 = (item % blocks13) * kGemvBlockRows;
      w13_gemv(experts[begin + i], j0, std::min(2 * n, j0 + kGemvBlockRows), h.data() + offset[i]);
    });
    // act = silu(gate) * up, in place over the gate half of each scratch row.
    constexpr int64_t kSiluRows = 16;
    pool.ParallelFor(CeilDiv(rows, kSiluRows), [&](int64_t item, int) {
      for (int64_t r = item * kSiluRows; r < std::min(rows, (item + 1) * kSiluRows); ++r) {
        kernels::SiluAndMulRef(h[r], 1, n, h[r]);
      }
    });
    pool.ParallelFor(count * blocks2, [&](int64_t item, int) {
      const int64_t i = item / blocks2, j0 = (item % blocks2) * kGemvBlockRows;
      w2_gemv(experts[begin + i], j0, std::min(k, j0 + kGemvBlockRows), h.data() + offset[i]);
    });
    begin = end;
  }
  return absl::OkStatus();
}

void SgemmExpertMlp(const float* x, int64_t rows, int64_t k, int64_t n, const float* w13,
                    const float* w2, float* h1, float* act, float* y) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, 2 * n, k, 1.0f, x, k, w13, k, 0.0f, h1,
              2 * n);
  kernels::SiluAndMulRef(h1, rows, n, act);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, k, n, 1.0f, act, n, w2, n, 0.0f, y, k);
}

}  // namespace cpu_experts_internal

WorkspaceShapes ReferenceExperts::GetWorkspaceShapes(const MoeProblem& p) const {
  WorkspaceShapes s;
  s.workspace13 = {3 * p.intermediate + p.hidden};  // row scratch + y
  s.workspace2 = {3 * p.intermediate * p.hidden};   // one expert, FP32
  s.output = {p.num_tokens, p.hidden};
  return s;
}

absl::Status ReferenceExperts::Apply(const ExpertsApplyArgs& args) {
  MOESERVE_RETURN_IF_ERROR(CheckStandardInput(kName, args));
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  const int64_t m = p.a1q.dim(0), k = w.hidden, n = w.intermediate, topk = p.topk_ids.dim(1);
  float* out = args.output.data<float>();
  if (m > 0) std::memset(out, 0, sizeof(float) * m * k);  // (no memset of a null empty buffer)
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

namespace {

// BlasExperts' workspace13: per-thread sgemm buffers (only when some expert can have more than
// gemv_max_rows rows), then the GEMV scratch.
struct BlasLayout {
  int64_t chunk_rows = 0;     // sgemm rows per chunk
  int64_t thread_floats = 0;  // per thread: x [rows, K], h1 [rows, 2N], act [rows, N], y [rows, K]
  int64_t gemv_rows = 0;      // GEMV scratch rows (2N floats each)
  bool sgemm = false;         // whether the sgemm path can run
  int64_t Workspace13(int64_t threads, int64_t n) const {
    return threads * thread_floats + gemv_rows * 2 * n;
  }
};

BlasLayout MakeBlasLayout(int64_t routes, int64_t k, int64_t n, int64_t gemv_max_rows) {
  BlasLayout l;
  routes = std::max<int64_t>(1, routes);
  l.sgemm = routes > gemv_max_rows;
  l.chunk_rows = std::min<int64_t>(BlasExperts::kChunkRows, routes);
  l.thread_floats = l.sgemm ? l.chunk_rows * (2 * k + 3 * n) : 0;
  l.gemv_rows = cpu_experts_internal::GemvScratchRows(routes, gemv_max_rows);
  return l;
}

}  // namespace

BlasExperts::BlasExperts(int num_threads, int64_t gemv_max_rows)
    : pool_(std::make_unique<ThreadPool>(num_threads)),
      gemv_max_rows_(gemv_max_rows < 0 ? kGemvMaxRows : gemv_max_rows) {
  // Parallelism comes from running experts concurrently; keep each sgemm on its caller.
  openblas_set_num_threads(1);
}

WorkspaceShapes BlasExperts::GetWorkspaceShapes(const MoeProblem& p) const {
  const int64_t threads = pool_->num_threads();
  const BlasLayout l =
      MakeBlasLayout(p.num_tokens * p.topk, p.hidden, p.intermediate, gemv_max_rows_);
  WorkspaceShapes s;
  s.workspace13 = {l.Workspace13(threads, p.intermediate)};
  // Per thread: one expert's FP32 weights, for the sgemm path only.
  s.workspace2 = {l.sgemm ? threads * 3 * p.intermediate * p.hidden : 0};
  s.output = {p.num_tokens, p.topk, p.hidden};
  return s;
}

absl::Status BlasExperts::Apply(const ExpertsApplyArgs& args) {
  MOESERVE_RETURN_IF_ERROR(CheckStandardInput(kName, args));
  const PreparedActivations& p = *args.prepared;
  const LayerWeights& w = *args.weights;
  const int64_t m = p.a1q.dim(0), k = w.hidden, n = w.intermediate, topk = p.topk_ids.dim(1);
  const int64_t threads = pool_->num_threads();
  const BlasLayout layout = MakeBlasLayout(m * topk, k, n, gemv_max_rows_);
  if (args.workspace13.numel() < layout.Workspace13(threads, n) ||
      (layout.sgemm && args.workspace2.numel() < threads * 3 * n * k)) {
    return absl::InternalError(absl::StrCat(kName, ": workspaces ", args.workspace13.DebugString(),
                                            ", ", args.workspace2.DebugString(), " too small for ",
                                            m, " x ", topk, " routes"));
  }
  float* out = args.output.data<float>();
  const int32_t* ids = p.topk_ids.data<int32_t>();
  for (int64_t r = 0; r < m * topk; ++r) {
    if (ids[r] < 0) std::memset(out + r * k, 0, sizeof(float) * k);  // remote route
  }
  const std::vector<std::vector<int64_t>> routes = GroupRoutes(p.topk_ids, w.num_local_experts);
  const float* a = p.a1q.data<float>();

  // Few rows: GEMV on the compressed weights. x / y point straight at the tokens' inputs and
  // the routes' outputs (no gather, no copy).
  std::vector<int64_t> large;
  std::vector<cpu_experts_internal::GemvExpertRows> small;
  int64_t small_rows = 0;
  for (int64_t e = 0; e < w.num_local_experts; ++e) {
    const int64_t rows = static_cast<int64_t>(routes[e].size());
    if (rows == 0) continue;
    if (rows > gemv_max_rows_) {
      large.push_back(e);
    } else {
      small.push_back({e, rows, nullptr, nullptr});
      small_rows += rows;
    }
  }
  if (!small.empty()) {
    std::vector<const float*> x(small_rows);
    std::vector<float*> y(small_rows);
    int64_t next = 0;
    for (cpu_experts_internal::GemvExpertRows& g : small) {
      g.x = x.data() + next;
      g.y = y.data() + next;
      for (int64_t route : routes[g.expert]) {
        x[next] = a + (route / topk) * k;
        y[next++] = out + route * k;
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
    float* x = args.workspace13.data<float>() + thread * layout.thread_floats;
    float* h1 = x + chunk_rows * k;
    float* act = h1 + chunk_rows * 2 * n;
    float* y = act + chunk_rows * n;
    const std::vector<int64_t>& rs = routes[e];
    for (size_t begin = 0; begin < rs.size(); begin += chunk_rows) {
      const int64_t rows = std::min<int64_t>(chunk_rows, static_cast<int64_t>(rs.size() - begin));
      for (int64_t j = 0; j < rows; ++j) {
        std::memcpy(x + j * k, a + (rs[begin + j] / topk) * k, sizeof(float) * k);
      }
      cpu_experts_internal::SgemmExpertMlp(x, rows, k, n, w13, w2, h1, act, y);
      for (int64_t j = 0; j < rows; ++j) {
        std::memcpy(out + rs[begin + j] * k, y + j * k, sizeof(float) * k);
      }
    }
    return absl::OkStatus();
  });
}

}  // namespace moeserve
