#include "core/ep_plan.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {
namespace {

// The one expert-id range check: ids index the placement's tables and per-expert counters.
absl::Status CheckExpertId(int32_t id, int64_t index, int64_t topk, const Placement& placement) {
  if (id >= 0 && id < placement.num_experts()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("expert id ", id, " at [", index / topk, ", ",
                                                 index % topk, "] outside [0, ",
                                                 placement.num_experts(), ")"));
}

}  // namespace

absl::Status ValidateEpPrepareArgs(absl::string_view who, const PrepareArgs& args,
                                   const Placement& placement, int rank) {
  MOESERVE_RETURN_IF_ERROR(CheckPrepareArgsLayout(who, args));
  if (args.num_experts != placement.num_experts() ||
      args.num_local_experts != placement.num_local_experts(rank)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " on rank ", rank, ": placement has ", placement.num_experts(),
                     " experts, ", placement.num_local_experts(rank), " local; forward has ",
                     args.num_experts, " and ", args.num_local_experts));
  }
  if (!args.expert_map.empty()) {
    bool same = args.expert_map.numel() == placement.num_experts();
    const int32_t* map = args.expert_map.data<int32_t>();
    for (int e = 0; same && e < placement.num_experts(); ++e) {
      same = map[e] == (placement.owner(e) == rank ? placement.local_index(e) : -1);
    }
    if (!same) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, " on rank ", rank, ": expert_map disagrees with the placement"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> PlanEpRounds(const int32_t* ids, int64_t num_tokens,
                                                  int64_t topk, const Placement& placement,
                                                  int64_t cap, bool bound_expert_rows) {
  std::vector<int64_t> bounds = {0};
  if (bound_expert_rows) {
    // Greedy: extend a round while its tokens and every expert's rows stay within cap.
    std::vector<int64_t> rows(placement.num_experts(), 0);
    std::vector<int32_t> touched;
    int64_t begin = 0;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int32_t* tok = ids + t * topk;
      for (int64_t k = 0; k < topk; ++k) {
        MOESERVE_RETURN_IF_ERROR(CheckExpertId(tok[k], t * topk + k, topk, placement));
      }
      bool fits = t - begin < cap;
      for (int64_t k = 0; k < topk; ++k) {
        const int32_t e = tok[k];
        const int64_t need = std::count(tok, tok + topk, e);
        if (need > cap) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "token ", t, " routes ", need, " times to expert ", e,
              ", more than max_num_tokens_per_rank=", cap, " rows per expert and rank"));
        }
        fits = fits && rows[e] + need <= cap;
      }
      if (!fits) {
        bounds.push_back(t);
        begin = t;
        for (int32_t e : touched) rows[e] = 0;
        touched.clear();
      }
      for (int64_t k = 0; k < topk; ++k) {
        if (rows[tok[k]]++ == 0) touched.push_back(tok[k]);
      }
    }
  } else {
    // Ids are not needed to chunk, but the whole forward is checked here, at its edge.
    for (int64_t i = 0; i < num_tokens * topk; ++i) {
      MOESERVE_RETURN_IF_ERROR(CheckExpertId(ids[i], i, topk, placement));
    }
    for (int64_t t = cap; t < num_tokens; t += cap) bounds.push_back(t);
  }
  if (num_tokens > 0) bounds.push_back(num_tokens);
  return bounds;
}

void PadEpRounds(int64_t rounds, std::vector<int64_t>* bounds) {
  const int64_t end = bounds->back();
  while (static_cast<int64_t>(bounds->size()) - 1 < rounds) bounds->push_back(end);
}

int64_t EpRouting::num_send() const {
  int64_t n = 0;
  for (int64_t c : send_count) n += c;
  return n;
}

bool EpRouting::StartsRecord(int64_t t, int64_t j) const {
  if (mode == EpDispatchMode::kPerRoute) return true;
  const int32_t* d = dest.data() + t * topk;
  return std::find(d, d + j, d[j]) == d + j;
}

absl::StatusOr<EpRouting> RouteEpTokens(const int32_t* ids, int64_t num_tokens, int64_t topk,
                                        const Placement& placement, EpDispatchMode mode) {
  EpRouting r;
  r.num_tokens = num_tokens;
  r.topk = topk;
  r.mode = mode;
  r.dest.resize(num_tokens * topk);
  for (int64_t i = 0; i < num_tokens * topk; ++i) {
    MOESERVE_RETURN_IF_ERROR(CheckExpertId(ids[i], i, topk, placement));
    r.dest[i] = placement.owner(ids[i]);
  }
  r.send_count.assign(placement.num_ranks(), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      if (r.StartsRecord(t, j)) ++r.send_count[r.dest[t * topk + j]];
    }
  }
  return r;
}

EpPlanLayout EpPlanLayout::For(int64_t num_send, int64_t num_tokens, int64_t topk) {
  EpPlanLayout l;
  l.send_token = 0;
  l.rec_ids = num_send;
  l.rec_weights = l.rec_ids + num_send * topk;
  l.comb_offsets = l.rec_weights + num_send * topk;
  l.comb_slots = l.comb_offsets + num_tokens + 1;
  l.words = l.comb_slots + num_send;
  return l;
}

