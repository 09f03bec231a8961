// ResolveEngineConfig: every refusal of bad options (message and code, as Engine::Create
// returns them), the automatic choices, and the backend "auto" decision with 0 and 1 GPUs on a
// registry with a stand-in GPU backend (no GPU needed).
#include "core/engine_plan.h"

#include <memory>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/provider_registry.h"
#include "core/rank_group.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

EngineOptions Tiny() {
  EngineOptions o;
  o.model = *ModelPreset("tiny");
  o.num_threads = 4;
  return o;
}

// The CPU backend plus a stand-in GPU backend with the CUDA providers' shape: names, formats,
// hidden % 8 == 0. Nothing is ever built from it.
const ProviderRegistry& WithGpu() {
  static const ProviderRegistry* registry = [] {
    auto* r = new ProviderRegistry();
    RegisterCpuBackend(*r);
    auto never_pf =
        [](const EnginePlan&,
           const RankResources&) -> absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> {
      return absl::UnimplementedError("stand-in");
    };
    auto never_experts = [](const EnginePlan&,
                            const RankResources&) -> absl::StatusOr<std::unique_ptr<Experts>> {
      return absl::UnimplementedError("stand-in");
    };
    for (const auto& [name, format, ep] :
         std::vector<std::tuple<std::string, ActivationFormat, bool>>{
             {"GpuNoEp", ActivationFormat::kStandard, false},
             {"GpuNoEpBatched", ActivationFormat::kBatchedExperts, false},
             {"GpuAllToAll", ActivationFormat::kStandard, true},
             {"GpuAllToAllBatched", ActivationFormat::kBatchedExperts, true}}) {
      PrepareFinalizeProvider p;
      p.name = name;
      p.backend = Backend::kCuda;
      p.format = format;
      p.supports_ep = ep;
      p.create = never_pf;
      EXPECT_TRUE(r->Register(p).ok());
    }
    for (const auto& [name, format] : std::vector<std::pair<std::string, ActivationFormat>>{
             {"GpuExperts", ActivationFormat::kStandard},
             {"GpuBatchedExperts", ActivationFormat::kBatchedExperts}}) {
      ExpertsProvider p;
      p.name = name;
      p.backend = Backend::kCuda;
      p.format = format;
      p.supports_ep = true;
      p.supports = [](const EnginePlan& plan) {
        return plan.model.hidden % 8 == 0 ? absl::OkStatus()
                                          : absl::InvalidArgumentError("needs hidden % 8 == 0");
      };
      p.create = never_experts;
      EXPECT_TRUE(r->Register(p).ok());
    }
    // A GPU-only Experts for MXFP8 weights alone (as cuda_w8a8).
    ExpertsProvider fp8;
    fp8.name = "GpuFp8Experts";
    fp8.aliases = {"gpu_fp8"};
    fp8.backend = Backend::kCuda;
    fp8.format = ActivationFormat::kStandard;
    fp8.supports_ep = true;
    fp8.supports = [](const EnginePlan& plan) {
      return plan.weights.format == WeightFormat::kMXFP8
                 ? absl::OkStatus()
                 : absl::InvalidArgumentError("GpuFp8Experts serves MXFP8 weights");
    };
    fp8.create = never_experts;
    EXPECT_TRUE(r->Register(fp8).ok());
    BackendProvider gpu;
    gpu.backend = Backend::kCuda;
    gpu.create_rank_group =
        [](const EnginePlan&,
           const ProviderRegistry&) -> absl::StatusOr<std::unique_ptr<RankGroup>> {
      return absl::UnimplementedError("stand-in");
    };
    EXPECT_TRUE(r->Register(gpu).ok());
    return r;
  }();
  return *registry;
}

const ProviderRegistry& CpuOnly() {
  static const ProviderRegistry* registry = [] {
    auto* r = new ProviderRegistry();
    RegisterCpuBackend(*r);
    return r;
  }();
  return *registry;
}

void ExpectRefused(const EngineOptions& o, absl::StatusCode code, absl::string_view message,
                   const ProviderRegistry& registry = CpuOnly(), int gpus = 0) {
  auto plan = ResolveEngineConfig(o, registry, gpus);
  ASSERT_FALSE(plan.ok()) << message;
  EXPECT_EQ(plan.status().code(), code) << plan.status();
  EXPECT_EQ(plan.status().message(), message);
}

