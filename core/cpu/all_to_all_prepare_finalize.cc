#include "core/cpu/all_to_all_prepare_finalize.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moeserve {

AllToAllPrepareAndFinalizeBase::AllToAllPrepareAndFinalizeBase(
    std::shared_ptr<Communicator> comm, std::shared_ptr<const Placement> placement,
    AllToAllOptions options)
    : comm_(std::move(comm)), placement_(std::move(placement)), options_(options) {
  expert_map_ = placement_->ExpertMap(comm_->rank());
}

absl::StatusOr<std::vector<int64_t>> AllToAllPrepareAndFinalizeBase::PlanChunks(
    const PrepareArgs& args) {
  const int64_t m = args.hidden_states.dim(0);
  const int64_t topk = args.topk_ids.rank() == 2 ? args.topk_ids.dim(1) : 0;
  const int64_t cap = options_.max_num_tokens_per_rank;
  std::vector<int64_t> bounds = {0};
  if (bounded_expert_rows()) {
    // Greedy: extend a round while its tokens and every expert's rows stay within cap.
    std::vector<int64_t> rows(placement_->num_experts(), 0);
    std::vector<int32_t> touched;
    const int32_t* ids = args.topk_ids.data<int32_t>();
    int64_t begin = 0;
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t k = 0; k < topk; ++k) {
        const int32_t e = ids[t * topk + k];
        if (e < 0 || e >= placement_->num_experts()) {
          return absl::InvalidArgumentError(absl::StrCat(name(), ": expert id ", e, " outside [0, ",
                                                         placement_->num_experts(), ")"));
        }
      }
      bool fits = t - begin < cap;
      for (int64_t k = 0; k < topk; ++k) {
        const int32_t e = ids[t * topk + k];
        int64_t need = 0;
        for (int64_t j = 0; j < topk; ++j) need += ids[t * topk + j] == e;
        if (need > cap) {
          return absl::ResourceExhaustedError(absl::StrCat(
              name(), ": token ", t, " routes ", need, " times to expert ", e,
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
        const int32_t e = ids[t * topk + k];
        if (rows[e]++ == 0) touched.push_back(e);
      }
    }
  } else {
    for (int64_t t = cap; t < m; t += cap) bounds.push_back(t);
  }
  if (m > 0) bounds.push_back(m);
  // Every rank runs the same number of rounds.
  const int64_t mine = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<int64_t> all;
  MOESERVE_RETURN_IF_ERROR(AllGatherCounts(*comm_, absl::MakeConstSpan(&mine, 1), &all));
  const int64_t rounds = std::max<int64_t>(1, *std::max_element(all.begin(), all.end()));
  while (static_cast<int64_t>(bounds.size()) - 1 < rounds) bounds.push_back(m);
  return bounds;
}

absl::Status AllToAllPrepareAndFinalizeBase::Dispatch(const PrepareArgs& args) {
  const TensorView& x = args.hidden_states;
  if (x.rank() != 2 || args.topk_ids.rank() != 2 || args.topk_ids.dim(0) != x.dim(0) ||
      args.topk_weights.shape() != args.topk_ids.shape() ||
      args.topk_ids.dtype() != DType::kINT32 || args.topk_weights.dtype() != DType::kFP32) {
    return absl::InvalidArgumentError(absl::StrCat(
        name(),
        ": expected hidden_states [M, K], topk_ids INT32 [M, topk], topk_weights FP32 "
        "[M, topk]; got ",
        x.DebugString(), ", ", args.topk_ids.DebugString(), ", ", args.topk_weights.DebugString()));
  }
  const int world = comm_->world_size(), me = comm_->rank();
  const int64_t m = x.dim(0), k = x.dim(1), topk = args.topk_ids.dim(1);
  if (m > options_.max_num_tokens_per_rank) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name(), ": ", m, " tokens exceed max_num_tokens_per_rank=",
                     options_.max_num_tokens_per_rank, " in one round (use PlanChunks)"));
  }
  if (args.num_experts != placement_->num_experts() ||
      args.num_local_experts != placement_->num_local_experts(me)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), " on rank ", me, ": placement has ", placement_->num_experts(),
                     " experts, ", placement_->num_local_experts(me), " local; forward has ",
                     args.num_experts, " and ", args.num_local_experts));
  }
  if (!args.expert_map.empty() &&
      (args.expert_map.numel() != placement_->num_experts() ||
       !std::equal(expert_map_.begin(), expert_map_.end(), args.expert_map.data<int32_t>()))) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), " on rank ", me, ": expert_map disagrees with the placement"));
  }
  hidden_ = k;
  topk_ = topk;
  num_src_ = m;
  // Quantization hook, before dispatch.
  const DType act = options_.quant.activation_dtype;
  TensorView a = x;
  if (x.dtype() != act || !x.is_contiguous()) {
    a = a1q_src_.Get(act, {m, k});
    MOESERVE_RETURN_IF_ERROR(ConvertTensor(x, a));
  }
  const int64_t row_bytes = k * static_cast<int64_t>(DTypeSize(act));
  record_bytes_ = row_bytes + topk * 8;

  // Records: (token, destination, route mask). Count, then fill grouped by destination.
  const int32_t* ids = args.topk_ids.data<int32_t>();
  const float* weights = args.topk_weights.data<float>();
  const bool per_route = options_.dispatch == AllToAllOptions::Dispatch::kPerRoute;
  std::vector<int> dest_of(m * topk);
  for (int64_t i = 0; i < m * topk; ++i) {
    if (ids[i] < 0 || ids[i] >= placement_->num_experts()) {
      return absl::InvalidArgumentError(absl::StrCat(name(), ": expert id ", ids[i], " at [",
                                                     i / topk, ", ", i % topk, "] outside [0, ",
                                                     placement_->num_experts(), ")"));
    }
    dest_of[i] = placement_->owner(ids[i]);
  }
  // A route (t, j) starts a record if it is the first of token t's routes to its rank (or
  // always, per route).
  auto starts_record = [&](int64_t t, int64_t j) {
    if (per_route) return true;
    for (int64_t i = 0; i < j; ++i) {
      if (dest_of[t * topk + i] == dest_of[t * topk + j]) return false;
    }
    return true;
  };
  send_count_.assign(world, 0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      if (starts_record(t, j)) ++send_count_[dest_of[t * topk + j]];
    }
  }
  std::vector<int64_t> slot(world, 0);
  int64_t total = 0;
  for (int d = 0; d < world; ++d) slot[d] = total, total += send_count_[d];
  send_token_.assign(total, 0);
  send_.resize(static_cast<size_t>(total * record_bytes_));
  std::vector<int32_t> rec_ids(topk);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      if (!starts_record(t, j)) continue;
      const int d = dest_of[t * topk + j];
      for (int64_t i = 0; i < topk; ++i) {
        const bool in = per_route ? i == j : dest_of[t * topk + i] == d;
        rec_ids[i] = in ? placement_->local_index(ids[t * topk + i]) : -1;
      }
      const int64_t s = slot[d]++;
      send_token_[s] = t;
      std::byte* rec = send_.data() + s * record_bytes_;
      std::memcpy(rec, a.data<std::byte>() + t * row_bytes, row_bytes);
      std::memcpy(rec + row_bytes, rec_ids.data(), topk * 4);
      std::memcpy(rec + row_bytes + topk * 4, weights + t * topk, topk * 4);
    }
  }

  // Per-peer counts, then the records.
  std::vector<int64_t> all;
  MOESERVE_RETURN_IF_ERROR(AllGatherCounts(*comm_, send_count_, &all));
  recv_count_.assign(world, 0);
  num_recv_ = 0;
  for (int s = 0; s < world; ++s) recv_count_[s] = all[s * world + me], num_recv_ += recv_count_[s];
  recv_.resize(static_cast<size_t>(num_recv_ * record_bytes_));
  std::vector<int64_t> sc(world), sd(world), rc(world), rd(world);
  int64_t so = 0, ro = 0;
  for (int p = 0; p < world; ++p) {
    sc[p] = send_count_[p] * record_bytes_, sd[p] = so, so += sc[p];
    rc[p] = recv_count_[p] * record_bytes_, rd[p] = ro, ro += rc[p];
    if (p != me) stats_.dispatch_bytes_sent += sc[p], stats_.dispatch_bytes_received += rc[p];
  }
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllV(send_.data(), sc, sd, recv_.data(), rc, rd));

  // The records' ids and weights, [M_recv, topk].
  TensorView rids = recv_ids_.Get(DType::kINT32, {num_recv_, topk});
  TensorView rw = recv_weights_.Get(DType::kFP32, {num_recv_, topk});
  for (int64_t i = 0; i < num_recv_; ++i) {
    std::memcpy(rids.data<int32_t>() + i * topk, record(i) + row_bytes, topk * 4);
    std::memcpy(rw.data<float>() + i * topk, record(i) + row_bytes + topk * 4, topk * 4);
  }
  return absl::OkStatus();
}

