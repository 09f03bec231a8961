// CPU experts benchmark: BlasExperts against the plain-loop ReferenceExperts and against its own
// dequantize + sgemm path alone (gemv_max_rows = 0, the code before the GEMV path) on the
// qwen3-30b-a3b layer shape (128 experts, top-8, hidden 2048, intermediate 768); the GEMM peers
// behind the BLAS choice (plain loop, OpenBLAS sgemm, oneDNN sgemm when built with it); and the
// per-expert crossover between the few-row GEMV on compressed weights (kernels/cpu/expert_gemv.h)
// and dequantize + sgemm.
// Physical limits reported next to each: FLOPs over the machine's measured peak sgemm rate,
// and weight bytes over the memory bandwidth measured here with memcpy.
//
// Usage: cpu_experts_bench [--quick]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/cpu/cpu_experts.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/modular_kernel.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/expert_gemv.h"
#include "kernels/cpu/mxfp8.h"
#include "tests/testing/test_util.h"
#ifdef MOESERVE_HAVE_DNNL
#include <dnnl.h>
#endif

namespace moeserve {
namespace {

double MedianSeconds(int reps, const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double MemcpyBandwidth() {
  const size_t n = size_t{512} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  const double s = MedianSeconds(5, [&] { std::memcpy(b.data(), a.data(), n); });
  return 2.0 * n / s;  // read + write
}

void PlainGemmNT(int m, int n, int k, const float* a, const float* b, float* c) {
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float acc = 0;
      for (int p = 0; p < k; ++p) acc += a[i * k + p] * b[j * k + p];
      c[i * n + j] = acc;
    }
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) {
  using namespace moeserve;
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  std::mt19937 rng(0);

  std::printf("# moeserve CPU experts benchmark\n\n");
  const double bw = MemcpyBandwidth();
  std::printf("memcpy bandwidth (read+write): %.1f GB/s\n\n", bw / 1e9);

  // --- GEMM peers on the W13 shape: [M, 2048] x [1536, 2048]^T, single thread.
  openblas_set_num_threads(1);
  const int n = 1536, k = 2048;
  std::printf("## GEMM peers, one thread: C[M,%d] = A[M,%d] B[%d,%d]^T (GFLOP/s)\n\n", n, k, n, k);
  std::printf("| M | plain loop | OpenBLAS sgemm | oneDNN sgemm |\n|---:|---:|---:|---:|\n");
  double peak_sgemm = 0;
  for (int m : {1, 8, 64, 512}) {
    Tensor a = testing::RandomNormal({m, k}, rng), b = testing::RandomNormal({n, k}, rng);
    Tensor c = Tensor::Empty(DType::kFP32, {m, n});
    const double flops = 2.0 * m * n * k;
    const double plain =
        m <= 64 ? flops / MedianSeconds(3,
                                        [&] {
                                          PlainGemmNT(m, n, k, a.data<float>(), b.data<float>(),
                                                      c.data<float>());
                                        })
                : 0;
    const double blas =
        flops / MedianSeconds(5, [&] {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data<float>(), k,
                      b.data<float>(), k, 0.0f, c.data<float>(), n);
        });
    peak_sgemm = std::max(peak_sgemm, blas);
    double dnnl = 0;
#ifdef MOESERVE_HAVE_DNNL
    dnnl = flops / MedianSeconds(5, [&] {
             dnnl_sgemm('N', 'T', m, n, k, 1.0f, a.data<float>(), k, b.data<float>(), k, 0.0f,
                        c.data<float>(), n);
           });
#endif
    std::printf("| %d | %s | %.1f | %s |\n", m,
                plain > 0 ? std::to_string(plain / 1e9).c_str() : "-", blas / 1e9,
                dnnl > 0 ? std::to_string(dnnl / 1e9).c_str() : "not built");
  }

