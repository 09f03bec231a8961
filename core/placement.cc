#include "core/placement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moeserve {
namespace {

absl::Status CheckDivides(absl::string_view policy, int num_experts, int num_ranks) {
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement ", policy, ": num_ranks=", num_ranks,
                     " must be >= 1 and divide num_experts=", num_experts));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Placement> Placement::Contiguous(int num_experts, int num_ranks) {
  if (auto s = CheckDivides("contiguous", num_experts, num_ranks); !s.ok()) return s;
  const int per = num_experts / num_ranks;
  std::vector<std::vector<int>> lists(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    for (int i = 0; i < per; ++i) lists[r].push_back(r * per + i);
  }
  return FromRankExperts(num_experts, std::move(lists), "contiguous");
}

absl::StatusOr<Placement> Placement::RoundRobin(int num_experts, int num_ranks) {
  if (auto s = CheckDivides("round_robin", num_experts, num_ranks); !s.ok()) return s;
  std::vector<std::vector<int>> lists(num_ranks);
  for (int e = 0; e < num_experts; ++e) lists[e % num_ranks].push_back(e);
  return FromRankExperts(num_experts, std::move(lists), "round_robin");
}

absl::StatusOr<Placement> Placement::ByName(absl::string_view name, int num_experts,
                                            int num_ranks) {
  if (name == "contiguous") return Contiguous(num_experts, num_ranks);
  if (name == "round_robin") return RoundRobin(num_experts, num_ranks);
  return absl::InvalidArgumentError(
      absl::StrCat("placement: got '", name, "', expected contiguous or round_robin"));
}

absl::StatusOr<Placement> Placement::FromRankExperts(int num_experts,
                                                     std::vector<std::vector<int>> rank_experts,
                                                     std::string name) {
  if (num_experts < 1 || rank_experts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("placement: need num_experts >= 1 (got ",
                                                   num_experts, ") and at least one rank"));
  }
  Placement p;
  p.name_ = std::move(name);
  p.num_experts_ = num_experts;
  p.owner_.assign(num_experts, -1);
  p.local_index_.assign(num_experts, -1);
  for (size_t r = 0; r < rank_experts.size(); ++r) {
    if (rank_experts[r].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("placement: rank ", r, " hosts no expert"));
    }
    for (size_t i = 0; i < rank_experts[r].size(); ++i) {
      const int e = rank_experts[r][i];
      if (e < 0 || e >= num_experts) {
        return absl::InvalidArgumentError(absl::StrCat("placement: rank ", r, " lists expert ", e,
                                                       ", outside [0, ", num_experts, ")"));
      }
      if (p.owner_[e] != -1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "placement: expert ", e, " is listed by rank ", p.owner_[e], " and rank ", r));
      }
      p.owner_[e] = static_cast<int>(r);
      p.local_index_[e] = static_cast<int>(i);
    }
  }
  for (int e = 0; e < num_experts; ++e) {
    if (p.owner_[e] == -1) {
      return absl::InvalidArgumentError(
          absl::StrCat("placement: expert ", e, " is hosted by no rank"));
    }
  }
  p.rank_experts_ = std::move(rank_experts);
  return p;
}

int Placement::max_local_experts() const {
  size_t m = 0;
  for (const auto& l : rank_experts_) m = std::max(m, l.size());
  return static_cast<int>(m);
}

std::vector<int32_t> Placement::ExpertMap(int rank) const {
  std::vector<int32_t> map(num_experts_, -1);
  for (size_t i = 0; i < rank_experts_[rank].size(); ++i) {
    map[rank_experts_[rank][i]] = static_cast<int32_t>(i);
  }
  return map;
}

}  // namespace moeserve