TEST(ResolveEngineConfig, Defaults) {
  auto plan = ResolveEngineConfig(Tiny(), CpuOnly(), 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->backend, Backend::kCpu);
  EXPECT_EQ(plan->prepare_finalize, "NoEpPrepareAndFinalize");
  EXPECT_EQ(plan->experts, "BlasExperts");
  EXPECT_EQ(plan->world_size, 1);
  EXPECT_FALSE(plan->multi_process);
  EXPECT_EQ(plan->threads_per_rank, 4);
  EXPECT_EQ(plan->max_tokens_per_rank, 8192);  // no-EP: the request limit
  EXPECT_EQ(plan->dispatch, AllToAllOptions::Dispatch::kPerRank);
  EXPECT_EQ(plan->placement->num_ranks(), 1);
}

// "auto" asks the GPU providers with the weight format too: a GPU-only provider for MXFP8
// weights gets the GPU for MXFP8, and for BF16 the refusal says why the backend is the CPU.
TEST(ResolveEngineConfig, AutoAsksGpuProvidersWithTheWeightFormat) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EngineOptions o = Tiny();
  o.backend = "auto";
  o.experts = "gpu_fp8";
  o.weight_format = WeightFormat::kMXFP8;
  auto plan = ResolveEngineConfig(o, WithGpu(), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->backend, Backend::kCuda);
  EXPECT_EQ(plan->experts, "GpuFp8Experts");
  o.weight_format = WeightFormat::kBF16;
  ExpectRefused(o, kInvalid,
                "experts: 'gpu_fp8' (GpuFp8Experts) runs on the cuda backend, but backend auto "
                "chose cpu: GpuFp8Experts serves MXFP8 weights",
                WithGpu(), 1);
  ExpectRefused(o, kInvalid,
                "experts: 'gpu_fp8' (GpuFp8Experts) runs on the cuda backend, but backend auto "
                "chose cpu: no CUDA device is visible",
                WithGpu(), 0);
  o.backend = "cpu";
  o.weight_format = WeightFormat::kMXFP8;
  ExpectRefused(o, kInvalid,
                "experts: 'gpu_fp8' (GpuFp8Experts) runs on the cuda backend, but backend cpu was "
                "asked for",
                WithGpu(), 1);
  // Other names still pick the GPU under auto (any GPU Experts that serves decides).
  o = Tiny();
  o.backend = "auto";
  plan = ResolveEngineConfig(o, WithGpu(), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->backend, Backend::kCuda);
  EXPECT_EQ(plan->experts, "GpuExperts");
}

TEST(ResolveEngineConfig, ExpertParallelChoices) {
  EngineOptions o = Tiny();
  o.model.num_experts = 16;
  o.num_ranks = 4;
  o.experts = "batched_blas";
  o.prepare_finalize = "all2all_batched";
  o.dispatch = "per_route";
  auto plan = ResolveEngineConfig(o, CpuOnly(), 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->prepare_finalize, "AllToAllBatched");
  EXPECT_EQ(plan->activation_format, ActivationFormat::kBatchedExperts);
  EXPECT_EQ(plan->max_tokens_per_rank, 128);  // 8192 / 4, capped for the batched format
  EXPECT_EQ(plan->threads_per_rank, 1);
  EXPECT_EQ(plan->dispatch, AllToAllOptions::Dispatch::kPerRoute);
  o.prepare_finalize = "auto";
  o.experts = "blas";
  plan = ResolveEngineConfig(o, CpuOnly(), 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->prepare_finalize, "AllToAllContiguous");
  EXPECT_EQ(plan->max_tokens_per_rank, 2048);
}

