// One registry of the modular kernel's building blocks and of the backends that run them.
//
// A provider declares what it is (class name, short aliases, backend, activation format, whether
// it serves expert parallelism), a factory, and Supports(plan): OK or INVALID_ARGUMENT saying why
// not. ResolveEngineConfig chooses providers from here by name; the engine's RankGroups build one
// instance per rank through the factories; moeserve-mk-check --list prints the table.
//
// Registration: core registers the CPU providers and the CPU backend when Global() is first
// used; core_cuda adds the CUDA ones from a static registrar (linked whole-archive through the
// moeserve_backends target, see core/CMakeLists.txt). Adding an Experts type is one file (the
// class and its ExpertsProvider) plus one Register call.
//
// Thread-safety: Register may run concurrently with lookups; providers are never removed, so the
// pointers lookups return stay valid for the registry's lifetime.
#ifndef MOESERVE_CORE_PROVIDER_REGISTRY_H_
#define MOESERVE_CORE_PROVIDER_REGISTRY_H_

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/comm/communicator.h"
#include "core/device_upload.h"
#include "core/engine_plan.h"
#include "core/modular_kernel.h"

namespace moeserve {

class CudaContext;        // core/cuda/cuda_backend.h (opaque here)
class MemoryRegion;       // core/memory_region.h
class DeviceWeightStore;  // core/cuda/cuda_backend.h
class RankGroup;          // core/rank_group.h

// What one rank hands the factories. Owned by the rank (RankGroup); factories keep shared
// references as they need.
struct RankResources {
  int rank = 0;  // global rank
  // This rank's endpoint among all ranks: null with one rank (no-EP). On backend cuda an
  // NcclCommunicator (core/comm/nccl_communicator.h).
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<CudaContext> cuda;                        // backend cuda: this rank's GPU
  std::shared_ptr<const DeviceWeightStore> device_weights;  // backend cuda: resident weights
};

struct PrepareFinalizeProvider {
  std::string name;                  // class name, as PrepareAndFinalize::name()
  std::vector<std::string> aliases;  // short names for --prepare_finalize
  Backend backend = Backend::kCpu;
  ActivationFormat format = ActivationFormat::kStandard;  // what Prepare produces
  bool supports_ep = false;                               // serves more than one rank
  // Reads hidden_states / writes the output in CUDA device memory too (accepts_device_tensors).
  bool device_tensors = false;
  // Reads topk ids and weights in CUDA device memory too, checking them on the device
  // (accepts_device_routing).
  bool device_routing = false;
  std::function<absl::StatusOr<std::unique_ptr<PrepareAndFinalize>>(const EnginePlan&,
                                                                    const RankResources&)>
      create;
  // Optional: a refusal beyond backend and EP (e.g. a build without NCCL).
  std::function<absl::Status(const EnginePlan&)> supports;

  // OK, or INVALID_ARGUMENT with the reason this provider cannot serve `plan`.
  absl::Status Supports(const EnginePlan& plan) const;
};

struct ExpertsProvider {
  std::string name;                  // class name, as Experts::name()
  std::vector<std::string> aliases;  // short names for --experts
  Backend backend = Backend::kCpu;
  ActivationFormat format = ActivationFormat::kStandard;  // what Apply consumes
  bool supports_ep = false;  // takes an expert map (routes to other ranks' experts, -1)
  // A plain-loop oracle, asked for by name only to check against: backend "auto" keeps it on
  // its own backend rather than substituting another backend's Experts.
  bool reference = false;
  std::function<absl::StatusOr<std::unique_ptr<Experts>>(const EnginePlan&, const RankResources&)>
      create;
  std::function<absl::Status(const EnginePlan&)> supports;  // optional, as above

  absl::Status Supports(const EnginePlan& plan) const;
};

// A backend: how many devices it sees and how it builds its ranks.
struct BackendProvider {
  Backend backend = Backend::kCpu;
  std::function<int()> visible_devices;  // null: not device-bound (CPU)
  // Builds plan.local_ranks ranks (weights, kernels, communicators). Blocks until ready.
  std::function<absl::StatusOr<std::unique_ptr<RankGroup>>(const EnginePlan&,
                                                           const class ProviderRegistry&)>
      create_rank_group;
  // A fresh multi-process collective id (leader); null: multi-process unsupported.
  std::function<absl::StatusOr<std::string>()> new_collective_id;
  // Shared-memory regions (core/memory_region.h); null: unsupported. Page-locks host memory for
  // DMA (cudaHostRegister) and undoes it.
  std::function<absl::Status(void* data, size_t bytes)> register_host_memory;
  std::function<void(void* data)> unregister_host_memory;
  // Opens a CUDA IPC handle (kCudaIpcHandleBytes) of `byte_size` bytes on `device_id`.
  std::function<absl::StatusOr<std::unique_ptr<MemoryRegion>>(absl::string_view raw_handle,
                                                              int device_id, int64_t byte_size)>
      open_ipc_region;
  // Large request bytes uploaded to device memory, the gather overlapping the copy
  // (core/device_upload.h); null: unsupported.
  UploadHostPiecesFn upload_host_pieces;
};

class ProviderRegistry {
 public:
  ProviderRegistry() = default;
  ProviderRegistry(const ProviderRegistry&) = delete;
  ProviderRegistry& operator=(const ProviderRegistry&) = delete;

  // The process-wide registry: the CPU providers and backend, plus what backends linked into
  // the binary registered.
  static ProviderRegistry& Global();

  // ALREADY_EXISTS when the name or an alias is taken (among providers of the same kind);
  // INVALID_ARGUMENT without a name or a factory.
  absl::Status Register(PrepareFinalizeProvider provider);
  absl::Status Register(ExpertsProvider provider);
  absl::Status Register(BackendProvider provider);

  // By class name or alias; null if unknown.
  const PrepareFinalizeProvider* FindPrepareFinalize(absl::string_view name) const;
  const ExpertsProvider* FindExperts(absl::string_view name) const;
  const BackendProvider* FindBackend(Backend backend) const;  // null: not linked in

  // By name, restricted to `backend`: INVALID_ARGUMENT "prepare_finalize: got 'x', expected ..."
  // listing that backend's aliases and class names.
  absl::StatusOr<const PrepareFinalizeProvider*> LookupPrepareFinalize(absl::string_view name,
                                                                       Backend backend) const;
  absl::StatusOr<const ExpertsProvider*> LookupExperts(absl::string_view name,
                                                       Backend backend) const;

  // Registration order.
  std::vector<const PrepareFinalizeProvider*> prepare_finalizes() const;
  std::vector<const ExpertsProvider*> experts() const;

 private:
  mutable std::mutex mu_;
  std::deque<PrepareFinalizeProvider> pfs_;  // deque: stable addresses
  std::deque<ExpertsProvider> experts_;
  std::deque<BackendProvider> backends_;
};

// The pair check on declared capabilities, with CheckCompatible's messages (core/modular_kernel.h):
// activation formats must match; under EP (world_size > 1) the Experts must take an expert map.
absl::Status CheckProvidersCompatible(const PrepareFinalizeProvider& pf,
                                      const ExpertsProvider& experts, const EnginePlan& plan);

// Core's CPU providers and backend (core/cpu/cpu_providers.cc, core/cpu/cpu_rank_group.cc);
// Global() calls it once. Exposed for tests that build their own registry.
void RegisterCpuBackend(ProviderRegistry& registry);

}  // namespace moeserve

#endif  // MOESERVE_CORE_PROVIDER_REGISTRY_H_
