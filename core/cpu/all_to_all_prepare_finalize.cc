#include "core/cpu/all_to_all_prepare_finalize.h"

#include <algorithm>
#include <cassert>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

AllToAllPrepareAndFinalizeBase::AllToAllPrepareAndFinalizeBase(
    std::shared_ptr<Communicator> comm, std::shared_ptr<const Placement> placement,
    AllToAllOptions options)
    : comm_(std::move(comm)), placement_(std::move(placement)), options_(options) {}

absl::StatusOr<std::vector<int64_t>> AllToAllPrepareAndFinalizeBase::PlanChunks(
    const PrepareArgs& args) {
  // The edge of a forward: validated once here, Prepare gets its rounds.
  MOESERVE_RETURN_IF_ERROR(ValidateEpPrepareArgs(name(), args, *placement_, rank()));
  absl::StatusOr<std::vector<int64_t>> bounds =
      PlanEpRounds(args.topk_ids.data<int32_t>(), args.topk_ids.dim(0), args.topk_ids.dim(1),
                   *placement_, options_.max_num_tokens_per_rank, bounded_expert_rows());
  if (!bounds.ok()) return PrefixEpStatus(name(), bounds.status());
  // Every rank runs the same number of rounds.
  const int64_t mine = static_cast<int64_t>(bounds->size()) - 1;
  std::vector<int64_t> all;
  MOESERVE_RETURN_IF_ERROR(AllGatherCounts(*comm_, absl::MakeConstSpan(&mine, 1), &all));
  MOESERVE_RETURN_IF_ERROR(CheckGatheredCounts(all, comm_->world_size(), options_.max_rounds,
                                               absl::StrCat(name(), " rounds")));
  PadEpRounds(std::max<int64_t>(1, *std::max_element(all.begin(), all.end())), &*bounds);
  return bounds;
}

absl::StatusOr<std::shared_ptr<EpDispatchPlan>> AllToAllPrepareAndFinalizeBase::Dispatch(
    const PrepareArgs& args) {
  const TensorView& x = args.hidden_states;
  // Preconditions (ValidateEpPrepareArgs in PlanChunks): a round of a validated forward.
  assert(x.rank() == 2 && args.topk_ids.rank() == 2 && args.topk_ids.dim(0) == x.dim(0) &&
         args.topk_weights.shape() == args.topk_ids.shape());
  const int world = comm_->world_size(), me = comm_->rank();
  const int64_t m = x.dim(0), k = x.dim(1), topk = args.topk_ids.dim(1);
  if (m > options_.max_num_tokens_per_rank) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name(), ": ", m, " tokens exceed max_num_tokens_per_rank=",
                     options_.max_num_tokens_per_rank, " in one round (use PlanChunks)"));
  }
  // Quantization hook, before dispatch.
  const DType act = options_.quant.activation_dtype;
  TensorView a = x;
  if (x.dtype() != act || !x.is_contiguous()) {
    a = a1q_src_.Get(act, {m, k});
    MOESERVE_RETURN_IF_ERROR(ConvertTensor(x, a));
  }
  const int64_t row_bytes = k * static_cast<int64_t>(DTypeSize(act));
  record_bytes_ = row_bytes + topk * 8;

  absl::StatusOr<EpDispatchPlan> built =
      BuildEpDispatchPlan(args.topk_ids.data<int32_t>(), args.topk_weights.data<float>(), m, topk,
                          *placement_, options_.dispatch);
  if (!built.ok()) return PrefixEpStatus(name(), built.status());
  auto plan = std::make_shared<EpDispatchPlan>(*std::move(built));
  // Records in send-slot order: grouped by destination rank, tokens ascending.
  const int64_t num_send = plan->num_send();
  send_.resize(static_cast<size_t>(num_send * record_bytes_));
  for (int64_t s = 0; s < num_send; ++s) {
    std::byte* rec = send_.data() + s * record_bytes_;
    std::memcpy(rec, a.data<std::byte>() + plan->send_token()[s] * row_bytes, row_bytes);
    std::memcpy(rec + row_bytes, plan->rec_ids().data() + s * topk, topk * 4);
    std::memcpy(rec + row_bytes + topk * 4, plan->rec_weights().data() + s * topk, topk * 4);
  }

  // Per-peer counts, then the records.
  std::vector<int64_t> all;
  MOESERVE_RETURN_IF_ERROR(AllGatherCounts(*comm_, plan->send_count, &all));
  // A rank sends a peer at most one record per route of its round.
  MOESERVE_RETURN_IF_ERROR(
      CheckGatheredCounts(all, world, options_.max_num_tokens_per_rank * topk, name()));
  plan->recv_count.assign(world, 0);
  for (int s = 0; s < world; ++s) plan->recv_count[s] = all[s * world + me];
  const int64_t num_recv = plan->num_recv();
  recv_.resize(static_cast<size_t>(num_recv * record_bytes_));
  const EpAllToAllVBytes bytes(plan->send_count, plan->recv_count, record_bytes_);
  bytes.CountPeerBytes(me, &stats_.dispatch_bytes_sent, &stats_.dispatch_bytes_received);
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllV(send_.data(), bytes.send_counts, bytes.send_displs,
                                            recv_.data(), bytes.recv_counts, bytes.recv_displs));

  // The records' ids and weights, [M_recv, topk].
  TensorView rids = recv_ids_.Get(DType::kINT32, {num_recv, topk});
  TensorView rw = recv_weights_.Get(DType::kFP32, {num_recv, topk});
  for (int64_t i = 0; i < num_recv; ++i) {
    std::memcpy(rids.data<int32_t>() + i * topk, record(i) + row_bytes, topk * 4);
    std::memcpy(rw.data<float>() + i * topk, record(i) + row_bytes + topk * 4, topk * 4);
  }
  return plan;
}

