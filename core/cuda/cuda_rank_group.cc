#include "core/cuda/cuda_rank_group.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/comm/nccl_communicator.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_memory_region.h"
#include "core/cuda/host_upload.h"
#include "core/status_macros.h"
#include "core/weight_loader.h"
#ifdef MOESERVE_HAVE_NCCL
#include "core/comm/nccl_host_transfer.h"
#include "core/cuda/nccl_all_to_all.h"
#endif

namespace moeserve {
namespace {

#ifdef MOESERVE_HAVE_NCCL
class NcclHostChannel final : public HostTransfer {
 public:
  explicit NcclHostChannel(std::shared_ptr<NcclCommunicator> comm) : transfer_(std::move(comm)) {}
  absl::Status Broadcast(void* host, int64_t bytes, int root) override {
    return transfer_.Broadcast(host, bytes, root);
  }
  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_counts,
                         absl::Span<const int64_t> send_displs, void* recv,
                         absl::Span<const int64_t> recv_counts,
                         absl::Span<const int64_t> recv_displs) override {
    return transfer_.AllToAllV(send, send_counts, send_displs, recv, recv_counts, recv_displs);
  }

 private:
  NcclHostTransfer transfer_;
};
#endif

// GPU ranks live in this process: each copies its answer straight into the output (the base
// RunRank), so no gather.
class CudaRankGroup final : public RankGroup {
 public:
  explicit CudaRankGroup(const EnginePlan& plan) : RankGroup(plan) {}

