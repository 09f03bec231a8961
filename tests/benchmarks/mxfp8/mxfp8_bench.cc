// MXFP8 vs BF16 expert weights on the CPU: BlasExperts serving the same synthetic weights as
// BF16 and as MXFP8 (the BF16 values quantized at load), qwen3-30b-a3b layer shape (128
// experts, top-8, hidden 2048, intermediate 768), one layer. Reports each path's time, their
// relative L2 error against each other and against ReferenceExperts on the BF16 weights, the
// one-off quantization cost, the per-expert dequantization cost behind the times, and the
// physical limits (weight bytes over measured memory bandwidth, FLOPs over measured sgemm peak).
//
// Routing is the seed's balanced pattern, topk_ids = (slot * 73 + 19) % num_experts with
// slot = token * topk + k (distinct experts per token; every expert equally loaded).
//
// Usage: mxfp8_bench [--out RESULTS.md]   (prints the markdown; --out also writes it there)
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/cpu/cpu_experts.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/model_config.h"
#include "core/modular_kernel.h"
#include "core/mxfp8_weights.h"
#include "core/weights.h"
#include "tests/testing/test_util.h"

namespace moeserve {
namespace {

std::string report;

void Emit(const char* fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fputs(buf, stdout);
  std::fflush(stdout);
  report += buf;
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double MedianSeconds(int reps, const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) t.push_back(Seconds(fn));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct Timing {
  double wall = 0;  // median seconds
  double cpu = 0;   // median process CPU seconds (all threads)
};

// Times a and b alternately (a, b, a, b, ...) after one warm-up each, so that load from other
// processes on a shared machine falls on both alike. Medians of wall and process CPU time.
std::pair<Timing, Timing> AlternatingMedians(int reps, const std::function<void()>& a,
                                             const std::function<void()>& b) {
  a();
  b();
  std::vector<double> wa, wb, ca, cb;
  for (int i = 0; i < reps; ++i) {
    for (int which = 0; which < 2; ++which) {
      const double c0 = ProcessCpuSeconds();
      const double w = Seconds(which == 0 ? a : b);
      const double c = ProcessCpuSeconds() - c0;
      (which == 0 ? wa : wb).push_back(w);
      (which == 0 ? ca : cb).push_back(c);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {{median(wa), median(ca)}, {median(wb), median(cb)}};
}

std::string Shell(const char* cmd) {
  std::string out;
  if (FILE* p = popen(cmd, "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof(buf), p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

using ::moeserve::testing::RelativeL2Error;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) {
  using namespace moeserve;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--out" && i + 1 < argc) out_path = argv[++i];
  }
  const int threads = 2;

  Emit("# MXFP8 vs BF16 expert weights, CPU\n\n");
  Emit("- machine: %s, %u hardware threads (lscpu: %s), shared with other builds while measured\n",
       Shell("lscpu | sed -n 's/^Model name: *//p'").c_str(), std::thread::hardware_concurrency(),
       Shell("lscpu | sed -n 's/^CPU(s): *//p'").c_str());
  Emit("- date: %s\n", Shell("date -u '+%Y-%m-%d %H:%M UTC'").c_str());
  Emit("- commit: %s (benchmark built from the working tree at this commit)\n",
       Shell("git -C " MOESERVE_SOURCE_DIR " rev-parse --short HEAD").c_str());
  Emit(
      "- command: `mxfp8_bench --out tests/benchmarks/mxfp8/RESULTS.md` (build: "
      "`ninja -C build mxfp8_bench`)\n");
  Emit(
      "- BlasExperts with %d threads (OpenBLAS sgemm single-threaded per expert), FP32 "
      "activations, NoEpPrepareAndFinalize; ReferenceExperts is the plain-loop oracle.\n\n",
      threads);

  // Physical limits measured here.
  double bw = 0;
  {
    const size_t n = size_t{256} << 20;
    std::vector<char> a(n, 1), b(n, 2);
    bw = 2.0 * n / MedianSeconds(3, [&] { std::memcpy(b.data(), a.data(), n); });
  }
  double sgemm_peak = 0;
  {
    openblas_set_num_threads(1);
    const int m = 256, n = 1536, k = 2048;
    std::vector<float> a(m * k, 0.5f), b(n * k, 0.25f), c(m * n);
    const double s = MedianSeconds(3, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k,
                  0.0f, c.data(), n);
    });
    sgemm_peak = 2.0 * m * n * k / s;
  }
  Emit(
      "Measured limits: memcpy %.1f GB/s (read + write), OpenBLAS sgemm %.1f GFLOP/s on one "
      "thread (M=256, the W13 shape), so about %.0f GFLOP/s on %d threads.\n\n",
      bw / 1e9, sgemm_peak / 1e9, threads * sgemm_peak / 1e9, threads);

  ModelConfig model = *ModelPreset("qwen3-30b-a3b");
  model.num_layers = 1;
  model.moe_layers.clear();
  const int64_t h = model.hidden, n = model.intermediate;
  std::vector<int> ids(model.num_experts);
  for (int e = 0; e < model.num_experts; ++e) ids[e] = e;
  std::unique_ptr<ExpertWeightStore> bf16, mx;
  const double t_gen = Seconds([&] {
    auto s = ExpertWeightStore::CreateSynthetic(model, ids, /*seed=*/0, threads);
    Check(s.status(), "synthetic weights");
    bf16 = std::move(*s);
  });
  const double t_quant = Seconds([&] {
    auto s = QuantizeStoreToMxfp8(*bf16, threads);
    Check(s.status(), "quantize");
    mx = std::move(*s);
  });
  const double values = 3.0 * h * n * model.num_experts;
  Emit(
      "Weights: one layer, %d experts: BF16 %.1f MB, MXFP8 %.1f MB (%.3f B/value incl. E8M0 "
      "scales). Generating BF16 took %.1f s; quantizing it to MXFP8 %.2f s on %d threads "
      "(%.1f ns/value/thread).\n\n",
      model.num_experts, bf16->total_bytes() / 1e6, mx->total_bytes() / 1e6,
      mx->total_bytes() / values, t_gen, t_quant, threads, t_quant * threads / values * 1e9);

  // Dequantization to FP32, the step BlasExperts / ReferenceExperts run per active expert per
  // forward: one thread, 8 experts.
  {
    std::vector<float> w13(2 * n * h), w2(h * n);
    const auto [tb, tm] = AlternatingMedians(
        5,
        [&] {
          for (int e = 0; e < 8; ++e) {
            Check(DequantizeExpertToFp32(*bf16->layer(0), e, w13.data(), w2.data()), "deq");
          }
        },
        [&] {
          for (int e = 0; e < 8; ++e) {
            Check(DequantizeExpertToFp32(*mx->layer(0), e, w13.data(), w2.data()), "deq");
          }
        });
    const double t_b = tb.cpu / 8, t_m = tm.cpu / 8;
    const double per = 3.0 * h * n;
    Emit(
        "Dequantizing one expert (%.1fM values) to FP32 on one thread (CPU time): BF16 %.2f ms "
        "(%.2f ns/value, %.1f GB/s of FP32 written), MXFP8 %.2f ms (%.2f ns/value, %.1f GB/s).\n\n",
        per / 1e6, t_b * 1e3, t_b / per * 1e9, per * 4 / t_b / 1e9, t_m * 1e3, t_m / per * 1e9,
        per * 4 / t_m / 1e9);
  }

  auto blas_bf16 = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(4096),
                                          std::make_unique<BlasExperts>(threads));
  auto blas_mx = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(4096),
                                        std::make_unique<BlasExperts>(threads));
  auto ref = *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(4096),
                                    std::make_unique<ReferenceExperts>());