absl::Status AllToAllPrepareAndFinalizeBase::Finalize(
    const TensorView& output, const TensorView& fused_expert_output,
    const PreparedActivations& prepared, const TopKWeightAndReduce& weight_and_reduce) {
  const auto* plan = dynamic_cast<const EpDispatchPlan*>(prepared.handle.get());
  if (plan == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": Finalize needs the PreparedActivations of its own Prepare"));
  }
  const int me = comm_->rank();
  const int64_t k = prepared.problem.hidden, m = plan->num_src_tokens;
  const int64_t num_recv = plan->num_recv();
  if (output.rank() != 2 || output.dtype() != DType::kFP32 || output.dim(0) != m ||
      output.dim(1) != k || !output.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": output must be FP32 [", m, ", ", k,
                                                   "], got ", output.DebugString()));
  }
  // Weight-and-reduce on the expert rank: one partial row per received record.
  TensorView partial;
  if (weight_and_reduce.kind() == TopKWeightAndReduce::Kind::kNoOp &&
      fused_expert_output.shape() == Shape{num_recv, k} && fused_expert_output.is_contiguous()) {
    partial = fused_expert_output;
  } else {
    partial = partial_.Get(DType::kFP32, {num_recv, k});
    const std::unique_ptr<TopKWeightAndReduce> resolved =
        weight_and_reduce.kind() == TopKWeightAndReduce::Kind::kDelegate
            ? MakeTopKWeightAndReduce(
                  ResolveWeightAndReduce(weight_and_reduce.kind(), activation_format()))
            : nullptr;
    MOESERVE_RETURN_IF_ERROR(
        (resolved ? *resolved : weight_and_reduce)
            .Apply(partial, fused_expert_output, prepared.topk_weights, prepared.topk_ids));
  }
  // Combine: partials go back to their source ranks (the reverse of the dispatch).
  combine_recv_.resize(static_cast<size_t>(plan->num_send() * k));
  const EpAllToAllVBytes bytes(plan->recv_count, plan->send_count,
                               k * static_cast<int64_t>(sizeof(float)));
  bytes.CountPeerBytes(me, &stats_.combine_bytes_sent, &stats_.combine_bytes_received);
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllV(partial.raw_data(), bytes.send_counts,
                                            bytes.send_displs, combine_recv_.data(),
                                            bytes.recv_counts, bytes.recv_displs));
  // Each token sums its partials from 0 in ascending rank order (as the device's
  // EpCombineReduce does with the same offsets and slots).
  float* out = output.data<float>();
  const absl::Span<const int32_t> off = plan->comb_offsets(), slots = plan->comb_slots();
  for (int64_t t = 0; t < m; ++t) {
    float* o = out + t * k;
    std::fill(o, o + k, 0.0f);
    for (int32_t j = off[t]; j < off[t + 1]; ++j) {
      const float* p = combine_recv_.data() + static_cast<int64_t>(slots[j]) * k;
      for (int64_t h = 0; h < k; ++h) o[h] += p[h];
    }
  }
  return absl::OkStatus();
}

