// The host-side expert-parallel (EP) routing plan shared by the all-to-all PrepareAndFinalize
// implementations (core/cpu/all_to_all_prepare_finalize.h on host memory,
// core/cuda/nccl_all_to_all.h on GPUs): pure functions of the routing (topk ids, weights) and
// the Placement, with no communicator and no device.
//
//  - ValidateEpPrepareArgs: the shape / dtype / placement preconditions, checked once per
//    forward at the PrepareAndFinalize's edge (PlanChunks).
//  - PlanEpRounds: a forward's local round boundaries (the chunking). The PrepareAndFinalize
//    agrees on the number of rounds with its peers and pads with PadEpRounds.
//  - RouteEpTokens + FillEpDispatchPlan (or BuildEpDispatchPlan, both at once): one round's
//    dispatch plan, the records per destination rank and the combine order, which Prepare
//    hands to Finalize as PreparedActivations::handle (DeepEP's layout tensors).
//
// Records: each source token is sent once per destination rank hosting at least one of its
// experts (kPerRank), or once per route (kPerRoute, to measure what deduplication saves). Send
// slots are grouped by destination rank, tokens ascending within each; a record carries the
// topk local expert ids on its rank (-1 elsewhere) and the token's topk router weights. The
// combine sums each token's partials in ascending slot order = ascending rank order, which
// keeps results deterministic and equal between the CPU and GPU implementations.
//
// Expert ids are range-checked (INVALID_ARGUMENT) where these functions first use them as
// indices, inside the passes that read them anyway, so no caller can index out of bounds.
// All functions are thread-compatible (no shared state).
#ifndef MOESERVE_CORE_EP_PLAN_H_
#define MOESERVE_CORE_EP_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/modular_kernel.h"
#include "core/placement.h"

namespace moeserve {

enum class EpDispatchMode { kPerRank, kPerRoute };

// INVALID_ARGUMENT unless hidden_states is [M, K], topk_ids contiguous INT32 [M, topk],
// topk_weights contiguous FP32 [M, topk], num_experts / num_local_experts match `placement` on
// `rank`, and expert_map (if given) is the placement's for `rank`. Messages start with `who`.
// O(num_experts); expert ids are not scanned here.
absl::Status ValidateEpPrepareArgs(absl::string_view who, const PrepareArgs& args,
                                   const Placement& placement, int rank);

// Local round boundaries {0, b1, ..., num_tokens} ({0} for no tokens) such that no round has
// more than `max_tokens_per_rank` tokens and, if `bound_expert_rows`, no expert gets more than
// `max_tokens_per_rank` routes from this rank in one round (greedy: a round grows while both
// fit). topk_ids: [num_tokens, topk] global ids. INVALID_ARGUMENT for an id outside
// [0, num_experts); RESOURCE_EXHAUSTED if one token alone routes more than max_tokens_per_rank
// times to one expert (bounded only).
absl::StatusOr<std::vector<int64_t>> PlanEpRounds(const int32_t* topk_ids, int64_t num_tokens,
                                                  int64_t topk, const Placement& placement,
                                                  int64_t max_tokens_per_rank,
                                                  bool bound_expert_rows);

// Pads `bounds` (from PlanEpRounds) with empty rounds at its end to `rounds` rounds, the count
// every rank agreed on. Requires rounds >= bounds->size() - 1.
void PadEpRounds(int64_t rounds, std::vector<int64_t>* bounds);

// One round's routes: the owner rank of each route and the records per destination rank.
struct EpRouting {
  int64_t num_tokens = 0;
  int64_t topk = 0;
  EpDispatchMode mode = EpDispatchMode::kPerRank;
  std::vector<int32_t> dest;        // [num_tokens * topk] owner rank of each route
  std::vector<int64_t> send_count;  // [num_ranks] records per destination rank
  int64_t num_send() const;
  // Whether route (t, j) starts a record: always per route; per rank, if it is token t's first
  // route to its rank.
  bool StartsRecord(int64_t t, int64_t j) const;
};

// First pass over one round's ids (also what a PrepareAndFinalize announces to its peers
// before the records exist). INVALID_ARGUMENT for an id outside [0, num_experts).
absl::StatusOr<EpRouting> RouteEpTokens(const int32_t* topk_ids, int64_t num_tokens, int64_t topk,
                                        const Placement& placement, EpDispatchMode mode);

// Word offsets of a plan's arrays in its block of 4-byte words, the layout the device kernels
// read (kernels/cuda/ep_pack.cuh): [send_token S | rec_ids S*topk | rec_weights S*topk (FP32) |
// comb_offsets M+1 | comb_slots S], S = send slots, M = source tokens.
struct EpPlanLayout {
  static EpPlanLayout For(int64_t num_send, int64_t num_tokens, int64_t topk);
  int64_t send_token = 0, rec_ids = 0, rec_weights = 0, comb_offsets = 0, comb_slots = 0;
  int64_t words = 0;  // total
};

// One round's dispatch plan, the handle Prepare passes to Finalize. Move-only; the arrays live
// in the plan's own storage or in the caller's block (see FillEpDispatchPlan).
class EpDispatchPlan : public DispatchHandle {
 public:
  EpDispatchPlan() = default;
  EpDispatchPlan(EpDispatchPlan&&) = default;
  EpDispatchPlan& operator=(EpDispatchPlan&&) = default;
  EpDispatchPlan(const EpDispatchPlan&) = delete;
  EpDispatchPlan& operator=(const EpDispatchPlan&) = delete;