  // --- Per-expert crossover, one thread, W13 shape: y[R,1536] = x[R,2048] W[1536,2048]^T with
  // BF16 weights: GEMV decoding in registers vs an FP32 copy (ConvertBf16ToFp32Ref) + sgemm.
  {
    std::printf(
        "\n## Per-expert crossover, one thread: y[R,%d] = x[R,%d] W[%d,%d]^T, BF16 "
        "weights (ms; GEMV path: %s)\n\n",
        n, k, n, k, kernels::GemvIsaName(kernels::GemvIsaBest()));
    std::printf(
        "| R | GEMV BF16 | GEMV MXFP8 | convert + OpenBLAS | convert + oneDNN | GEMV "
        "GFLOP/s |\n|---:|---:|---:|---:|---:|---:|\n");
    Tensor wsrc = testing::RandomNormal({n, k}, rng, 0.02f);
    std::vector<uint16_t> wb(n * k);
    kernels::ConvertFp32ToBf16Ref(wsrc.data<float>(), wb.data(), n * k);
    std::vector<uint8_t> wq(n * k), ws(n * kernels::Mxfp8ScaleBlocks(k));
    (void)kernels::QuantizeMxfp8RowsRef(wsrc.data<float>(), n, k, wq.data(), ws.data());
    std::vector<float> wf(n * k);
    for (int r : {1, 4, 16, 64, 256}) {
      Tensor a = testing::RandomNormal({r, k}, rng);
      Tensor c = Tensor::Empty(DType::kFP32, {r, n});
      std::vector<const float*> xp(r);
      std::vector<float*> yp(r);
      for (int i = 0; i < r; ++i) {
        xp[i] = a.data<float>() + i * k;
        yp[i] = c.data<float>() + i * n;
      }
      const double t_gemv = MedianSeconds(
          5, [&] { kernels::ExpertGemvBf16(wb.data(), k, 0, n, xp.data(), r, yp.data()); });
      const double t_gemv8 = MedianSeconds(5, [&] {
        kernels::ExpertGemvMxfp8(wq.data(), ws.data(), k, 0, n, xp.data(), r, yp.data());
      });
      const double t_blas = MedianSeconds(5, [&] {
        kernels::ConvertBf16ToFp32Ref(wb.data(), wf.data(), n * k);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, n, k, 1.0f, a.data<float>(), k,
                    wf.data(), k, 0.0f, c.data<float>(), n);
      });
      std::string dnnl = "not built";
#ifdef MOESERVE_HAVE_DNNL
      const double t_dnnl = MedianSeconds(5, [&] {
        kernels::ConvertBf16ToFp32Ref(wb.data(), wf.data(), n * k);
        dnnl_sgemm('N', 'T', r, n, k, 1.0f, a.data<float>(), k, wf.data(), k, 0.0f, c.data<float>(),
                   n);
      });
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%.3f", t_dnnl * 1e3);
      dnnl = buf;
#endif
      std::printf("| %d | %.3f | %.3f | %.3f | %s | %.1f |\n", r, t_gemv * 1e3, t_gemv8 * 1e3,
                  t_blas * 1e3, dnnl.c_str(), 2.0 * r * n * k / t_gemv / 1e9);
    }
  }

  // --- Experts on the qwen3-30b-a3b layer.
  ModelConfig model = *ModelPreset("qwen3-30b-a3b");
  model.num_layers = 1;
  std::vector<int> ids(model.num_experts);
  for (int e = 0; e < model.num_experts; ++e) ids[e] = e;
  auto store = *ExpertWeightStore::CreateSynthetic(model, ids, 0, 2);
  auto ref = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(4096),
                                    std::make_unique<ReferenceExperts>());
  auto blas = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(4096),
                                     std::make_unique<BlasExperts>(2));
  auto sgemm = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(4096),
                                      std::make_unique<BlasExperts>(2, /*gemv_max_rows=*/0));
  std::printf(
      "\n## Experts, qwen3-30b-a3b layer (E=128, top-8, hidden 2048, intermediate 768), "
      "2 threads, FP32 activations, BF16 weights\n\n");
  std::printf(
      "| tokens | active experts | ReferenceExperts ms | sgemm path only ms | "
      "BlasExperts ms | vs reference | vs sgemm path | Blas GFLOP/s | "
      "Blas %% of sgemm peak x2 | weight GB/s | weight GB/s %% of memcpy | "
      "rel. L2 vs reference |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::vector<int> tokens = quick ? std::vector<int>{1, 64} : std::vector<int>{1, 64, 1024};
  for (int m : tokens) {
    Tensor x = testing::RandomNormal({m, model.hidden}, rng);
    Tensor tid =
        testing::MakeRouting(testing::Routing::kUniform, m, model.topk, model.num_experts, rng);
    Tensor w = testing::RandomTopkWeights(m, model.topk, rng);
    std::vector<bool> active(model.num_experts);
    for (int64_t i = 0; i < tid.numel(); ++i) active[tid.data<int32_t>()[i]] = true;
    const int n_active = static_cast<int>(std::count(active.begin(), active.end(), true));
    ModularKernelArgs args{.hidden_states = x.view(),
                           .topk_ids = tid.view(),
                           .topk_weights = w.view(),
                           .weights = store->layer(0),
                           .num_experts = model.num_experts};
    Tensor out_ref = Tensor::Empty(DType::kFP32, {m, model.hidden});
    Tensor out_blas = Tensor::Empty(DType::kFP32, {m, model.hidden});
    Tensor out_sgemm = Tensor::Empty(DType::kFP32, {m, model.hidden});
    const int ref_reps = m >= 1024 ? 1 : 3;
    const double t_ref = MedianSeconds(ref_reps, [&] { (void)ref->Forward(args, out_ref.view()); });
    const double t_sgemm =
        MedianSeconds(m >= 1024 ? 3 : 5, [&] { (void)sgemm->Forward(args, out_sgemm.view()); });
    const double t_blas = MedianSeconds(5, [&] { (void)blas->Forward(args, out_blas.view()); });
    const double flops = 2.0 * 3 * model.hidden * model.intermediate * m * model.topk;
    const double weight_bytes = 2.0 * 3 * model.hidden * model.intermediate * n_active;
    std::printf(
        "| %d | %d | %.2f | %.2f | %.2f | %.1fx | %.1fx | %.1f | %.0f%% | %.1f | %.0f%% | "
        "%.1e |\n",
        m, n_active, t_ref * 1e3, t_sgemm * 1e3, t_blas * 1e3, t_ref / t_blas, t_sgemm / t_blas,
        flops / t_blas / 1e9, 100.0 * flops / t_blas / (2 * peak_sgemm),
        weight_bytes / t_blas / 1e9, 100.0 * weight_bytes / t_blas / bw,
        testing::RelativeL2Error(out_blas.data<float>(), out_ref.data<float>(), out_ref.numel()));
  }
  return 0;
}
