// Expert parallelism across GPUs over NCCL (two ranks, one GPU each):
//  - NcclCommunicator: all-to-all-v with uneven counts (self share included) and all-gather on
//    device buffers;
//  - the combination suite at EP2: Engine{backend=cuda, ranks=2} with the NCCL AllToAllContiguous
//    (CudaExperts) and AllToAllBatched (CudaBatchedExperts) PrepareAndFinalize, BF16 and MXFP8
//    weights, three routings, M up to 4096 tokens per request, against the CPU engine on one rank
//    (ReferenceExperts up to M=333; BlasExperts, itself tested against the reference on CPU, at
//    M=4096), relative L2 < 1e-2; several dispatch rounds, per-route dispatch, round-robin;
//  - faults: an error injected on one rank, and a rank that joins late (past the collective
//    timeout): the forward fails with INTERNAL / DEADLINE_EXCEEDED within a bounded time, the
//    engine reports not healthy and answers UNAVAILABLE, nothing hangs, and Recover() restores
//    it; a refusal on one rank (capacity) fails the forward on all ranks and leaves it healthy.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/comm/nccl_communicator.h"
#include "core/comm/rank_threads.h"
#include "core/cuda/cuda_backend.h"
#include "core/engine.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using ep_testing::Routing;
using ::testing::HasSubstr;

constexpr double kBf16Tolerance = 1e-2;

#define SKIP_WITHOUT_TWO_GPUS()                                          \
  if (CudaDeviceCount() < 2) {                                           \
    GTEST_SKIP() << "needs 2 CUDA devices, found " << CudaDeviceCount(); \
  }

#ifndef MOESERVE_HAVE_NCCL
TEST(NcclEp, Disabled) { GTEST_SKIP() << "built without NCCL"; }
#else

TEST(NcclCommunicator, ExchangesAreCorrect) {
  SKIP_WITHOUT_TWO_GPUS();
  std::vector<std::shared_ptr<CudaContext> > ctx;
  std::vector<int> devices = {0, 1};
  std::vector<void*> streams;
  for (int r = 0; r < 2; ++r) {
    ctx.push_back(*CudaContext::Create(r));
    streams.push_back(ctx.back()->stream());
  }
  auto group = NcclCommGroup::Create(devices, streams, absl::Seconds(30));
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<std::vector<uint8_t> > got(2);
  std::vector<std::vector<int64_t> > gathered(2);
  auto count = [](int from, int to) -> int64_t { return (to + 1) * 1000 + from + 1; };
  auto byte = [](int from, int to, int64_t i) { return uint8_t((from * 100 + to * 10 + i % 7)); };
  RankThreads threads(2);
  std::vector<absl::Status> st = threads.Run([&](int r) -> absl::Status {
    auto comm = (*group)->communicator(r);
    cudaSetDevice(r);
    std::vector<int64_t> sc(2), sd(2), rc(2), rd(2);
    int64_t so = 0, ro = 0;
    for (int p = 0; p < 2; ++p) {
      sc[p] = count(r, p), sd[p] = so, so += sc[p];
      rc[p] = count(p, r), rd[p] = ro, ro += rc[p];
    }
    std::vector<uint8_t> host(so);
    for (int p = 0; p < 2; ++p) {
      for (int64_t i = 0; i < sc[p]; ++i) host[sd[p] + i] = byte(r, p, i);
    }
    void *d_send = nullptr, *d_recv = nullptr, *d_g = nullptr;
    cudaMalloc(&d_send, so);
    cudaMalloc(&d_recv, ro);
    cudaMalloc(&d_g, 3 * 16);
    cudaMemcpy(d_send, host.data(), so, cudaMemcpyHostToDevice);
    MOESERVE_RETURN_IF_ERROR(comm->AllToAllV(d_send, sc, sd, d_recv, rc, rd));
    const int64_t mine[2] = {r * 7 + 1, -r};
    cudaMemcpy(d_g, mine, 16, cudaMemcpyHostToDevice);
    MOESERVE_RETURN_IF_ERROR(comm->AllGather(d_g, 16, static_cast<char*>(d_g) + 16));
    MOESERVE_RETURN_IF_ERROR(comm->Synchronize());
    MOESERVE_RETURN_IF_ERROR(comm->Barrier());
    got[r].resize(ro);
    gathered[r].resize(4);
    cudaMemcpy(got[r].data(), d_recv, ro, cudaMemcpyDeviceToHost);
    cudaMemcpy(gathered[r].data(), static_cast<char*>(d_g) + 16, 32, cudaMemcpyDeviceToHost);
    cudaFree(d_send);
    cudaFree(d_recv);
    cudaFree(d_g);
    return absl::OkStatus();
  });
  for (const auto& s : st) ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < 2; ++r) {
    int64_t off = 0;
    for (int p = 0; p < 2; ++p) {
      for (int64_t i = 0; i < count(p, r); ++i) {
        ASSERT_EQ(got[r][off + i], byte(p, r, i)) << "rank " << r << " from " << p << " at " << i;
      }
      off += count(p, r);
    }
    EXPECT_EQ(gathered[r], (std::vector<int64_t>{1, 0, 8, -1}));
  }
  EXPECT_TRUE((*group)->healthy());
}

