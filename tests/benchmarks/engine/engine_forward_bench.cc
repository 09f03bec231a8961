// Times Engine::Forward alone (no gRPC): what one layer call costs inside the server, next to
// the expert kernel benchmark (tests/benchmarks/cuda) and the client round trip
// (moeserve-cli load). Seed per-rank layer by default: 32 local experts, top-8, hidden 3072,
// intermediate 5120, balanced routing (route slot s = token * topk + k goes to expert
// (73 s + 19) mod E, the seed's rule). Prints one CSV line per token count:
//   tokens,wall_p50_us,wall_p90_us,prepare_p50_us,experts_p50_us,finalize_p50_us,
//   engine_p50_us,host_stage_p50_us,host_launch_p50_us,host_collect_p50_us,host_timer_p50_us
// (engine: the engine step's wall; host_*: a graphed step's host clock, StageTimings).
//
//   engine_forward_bench [--backend auto] [--weight_format mxfp8] [--dtype bf16]
//                        [--tokens 1,16,64,1024] [--iters 200] [--timed 1]
//                        [--model seed|trivial] [--graph_max_tokens -1]
// --timed 0 passes no ForwardTimings (the stage columns are then 0).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/engine.h"
#include "core/model_config.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/benchmarks/percentile.h"

namespace moeserve {
namespace {

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return moeserve::bench::NearestRankPercentile(v, p);
}

int Main(int argc, char** argv) {
  std::string backend = "auto", weight_format = "mxfp8", dtype_name = "bf16",
              tokens_arg = "1,16,64,1024";
  std::string model_name = "seed";
  int iters = 200, timed = 1;
  int64_t graph_max_tokens = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--backend")
      backend = value;
    else if (flag == "--weight_format")
      weight_format = value;
    else if (flag == "--dtype")
      dtype_name = value;
    else if (flag == "--tokens")
      tokens_arg = value;
    else if (flag == "--iters" && absl::SimpleAtoi(value, &iters))
      continue;
    else if (flag == "--timed" && absl::SimpleAtoi(value, &timed))
      continue;
    else if (flag == "--graph_max_tokens" && absl::SimpleAtoi(value, &graph_max_tokens))
      continue;
    else if (flag == "--model" && (value == "seed" || value == "trivial"))
      model_name = value;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  absl::StatusOr<ModelConfig> model = ModelPreset("seed-megamoe");
  if (!model.ok()) return 1;
  ModelOverrides overrides;
  overrides.num_experts = 32;
  overrides.num_layers = 1;
  if (model_name == "trivial") {  // the server's own cost: almost no expert work
    overrides.hidden = 7168;
    overrides.intermediate = 64;
    overrides.num_experts = 16;
    overrides.topk = 4;
  }
  model = ApplyOverrides(*model, overrides);
  if (!model.ok()) return 1;
  EngineOptions options;
  options.model = *model;
  options.backend = backend;
  options.weight_format = weight_format == "mxfp8" ? WeightFormat::kMXFP8 : WeightFormat::kBF16;
  options.num_ranks = backend == "cpu" ? 1 : 0;
  options.graph_max_tokens = graph_max_tokens;
  auto engine = Engine::Create(options);
  if (!engine.ok()) {
    std::fprintf(stderr, "Engine::Create: %s\n", engine.status().ToString().c_str());
    return 1;
  }
  const auto dtype = ParseDType(dtype_name);
  if (!dtype.ok()) return 2;
  const ModelConfig& m = (*engine)->info().model;
  std::printf("# model=%s backend=%s experts=%s weights=%s answer=%s cuda_graphs<=%lld\n",
              model_name.c_str(), (*engine)->info().backend.c_str(),
              (*engine)->info().experts.c_str(), weight_format.c_str(), dtype_name.c_str(),
              static_cast<long long>((*engine)->info().graph_max_tokens));
  std::printf(
      "tokens,wall_p50_us,wall_p90_us,prepare_p50_us,experts_p50_us,finalize_p50_us,"
      "engine_p50_us,host_stage_p50_us,host_launch_p50_us,host_collect_p50_us,"
      "host_timer_p50_us\n");
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (const absl::string_view t : absl::StrSplit(tokens_arg, ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(t, &n) || n <= 0) return 2;
    const size_t esize = DTypeSize(*dtype);
    std::vector<uint8_t> x(n * m.hidden * esize), out(n * m.hidden * esize);
    std::vector<float> xf(n * m.hidden);
    for (auto& v : xf) v = nd(rng);
    if (*dtype == DType::kFP32) {
      std::copy(xf.begin(), xf.end(), reinterpret_cast<float*>(x.data()));
    } else {
      kernels::ConvertFp32ToBf16Ref(xf.data(), reinterpret_cast<uint16_t*>(x.data()), xf.size());
    }
    std::vector<int32_t> ids(n * m.topk);
    std::vector<float> w(n * m.topk, 1.0f / m.topk);
    for (size_t s = 0; s < ids.size(); ++s)
      ids[s] = static_cast<int32_t>((73 * s + 19) % m.num_experts);
    ForwardInput in{.layer = 0,
                    .hidden_states = TensorView(x.data(), *dtype, {n, m.hidden}),
                    .topk_ids = TensorView(ids.data(), DType::kINT32, {n, m.topk}),
                    .topk_weights = TensorView(w.data(), DType::kFP32, {n, m.topk})};
    const TensorView output(out.data(), *dtype, {n, m.hidden});
    std::vector<double> wall, prep, exp, fin, eng, h_stage, h_launch, h_collect, h_timer;
    for (int i = 0; i < iters + 10; ++i) {
      ForwardTimings timings;
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status s = (*engine)->Forward(in, output, timed ? &timings : nullptr);
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (!s.ok()) {
        std::fprintf(stderr, "Forward: %s\n", s.ToString().c_str());
        return 1;
      }
      if (i < 10) continue;  // warm-up
      wall.push_back(us);
      prep.push_back(timings.stages.prepare_us);
      exp.push_back(timings.stages.experts_us);
      fin.push_back(timings.stages.finalize_us);
      eng.push_back(timings.engine_us);
      h_stage.push_back(timings.stages.host_stage_us);
      h_launch.push_back(timings.stages.host_launch_us);
      h_collect.push_back(timings.stages.host_collect_us);
      h_timer.push_back(timings.stages.host_timer_us);
    }
    std::printf("%lld,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f\n",
                static_cast<long long>(n), Percentile(wall, 50), Percentile(wall, 90),
                Percentile(prep, 50), Percentile(exp, 50), Percentile(fin, 50), Percentile(eng, 50),
                Percentile(h_stage, 50), Percentile(h_launch, 50), Percentile(h_collect, 50),
                Percentile(h_timer, 50));
  }
  return 0;
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) { return moeserve::Main(argc, argv); }