absl::Status AllToAllPrepareAndFinalizeBase::Finalize(
    const TensorView& output, const TensorView& fused_expert_output,
    const PreparedActivations& prepared, const TopKWeightAndReduce& weight_and_reduce) {
  const int world = comm_->world_size(), me = comm_->rank();
  const int64_t k = hidden_;
  if (output.rank() != 2 || output.dtype() != DType::kFP32 || output.dim(0) != num_src_ ||
      output.dim(1) != k || !output.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": output must be FP32 [", num_src_,
                                                   ", ", k, "], got ", output.DebugString()));
  }
  // Weight-and-reduce on the expert rank: one partial row per received record.
  TensorView partial;
  if (weight_and_reduce.kind() == TopKWeightAndReduce::Kind::kNoOp &&
      fused_expert_output.shape() == Shape{num_recv_, k} && fused_expert_output.is_contiguous()) {
    partial = fused_expert_output;
  } else {
    partial = partial_.Get(DType::kFP32, {num_recv_, k});
    const std::unique_ptr<TopKWeightAndReduce> resolved =
        weight_and_reduce.kind() == TopKWeightAndReduce::Kind::kDelegate
            ? MakeTopKWeightAndReduce(delegate_kind())
            : nullptr;
    MOESERVE_RETURN_IF_ERROR(
        (resolved ? *resolved : weight_and_reduce)
            .Apply(partial, fused_expert_output, prepared.topk_weights, prepared.topk_ids));
  }
  // Combine: partials go back to their source ranks (the reverse of the dispatch).
  const int64_t row = k * static_cast<int64_t>(sizeof(float));
  const int64_t num_send = static_cast<int64_t>(send_token_.size());
  combine_recv_.resize(static_cast<size_t>(num_send * k));
  std::vector<int64_t> sc(world), sd(world), rc(world), rd(world);
  int64_t so = 0, ro = 0;
  for (int p = 0; p < world; ++p) {
    sc[p] = recv_count_[p] * row, sd[p] = so, so += sc[p];
    rc[p] = send_count_[p] * row, rd[p] = ro, ro += rc[p];
    if (p != me) stats_.combine_bytes_sent += sc[p], stats_.combine_bytes_received += rc[p];
  }
  MOESERVE_RETURN_IF_ERROR(
      comm_->AllToAllV(partial.raw_data(), sc, sd, combine_recv_.data(), rc, rd));
  float* out = output.data<float>();
  if (output.nbytes() > 0) std::memset(out, 0, output.nbytes());
  // Slots are grouped by destination rank, so each token sums its partials in rank order.
  for (int64_t s = 0; s < num_send; ++s) {
    float* o = out + send_token_[s] * k;
    const float* p = combine_recv_.data() + s * k;
    for (int64_t h = 0; h < k; ++h) o[h] += p[h];
  }
  return absl::OkStatus();
}