  Emit("## qwen3-30b-a3b layer (E=128, top-8, hidden 2048, intermediate 768)\n\n");
  Emit(
      "Wall and process-CPU times are medians over reps (9 at M=1, 5 otherwise), BF16 and MXFP8 "
      "run alternately after one warm-up each, so that other load hits both alike. Floors: weight "
      "stream = active experts' "
      "weight bytes read once at memcpy speed (read+write rate, so optimistic); FLOPs = "
      "2*3*H*I*M*topk at %d x one-thread sgemm peak.\n\n",
      threads);
  Emit(
      "| M | active experts | BF16 Blas ms | MXFP8 Blas ms | MXFP8 / BF16 time | "
      "BF16 CPU ms | MXFP8 CPU ms | MXFP8 / BF16 CPU | "
      "BF16 stream floor ms | MXFP8 stream floor ms | FLOP floor ms | rel L2 MXFP8 vs BF16 Blas "
      "| rel L2 MXFP8 Blas vs Ref BF16 | rel L2 BF16 Blas vs Ref BF16 |\n");
  Emit("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t m : {1, 64, 256}) {
    const int topk = model.topk;
    std::vector<float> x(m * h), w(m * topk);
    std::vector<int32_t> tid(m * topk);
    for (float& v : x) v = normal(rng);
    std::vector<bool> active(model.num_experts);
    for (int64_t t = 0; t < m; ++t) {
      float sum = 0;
      for (int k = 0; k < topk; ++k) {
        const int64_t slot = t * topk + k;
        tid[slot] = static_cast<int32_t>((slot * 73 + 19) % model.num_experts);
        active[tid[slot]] = true;
        w[slot] = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
        sum += w[slot];
      }
      for (int k = 0; k < topk; ++k) w[t * topk + k] /= sum;
    }
    const int n_active = static_cast<int>(std::count(active.begin(), active.end(), true));
    ModularKernelArgs args;
    args.hidden_states = TensorView(x.data(), DType::kFP32, {m, h});
    args.topk_ids = TensorView(tid.data(), DType::kINT32, {m, topk});
    args.topk_weights = TensorView(w.data(), DType::kFP32, {m, topk});
    args.num_experts = model.num_experts;
    std::vector<float> o_b(m * h), o_m(m * h), o_r(m * h);
    const TensorView vb(o_b.data(), DType::kFP32, {m, h}), vm(o_m.data(), DType::kFP32, {m, h}),
        vr(o_r.data(), DType::kFP32, {m, h});
    const int reps = m == 1 ? 9 : 5;
    ModularKernelArgs args_mx = args;
    args.weights = bf16->layer(0);
    args_mx.weights = mx->layer(0);
    const auto [tb, tm] = AlternatingMedians(
        reps, [&] { Check(blas_bf16->Forward(args, vb), "bf16"); },
        [&] { Check(blas_mx->Forward(args_mx, vm), "mxfp8"); });
    const double t_b = tb.wall, t_m = tm.wall;
    Check(ref->Forward(args, vr), "reference");  // once, untimed: the oracle
    const double per_expert = 3.0 * h * n;
    const double floor_b = 2 * per_expert * n_active / bw,
                 floor_m = 1.03125 * per_expert * n_active / bw;
    const double floor_f = 2.0 * 3 * h * n * m * topk / (threads * sgemm_peak);
    Emit(
        "| %lld | %d | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f | %.1f | %.1f | %.1f | %.2e | "
        "%.2e | %.2e |\n",
        static_cast<long long>(m), n_active, t_b * 1e3, t_m * 1e3, t_m / t_b, tb.cpu * 1e3,
        tm.cpu * 1e3, tm.cpu / tb.cpu, floor_b * 1e3, floor_m * 1e3, floor_f * 1e3,
        RelativeL2Error(o_m.data(), o_b.data(), m * h),
        RelativeL2Error(o_m.data(), o_r.data(), m * h),
        RelativeL2Error(o_b.data(), o_r.data(), m * h));
  }
  if (!out_path.empty()) {
    if (FILE* f = std::fopen(out_path.c_str(), "w")) {
      std::fputs(report.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}