int64_t EpDispatchPlan::num_recv() const {
  int64_t n = 0;
  for (int64_t c : recv_count) n += c;
  return n;
}

EpDispatchPlan FillEpDispatchPlan(const EpRouting& routing, const int32_t* ids,
                                  const float* weights, const Placement& placement, void* block) {
  const int64_t m = routing.num_tokens, topk = routing.topk;
  EpDispatchPlan plan;
  plan.num_src_tokens = m;
  plan.topk = topk;
  plan.send_count = routing.send_count;
  plan.num_send_ = routing.num_send();
  plan.layout_ = EpPlanLayout::For(plan.num_send_, m, topk);
  if (block != nullptr) {
    plan.external_ = static_cast<std::byte*>(block);
  } else {
    plan.owned_.resize(static_cast<size_t>(plan.layout_.words) * 4);
  }
  std::byte* base = plan.external_ != nullptr ? plan.external_ : plan.owned_.data();
  int32_t* words = reinterpret_cast<int32_t*>(base);
  int32_t* send_token = words + plan.layout_.send_token;
  int32_t* rec_ids = words + plan.layout_.rec_ids;
  float* rec_w = reinterpret_cast<float*>(base) + plan.layout_.rec_weights;
  int32_t* comb_off = words + plan.layout_.comb_offsets;
  int32_t* comb_slots = words + plan.layout_.comb_slots;

  const bool per_route = routing.mode == EpDispatchMode::kPerRoute;
  const int world = static_cast<int>(routing.send_count.size());
  std::vector<int64_t> slot(world, 0);
  for (int64_t d = 0, total = 0; d < world; ++d) slot[d] = total, total += routing.send_count[d];
  std::fill(comb_off, comb_off + m + 1, 0);
  for (int64_t t = 0; t < m; ++t) {
    const int32_t* dest = routing.dest.data() + t * topk;
    for (int64_t j = 0; j < topk; ++j) {
      if (!routing.StartsRecord(t, j)) continue;
      const int d = dest[j];
      const int64_t s = slot[d]++;
      send_token[s] = static_cast<int32_t>(t);
      ++comb_off[t + 1];
      for (int64_t i = 0; i < topk; ++i) {
        const bool in = per_route ? i == j : dest[i] == d;
        rec_ids[s * topk + i] = in ? placement.local_index(ids[t * topk + i]) : -1;
        rec_w[s * topk + i] = weights[t * topk + i];
      }
    }
  }
  for (int64_t t = 0; t < m; ++t) comb_off[t + 1] += comb_off[t];
  // Each token's slots in ascending slot order = ascending destination rank.
  std::vector<int32_t> fill(comb_off, comb_off + m);
  for (int64_t s = 0; s < plan.num_send_; ++s) {
    comb_slots[fill[send_token[s]]++] = static_cast<int32_t>(s);
  }
  return plan;
}

absl::StatusOr<EpDispatchPlan> BuildEpDispatchPlan(const int32_t* ids, const float* weights,
                                                   int64_t num_tokens, int64_t topk,
                                                   const Placement& placement,
                                                   EpDispatchMode mode) {
  MOESERVE_ASSIGN_OR_RETURN(const EpRouting routing,
                            RouteEpTokens(ids, num_tokens, topk, placement, mode));
  return FillEpDispatchPlan(routing, ids, weights, placement, /*block=*/nullptr);
}

MoeProblem EpRecvProblem(const PrepareArgs& args, const EpDispatchPlan& plan,
                         int64_t max_num_tokens) {
  return MoeProblem{.num_tokens = plan.num_recv(),
                    .hidden = args.hidden_states.dim(1),
                    .intermediate = args.intermediate,
                    .topk = plan.topk,
                    .num_experts = args.num_experts,
                    .num_local_experts = args.num_local_experts,
                    .max_num_tokens = max_num_tokens};
}

EpAllToAllVBytes::EpAllToAllVBytes(absl::Span<const int64_t> send, absl::Span<const int64_t> recv,
                                   int64_t unit_bytes)
    : send_counts(send.size()),
      send_displs(send.size()),
      recv_counts(recv.size()),
      recv_displs(recv.size()) {
  int64_t so = 0, ro = 0;
  for (size_t p = 0; p < send.size(); ++p) {
    send_counts[p] = send[p] * unit_bytes, send_displs[p] = so, so += send_counts[p];
  }
  for (size_t p = 0; p < recv.size(); ++p) {
    recv_counts[p] = recv[p] * unit_bytes, recv_displs[p] = ro, ro += recv_counts[p];
  }
}

void EpAllToAllVBytes::CountPeerBytes(int self, int64_t* sent, int64_t* received) const {
  for (int p = 0; p < static_cast<int>(send_counts.size()); ++p) {
    if (p != self) *sent += send_counts[p], *received += recv_counts[p];
  }
}

absl::Status PrefixEpStatus(absl::string_view who, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(who, ": ", status.message()));
}

}  // namespace moeserve