EngineOptions Ep2(const std::string& pf, const std::string& experts, WeightFormat wf) {
  EngineOptions o;
  o.model = *ApplyOverrides(
      *ModelPreset("tiny"),
      ModelOverrides{
          .num_layers = 2, .num_experts = 32, .topk = 8, .hidden = 256, .intermediate = 128});
  o.backend = "cuda";
  o.num_ranks = 2;
  o.prepare_finalize = pf;
  o.experts = experts;
  o.weight_format = wf;
  o.seed = 21;
  o.num_threads = 8;
  o.max_tokens_per_request = 4096;
  o.collective_timeout_ms = 20000;
  return o;
}

EngineOptions Oracle(const EngineOptions& gpu, const std::string& experts) {
  EngineOptions o = gpu;
  o.backend = "cpu";
  o.num_ranks = 1;
  o.prepare_finalize = "no_ep";
  o.experts = experts;
  o.rank_experts.clear();
  o.placement = "contiguous";
  o.dispatch = "per_rank";
  o.max_tokens_per_rank = 0;
  return o;
}

using ep_testing::Bf16ToFloats;
using ep_testing::ToBf16;

struct Inputs {
  Tensor x, ids, w;
  ForwardInput in(int layer) const {
    return ForwardInput{.layer = layer,
                        .hidden_states = x.view(),
                        .topk_ids = ids.view(),
                        .topk_weights = w.view()};
  }
};

Inputs MakeInputs(const ModelConfig& model, int64_t m, Routing routing, const std::vector<int>& hot,
                  std::mt19937& rng) {
  Inputs i;
  i.x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
  i.ids = ep_testing::MakeRouting(routing, m, model.topk, model.num_experts, hot, rng);
  i.w = ep_testing::RandomTopkWeights(m, model.topk, rng);
  return i;
}

// Runs `gpu` and `cpu` on the same inputs; relative L2 of the BF16 outputs.
double Compare(Engine& gpu, Engine& cpu, const Inputs& in, int layer,
               ForwardTimings* timings = nullptr) {
  const int64_t m = in.x.view().dim(0), h = in.x.view().dim(1);
  Tensor got = Tensor::Empty(DType::kBF16, {m, h});
  Tensor want = Tensor::Empty(DType::kBF16, {m, h});
  absl::Status s = gpu.Forward(in.in(layer), got.view(), timings);
  EXPECT_TRUE(s.ok()) << s;
  s = cpu.Forward(in.in(layer), want.view());
  EXPECT_TRUE(s.ok()) << s;
  if (m == 0) return 0;
  const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
  return ep_testing::RelativeL2Error(g.data(), r.data(), g.size());
}

