#include "core/rank_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

void RankGroup::StartThreads() {
  if (ranks_.size() > 1) threads_ = std::make_unique<RankThreads>(static_cast<int>(ranks_.size()));
}

absl::Status RankGroup::Run(const ForwardStep& step) {
  return RunOnEveryRank([&](int local) { return RunRank(local, step); });
}

absl::Status RankGroup::RunOnEveryRank(const std::function<absl::Status(int local)>& fn) {
  auto rank_step = [&](int local) {
    absl::Status s = fn(local);
    // Peers blocked in a collective waiting for this rank give up; an agreed failure (every
    // rank stopped at the same point) leaves no collective waiting.
    if (!s.ok() && !IsAgreedStepFailure(s)) AbortPeers(s);
    return s;
  };
  std::vector<absl::Status> statuses;
  if (threads_ != nullptr) {
    statuses = threads_->Run(rank_step);
  } else {
    statuses.push_back(rank_step(0));
  }
  absl::Status root_cause = absl::OkStatus();
  for (size_t i = 0; i < statuses.size(); ++i) {
    const absl::Status& s = statuses[i];
    if (s.ok()) continue;
    // Prefer the root cause over the peers' ABORTED echoes.
    if (root_cause.ok() || (root_cause.code() == absl::StatusCode::kAborted &&
                            s.code() != absl::StatusCode::kAborted)) {
      if (plan_.world_size == 1) {
        root_cause = s;
      } else {
        root_cause = absl::Status(
            s.code(), absl::StrCat("rank ", first_rank() + static_cast<int>(i), ": ", s.message()));
        s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
          root_cause.SetPayload(url, payload);
        });
      }
    }
  }
  if (!root_cause.ok()) AfterFailedStep(root_cause);
  return root_cause;
}

absl::Status RankGroup::ForwardSlice(int local, int layer, const TensorView& hidden_states,
                                     const TensorView& topk_ids, const TensorView& topk_weights,
                                     const TensorView& out, bool timed, int lane, StopLatch* stop) {
  Rank& rank = ranks_[local];
  ModularKernelArgs args;
  args.hidden_states = hidden_states;
  args.topk_ids = topk_ids;
  args.topk_weights = topk_weights;
  args.layer = layer;
  args.weights = rank.weights->layer(layer);
  args.stop = stop;
  args.num_experts = plan_.model.num_experts;
  args.expert_map = TensorView(rank.expert_map.data(), DType::kINT32,
                               {static_cast<int64_t>(rank.expert_map.size())});
  if (args.weights == nullptr) {
    return absl::InternalError(
        absl::StrCat("rank ", first_rank() + local, " has no weights for layer ", layer));
  }
  if (lane < 0 || lane >= static_cast<int>(rank.kernels.size())) {
    return absl::InternalError(absl::StrCat("lane ", lane, " of ", rank.kernels.size()));
  }
  if (rank.timings.size() != rank.kernels.size()) rank.timings.resize(rank.kernels.size());
  return rank.kernels[lane]->Forward(args, out, timed ? &rank.timings[lane] : nullptr);
}

TensorView RankGroup::OutputBuffer(int local, int64_t rows, DType dtype) {
  return ranks_[local].out.Get(dtype, {rows, plan_.model.hidden});
}

absl::Status RankGroup::RunRank(int local, const ForwardStep& step) {
  const int r = first_rank() + local;
  if (plan_.fault_injection_for_testing) {
    MOESERVE_RETURN_IF_ERROR(plan_.fault_injection_for_testing(r));
  }
  const int64_t begin = step.bounds[r], end = step.bounds[r + 1];
  return ForwardSlice(local, step.layer, step.hidden_states.Slice(begin, end),
                      step.topk_ids.Slice(begin, end), step.topk_weights.Slice(begin, end),
                      step.output.Slice(begin, end), step.timed, step.lane, step.stop);
}

GraphStats RankGroup::graph_stats() const {
  GraphStats sum;
  for (const Rank& rank : ranks_) {
    for (const auto& kernel : rank.kernels) {
      const GraphStats s = kernel->graph_stats();
      sum.replays += s.replays;
      sum.captures += s.captures;
      sum.eager += s.eager;
      sum.graphs += s.graphs;
      if (sum.disabled_reason.empty()) sum.disabled_reason = s.disabled_reason;
    }
  }
  return sum;
}

int64_t RankGroup::graph_max_tokens() const {
  int64_t most = 0;
  for (const Rank& rank : ranks_) {
    for (const auto& kernel : rank.kernels) most = std::max(most, kernel->graph_max_tokens());
  }
  return most;
}

absl::Status RankGroup::health() const {
  std::lock_guard<std::mutex> lock(health_mu_);
  return health_;
}

void RankGroup::MarkUnhealthy(absl::Status cause) {
  std::lock_guard<std::mutex> lock(health_mu_);
  health_ = std::move(cause);
}

absl::Status RankGroup::Recover() {
  std::lock_guard<std::mutex> lock(health_mu_);
  health_ = absl::OkStatus();
  return absl::OkStatus();
}

}  // namespace moeserve
