// The CUDA backend: one GPU per rank (local rank r on device r), each with resident packed
// weights; NCCL between the GPUs for expert parallelism, within one process or across processes
// (then each rank also gets a host channel for the MultiProcessDriver). Registered with the
// provider registry by core_cuda itself (RegisterCudaBackend, from a static registrar).
#ifndef MOESERVE_CORE_CUDA_CUDA_RANK_GROUP_H_
#define MOESERVE_CORE_CUDA_CUDA_RANK_GROUP_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/engine_plan.h"
#include "core/provider_registry.h"
#include "core/rank_group.h"

namespace moeserve {

// Builds plan.local_ranks GPU ranks. plan.backend must be kCuda. Blocks until the weights are
// resident and (EP) the NCCL communicators formed, which in multi-process mode waits for every
// process.
absl::StatusOr<std::unique_ptr<RankGroup>> CreateCudaRankGroup(const EnginePlan& plan,
                                                               const ProviderRegistry& registry);

// The CUDA PrepareAndFinalize and Experts providers (core/cuda/cuda_providers.cc).
void RegisterCudaProviders(ProviderRegistry& registry);

// The CUDA providers and the cuda backend. Idempotent per
// registry (a second call finds the names taken).
void RegisterCudaBackend(ProviderRegistry& registry);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_CUDA_RANK_GROUP_H_