TEST(NcclEp, CombinationSuiteMatchesCpuReference) {
  SKIP_WITHOUT_TWO_GPUS();
  int cases = 0;
  for (WeightFormat wf : {WeightFormat::kBF16, WeightFormat::kMXFP8}) {
    for (const auto& [pf, ex] : std::vector<std::pair<std::string, std::string> >{
             {"all2all_contiguous", "blas"}, {"all2all_batched", "batched_blas"}}) {
      const EngineOptions o = Ep2(pf, ex, wf);
      auto gpu = Engine::Create(o);
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      auto reference = Engine::Create(Oracle(o, "reference"));
      auto blas = Engine::Create(Oracle(o, "blas"));
      ASSERT_TRUE(reference.ok() && blas.ok());
      const EngineInfo& info = (*gpu)->info();
      EXPECT_EQ(info.backend, "cuda");
      EXPECT_EQ(info.num_ranks, 2);
      EXPECT_EQ(info.prepare_finalize,
                pf == "all2all_contiguous" ? "NcclAllToAllContiguous" : "NcclAllToAllBatched");
      std::mt19937 rng(7);
      for (Routing routing : {Routing::kUniform, Routing::kBalancedAffine, Routing::kHotExpert}) {
        for (int64_t m : {0, 1, 64, 333, 4096}) {
          SCOPED_TRACE(absl::StrCat(WeightFormatName(wf), " ", info.prepare_finalize, " ",
                                    ep_testing::RoutingName(routing), " M=", m));
          const Inputs in = MakeInputs(info.model, m, routing, info.rank_experts[1], rng);
          ForwardTimings t;
          const double err = Compare(**gpu, m <= 333 ? **reference : **blas, in, m % 2, &t);
          EXPECT_LT(err, kBf16Tolerance);
          if (m > 0) {
            EXPECT_GT(t.stages.transfer.dispatch_bytes_sent, 0);
          }
          ++cases;
        }
      }
      EXPECT_TRUE((*gpu)->healthy());
    }
  }
  EXPECT_EQ(cases, 60);
}

