// The provider registry: lookups by alias and class name, refusals that list the choices,
// Supports reasons, and declarations that match what the factories build.
#include "core/provider_registry.h"

#include <memory>

#include "core/comm/in_process_communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moeserve {
namespace {

using ::testing::HasSubstr;

// A registry with the CPU backend only, as a build without CUDA has.
const ProviderRegistry& CpuRegistry() {
  static const ProviderRegistry* registry = [] {
    auto* r = new ProviderRegistry();
    RegisterCpuBackend(*r);
    return r;
  }();
  return *registry;
}

EnginePlan Plan(int world_size) {
  EnginePlan plan;
  plan.model = *ModelPreset("tiny");
  plan.world_size = plan.local_ranks = world_size;
  plan.max_tokens_per_rank = 16;
  plan.placement =
      std::make_shared<const Placement>(*Placement::Contiguous(plan.model.num_experts, world_size));
  return plan;
}

TEST(ProviderRegistry, FindsByAliasAndClassName) {
  const ProviderRegistry& r = CpuRegistry();
  for (const auto& [alias, name] : std::vector<std::pair<std::string, std::string>>{
           {"no_ep", "NoEpPrepareAndFinalize"},
           {"all2all_contiguous", "AllToAllContiguous"},
           {"all2all_batched", "AllToAllBatched"}}) {
    ASSERT_NE(r.FindPrepareFinalize(alias), nullptr) << alias;
    EXPECT_EQ(r.FindPrepareFinalize(alias)->name, name);
    EXPECT_EQ(r.FindPrepareFinalize(name), r.FindPrepareFinalize(alias));
  }
  for (const auto& [alias, name] : std::vector<std::pair<std::string, std::string>>{
           {"reference", "ReferenceExperts"},
           {"blas", "BlasExperts"},
           {"batched_reference", "BatchedReferenceExperts"},
           {"batched_blas", "BatchedBlasExperts"}}) {
    ASSERT_NE(r.FindExperts(alias), nullptr) << alias;
    EXPECT_EQ(r.FindExperts(alias)->name, name);
    EXPECT_EQ(r.FindExperts(name), r.FindExperts(alias));
  }
  EXPECT_EQ(r.FindExperts("eference"), nullptr);  // no substring matches
  EXPECT_NE(r.FindBackend(Backend::kCpu), nullptr);
  EXPECT_EQ(r.FindBackend(Backend::kCuda), nullptr);
}

TEST(ProviderRegistry, UnknownNameListsTheChoices) {
  const ProviderRegistry& r = CpuRegistry();
  auto pf = r.LookupPrepareFinalize("bogus", Backend::kCpu);
  EXPECT_EQ(pf.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pf.status().message(),
            "prepare_finalize: got 'bogus', expected no_ep, all2all_contiguous or all2all_batched "
            "(or a class name: NoEpPrepareAndFinalize, AllToAllContiguous, AllToAllBatched)");
  auto experts = r.LookupExperts("bogus", Backend::kCpu);
  EXPECT_EQ(experts.status().message(),
            "experts: got 'bogus', expected reference, blas, batched_reference or batched_blas "
            "(or a class name: ReferenceExperts, BlasExperts, BatchedReferenceExperts, "
            "BatchedBlasExperts)");
}

TEST(ProviderRegistry, DuplicatesAreRefused) {
  ProviderRegistry r;
  RegisterCpuBackend(r);
  ExpertsProvider twin = *r.FindExperts("blas");
  EXPECT_EQ(r.Register(twin).code(), absl::StatusCode::kAlreadyExists);
  twin.name = "OtherExperts";
  EXPECT_THAT(r.Register(twin).message(), HasSubstr("alias blas is taken by BlasExperts"));
  twin.aliases = {};
  EXPECT_TRUE(r.Register(twin).ok());
  EXPECT_EQ(r.experts().back()->name, "OtherExperts");
}

TEST(ProviderRegistry, SupportsSaysWhy) {
  const ProviderRegistry& r = CpuRegistry();
  const absl::Status no_ep = r.FindPrepareFinalize("no_ep")->Supports(Plan(2));
  EXPECT_EQ(no_ep.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_ep.message(), HasSubstr("NoEpPrepareAndFinalize serves a single rank"));
  EXPECT_TRUE(r.FindPrepareFinalize("no_ep")->Supports(Plan(1)).ok());
  EXPECT_TRUE(r.FindPrepareFinalize("all2all_batched")->Supports(Plan(4)).ok());
  EnginePlan gpu = Plan(1);
  gpu.backend = Backend::kCuda;
  EXPECT_THAT(r.FindExperts("blas")->Supports(gpu).message(),
              HasSubstr("BlasExperts runs on backend cpu, not cuda"));
  EnginePlan zero = Plan(2);
  zero.max_tokens_per_rank = 0;
  EXPECT_THAT(r.FindPrepareFinalize("all2all_contiguous")->Supports(zero).message(),
              HasSubstr("max_num_tokens_per_rank must be > 0"));
  const absl::Status pair = CheckProvidersCompatible(*r.FindPrepareFinalize("all2all_batched"),
                                                     *r.FindExperts("blas"), Plan(2));
  EXPECT_EQ(pair.message(),
            "AllToAllBatched produces BatchedExperts activations but BlasExperts expects "
            "Standard");
}

// What a provider declares is what its factory builds.
TEST(ProviderRegistry, DeclarationsMatchTheInstances) {
  const ProviderRegistry& r = CpuRegistry();
  const EnginePlan plan = Plan(2);
  auto group = InProcessCommGroup::Create(2, absl::Seconds(1));
  ASSERT_TRUE(group.ok());
  RankResources rank;
  rank.comm = (*group)->MakeCommunicator(0);
  for (const PrepareFinalizeProvider* p : r.prepare_finalizes()) {
    EnginePlan own = p->supports_ep ? plan : Plan(1);
    auto pf = p->create(own, p->supports_ep ? rank : RankResources());
    ASSERT_TRUE(pf.ok()) << p->name << ": " << pf.status();
    EXPECT_EQ((*pf)->name(), p->name);
    EXPECT_EQ((*pf)->activation_format(), p->format) << p->name;
  }
  for (const ExpertsProvider* p : r.experts()) {
    auto experts = p->create(plan, rank);
    ASSERT_TRUE(experts.ok()) << p->name << ": " << experts.status();
    EXPECT_EQ((*experts)->name(), p->name);
    EXPECT_EQ((*experts)->activation_formats().input, p->format) << p->name;
    EXPECT_EQ((*experts)->supports_expert_map(), p->supports_ep) << p->name;
  }
}

}  // namespace
}  // namespace moeserve