TEST(ResolveEngineConfig, EveryBadOptionIsRefusedSayingWhy) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kPrecondition = absl::StatusCode::kFailedPrecondition;
  EngineOptions o = Tiny();
  o.backend = "tpu";
  ExpectRefused(o, kInvalid, "backend: got 'tpu', expected cpu, cuda or auto");
  o = Tiny();
  o.backend = "cuda";
  ExpectRefused(o, kPrecondition,
                "backend 'cuda': this moeserve was built without CUDA "
                "(MOESERVE_ENABLE_CUDA=OFF); use --backend cpu");
  ExpectRefused(o, kPrecondition,
                "backend 'cuda': no CUDA device is visible (no GPU or no driver); use --backend "
                "cpu",
                WithGpu(), 0);
  o.num_ranks = 2;
  ExpectRefused(o, kPrecondition,
                "num_ranks: 2 GPU ranks requested but 1 CUDA devices are visible (backend cuda "
                "runs one rank per GPU)",
                WithGpu(), 1);
  o.num_ranks = 1;
  o.model.hidden = 100;
  ExpectRefused(o, kInvalid, "backend 'cuda' needs hidden % 8 == 0, got hidden=100", WithGpu(), 1);
  o = Tiny();
  o.num_ranks = 1000;
  ExpectRefused(o, kInvalid,
                absl::StrCat("num_ranks: got 1000, expected a value in [1, num_experts=",
                             o.model.num_experts, "]"));
  o = Tiny();
  o.world_size = 2;
  ExpectRefused(o, kPrecondition,
                "world_size: multi-process serving (world_size=2 > num_ranks=1) needs backend "
                "cuda");
  o.backend = "cuda";
  o.world_size = 3;
  o.num_ranks = 2;
  ExpectRefused(o, kInvalid,
                "world_size: got 3, expected a multiple of the ranks per process (2), at most 256",
                WithGpu(), 2);
  o.world_size = 4;
  o.node_rank = 2;
  ExpectRefused(o, kInvalid, "node_rank: got 2, expected a value in [0, 2)", WithGpu(), 2);
  o.node_rank = 1;
  ExpectRefused(o, kInvalid,
                "collective_id: multi-process serving needs the leader's NCCL unique id", WithGpu(),
                2);
  // Followers wait for the next command at most the collective timeout: the leader's idle
  // heartbeat must come well within it (and be on).
  o.collective_id = "id";
  o.collective_timeout_ms = 3000;
  o.heartbeat_ms = 1001;
  ExpectRefused(o, kInvalid,
                "heartbeat_ms: got 1001, expected a value in [1, collective_timeout_ms / 3 = 1000] "
                "for multi-process serving (followers wait at most collective_timeout_ms for the "
                "next command, and an idle leader's heartbeats can be two periods apart)",
                WithGpu(), 2);
  o.heartbeat_ms = 0;
  ExpectRefused(o, kInvalid,
                "heartbeat_ms: got 0, expected a value in [1, collective_timeout_ms / 3 = 1000] "
                "for multi-process serving (followers wait at most collective_timeout_ms for the "
                "next command, and an idle leader's heartbeats can be two periods apart)",
                WithGpu(), 2);
  o.heartbeat_ms = 1000;
  EXPECT_TRUE(ResolveEngineConfig(o, WithGpu(), 2).ok());
  o.world_size = 2;  // one process: no heartbeat needed
  o.node_rank = 0;
  o.heartbeat_ms = 0;
  EXPECT_TRUE(ResolveEngineConfig(o, WithGpu(), 2).ok());
  o = Tiny();
  o.max_tokens_per_request = 0;
  ExpectRefused(o, kInvalid, "max_tokens_per_request must be > 0");
  o = Tiny();
  o.max_tokens_per_rank = -1;
  ExpectRefused(o, kInvalid, "max_tokens_per_rank: got -1, expected >= 0 (0: automatic)");
  o = Tiny();
  o.dispatch = "broadcast";
  ExpectRefused(o, kInvalid, "dispatch: got 'broadcast', expected per_rank or per_route");
  o = Tiny();
  o.collective_timeout_ms = 0;
  ExpectRefused(o, kInvalid, "collective_timeout_ms must be > 0");
  o = Tiny();
  o.group_formation_timeout_ms = 0;
  ExpectRefused(o, kInvalid, "group_formation_timeout_ms: got 0, expected > 0");
  o = Tiny();
  o.experts = "cuda";  // a GPU provider's name on the CPU: not a choice there
  ExpectRefused(o, kInvalid,
                "experts: got 'cuda', expected reference, blas, batched_reference or "
                "batched_blas (or a class name: ReferenceExperts, BlasExperts, "
                "BatchedReferenceExperts, BatchedBlasExperts)");
  o = Tiny();
  o.prepare_finalize = "zigzag";
  ExpectRefused(o, kInvalid,
                "prepare_finalize: got 'zigzag', expected no_ep, all2all_contiguous or "
                "all2all_batched (or a class name: NoEpPrepareAndFinalize, AllToAllContiguous, "
                "AllToAllBatched)");
  o = Tiny();
  o.prepare_finalize = "no_ep";
  o.num_ranks = 2;
  ExpectRefused(o, kInvalid,
                "NoEpPrepareAndFinalize serves a single rank, but there are 2 ranks; use "
                "AllToAllContiguous (all2all_contiguous) or AllToAllBatched (all2all_batched)");
  o.backend = "cuda";
  ExpectRefused(o, kInvalid, "prepare_finalize: no_ep runs on a single rank, got num_ranks=2",
                WithGpu(), 2);
  o = Tiny();
  o.num_ranks = 2;
  o.rank_experts = {{0}};
  ExpectRefused(o, kInvalid, "rank_experts: lists 1 ranks, num_ranks=2");
  o = Tiny();
  o.placement = "zigzag";
  auto plan = ResolveEngineConfig(o, CpuOnly(), 0);
  EXPECT_EQ(plan.status().code(), kInvalid);
  EXPECT_THAT(plan.status().message(), HasSubstr("placement"));
  // A pair whose formats differ.
  o = Tiny();
  o.num_ranks = 2;
  o.prepare_finalize = "all2all_batched";
  ExpectRefused(o, kInvalid,
                "AllToAllBatched produces BatchedExperts activations but BlasExperts expects "
                "Standard");
  // An invalid model is the model's refusal.
  o = Tiny();
  o.model.topk = 0;
  EXPECT_EQ(ResolveEngineConfig(o, CpuOnly(), 0).status().code(), kInvalid);
}

