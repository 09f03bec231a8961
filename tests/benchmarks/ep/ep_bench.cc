// CPU expert-parallel path on qwen3-30b-a3b shapes (1 MoE layer; 128 experts, top-8, hidden
// 2048, intermediate 768, BF16 weights, FP32 activations): per-stage time, bytes each rank
// sends/receives in dispatch and combine, and what sending a token once per destination rank
// saves over once per route. Peer in the same run: the single-rank no_ep engine. Physical
// limit for the in-process exchange: bytes moved / memcpy bandwidth measured in the same run.
//
//   ep_bench [--ranks 1,4,16] [--tokens 16,128] [--iters 2]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/engine.h"
#include "tests/ep/ep_test_util.h"

namespace moeserve {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Single-thread memcpy bandwidth (GB/s, bytes copied per second), 64 MiB.
double MemcpyGBps() {
  const size_t n = size_t{64} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    const double t0 = Now();
    std::memcpy(b.data(), a.data(), n);
    best = std::min(best, Now() - t0);
  }
  return n / best / 1e9;
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int v;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

struct Config {
  const char* label;
  int ranks;
  const char* pf;
  const char* experts;
  const char* dispatch;
};

int Main(int argc, char** argv) {
  std::vector<int> ranks = {1, 4, 16}, tokens = {16, 128};
  int iters = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--ranks")) ranks = ParseList(argv[i + 1]);
    if (!std::strcmp(argv[i], "--tokens")) tokens = ParseList(argv[i + 1]);
    if (!std::strcmp(argv[i], "--iters")) iters = std::max(1, std::atoi(argv[i + 1]));
  }
  auto model = ApplyOverrides(*ModelPreset("qwen3-30b-a3b"), ModelOverrides{.num_layers = 1});
  if (!model.ok()) return 1;
  const double memcpy_gbps = MemcpyGBps();
  std::printf("model %s, 1 layer; memcpy %.1f GB/s (1 thread); %u hardware threads\n\n",
              model->DebugString().c_str(), memcpy_gbps, std::thread::hardware_concurrency());

  std::vector<Config> configs;
  for (int r : ranks) {
    if (r == 1) configs.push_back({"no_ep (peer)", 1, "no_ep", "blas", "per_rank"});
    configs.push_back({"contiguous", r, "all2all_contiguous", "blas", "per_rank"});
    if (r > 1) {
      configs.push_back({"contiguous per-route", r, "all2all_contiguous", "blas", "per_route"});
      configs.push_back({"batched", r, "all2all_batched", "batched_blas", "per_rank"});
    }
  }
  std::printf(
      "| R | PF (dispatch) | M | forward ms | prepare ms | experts ms | finalize ms | "
      "chunks | dispatch B sent, all ranks | combine B sent, all ranks | "
      "dispatch B sent, max rank | combine B sent, max rank | memcpy floor us, max rank "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  // (R, M) -> total dispatch / combine bytes, per-rank and per-route dispatch.
  std::map<std::pair<int, int>, std::pair<int64_t, int64_t>> per_rank, per_route;
  for (const Config& c : configs) {
    EngineOptions o;
    o.model = *model;
    o.num_ranks = c.ranks;
    o.prepare_finalize = c.pf;
    o.experts = c.experts;
    o.dispatch = c.dispatch;
    o.seed = 1;
    o.max_tokens_per_request = 4096;
    auto engine = Engine::Create(o);
    if (!engine.ok()) {
      std::fprintf(stderr, "%s R=%d: %s\n", c.label, c.ranks, engine.status().ToString().c_str());
      return 1;
    }
    for (int m : tokens) {
      std::mt19937 rng(1000 + m);  // every config sees the same inputs for one M
      const Tensor x = ep_testing::RandomNormal({m, model->hidden}, rng);
      const Tensor ids = ep_testing::MakeRouting(ep_testing::Routing::kUniform, m, model->topk,
                                                 model->num_experts, {}, rng);
      const Tensor w = ep_testing::RandomTopkWeights(m, model->topk, rng);
      Tensor out = Tensor::Empty(DType::kFP32, {m, model->hidden});
      ForwardInput in{
          .layer = 0, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
      double best = 1e30;
      ForwardTimings best_t;
      for (int i = 0; i <= iters; ++i) {  // first is a warm-up
        ForwardTimings t;
        const double t0 = Now();
        if (absl::Status s = (*engine)->Forward(in, out.view(), &t); !s.ok()) {
          std::fprintf(stderr, "%s\n", s.ToString().c_str());
          return 1;
        }
        const double dt = Now() - t0;
        if (i > 0 && dt < best) best = dt, best_t = t;
      }
      int64_t max_dispatch = 0, max_combine = 0, max_moved = 0;
      const int64_t all_dispatch = best_t.stages.transfer.dispatch_bytes_sent;
      const int64_t all_combine = best_t.stages.transfer.combine_bytes_sent;
      if (std::string(c.pf) == "all2all_contiguous") {
        (std::string(c.dispatch) == "per_route" ? per_route : per_rank)[{c.ranks, m}] = {
            all_dispatch, all_combine};
      }
      for (const StageTimings& s : best_t.rank_stages) {
        max_dispatch = std::max(max_dispatch, s.transfer.dispatch_bytes_sent);
        max_combine = std::max(max_combine, s.transfer.combine_bytes_sent);
        max_moved = std::max(
            max_moved, s.transfer.dispatch_bytes_received + s.transfer.combine_bytes_received);
      }
      std::printf(
          "| %d | %s | %d | %.1f | %.2f | %.1f | %.2f | %lld | %lld | %lld | %lld | %lld | %.1f "
          "|\n",
          c.ranks, c.label, m, best * 1e3, best_t.stages.prepare_us / 1e3,
          best_t.stages.experts_us / 1e3, best_t.stages.finalize_us / 1e3,
          static_cast<long long>(best_t.stages.num_chunks), static_cast<long long>(all_dispatch),
          static_cast<long long>(all_combine), static_cast<long long>(max_dispatch),
          static_cast<long long>(max_combine), max_moved / (memcpy_gbps * 1e3));
      std::fflush(stdout);
    }
  }
  std::printf(
      "\nSending once per destination rank instead of once per route (same inputs, "
      "all ranks):\n\n| R | M | dispatch B per-rank | dispatch B per-route | saved | "
      "combine B per-rank | combine B per-route | saved |\n"
      "|---|---|---|---|---|---|---|---|\n");
  for (const auto& [key, route] : per_route) {
    const auto it = per_rank.find(key);
    if (it == per_rank.end()) continue;
    const auto [d, cmb] = it->second;
    std::printf("| %d | %d | %lld | %lld | %.1f%% | %lld | %lld | %.1f%% |\n", key.first,
                key.second, static_cast<long long>(d), static_cast<long long>(route.first),
                100.0 * (1.0 - static_cast<double>(d) / std::max<int64_t>(1, route.first)),
                static_cast<long long>(cmb), static_cast<long long>(route.second),
                100.0 * (1.0 - static_cast<double>(cmb) / std::max<int64_t>(1, route.second)));
  }
  return 0;
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) { return moeserve::Main(argc, argv); }