absl::Status AllToAllContiguousPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                           PreparedActivations* out) {
  MOESERVE_ASSIGN_OR_RETURN(std::shared_ptr<EpDispatchPlan> plan, Dispatch(args));
  const int64_t hidden = args.hidden_states.dim(1), topk = plan->topk;
  const int64_t num_recv = plan->num_recv();
  const DType act = options_.quant.activation_dtype;
  const int64_t row_bytes = hidden * static_cast<int64_t>(DTypeSize(act));
  TensorView a1q = a1q_.Get(act, {num_recv, hidden});
  for (int64_t i = 0; i < num_recv; ++i) {
    std::memcpy(a1q.data<std::byte>() + i * row_bytes, record(i), row_bytes);
  }
  out->format = ActivationFormat::kStandard;
  out->a1q = a1q;
  out->a1q_scale = TensorView();
  out->topk_ids = recv_ids_.Get(DType::kINT32, {num_recv, topk});
  out->topk_weights = recv_weights_.Get(DType::kFP32, {num_recv, topk});
  out->expert_num_tokens = TensorView();
  out->problem = EpRecvProblem(args, *plan, /*max_num_tokens=*/num_recv);
  out->handle = std::move(plan);
  return absl::OkStatus();
}

absl::Status AllToAllBatchedPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                        PreparedActivations* out) {
  MOESERVE_ASSIGN_OR_RETURN(std::shared_ptr<EpDispatchPlan> plan, Dispatch(args));
  const int64_t hidden = args.hidden_states.dim(1), topk = plan->topk;
  const int64_t num_recv = plan->num_recv();
  const DType act = options_.quant.activation_dtype;
  const int64_t row_bytes = hidden * static_cast<int64_t>(DTypeSize(act));
  const int64_t num_local = args.num_local_experts, cap = max_tokens();
  TensorView a1q = a1q_.Get(act, {num_local, cap, hidden});
  TensorView counts = expert_num_tokens_.Get(DType::kINT32, {num_local});
  int32_t* n = counts.data<int32_t>();
  std::fill(n, n + num_local, 0);
  TensorView ids = recv_ids_.Get(DType::kINT32, {num_recv, topk});
  for (int64_t i = 0; i < num_recv; ++i) {
    for (int64_t j = 0; j < topk; ++j) {
      const int32_t e = ids.data<int32_t>()[i * topk + j];
      if (e < 0) continue;
      if (e >= num_local || n[e] >= cap) {
        // PlanChunks keeps every expert within capacity; reaching this is a bug, and a route
        // must never be dropped silently.
        return absl::InternalError(absl::StrCat(name(), " on rank ", rank(),
                                                ": route to local "
                                                "expert ",
                                                e, " has no row (capacity ", cap, " rows, ",
                                                num_local, " local experts)"));
      }
      std::memcpy(a1q.data<std::byte>() + (e * cap + n[e]++) * row_bytes, record(i), row_bytes);
    }
  }
  out->format = ActivationFormat::kBatchedExperts;
  out->a1q = a1q;
  out->a1q_scale = TensorView();
  out->topk_ids = ids;
  out->topk_weights = recv_weights_.Get(DType::kFP32, {num_recv, topk});
  out->expert_num_tokens = counts;
  out->problem = EpRecvProblem(args, *plan, /*max_num_tokens=*/cap);
  out->handle = std::move(plan);
  return absl::OkStatus();
}

}  // namespace moeserve
