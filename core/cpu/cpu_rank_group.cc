#include "core/cpu/cpu_rank_group.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/comm/in_process_communicator.h"
#include "core/status_macros.h"
#include "core/weight_loader.h"

namespace moeserve {
namespace {

class CpuRankGroup final : public RankGroup {
 public:
  explicit CpuRankGroup(const EnginePlan& plan) : RankGroup(plan) {}

  absl::Status Build(const ProviderRegistry& registry) {
    const PrepareFinalizeProvider* pf = registry.FindPrepareFinalize(plan_.prepare_finalize);
    const ExpertsProvider* experts = registry.FindExperts(plan_.experts);
    if (pf == nullptr || experts == nullptr) {
      return absl::InternalError("the plan names providers the registry does not have");
    }
    const int n = plan_.local_ranks;
    if (n > 1 || pf->supports_ep) {
      MOESERVE_ASSIGN_OR_RETURN(group_, InProcessCommGroup::Create(n, plan_.collective_timeout));
    }
    ranks_.resize(n);
    comms_.resize(n);
    for (int r = 0; r < n; ++r) {
      Rank& rank = ranks_[r];
      RankResources resources;
      resources.rank = r;
      if (group_) resources.comm = comms_[r] = group_->MakeCommunicator(r);
      MOESERVE_ASSIGN_OR_RETURN(
          rank.weights, LoadExpertWeights(plan_.weights, plan_.model,
                                          plan_.placement->rank_experts(plan_.first_rank + r),
                                          plan_.first_rank + r));
      rank.expert_map = plan_.placement->ExpertMap(r);
      // Lanes (plan_.lanes > 1 only without collectives): a kernel each, same weights.
      for (int lane = 0; lane < plan_.lanes; ++lane) {
        MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<PrepareAndFinalize> prepare_finalize,
                                  pf->create(plan_, resources));
        MOESERVE_ASSIGN_OR_RETURN(std::unique_ptr<Experts> expert_impl,
                                  experts->create(plan_, resources));
        MOESERVE_ASSIGN_OR_RETURN(
            std::unique_ptr<ModularKernel> kernel,
            ModularKernel::Create(std::move(prepare_finalize), std::move(expert_impl)));
        rank.kernels.push_back(std::move(kernel));
      }
      rank.timings.resize(plan_.lanes);
    }
    StartThreads();
    return absl::OkStatus();
  }

  int num_local_ranks() const override { return static_cast<int>(ranks_.size()); }

 protected:
  // The leader writes its slice in place; the others send theirs to it.
  absl::Status RunRank(int r, const ForwardStep& step) override {
    if (ranks_.size() == 1) return RankGroup::RunRank(r, step);
    if (r == 0) return RunLeader(step);
    if (plan_.fault_injection_for_testing) {
      MOESERVE_RETURN_IF_ERROR(plan_.fault_injection_for_testing(r));
    }
    const int64_t begin = step.bounds[r], end = step.bounds[r + 1];
    const TensorView out = OutputBuffer(r, end - begin, step.output.dtype());
    MOESERVE_RETURN_IF_ERROR(ForwardSlice(
        r, step.layer, step.hidden_states.Slice(begin, end), step.topk_ids.Slice(begin, end),
        step.topk_weights.Slice(begin, end), out, step.timed, step.lane, step.stop));
    return Gather(r, step, out);
  }

  void AbortPeers(const absl::Status& cause) override {
    if (group_) group_->Abort(cause);
  }
  // Every rank thread has returned: no collective is in flight.
  void AfterFailedStep(const absl::Status&) override {
    if (group_) group_->Reset();
  }

 private:
  // The output slices to the leader (rank 0 receives, the others send).
  absl::Status Gather(int r, const ForwardStep& step, const TensorView& out) {
    const int world = static_cast<int>(ranks_.size());
    const int64_t row_bytes =
        plan_.model.hidden * static_cast<int64_t>(DTypeSize(step.output.dtype()));
    std::vector<int64_t> send_counts(world, 0), send_displs(world, 0), recv_counts(world, 0),
        recv_displs(world, 0);
    if (r != 0) {
      send_counts[0] = (step.bounds[r + 1] - step.bounds[r]) * row_bytes;
    } else {
      for (int p = 1; p < world; ++p) {
        recv_counts[p] = (step.bounds[p + 1] - step.bounds[p]) * row_bytes;
        recv_displs[p] = step.bounds[p] * row_bytes;
      }
    }
    return comms_[r]->AllToAllV(out.raw_data(), send_counts, send_displs, step.output.raw_data(),
                                recv_counts, recv_displs);
  }

  absl::Status RunLeader(const ForwardStep& step) {
    MOESERVE_RETURN_IF_ERROR(RankGroup::RunRank(0, step));
    return Gather(0, step, step.output.Slice(step.bounds[0], step.bounds[1]));
  }

  std::shared_ptr<InProcessCommGroup> group_;  // null with one rank and no-EP
  std::vector<std::shared_ptr<Communicator>> comms_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RankGroup>> CreateCpuRankGroup(const EnginePlan& plan,
                                                              const ProviderRegistry& registry) {
  if (plan.backend != Backend::kCpu || plan.multi_process) {
    return absl::InvalidArgumentError("the CPU rank group serves backend cpu in one process");
  }
  auto group = std::make_unique<CpuRankGroup>(plan);
  MOESERVE_RETURN_IF_ERROR(group->Build(registry));
  return group;
}

void RegisterCpuBackend(ProviderRegistry& registry) {
  RegisterCpuProviders(registry);
  BackendProvider cpu;
  cpu.backend = Backend::kCpu;
  cpu.create_rank_group = CreateCpuRankGroup;
  (void)registry.Register(std::move(cpu));
}

}  // namespace moeserve