  absl::Status Build(const ProviderRegistry& registry) {
    const PrepareFinalizeProvider* pf = registry.FindPrepareFinalize(plan_.prepare_finalize);
    const ExpertsProvider* experts = registry.FindExperts(plan_.experts);
    if (pf == nullptr || experts == nullptr) {
      return absl::InternalError("the plan names providers the registry does not have");
    }
    const int n = plan_.local_ranks;
    const int lanes = plan_.lanes;
    ranks_.resize(n);
    contexts_.resize(n);
    device_weights_.resize(n);
    for (int r = 0; r < n; ++r) {
      const int global = plan_.first_rank + r;
      // Lane 0's context is the rank's (NCCL's stream); other lanes get streams of their own.
      for (int lane = 0; lane < lanes; ++lane) {
        MOESERVE_ASSIGN_OR_RETURN(std::shared_ptr<CudaContext> ctx,
                                  CudaContext::Create(/*device=*/r));
        contexts_[r].push_back(std::move(ctx));
      }
      MOESERVE_ASSIGN_OR_RETURN(ranks_[r].weights,
                                LoadExpertWeights(plan_.weights, plan_.model,
                                                  plan_.placement->rank_experts(global), global));
      MOESERVE_ASSIGN_OR_RETURN(device_weights_[r],
                                DeviceWeightStore::Create(*ranks_[r].weights, *contexts_[r][0]));
      ranks_[r].expert_map = plan_.placement->ExpertMap(global);
    }
    if (pf->supports_ep) MOESERVE_RETURN_IF_ERROR(CreateCommunicators());
    for (int r = 0; r < n; ++r) {
      for (int lane = 0; lane < lanes; ++lane) {
        RankResources resources;
        resources.rank = plan_.first_rank + r;
        resources.cuda = contexts_[r][lane];
        resources.device_weights = device_weights_[r];  // shared by the lanes
#ifdef MOESERVE_HAVE_NCCL
        if (nccl_ != nullptr) resources.comm = nccl_->communicator(r);
#endif
        MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<PrepareAndFinalize> prepare_finalize,
                                  pf->create(plan_, resources));
        MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<Experts> expert_impl,
                                  experts->create(plan_, resources));
        MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<WorkspaceAllocator> workspaces,
                                  CreateCudaWorkspaceAllocator(contexts_[r][lane]));
        MOESERVE_ASSIGN_OR_RETURN(
            std::unique_ptr<ModularKernel> kernel,
            ModularKernel::Create(std::move(prepare_finalize), std::move(expert_impl),
                                  std::move(workspaces)));
        if (plan_.graph_max_tokens > 0) {
          GraphOptions graphs;
          graphs.max_tokens = plan_.graph_max_tokens;
          if (absl::Status g = kernel->EnableGraphs(graphs); !g.ok()) {
            if (plan_.graphs_required) {
              return absl::InvalidArgumentError(
                  absl::StrCat("graph_max_tokens: ", plan_.graph_max_tokens, ": ", g.message()));
            }
            no_graphs_reason_ = std::string(g.message());
          }
        }
        ranks_[r].kernels.push_back(std::move(kernel));
      }
      ranks_[r].timings.resize(lanes);
    }
    StartThreads();
    return absl::OkStatus();
  }

  int num_local_ranks() const override { return static_cast<int>(ranks_.size()); }

  HostTransfer* host_transfer(int local) override {
    return local < static_cast<int>(host_.size()) ? host_[local].get() : nullptr;
  }

  absl::Status Recover() override {
#ifdef MOESERVE_HAVE_NCCL
    if (nccl_ != nullptr && !nccl_->healthy()) MOESERVE_RETURN_IF_ERROR(nccl_->Reinit());
#endif
    return RankGroup::Recover();
  }

  void Abort(const absl::Status& cause) override {
#ifdef MOESERVE_HAVE_NCCL
    if (nccl_ != nullptr) nccl_->Abort(cause);
#endif
  }

 protected:
  // A refusal all GPU ranks agreed on (in PlanChunks) leaves NCCL intact.
  void AbortPeers(const absl::Status& cause) override {
#ifdef MOESERVE_HAVE_NCCL
    if (nccl_ != nullptr && !IsAgreedFailure(cause)) nccl_->Abort(cause);
#endif
  }

  // Communicators that failed cannot run another collective: stop serving until Recover().
  void AfterFailedStep(const absl::Status& cause) override {
#ifdef MOESERVE_HAVE_NCCL
    if (nccl_ != nullptr && !nccl_->healthy()) {
      nccl_->AbortAll();
      MarkUnhealthy(absl::UnavailableError(absl::StrCat(
          "not serving: the NCCL communicators were aborted after: ", cause.message())));
    }
#endif
  }

 private:
  absl::Status CreateCommunicators() {
#ifndef MOESERVE_HAVE_NCCL
    return absl::FailedPreconditionError(
        absl::StrCat("prepare_finalize ", plan_.prepare_finalize,
                     " on GPUs needs NCCL, which this build lacks"));
#else
    std::vector<int> devices;
    std::vector<void*> streams;
    for (int r = 0; r < plan_.local_ranks; ++r) {
      devices.push_back(r);
      streams.push_back(contexts_[r][0]->stream());
    }
    if (plan_.multi_process) {
      MOESERVE_ASSIGN_OR_RETURN(
          nccl_, NcclCommGroup::CreateMultiProcess(
                     devices, streams, plan_.world_size, plan_.first_rank, plan_.collective_id,
                     plan_.collective_timeout, plan_.group_formation_timeout));
      for (int r = 0; r < plan_.local_ranks; ++r) {
        host_.push_back(std::make_unique<NcclHostChannel>(nccl_->communicator(r)));
      }
    } else {
      MOESERVE_ASSIGN_OR_RETURN(nccl_,
                                NcclCommGroup::Create(devices, streams, plan_.collective_timeout));
    }
    return absl::OkStatus();
#endif
  }

  std::vector<std::vector<std::shared_ptr<CudaContext>>> contexts_;  // [rank][lane]
  std::vector<std::shared_ptr<DeviceWeightStore>> device_weights_;
  std::shared_ptr<NcclCommGroup> nccl_;              // with an all-to-all PrepareAndFinalize
  std::vector<std::unique_ptr<HostTransfer>> host_;  // multi-process only
};

}  // namespace

absl::StatusOr<std::unique_ptr<RankGroup>> CreateCudaRankGroup(const EnginePlan& plan,
                                                               const ProviderRegistry& registry) {
  if (plan.backend != Backend::kCuda) {
    return absl::InvalidArgumentError("the CUDA rank group serves backend cuda");
  }
  auto group = std::make_unique<CudaRankGroup>(plan);
  MOESERVE_RETURN_IF_ERROR(group->Build(registry));
  return group;
}

void RegisterCudaBackend(ProviderRegistry& registry) {
  RegisterCudaProviders(registry);
  BackendProvider cuda;
  cuda.backend = Backend::kCuda;
  cuda.visible_devices = CudaDeviceCount;
  cuda.create_rank_group = CreateCudaRankGroup;
  cuda.register_host_memory = CudaRegisterHostMemory;
  cuda.unregister_host_memory = CudaUnregisterHostMemory;
  cuda.open_ipc_region = OpenCudaIpcRegion;
  cuda.upload_host_pieces = CudaUploadHostPieces;
#ifdef MOESERVE_HAVE_NCCL
  cuda.new_collective_id = NcclCommGroup::NewUniqueId;
#endif
  (void)registry.Register(std::move(cuda));
}

}  // namespace moeserve
