// The CPU backend: one worker thread per rank in this process, in-process communicators between
// them, the leader (rank 0) gathering the output slices.
#ifndef MOESERVE_CORE_CPU_CPU_RANK_GROUP_H_
#define MOESERVE_CORE_CPU_CPU_RANK_GROUP_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/engine_plan.h"
#include "core/provider_registry.h"
#include "core/rank_group.h"

namespace moeserve {

// Builds plan.local_ranks CPU ranks: loads each rank's experts (plan.weights) and builds its
// kernel from the plan's providers. plan.backend must be kCpu.
absl::StatusOr<std::unique_ptr<RankGroup>> CreateCpuRankGroup(const EnginePlan& plan,
                                                              const ProviderRegistry& registry);

// The CPU PrepareAndFinalize and Experts providers (core/cpu/cpu_providers.cc).
void RegisterCpuProviders(ProviderRegistry& registry);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_CPU_RANK_GROUP_H_