absl::Status AllToAllContiguousPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                           PreparedActivations* out) {
  MOESERVE_RETURN_IF_ERROR(Dispatch(args));
  const DType act = options_.quant.activation_dtype;
  const int64_t row_bytes = hidden_ * static_cast<int64_t>(DTypeSize(act));
  TensorView a1q = a1q_.Get(act, {num_recv_, hidden_});
  for (int64_t i = 0; i < num_recv_; ++i) {
    std::memcpy(a1q.data<std::byte>() + i * row_bytes, record(i), row_bytes);
  }
  out->format = ActivationFormat::kStandard;
  out->a1q = a1q;
  out->a1q_scale = TensorView();
  out->topk_ids = recv_ids_.Get(DType::kINT32, {num_recv_, topk_});
  out->topk_weights = recv_weights_.Get(DType::kFP32, {num_recv_, topk_});
  out->expert_num_tokens = TensorView();
  out->problem = MoeProblem{.num_tokens = num_recv_,
                            .hidden = hidden_,
                            .intermediate = args.intermediate,
                            .topk = topk_,
                            .num_experts = args.num_experts,
                            .num_local_experts = args.num_local_experts,
                            .max_num_tokens = num_recv_};
  return absl::OkStatus();
}

absl::Status AllToAllBatchedPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                        PreparedActivations* out) {
  MOESERVE_RETURN_IF_ERROR(Dispatch(args));
  const DType act = options_.quant.activation_dtype;
  const int64_t row_bytes = hidden_ * static_cast<int64_t>(DTypeSize(act));
  const int64_t num_local = args.num_local_experts, cap = max_tokens();
  TensorView a1q = a1q_.Get(act, {num_local, cap, hidden_});
  TensorView counts = expert_num_tokens_.Get(DType::kINT32, {num_local});
  int32_t* n = counts.data<int32_t>();
  std::fill(n, n + num_local, 0);
  TensorView ids = recv_ids_.Get(DType::kINT32, {num_recv_, topk_});
  for (int64_t i = 0; i < num_recv_; ++i) {
    for (int64_t j = 0; j < topk_; ++j) {
      const int32_t e = ids.data<int32_t>()[i * topk_ + j];
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
  out->topk_weights = recv_weights_.Get(DType::kFP32, {num_recv_, topk_});
  out->expert_num_tokens = counts;
  out->problem = MoeProblem{.num_tokens = num_recv_,
                            .hidden = hidden_,
                            .intermediate = args.intermediate,
                            .topk = topk_,
                            .num_experts = args.num_experts,
                            .num_local_experts = num_local,
                            .max_num_tokens = cap};
  return absl::OkStatus();
}

}  // namespace moeserve