TEST(NcclEp, RoundsPerRouteAndRoundRobin) {
  SKIP_WITHOUT_TWO_GPUS();
  struct Variant {
    std::string pf, ex, placement, dispatch;
    int64_t tokens_per_rank;
  };
  for (const Variant& v :
       std::vector<Variant>{{"all2all_contiguous", "blas", "contiguous", "per_rank", 100},
                            {"all2all_batched", "batched_blas", "contiguous", "per_rank", 8},
                            {"all2all_contiguous", "blas", "round_robin", "per_route", 0},
                            {"all2all_batched", "batched_blas", "round_robin", "per_route", 0}}) {
    EngineOptions o = Ep2(v.pf, v.ex, WeightFormat::kMXFP8);
    o.placement = v.placement;
    o.dispatch = v.dispatch;
    o.max_tokens_per_rank = v.tokens_per_rank;
    auto gpu = Engine::Create(o);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto reference = Engine::Create(Oracle(o, "reference"));
    ASSERT_TRUE(reference.ok());
    std::mt19937 rng(3);
    for (int64_t m : {5, 517}) {
      SCOPED_TRACE(absl::StrCat(v.pf, " ", v.placement, " ", v.dispatch, " cap ", v.tokens_per_rank,
                                " M=", m));
      const Inputs in = MakeInputs((*gpu)->info().model, m, Routing::kHotExpert, {0, 2, 4, 6}, rng);
      ForwardTimings t;
      EXPECT_LT(Compare(**gpu, **reference, in, 0, &t), kBf16Tolerance);
      if (v.tokens_per_rank > 0 && m == 517) {
        EXPECT_GT(t.stages.num_chunks, 1);
      }
    }
  }
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs one good forward (checked), returns its inputs.
void ExpectGoodForward(Engine& gpu, Engine& reference, std::mt19937& rng) {
  const Inputs in = MakeInputs(gpu.info().model, 64, Routing::kUniform, {}, rng);
  EXPECT_LT(Compare(gpu, reference, in, 0), kBf16Tolerance);
}

TEST(NcclEpFaults, InjectedErrorOnOneRank) {
  SKIP_WITHOUT_TWO_GPUS();
  std::atomic<bool> inject{false};
  EngineOptions o = Ep2("all2all_contiguous", "blas", WeightFormat::kBF16);
  o.collective_timeout_ms = 5000;
  o.fault_injection_for_testing = [&](int rank) -> absl::Status {
    if (rank == 1 && inject.load()) return absl::InternalError("injected fault on rank 1");
    return absl::OkStatus();
  };
  auto gpu = Engine::Create(o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto reference = Engine::Create(Oracle(o, "reference"));
  ASSERT_TRUE(reference.ok());
  std::mt19937 rng(9);
  ExpectGoodForward(**gpu, **reference, rng);
  inject = true;
  const Inputs in = MakeInputs((*gpu)->info().model, 64, Routing::kUniform, {}, rng);
  Tensor out = Tensor::Empty(DType::kBF16, {64, 256});
  auto t0 = std::chrono::steady_clock::now();
  absl::Status s = (*gpu)->Forward(in.in(0), out.view());
  EXPECT_LT(SecondsSince(t0), 15.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(s.message(), HasSubstr("injected fault"));
  EXPECT_FALSE((*gpu)->healthy());
  EXPECT_EQ((*gpu)->health().code(), absl::StatusCode::kUnavailable);
  inject = false;
  t0 = std::chrono::steady_clock::now();
  s = (*gpu)->Forward(in.in(0), out.view());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(SecondsSince(t0), 1.0);
  ASSERT_TRUE((*gpu)->Recover().ok());
  EXPECT_TRUE((*gpu)->healthy());
  ExpectGoodForward(**gpu, **reference, rng);
}

TEST(NcclEpFaults, RankThatDoesNotJoinTimesOut) {
  SKIP_WITHOUT_TWO_GPUS();
  std::atomic<bool> late{false};
  EngineOptions o = Ep2("all2all_batched", "batched_blas", WeightFormat::kMXFP8);
  o.collective_timeout_ms = 1000;
  o.fault_injection_for_testing = [&](int rank) -> absl::Status {
    if (rank == 1 && late.load()) std::this_thread::sleep_for(std::chrono::seconds(4));
    return absl::OkStatus();
  };
  auto gpu = Engine::Create(o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto reference = Engine::Create(Oracle(o, "reference"));
  ASSERT_TRUE(reference.ok());
  std::mt19937 rng(10);
  ExpectGoodForward(**gpu, **reference, rng);
  late = true;
  const Inputs in = MakeInputs((*gpu)->info().model, 64, Routing::kUniform, {}, rng);
  Tensor out = Tensor::Empty(DType::kBF16, {64, 256});
  auto t0 = std::chrono::steady_clock::now();
  absl::Status s = (*gpu)->Forward(in.in(0), out.view());
  const double took = SecondsSince(t0);
  EXPECT_LT(took, 15.0);
  // A collective timeout is the server's failure: UNAVAILABLE, the cause in the message.
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("DEADLINE_EXCEEDED"), absl::string_view::npos) << s;
  EXPECT_FALSE((*gpu)->healthy());
  late = false;
  EXPECT_EQ((*gpu)->Forward(in.in(0), out.view()).code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE((*gpu)->Recover().ok());
  ExpectGoodForward(**gpu, **reference, rng);
  std::printf("late rank: forward failed after %.2f s (timeout 1 s, late rank slept 4 s): %s\n",
              took, s.ToString().c_str());
}

TEST(NcclEpFaults, RefusalOnOneRankIsAgreedAndKeepsServing) {
  SKIP_WITHOUT_TWO_GPUS();
  EngineOptions o = Ep2("all2all_batched", "batched_blas", WeightFormat::kBF16);
  o.max_tokens_per_rank = 1;
  auto gpu = Engine::Create(o);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  auto reference = Engine::Create(Oracle(o, "reference"));
  ASSERT_TRUE(reference.ok());
  std::mt19937 rng(11);
  Inputs in = MakeInputs((*gpu)->info().model, 8, Routing::kUniform, {}, rng);
  // Token 5 (rank 1's slice) routes twice to one expert: more rows than one per rank allows.
  in.ids.data<int32_t>()[5 * 8 + 1] = in.ids.data<int32_t>()[5 * 8];
  Tensor out = Tensor::Empty(DType::kBF16, {8, 256});
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = (*gpu)->Forward(in.in(0), out.view());
  EXPECT_LT(SecondsSince(t0), 10.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("rank 1"));
  EXPECT_TRUE((*gpu)->healthy());
  ExpectGoodForward(**gpu, **reference, rng);
}

#endif  // MOESERVE_HAVE_NCCL

}  // namespace
}  // namespace moeserve
