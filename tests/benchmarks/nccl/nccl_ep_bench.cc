// NCCL expert-parallel benchmark on two GPUs (one process, one thread per GPU).
//   floor:   NcclCommunicator::AllToAllV of 16 bytes to the peer + Synchronize (the smallest
//            NCCL send/recv exchange with a host wait), median of 500;
//   a2a:     NcclAllToAllContiguous dispatch + combine, host input -> host output (PlanChunks,
//            Prepare, Finalize with a NoOp reduce over a device tensor; no experts), 64 experts
//            top-8 uniform routing, hidden 3072 / 7168, 16..4096 tokens per rank, median;
//   forward: Engine{cuda, 2 ranks} forward of a seed-shaped layer (64 experts, 32 per rank,
//            hidden 3072, intermediate 5120, MXFP8, top-8) at 16/32/64 tokens per rank, next to a
//            1-GPU no-EP forward of 32 experts with the same routes per GPU (experts-only
//            reference: experts + its H2D/D2H).
// Usage: nccl_ep_bench [out.csv] [--quick]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/comm/nccl_communicator.h"
#include "core/comm/rank_threads.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/nccl_all_to_all.h"
#include "core/engine.h"
#include "core/status_macros.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/ep/ep_test_util.h"

namespace moeserve {
namespace {

using Clock = std::chrono::steady_clock;
double Us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#define CHECK_OK(expr)                                                                          \
  do {                                                                                          \
    absl::Status _s = (expr);                                                                   \
    if (!_s.ok()) {                                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, _s.ToString().c_str()); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

Tensor ToBf16(const Tensor& x) {
  Tensor y = Tensor::Empty(DType::kBF16, x.shape());
  kernels::ConvertFp32ToBf16Ref(x.data<float>(), y.data<uint16_t>(), x.numel());
  return y;
}

struct Row {
  std::string what;
  int64_t hidden = 0, tokens = 0;
  double us = 0, peer_us = 0;
  int64_t bytes = 0;
};

int Main(int argc, char** argv) {
  const std::string csv = argc > 1 ? argv[1] : "nccl_ep_bench.csv";
  const bool quick = argc > 2 && std::string(argv[2]) == "--quick";
  if (CudaDeviceCount() < 2) {
    std::printf("needs 2 GPUs\n");
    return 0;
  }
  std::printf("%s\n", NcclCommGroup::Version().c_str());
  std::vector<Row> rows;
  const int world = 2, topk = 8, num_experts = 64;
  std::vector<std::shared_ptr<CudaContext>> ctx;
  std::vector<void*> streams;
  for (int r = 0; r < world; ++r) {
    ctx.push_back(*CudaContext::Create(r));
    streams.push_back(ctx[r]->stream());
  }
  auto group_or = NcclCommGroup::Create({0, 1}, streams, absl::Seconds(60));
  CHECK_OK(group_or.status());
  auto group = *group_or;
  RankThreads threads(world);

  // 1. Floor: smallest exchange with the peer plus the host wait.
  {
    std::vector<double> t0(600);
    std::vector<absl::Status> st = threads.Run([&](int r) -> absl::Status {
      auto comm = group->communicator(r);
      cudaSetDevice(r);
      void* d = nullptr;
      cudaMalloc(&d, 64);
      std::vector<int64_t> sc = {r == 0 ? 0 : 16, r == 0 ? 16 : 0}, sd = {0, 0};
      std::vector<int64_t> rc = sc, rd = {32, 32};
      for (int i = 0; i < 600; ++i) {
        const auto a = Clock::now();
        MOESERVE_RETURN_IF_ERROR(comm->AllToAllV(d, sc, sd, d, rc, rd));
        MOESERVE_RETURN_IF_ERROR(comm->Synchronize());
        if (r == 0) t0[i] = Us(a, Clock::now());
      }
      cudaFree(d);
      return absl::OkStatus();
    });
    for (auto& s : st) CHECK_OK(s);
    t0.erase(t0.begin(), t0.begin() + 100);
    rows.push_back({"nccl_sendrecv_16B_floor", 0, 0, Median(t0), 0, 16});
    std::printf("NCCL send/recv floor (16 B each way + host wait): median %.1f us\n",
                rows.back().us);
  }

  // 2. Dispatch + combine.
  std::shared_ptr<const Placement> placement =
      std::make_shared<const Placement>(*Placement::Contiguous(num_experts, world));
  const std::vector<int64_t> hiddens = {3072, 7168};
  // Kept to the end: no device buffer is freed and reallocated while NCCL is in use.
  std::vector<std::unique_ptr<PrepareAndFinalize>> keep_pf;
  std::vector<void*> keep_fused, keep_pinned;
  std::vector<int64_t> tokens = {16, 32, 64, 128, 256, 512, 1024, 2048, 4096};
  if (quick) tokens = {16, 64, 1024};
  for (int64_t hidden : hiddens) {
    std::vector<std::unique_ptr<PrepareAndFinalize>> pf(world);
    for (int r = 0; r < world; ++r) {
      NcclAllToAllOptions o;
      o.max_num_tokens_per_rank = 4096;
      pf[r] = *CreateNcclAllToAllPrepareAndFinalize(ctx[r], group->communicator(r), placement, o);
    }
    std::vector<void*> fused(world);
    for (int r = 0; r < world; ++r) {
      cudaSetDevice(r);
      cudaMalloc(&fused[r], 2 * 4096 * hidden * 4);
      cudaMemset(fused[r], 0, 2 * 4096 * hidden * 4);
    }
    for (int64_t t : tokens) {
      std::mt19937 rng(1234 + t);
      // Input and answer in page-locked host memory, as the PyTorch peer's.
      std::vector<Tensor> ids, w;
      std::vector<TensorView> xv, outv;
      for (int r = 0; r < world; ++r) {
        const Tensor xr = ToBf16(ep_testing::RandomNormal({t, hidden}, rng));
        void* px = nullptr;
        void* po = nullptr;
        cudaMallocHost(&px, xr.view().nbytes());
        cudaMallocHost(&po, t * hidden * 4);
        std::memcpy(px, xr.view().raw_data(), xr.view().nbytes());
        keep_pinned.push_back(px);
        keep_pinned.push_back(po);
        xv.emplace_back(px, DType::kBF16, Shape{t, hidden});
        outv.emplace_back(po, DType::kFP32, Shape{t, hidden});
        ids.push_back(
            ep_testing::MakeRouting(ep_testing::Routing::kUniform, t, topk, num_experts, {}, rng));
        w.push_back(ep_testing::RandomTopkWeights(t, topk, rng));
      }
      const int iters = t <= 256 ? 300 : (t <= 1024 ? 60 : 25), warm = iters / 5;
      std::vector<double> times(iters);
      int64_t bytes = 0;
      std::vector<absl::Status> st = threads.Run([&](int r) -> absl::Status {
        cudaSetDevice(r);
        auto noop = MakeTopKWeightAndReduce(TopKWeightAndReduce::Kind::kNoOp);
        PrepareArgs a;
        a.hidden_states = xv[r];
        a.topk_ids = ids[r].view();
        a.topk_weights = w[r].view();
        a.num_experts = num_experts;
        a.num_local_experts = num_experts / world;
        a.intermediate = 0;
        const TransferStats s0 = pf[r]->transfer_stats();
        for (int i = 0; i < iters; ++i) {
          const auto t0 = Clock::now();
          MOESERVE_ASSIGN_OR_RETURN(std::vector<int64_t> b, pf[r]->PlanChunks(a));
          (void)b;
          PreparedActivations p;
          MOESERVE_RETURN_IF_ERROR(pf[r]->Prepare(a, &p));
          TensorView f(fused[r], DType::kFP32, {p.problem.num_tokens, hidden});
          MOESERVE_RETURN_IF_ERROR(pf[r]->Finalize(outv[r], f, p, *noop));
          if (r == 0) times[i] = Us(t0, Clock::now());
        }
        if (r == 0) {
          const TransferStats s1 = pf[r]->transfer_stats();
          bytes = (s1.dispatch_bytes_sent - s0.dispatch_bytes_sent + s1.combine_bytes_sent -
                   s0.combine_bytes_sent) /
                  iters;
        }
        return absl::OkStatus();
      });
      for (auto& s : st) CHECK_OK(s);
      times.erase(times.begin(), times.begin() + warm);
      rows.push_back({"dispatch_combine", hidden, t, Median(times), 0, bytes});
      std::printf(
          "dispatch+combine hidden %5lld tokens/rank %5lld: median %9.1f us  (%lld B "
          "sent by rank 0 per forward)\n",
          (long long)hidden, (long long)t, rows.back().us, (long long)bytes);
    }
    for (auto& p : pf) keep_pf.push_back(std::move(p));
    for (void* f : fused) keep_fused.push_back(f);
  }
  keep_pf.clear();
  for (size_t i = 0; i < keep_fused.size(); ++i) {
    cudaSetDevice(static_cast<int>(i % world));
    cudaFree(keep_fused[i]);
  }
  for (void* p : keep_pinned) cudaFreeHost(p);
  group.reset();
  ctx.clear();

  // 3. EP2 forward of the seed-shaped layer vs a 1-GPU 32-expert forward with the same routes
  // per GPU.
  {
    EngineOptions o;
    o.model = *ApplyOverrides(*ModelPreset("seed-megamoe"),
                              ModelOverrides{.num_layers = 1, .num_experts = 64});
    o.backend = "cuda";
    o.num_ranks = 2;
    o.weight_format = WeightFormat::kMXFP8;
    o.seed = 1;
    o.max_tokens_per_request = 8192;
    auto ep2 = Engine::Create(o);
    CHECK_OK(ep2.status());
    EngineOptions o1 = o;
    o1.model.num_experts = 32;
    o1.num_ranks = 1;
    auto one = Engine::Create(o1);
    CHECK_OK(one.status());
    for (int64_t t : {16, 32, 64}) {
      std::mt19937 rng(77 + t);
      const int64_t m = 2 * t;  // tokens per request: t per rank
      const Tensor x = ToBf16(ep_testing::RandomNormal({m, 3072}, rng));
      const Tensor ids =
          ep_testing::MakeRouting(ep_testing::Routing::kUniform, m, topk, 64, {}, rng);
      const Tensor w = ep_testing::RandomTopkWeights(m, topk, rng);
      // One GPU with 32 experts and t tokens top-8 sees the same 8t routes an EP2 rank does.
      const Tensor x1 = ToBf16(ep_testing::RandomNormal({t, 3072}, rng));
      const Tensor ids1 =
          ep_testing::MakeRouting(ep_testing::Routing::kUniform, t, topk, 32, {}, rng);
      const Tensor w1 = ep_testing::RandomTopkWeights(t, topk, rng);
      Tensor out = Tensor::Empty(DType::kBF16, {m, 3072});
      Tensor out1 = Tensor::Empty(DType::kBF16, {t, 3072});
      ForwardInput in{
          .layer = 0, .hidden_states = x.view(), .topk_ids = ids.view(), .topk_weights = w.view()};
      ForwardInput in1{.layer = 0,
                       .hidden_states = x1.view(),
                       .topk_ids = ids1.view(),
                       .topk_weights = w1.view()};
      std::vector<double> a, b;
      StageTimings st_sum;
      for (int i = 0; i < 60; ++i) {
        ForwardTimings ft;
        auto t0 = Clock::now();
        CHECK_OK((*ep2)->Forward(in, out.view(), &ft));
        auto t1 = Clock::now();
        CHECK_OK((*one)->Forward(in1, out1.view()));
        auto t2 = Clock::now();
        if (i >= 10) {
          a.push_back(Us(t0, t1)), b.push_back(Us(t1, t2));
          st_sum.prepare_us += ft.stages.prepare_us / 50;
          st_sum.experts_us += ft.stages.experts_us / 50;
          st_sum.finalize_us += ft.stages.finalize_us / 50;
        }
      }
      rows.push_back({"ep2_forward_seed_mxfp8", 3072, t, Median(a), Median(b), 0});
      std::printf(
          "EP2 forward seed layer (MXFP8) %lld tokens/rank: %.1f us; 1-GPU 32 experts, "
          "%lld tokens: %.1f us; stages (slowest rank, host-side; prepare/experts are "
          "enqueue times, finalize includes the wait): prepare %.1f experts %.1f "
          "finalize %.1f us\n",
          (long long)t, Median(a), (long long)t, Median(b), st_sum.prepare_us, st_sum.experts_us,
          st_sum.finalize_us);
    }
  }

  std::ofstream f(csv);
  f << "what,hidden,tokens_per_rank,us,peer_us,bytes\n";
  for (const Row& r : rows) {
    f << r.what << "," << r.hidden << "," << r.tokens << "," << r.us << "," << r.peer_us << ","
      << r.bytes << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace moeserve

int main(int argc, char** argv) { return moeserve::Main(argc, argv); }