// The NCCL group of a multi-process deployment forms after every process's weight load: its
// deadline is its own (long by default), never shorter than a collective's.
TEST(ResolveEngineConfig, GroupFormationTimeout) {
  EngineOptions o = Tiny();
  absl::StatusOr<EnginePlan> plan = ResolveEngineConfig(o, CpuOnly(), 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->group_formation_timeout, absl::Seconds(600));
  o.collective_timeout_ms = 90000;
  o.group_formation_timeout_ms = 30000;
  plan = ResolveEngineConfig(o, CpuOnly(), 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->group_formation_timeout, absl::Seconds(90));
  o.group_formation_timeout_ms = 1800000;
  plan = ResolveEngineConfig(o, CpuOnly(), 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->group_formation_timeout, absl::Minutes(30));
}

TEST(ResolveEngineConfig, AutoBackendByCapabilities) {
  EngineOptions o = Tiny();
  o.backend = "auto";
  auto backend = [&](const ProviderRegistry& r, int gpus) {
    auto plan = ResolveEngineConfig(o, r, gpus);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? plan->backend : Backend::kCpu;
  };
  EXPECT_EQ(backend(WithGpu(), 0), Backend::kCpu);
  EXPECT_EQ(backend(CpuOnly(), 1), Backend::kCpu);  // no GPU backend linked in
  EXPECT_EQ(backend(WithGpu(), 1), Backend::kCuda);
  auto plan = ResolveEngineConfig(o, WithGpu(), 1);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->experts, "GpuExperts");  // "blas" picks the GPU's Standard Experts
  EXPECT_EQ(plan->prepare_finalize, "GpuNoEp");
  o.experts = "batched_blas";
  plan = ResolveEngineConfig(o, WithGpu(), 1);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->experts, "GpuBatchedExperts");
  EXPECT_EQ(plan->prepare_finalize, "GpuNoEpBatched");
  // A reference oracle stays on the CPU.
  o.experts = "reference";
  EXPECT_EQ(backend(WithGpu(), 1), Backend::kCpu);
  o.experts = "BatchedReferenceExperts";
  o.prepare_finalize = "all2all_batched";  // the CPU's batched pair on one rank
  EXPECT_EQ(backend(WithGpu(), 1), Backend::kCpu);
  // The GPU Experts refuse hidden % 8 != 0: the CPU serves.
  o.experts = "blas";
  o.prepare_finalize = "auto";
  o.model.hidden = 100;
  EXPECT_EQ(backend(WithGpu(), 1), Backend::kCpu);
}

}  // namespace
}  // namespace moeserve
