// Which rank hosts which expert.
//
// A Placement is an immutable value: per rank, the global expert ids it hosts in local-index
// order, plus the derived inverse (owner rank and local index of every expert) and vLLM's
// expert_map (per rank, global id -> local index or -1). Built-in policies are "contiguous"
// (rank r owns [r*E/R, (r+1)*E/R)) and "round_robin" (rank r owns r, r+R, r+2R, ...). An
// explicit per-rank list (FromRankExperts) is the seam for rebalancing from observed expert
// load (EPLB) later; every expert must then be hosted exactly once (no replicas yet).
#ifndef MOESERVE_CORE_PLACEMENT_H_
#define MOESERVE_CORE_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moeserve {

class Placement {
 public:
  // num_ranks must divide num_experts.
  static absl::StatusOr<Placement> Contiguous(int num_experts, int num_ranks);
  static absl::StatusOr<Placement> RoundRobin(int num_experts, int num_ranks);
  // `name`: "contiguous" or "round_robin"; INVALID_ARGUMENT otherwise.
  static absl::StatusOr<Placement> ByName(absl::string_view name, int num_experts, int num_ranks);
  // Explicit lists (e.g. from a load balancer). Ranks may host different numbers of experts,
  // at least one each; every expert in [0, num_experts) exactly once.
  static absl::StatusOr<Placement> FromRankExperts(int num_experts,
                                                   std::vector<std::vector<int>> rank_experts,
                                                   std::string name = "custom");

  const std::string& name() const { return name_; }
  int num_experts() const { return num_experts_; }
  int num_ranks() const { return static_cast<int>(rank_experts_.size()); }
  // Global ids hosted by `rank`, in local-index order.
  const std::vector<int>& rank_experts(int rank) const { return rank_experts_[rank]; }
  const std::vector<std::vector<int>>& all_rank_experts() const { return rank_experts_; }
  int num_local_experts(int rank) const { return static_cast<int>(rank_experts_[rank].size()); }
  int max_local_experts() const;
  int owner(int expert) const { return owner_[expert]; }
  int local_index(int expert) const { return local_index_[expert]; }
  // [num_experts] global id -> local index on `rank`, or -1 (vLLM's expert_map).
  std::vector<int32_t> ExpertMap(int rank) const;

 private:
  Placement() = default;
  std::string name_;
  int num_experts_ = 0;
  std::vector<std::vector<int>> rank_experts_;
  std::vector<int> owner_;
  std::vector<int> local_index_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_PLACEMENT_H_
