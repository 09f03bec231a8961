// Server-side routing cost (core/router): Route() for DeepSeek-V3's router (256 experts,
// hidden 7168, sigmoid, bias, 8 groups keeping 4, top-8) and Qwen3-30B-A3B's (128 experts,
// hidden 2048, softmax top-8), BF16 hidden states, M in {1, 16, 64, 256, 1024}, on 1 thread and
// on a pool. Peers measured in the same run: the FP32 gate GEMM alone (one cblas_sgemm on one
// thread: what the selection adds is the difference) and a memcpy of the FP32 gate (the
// memory-stream floor of reading it once per call).
//
//   router_bench [--reps N] [--threads T]      (prints a markdown table)
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/router.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve {
namespace {

template <typename F>
double MedianUs(int reps, F&& fn) {
  fn();  // warm up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Case {
  const char* name;
  int64_t experts, hidden;
  int topk;
  RouterConfig config;
};

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) {
  using namespace moeserve;
  int reps = 30;
  int threads = std::max(2, std::min(8, static_cast<int>(std::thread::hardware_concurrency())));
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--reps") reps = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--threads") threads = std::atoi(argv[i + 1]);
  }
  openblas_set_num_threads(1);
  RouterConfig v3;
  v3.scoring = RouterScoring::kSigmoid;
  v3.correction_bias = true;
  v3.n_group = 8;
  v3.topk_group = 4;
  v3.renormalize = true;
  v3.routed_scaling_factor = 2.5f;
  RouterConfig qwen;
  qwen.renormalize = true;
  const Case cases[] = {{"deepseek-v3", 256, 7168, 8, v3}, {"qwen3-30b-a3b", 128, 2048, 8, qwen}};
  ThreadPool pool(threads);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::printf(
      "| router | M | route 1 thread (us) | route %d threads (us) | gate GEMM alone, 1 "
      "thread (us) | gate memcpy floor (us) |\n|---|---|---|---|---|---|\n",
      threads);
  for (const Case& c : cases) {
    Tensor gate = Tensor::Empty(DType::kFP32, {c.experts, c.hidden});
    for (int64_t i = 0; i < gate.numel(); ++i) gate.data<float>()[i] = normal(rng) * 0.01f;
    Tensor bias = Tensor::Empty(DType::kFP32, {c.experts});
    for (int64_t i = 0; i < c.experts; ++i) bias.data<float>()[i] = normal(rng) * 0.1f;
    Tensor gate_copy = Tensor::Empty(DType::kFP32, {c.experts, c.hidden});
    for (int64_t m : {1, 16, 64, 256, 1024}) {
      Tensor x = Tensor::Empty(DType::kBF16, {m, c.hidden});
      for (int64_t i = 0; i < x.numel(); ++i) {
        x.data<uint16_t>()[i] = kernels::FloatToBf16(normal(rng));
      }
      Tensor xf = Tensor::Empty(DType::kFP32, {m, c.hidden});
      kernels::ConvertBf16ToFp32Ref(x.data<uint16_t>(), xf.data<float>(), x.numel());
      Tensor ids = Tensor::Empty(DType::kINT32, {m, c.topk});
      Tensor w = Tensor::Empty(DType::kFP32, {m, c.topk});
      Tensor logits = Tensor::Empty(DType::kFP32, {m, c.experts});
      const int r = std::max(5, static_cast<int>(reps * 16 / std::max<int64_t>(16, m)));
      auto route = [&](ThreadPool* p) {
        return MedianUs(r, [&] {
          if (!Route(c.config, x.view(), gate.view(), bias.view(), ids.view(), w.view(), p).ok()) {
            std::abort();
          }
        });
      };
      const double one = route(nullptr);
      const double many = route(&pool);
      const double gemm = MedianUs(r, [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                    static_cast<int>(c.experts), static_cast<int>(c.hidden), 1.0f, xf.data<float>(),
                    static_cast<int>(c.hidden), gate.data<float>(), static_cast<int>(c.hidden),
                    0.0f, logits.data<float>(), static_cast<int>(c.experts));
      });
      const double copy = MedianUs(
          r, [&] { std::memcpy(gate_copy.data<float>(), gate.data<float>(), gate.nbytes()); });
      std::printf("| %s | %lld | %.1f | %.1f | %.1f | %.1f |\n", c.name, static_cast<long long>(m),
                  one, many, gemm, copy);
      std::fflush(stdout);
    }
  }
  return 0;
}