  int64_t num_src_tokens = 0;  // M
  int64_t topk = 0;
  std::vector<int64_t> send_count;  // [num_ranks] records per destination rank
  // [num_ranks] records per source rank: filled by the PrepareAndFinalize after its count
  // exchange (empty before).
  std::vector<int64_t> recv_count;

  int64_t num_send() const { return num_send_; }
  int64_t num_recv() const;
  const EpPlanLayout& layout() const { return layout_; }
  // Source token of each send slot; slots grouped by destination rank, tokens ascending.
  absl::Span<const int32_t> send_token() const { return Words<int32_t>(layout_.send_token, S()); }
  // [S, topk] local expert id on the slot's destination rank, or -1.
  absl::Span<const int32_t> rec_ids() const { return Words<int32_t>(layout_.rec_ids, S() * topk); }
  // [S, topk] the token's router weights.
  absl::Span<const float> rec_weights() const {
    return Words<float>(layout_.rec_weights, S() * topk);
  }
  // [M + 1] token t's slots are comb_slots[comb_offsets[t] .. comb_offsets[t + 1]).
  absl::Span<const int32_t> comb_offsets() const {
    return Words<int32_t>(layout_.comb_offsets, num_src_tokens + 1);
  }
  // [S] each token's slots, ascending (= ascending destination rank).
  absl::Span<const int32_t> comb_slots() const { return Words<int32_t>(layout_.comb_slots, S()); }
  // The whole block (layout().words 4-byte words), for one copy to the device.
  const void* block() const { return base(); }

 private:
  friend EpDispatchPlan FillEpDispatchPlan(const EpRouting&, const int32_t*, const float*,
                                           const Placement&, void*);
  size_t S() const { return static_cast<size_t>(num_send_); }
  const std::byte* base() const { return external_ != nullptr ? external_ : owned_.data(); }
  template <typename T>
  absl::Span<const T> Words(int64_t offset, size_t n) const {
    return absl::MakeConstSpan(reinterpret_cast<const T*>(base()) + offset, n);
  }

  int64_t num_send_ = 0;
  EpPlanLayout layout_;
  std::byte* external_ = nullptr;  // the caller's block, if any
  std::vector<std::byte> owned_;
};

// Second pass: the plan of the round `routing` came from (same topk_ids; topk_weights
// [num_tokens, topk]). `block`: EpPlanLayout::For(routing.num_send(), ...).words 4-byte words,
// 4-byte aligned, that must outlive the plan (e.g. pinned staging memory for the device copy);
// null: the plan owns its storage. recv_count stays empty.
EpDispatchPlan FillEpDispatchPlan(const EpRouting& routing, const int32_t* topk_ids,
                                  const float* topk_weights, const Placement& placement,
                                  void* block);

// RouteEpTokens + FillEpDispatchPlan into plan-owned storage.
absl::StatusOr<EpDispatchPlan> BuildEpDispatchPlan(const int32_t* topk_ids,
                                                   const float* topk_weights, int64_t num_tokens,
                                                   int64_t topk, const Placement& placement,
                                                   EpDispatchMode mode);

// The sizes Experts see on the expert rank after the dispatch of `plan` (its recv_count
// filled) for the forward `args`; max_num_tokens as the activation format defines it.
MoeProblem EpRecvProblem(const PrepareArgs& args, const EpDispatchPlan& plan,
                         int64_t max_num_tokens);

// Byte counts and displacements of one all-to-all-v (Communicator::AllToAllV) that sends
// send[p] units to and receives recv[p] units from each rank p, packed in rank order. The
// dispatch sends (plan.send_count, plan.recv_count); the combine is its reverse.
struct EpAllToAllVBytes {
  EpAllToAllVBytes(absl::Span<const int64_t> send, absl::Span<const int64_t> recv,
                   int64_t unit_bytes);
  // Adds the bytes exchanged with ranks other than `self` (its own share is a local copy).
  void CountPeerBytes(int self, int64_t* sent, int64_t* received) const;
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
};

// `status` with its message prefixed by "`who`: " (plan errors name no implementation).
absl::Status PrefixEpStatus(absl::string_view who, const absl::Status& status);

}  // namespace moeserve

#endif  // MOESERVE_CORE_EP_PLAN_H_
