// CPU experts benchmark: BlasExperts against the plain-loop ReferenceExperts on the
// qwen3-30b-a3b layer shape (128 experts, top-8, hidden 2048, intermediate 768), and the GEMM
// peers behind the BLAS choice (plain loop, OpenBLAS sgemm, oneDNN sgemm when built with it).
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
    const double plain = m <= 64 ? flops / MedianSeconds(3, [&] {
      PlainGemmNT(m, n, k, a.data<float>(), b.data<float>(), c.data<float>());
    }) : 0;
    const double blas = flops / MedianSeconds(5, [&] {
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
    std::printf("| %d | %s | %.1f | %s |\n", m, plain > 0 ? std::to_string(plain / 1e9).c_str() : "-",
                blas / 1e9, dnnl > 0 ? std::to_string(dnnl / 1e9).c_str() : "not built");
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
  std::printf("\n## Experts, qwen3-30b-a3b layer (E=128, top-8, hidden 2048, intermediate 768), "
              "2 threads, FP32 activations, BF16 weights\n\n");
  std::printf("| tokens | active experts | ReferenceExperts ms | BlasExperts ms | speedup | "
              "Blas GFLOP/s | Blas %% of sgemm peak x2 | weight GB/s | rel. L2 vs reference |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::vector<int> tokens = quick ? std::vector<int>{1, 64} : std::vector<int>{1, 64, 1024};
  for (int m : tokens) {
    Tensor x = testing::RandomNormal({m, model.hidden}, rng);
    Tensor tid = testing::MakeRouting(testing::Routing::kUniform, m, model.topk,
                                      model.num_experts, rng);
    Tensor w = testing::RandomTopkWeights(m, model.topk, rng);
    std::vector<bool> active(model.num_experts);
    for (int64_t i = 0; i < tid.numel(); ++i) active[tid.data<int32_t>()[i]] = true;
    const int n_active = static_cast<int>(std::count(active.begin(), active.end(), true));
    ModularKernelArgs args{.hidden_states = x.view(), .topk_ids = tid.view(),
                           .topk_weights = w.view(), .weights = store->layer(0),
                           .num_experts = model.num_experts};
    Tensor out_ref = Tensor::Empty(DType::kFP32, {m, model.hidden});
    Tensor out_blas = Tensor::Empty(DType::kFP32, {m, model.hidden});
    const int ref_reps = m >= 1024 ? 1 : 3;
    const double t_ref = MedianSeconds(ref_reps, [&] { (void)ref->Forward(args, out_ref.view()); });
    const double t_blas = MedianSeconds(5, [&] { (void)blas->Forward(args, out_blas.view()); });
    const double flops = 2.0 * 3 * model.hidden * model.intermediate * m * model.topk;
    const double weight_bytes = 2.0 * 3 * model.hidden * model.intermediate * n_active;
    std::printf("| %d | %d | %.2f | %.2f | %.1fx | %.1f | %.0f%% | %.1f | %.1e |\n", m, n_active,
                t_ref * 1e3, t_blas * 1e3, t_ref / t_blas, flops / t_blas / 1e9,
                100.0 * flops / t_blas / (2 * peak_sgemm), weight_bytes / t_blas / 1e9,
                testing::RelativeL2Error(out_blas.data<float>(), out_ref.data<float>(),
                                         out_ref.numel()));
  }
  return 0;
}
