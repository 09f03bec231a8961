#include "core/cuda/nccl_all_to_all.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/cuda/grow_only_buffer.h"
#include "core/status_macros.h"
#include "kernels/cuda/ep_pack.cuh"
#include "kernels/cuda/moe_routing.cuh"

namespace moeserve {
namespace {

constexpr char kAgreedPayload[] = "moeserve/agreed_failure";

absl::Status Agreed(absl::Status s) {
  s.SetPayload(kAgreedPayload, absl::Cord("1"));
  return s;
}

// Grow-only device / pinned allocations (one forward at a time per instance).
struct DevBuf : GrowOnlyBuffer {
  DevBuf() : GrowOnlyBuffer(Memory::kDevice, 512, /*quarter_slack=*/true) {}
};
struct PinBuf : GrowOnlyBuffer {
  PinBuf() : GrowOnlyBuffer(Memory::kPinnedHost, 4096, /*quarter_slack=*/true) {}
};

size_t Align256(size_t b) { return (b + 255) / 256 * 256; }

// Page-locked (cudaMallocHost / cudaHostRegister) host memory can be copied without staging.
bool IsPinned(const void* p) {
  cudaPointerAttributes a;
  if (p == nullptr || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost;
}

class NcclAllToAllPrepareAndFinalize final : public PrepareAndFinalize {
 public:
  NcclAllToAllPrepareAndFinalize(std::shared_ptr<CudaContext> ctx,
                                 std::shared_ptr<NcclCommunicator> comm,
                                 std::shared_ptr<const Placement> placement,
                                 NcclAllToAllOptions options)
      : ctx_(std::move(ctx)),
        comm_(std::move(comm)),
        placement_(std::move(placement)),
        opts_(options) {
    quant_.activation_dtype = DType::kBF16;
    expert_map_ = placement_->ExpertMap(comm_->rank());
    stream_ = static_cast<cudaStream_t>(CudaContextStream(*ctx_));
  }

  absl::string_view name() const override {
    return opts_.format == ActivationFormat::kStandard ? "NcclAllToAllContiguous"
                                                       : "NcclAllToAllBatched";
  }
  ActivationFormat activation_format() const override { return opts_.format; }
  std::optional<DType> topk_indices_dtype() const override { return DType::kINT32; }
  int64_t max_num_tokens_per_rank() const override { return opts_.max_num_tokens_per_rank; }
  int num_dispatchers() const override { return comm_->world_size(); }
  const QuantConfig& quant_config() const override { return quant_; }
  TransferStats transfer_stats() const override { return stats_; }

  absl::StatusOr<std::vector<int64_t>> PlanChunks(const PrepareArgs& args) override;
  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override;
  absl::Status Finalize(const TensorView& output, const TensorView& fused_expert_output,
                        const PreparedActivations& prepared,
                        const TopKWeightAndReduce& weight_and_reduce) override;

 private:
  bool batched() const { return opts_.format == ActivationFormat::kBatchedExperts; }
  int64_t capacity() const { return opts_.max_num_tokens_per_rank * comm_->world_size(); }
  absl::Status CheckArgs(const PrepareArgs& args) const;
  // Host routing plan of one round: dest_of_ and per destination the record count.
  absl::Status Route(const PrepareArgs& args, std::vector<int64_t>* send_count);
  bool StartsRecord(int64_t t, int64_t j) const;
  // NCCL all-gather of `mine` (int64, same length on every rank), then D2H + Synchronize.
  absl::Status GatherCounts(const std::vector<int64_t>& mine, std::vector<int64_t>* all);

  std::shared_ptr<CudaContext> ctx_;
  std::shared_ptr<NcclCommunicator> comm_;
  std::shared_ptr<const Placement> placement_;
  NcclAllToAllOptions opts_;
  QuantConfig quant_;
  cudaStream_t stream_ = nullptr;
  std::vector<int32_t> expert_map_;
  TransferStats stats_;

  // Round state.
  int64_t hidden_ = 0, topk_ = 0, num_src_ = 0, num_send_ = 0, num_recv_ = 0;
  std::vector<int> dest_of_;
  std::vector<int64_t> send_count_, recv_count_;
  bool have_counts_ = false;                 // recv_count_ known from PlanChunks for round 0
  std::vector<int64_t> planned_send_count_;  // what PlanChunks announced for round 0

  DevBuf d_in_, d_send_rows_, d_recv_rows_, d_recv_ids_, d_recv_w_, d_batched_, d_align_;
  DevBuf d_partial_, d_comb_recv_, d_out_, d_cnt_;
  PinBuf pin_in_, pin_out_, pin_cnt_;
  int32_t* d_plan_ = nullptr;  // into d_in_
  int32_t* d_slot_ = nullptr;  // batched: route -> row within its expert
};

absl::Status NcclAllToAllPrepareAndFinalize::CheckArgs(const PrepareArgs& args) const {
  const TensorView& x = args.hidden_states;
  if (x.rank() != 2 || args.topk_ids.rank() != 2 || args.topk_ids.dim(0) != x.dim(0) ||
      args.topk_weights.shape() != args.topk_ids.shape() ||
      args.topk_ids.dtype() != DType::kINT32 || args.topk_weights.dtype() != DType::kFP32 ||
      !args.topk_ids.is_contiguous() || !args.topk_weights.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(
        name(),
        ": expected hidden_states [M, K], topk_ids INT32 [M, topk], topk_weights FP32 "
        "[M, topk]; got ",
        x.DebugString(), ", ", args.topk_ids.DebugString(), ", ", args.topk_weights.DebugString()));
  }
  const int me = comm_->rank();
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
  if (x.dim(1) % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": hidden must be a multiple of 8 on the CUDA path, got ", x.dim(1)));
  }
  const int32_t* ids = args.topk_ids.data<int32_t>();
  for (int64_t i = 0; i < args.topk_ids.numel(); ++i) {
    if (ids[i] < 0 || ids[i] >= placement_->num_experts()) {
      const int64_t topk = args.topk_ids.dim(1);
      return absl::InvalidArgumentError(absl::StrCat(name(), ": expert id ", ids[i], " at [",
                                                     i / topk, ", ", i % topk, "] outside [0, ",
                                                     placement_->num_experts(), ")"));
    }
  }
  return absl::OkStatus();
}

bool NcclAllToAllPrepareAndFinalize::StartsRecord(int64_t t, int64_t j) const {
  if (opts_.dispatch == AllToAllOptions::Dispatch::kPerRoute) return true;
  for (int64_t i = 0; i < j; ++i) {
    if (dest_of_[t * topk_ + i] == dest_of_[t * topk_ + j]) return false;
  }
  return true;
}

absl::Status NcclAllToAllPrepareAndFinalize::Route(const PrepareArgs& args,
                                                   std::vector<int64_t>* send_count) {
  const int64_t m = args.topk_ids.dim(0);
  topk_ = args.topk_ids.dim(1);
  const int32_t* ids = args.topk_ids.data<int32_t>();
  dest_of_.resize(m * topk_);
  for (int64_t i = 0; i < m * topk_; ++i) dest_of_[i] = placement_->owner(ids[i]);
  send_count->assign(comm_->world_size(), 0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < topk_; ++j) {
      if (StartsRecord(t, j)) ++(*send_count)[dest_of_[t * topk_ + j]];
    }
  }
  return absl::OkStatus();
}

absl::Status NcclAllToAllPrepareAndFinalize::GatherCounts(const std::vector<int64_t>& mine,
                                                          std::vector<int64_t>* all) {
  const int world = comm_->world_size();
  const size_t n = mine.size(), bytes = n * sizeof(int64_t);
  MOESERVE_ASSIGN_OR_RETURN(void* pin, pin_cnt_.Get(bytes * (world + 1)));
  MOESERVE_ASSIGN_OR_RETURN(void* dev, d_cnt_.Get(bytes * (world + 1)));
  std::memcpy(pin, mine.data(), bytes);
  char* d_recv = static_cast<char*>(dev) + bytes;
  char* p_recv = static_cast<char*>(pin) + bytes;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev, pin, bytes, cudaMemcpyHostToDevice, stream_));
  MOESERVE_RETURN_IF_ERROR(comm_->AllGather(dev, static_cast<int64_t>(bytes), d_recv));
  MOESERVE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(p_recv, d_recv, bytes * world, cudaMemcpyDeviceToHost, stream_));
  MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
  all->assign(reinterpret_cast<const int64_t*>(p_recv),
              reinterpret_cast<const int64_t*>(p_recv) + n * world);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> NcclAllToAllPrepareAndFinalize::PlanChunks(
    const PrepareArgs& args) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  const int world = comm_->world_size(), me = comm_->rank();
  have_counts_ = false;
  // Local planning; a refusal is announced to the peers through the count exchange below, so
  // every rank fails this forward together and NCCL is left intact.
  absl::Status local = CheckArgs(args);
  const int64_t m = local.ok() ? args.hidden_states.dim(0) : 0;
  const int64_t topk = local.ok() ? args.topk_ids.dim(1) : 0;
  const int64_t cap = opts_.max_num_tokens_per_rank;
  std::vector<int64_t> bounds = {0};
  if (local.ok() && batched()) {
    // As AllToAllBatched: extend a round while its tokens and every expert's rows fit.
    std::vector<int64_t> rows(placement_->num_experts(), 0);
    std::vector<int32_t> touched;
    const int32_t* ids = args.topk_ids.data<int32_t>();
    int64_t begin = 0;
    for (int64_t t = 0; t < m && local.ok(); ++t) {
      bool fits = t - begin < cap;
      for (int64_t k = 0; k < topk; ++k) {
        const int32_t e = ids[t * topk + k];
        int64_t need = 0;
        for (int64_t j = 0; j < topk; ++j) need += ids[t * topk + j] == e;
        if (need > cap) {
          local = absl::ResourceExhaustedError(absl::StrCat(
              name(), ": token ", t, " routes ", need, " times to expert ", e,
              ", more than max_num_tokens_per_rank=", cap, " rows per expert and rank"));
          break;
        }
        fits = fits && rows[e] + need <= cap;
      }
      if (!local.ok()) break;
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
  } else if (local.ok()) {
    for (int64_t t = cap; t < m; t += cap) bounds.push_back(t);
  }
  if (!local.ok()) bounds = {0};
  if (m > 0 && local.ok()) bounds.push_back(m);
  // Round 0's counts travel with the plan: a single-round forward needs no other exchange.
  std::vector<int64_t> round0(world, 0);
  if (local.ok() && bounds.size() > 1) {
    PrepareArgs first = args;
    first.hidden_states = args.hidden_states.Slice(0, bounds[1]);
    first.topk_ids = args.topk_ids.Slice(0, bounds[1]);
    topk_ = topk;
    MOESERVE_RETURN_IF_ERROR(Route(first, &round0));
  }
  std::vector<int64_t> mine = {static_cast<int64_t>(local.code()),
                               static_cast<int64_t>(bounds.size()) - 1};
  mine.insert(mine.end(), round0.begin(), round0.end());
  std::vector<int64_t> all;
  MOESERVE_RETURN_IF_ERROR(GatherCounts(mine, &all));
  const int64_t stride = 2 + world;
  for (int p = 0; p < world; ++p) {
    const int64_t code = all[p * stride];
    if (code == 0) continue;
    if (!local.ok()) return Agreed(local);
    return Agreed(absl::AbortedError(
        absl::StrCat(name(), ": rank ", p, " refused this forward (",
                     absl::StatusCodeToString(static_cast<absl::StatusCode>(code)), ")")));
  }
  int64_t rounds = 1;
  for (int p = 0; p < world; ++p) rounds = std::max(rounds, all[p * stride + 1]);
  while (static_cast<int64_t>(bounds.size()) - 1 < rounds) bounds.push_back(m);
  recv_count_.assign(world, 0);
  for (int p = 0; p < world; ++p) recv_count_[p] = all[p * stride + 2 + me];
  planned_send_count_ = round0;
  have_counts_ = true;
  return bounds;
}

absl::Status NcclAllToAllPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                     PreparedActivations* out) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  MOESERVE_RETURN_IF_ERROR(CheckArgs(args));
  const int world = comm_->world_size(), me = comm_->rank();
  const TensorView& x = args.hidden_states;
  const int64_t m = x.dim(0), k = x.dim(1);
  if (m > opts_.max_num_tokens_per_rank) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name(), ": ", m, " tokens exceed max_num_tokens_per_rank=", opts_.max_num_tokens_per_rank,
        " in one round (use PlanChunks)"));
  }
  hidden_ = k;
  num_src_ = m;
  MOESERVE_RETURN_IF_ERROR(Route(args, &send_count_));
  const int64_t topk = topk_;
  if (have_counts_ && send_count_ != planned_send_count_) {
    // The peers expect what PlanChunks announced; a different exchange would mismatch theirs.
    return absl::InternalError(absl::StrCat(name(), " on rank ", me,
                                            ": Prepare got other "
                                            "tokens than PlanChunks planned for this round"));
  }
  if (!have_counts_) {
    std::vector<int64_t> all;
    MOESERVE_RETURN_IF_ERROR(GatherCounts(send_count_, &all));
    recv_count_.assign(world, 0);
    for (int p = 0; p < world; ++p) recv_count_[p] = all[p * world + me];
  }
  have_counts_ = false;
  num_send_ = 0;
  num_recv_ = 0;
  for (int p = 0; p < world; ++p) num_send_ += send_count_[p], num_recv_ += recv_count_[p];

  // Pinned staging: [x BF16 | send_token | rec_ids | rec_w | comb_off (m+1) | comb_slots].
  const size_t x_bytes = Align256(m * k * 2);
  const size_t plan_elems = 2 * num_send_ + 2 * num_send_ * topk + m + 1;
  const size_t in_bytes = x_bytes + plan_elems * 4;
  MOESERVE_ASSIGN_OR_RETURN(void* pin, pin_in_.Get(in_bytes));
  MOESERVE_ASSIGN_OR_RETURN(void* d_in, d_in_.Get(in_bytes));
  auto* pin_x = static_cast<uint8_t*>(pin);
  auto* send_token = reinterpret_cast<int32_t*>(pin_x + x_bytes);
  int32_t* rec_ids = send_token + num_send_;
  auto* rec_w = reinterpret_cast<float*>(rec_ids + num_send_ * topk);
  auto* comb_off = reinterpret_cast<int32_t*>(rec_w + num_send_ * topk);
  int32_t* comb_slots = comb_off + m + 1;
  // Pinned BF16 input goes to the device as it is; anything else through the staging buffer.
  const bool direct_x =
      m > 0 && x.dtype() == DType::kBF16 && x.is_contiguous() && IsPinned(x.raw_data());
  if (m > 0 && !direct_x) {
    TensorView pin_x_view(pin_x, DType::kBF16, {m, k});
    if (x.dtype() == DType::kBF16 && x.is_contiguous()) {
      std::memcpy(pin_x, x.raw_data(), m * k * 2);
    } else {
      MOESERVE_RETURN_IF_ERROR(ConvertTensor(x, pin_x_view));
    }
  }
  // Records grouped by destination rank, tokens ascending within each (as the CPU oracle).
  const int32_t* ids = args.topk_ids.data<int32_t>();
  const float* weights = args.topk_weights.data<float>();
  const bool per_route = opts_.dispatch == AllToAllOptions::Dispatch::kPerRoute;
  std::vector<int64_t> slot(world, 0);
  for (int64_t d = 0, total = 0; d < world; ++d) slot[d] = total, total += send_count_[d];
  std::fill(comb_off, comb_off + m + 1, 0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      if (!StartsRecord(t, j)) continue;
      const int d = dest_of_[t * topk + j];
      const int64_t s = slot[d]++;
      send_token[s] = static_cast<int32_t>(t);
      ++comb_off[t + 1];
      for (int64_t i = 0; i < topk; ++i) {
        const bool in = per_route ? i == j : dest_of_[t * topk + i] == d;
        rec_ids[s * topk + i] = in ? placement_->local_index(ids[t * topk + i]) : -1;
        rec_w[s * topk + i] = weights[t * topk + i];
      }
    }
  }
  for (int64_t t = 0; t < m; ++t) comb_off[t + 1] += comb_off[t];
  {
    // Each token's slots in ascending slot order = ascending destination rank.
    std::vector<int32_t> fill(comb_off, comb_off + m);
    for (int64_t s = 0; s < num_send_; ++s)
      comb_slots[fill[send_token[s]]++] = static_cast<int32_t>(s);
  }
  if (direct_x) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_in, x.raw_data(), m * k * 2, cudaMemcpyHostToDevice, stream_));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<uint8_t*>(d_in) + x_bytes,
                                                  pin_x + x_bytes, plan_elems * 4,
                                                  cudaMemcpyHostToDevice, stream_));
  } else {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_in, pin, in_bytes, cudaMemcpyHostToDevice, stream_));
  }
  d_plan_ = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(d_in) + x_bytes);
  const int32_t* d_send_token = d_plan_;
  const int32_t* d_rec_ids = d_plan_ + num_send_;
  const int32_t* d_rec_w = d_rec_ids + num_send_ * topk;

  // Pack, then one NCCL group for rows, ids and weights.
  MOESERVE_ASSIGN_OR_RETURN(void* d_send_rows, d_send_rows_.Get(num_send_ * k * 2));
  MOESERVE_CUDA_RETURN_IF_ERROR(
      kernels::LaunchEpGatherRows(static_cast<const uint16_t*>(d_in), d_send_token, num_send_, k,
                                  static_cast<uint16_t*>(d_send_rows), stream_));
  MOESERVE_ASSIGN_OR_RETURN(void* d_rows, d_recv_rows_.Get(num_recv_ * k * 2));
  MOESERVE_ASSIGN_OR_RETURN(void* d_rids, d_recv_ids_.Get(num_recv_ * topk * 4));
  MOESERVE_ASSIGN_OR_RETURN(void* d_rw, d_recv_w_.Get(num_recv_ * topk * 4));
  std::vector<int64_t> sc[3], sd[3], rc[3], rd[3];
  const int64_t unit[3] = {k * 2, topk * 4, topk * 4};
  for (int b = 0; b < 3; ++b) {
    sc[b].resize(world), sd[b].resize(world), rc[b].resize(world), rd[b].resize(world);
    int64_t so = 0, ro = 0;
    for (int p = 0; p < world; ++p) {
      sc[b][p] = send_count_[p] * unit[b], sd[b][p] = so, so += sc[b][p];
      rc[b][p] = recv_count_[p] * unit[b], rd[b][p] = ro, ro += rc[b][p];
      if (p != me)
        stats_.dispatch_bytes_sent += sc[b][p], stats_.dispatch_bytes_received += rc[b][p];
    }
  }
  const AllToAllVTransfer transfers[3] = {
      {d_send_rows, sc[0].data(), sd[0].data(), d_rows, rc[0].data(), rd[0].data()},
      {d_rec_ids, sc[1].data(), sd[1].data(), d_rids, rc[1].data(), rd[1].data()},
      {d_rec_w, sc[2].data(), sd[2].data(), d_rw, rc[2].data(), rd[2].data()}};
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllVGroup(transfers));

  const int64_t e = args.num_local_experts;
  out->a1q_scale = TensorView();
  out->topk_ids = TensorView(d_rids, DType::kINT32, {num_recv_, topk});
  out->topk_weights = TensorView(d_rw, DType::kFP32, {num_recv_, topk});
  out->problem = MoeProblem{.num_tokens = num_recv_,
                            .hidden = k,
                            .intermediate = args.intermediate,
                            .topk = topk,
                            .num_experts = args.num_experts,
                            .num_local_experts = e,
                            .max_num_tokens = num_recv_};
  if (!batched()) {
    out->format = ActivationFormat::kStandard;
    out->a1q = TensorView(d_rows, DType::kBF16, {num_recv_, k});
    out->expert_num_tokens = TensorView();
    return absl::OkStatus();
  }
  // BatchedExperts: rows of local expert e are its routes in (record, k) order (stable align),
  // at most capacity() of them (PlanChunks keeps every rank's contribution within
  // max_num_tokens_per_rank).
  if (e > kernels::kMoeAlignMaxExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", e, " local experts exceed ", kernels::kMoeAlignMaxExperts));
  }
  const int64_t cap = capacity(), routes = num_recv_ * topk;
  MOESERVE_ASSIGN_OR_RETURN(void* d_a, d_batched_.Get(e * cap * k * 2));
  MOESERVE_ASSIGN_OR_RETURN(void* d_al, d_align_.Get((2 * e + 2 + 2 * routes) * 4));
  auto* counts = static_cast<int32_t*>(d_al);
  int32_t* offsets = counts + e;
  int32_t* sorted = offsets + e + 1;
  d_slot_ = sorted + routes;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counts, 0, e * 4, stream_));
  if (routes > 0) {
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(static_cast<int32_t*>(d_rids), routes,
                                                          static_cast<int>(e), counts, offsets,
                                                          sorted, d_slot_, stream_));
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchPermuteToBatched(
        static_cast<uint16_t*>(d_rows), static_cast<int32_t*>(d_rids), d_slot_, num_recv_,
        static_cast<int>(topk), k, static_cast<int>(e), cap, static_cast<uint16_t*>(d_a), stream_));
  }
  out->format = ActivationFormat::kBatchedExperts;
  out->a1q = TensorView(d_a, DType::kBF16, {e, cap, k});
  out->expert_num_tokens = TensorView(counts, DType::kINT32, {e});
  out->problem.max_num_tokens = cap;
  return absl::OkStatus();
}

absl::Status NcclAllToAllPrepareAndFinalize::Finalize(const TensorView& output,
                                                      const TensorView& fused_expert_output,
                                                      const PreparedActivations& prepared,
                                                      const TopKWeightAndReduce& war) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  const int world = comm_->world_size(), me = comm_->rank();
  const int64_t k = hidden_, topk = topk_, m = num_src_;
  if (output.rank() != 2 || output.dtype() != DType::kFP32 || output.dim(0) != m ||
      output.dim(1) != k || !output.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": output must be FP32 [", m, ", ", k,
                                                   "], got ", output.DebugString()));
  }
  // The Experts' device output: from the context (CudaExperts), or a device tensor handed in.
  const TensorView fused =
      fused_expert_output.numel() > 0 ? fused_expert_output : CudaContextFusedOutput(*ctx_);
  TopKWeightAndReduce::Kind kind = war.kind();
  if (kind == TopKWeightAndReduce::Kind::kDelegate) {
    kind = batched() ? TopKWeightAndReduce::Kind::kNaiveBatched
                     : TopKWeightAndReduce::Kind::kContiguous;
  }
  const int e = static_cast<int>(prepared.problem.num_local_experts);
  const float* w = prepared.topk_weights.data<float>();
  const int32_t* ids = prepared.topk_ids.data<int32_t>();
  void* d_partial = nullptr;
  switch (kind) {
    case TopKWeightAndReduce::Kind::kNoOp:
      if (num_recv_ > 0 && (fused.numel() != num_recv_ * k || fused.dtype() != DType::kFP32)) {
        return absl::InvalidArgumentError(absl::StrCat(name(), ": NoOp reduce needs FP32 [",
                                                       num_recv_, ", ", k, "] expert output, got ",
                                                       fused.DebugString()));
      }
      d_partial = fused.raw_data();
      break;
    case TopKWeightAndReduce::Kind::kContiguous: {
      if (batched()) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": Contiguous reduce needs Standard-format expert output"));
      }
      MOESERVE_ASSIGN_OR_RETURN(d_partial, d_partial_.Get(num_recv_ * k * 4));
      if (num_recv_ > 0) {
        MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceContiguous(
            fused.data<float>(), w, ids, num_recv_, static_cast<int>(topk), k, e,
            static_cast<float*>(d_partial), stream_));
      }
      break;
    }
    case TopKWeightAndReduce::Kind::kNaiveBatched: {
      if (!batched()) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": NaiveBatched reduce needs BatchedExperts output"));
      }
      MOESERVE_ASSIGN_OR_RETURN(d_partial, d_partial_.Get(num_recv_ * k * 4));
      if (num_recv_ > 0) {
        MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceNaiveBatched(
            fused.data<float>(), w, ids, d_slot_, num_recv_, static_cast<int>(topk), k, e,
            capacity(), static_cast<float*>(d_partial), stream_));
      }
      break;
    }
    default:
      return absl::InternalError("unresolved TopKWeightAndReduce");
  }
  // Combine: the partials go back to their source ranks (the reverse of the dispatch).
  MOESERVE_ASSIGN_OR_RETURN(void* d_comb, d_comb_recv_.Get(num_send_ * k * 4));
  const int64_t row = k * 4;
  std::vector<int64_t> sc(world), sd(world), rc(world), rd(world);
  int64_t so = 0, ro = 0;
  for (int p = 0; p < world; ++p) {
    sc[p] = recv_count_[p] * row, sd[p] = so, so += sc[p];
    rc[p] = send_count_[p] * row, rd[p] = ro, ro += rc[p];
    if (p != me) stats_.combine_bytes_sent += sc[p], stats_.combine_bytes_received += rc[p];
  }
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllV(d_partial, sc, sd, d_comb, rc, rd));
  if (m > 0) {
    MOESERVE_ASSIGN_OR_RETURN(void* d_out, d_out_.Get(m * k * 4));
    // Device twin of the staging layout: [send_token | rec_ids | rec_w | comb_off | comb_slots].
    const int32_t* comb_off = d_plan_ + num_send_ + 2 * num_send_ * topk;
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchEpCombineReduce(
        static_cast<const float*>(d_comb), comb_off, comb_off + m + 1, m, k,
        static_cast<float*>(d_out), stream_));
    if (IsPinned(output.raw_data())) {  // straight into a page-locked answer
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(output.raw_data(), d_out, m * k * 4, cudaMemcpyDeviceToHost, stream_));
      MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
    } else {
      MOESERVE_ASSIGN_OR_RETURN(void* pin, pin_out_.Get(m * k * 4));
      MOESERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(pin, d_out, m * k * 4, cudaMemcpyDeviceToHost, stream_));
      MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
      std::memcpy(output.raw_data(), pin, m * k * 4);
    }
  } else {
    MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());
  }
  return absl::OkStatus();
}

}  // namespace

bool IsAgreedFailure(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kAgreedPayload).has_value();
}

absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> CreateNcclAllToAllPrepareAndFinalize(
    std::shared_ptr<CudaContext> ctx, std::shared_ptr<NcclCommunicator> comm,
    std::shared_ptr<const Placement> placement, NcclAllToAllOptions options) {
  if (ctx == nullptr || comm == nullptr || placement == nullptr) {
    return absl::InvalidArgumentError(
        "NcclAllToAll: needs a context, a communicator and a "
        "placement");
  }
  if (comm->stream() != CudaContextStream(*ctx)) {
    return absl::InvalidArgumentError(
        "NcclAllToAll: the communicator must run on the "
        "context's stream");
  }
  if (placement->num_ranks() != comm->world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("NcclAllToAll: placement has ",
                                                   placement->num_ranks(), " ranks, group ",
                                                   comm->world_size()));
  }
  if (options.max_num_tokens_per_rank <= 0) {
    return absl::InvalidArgumentError("NcclAllToAll: max_num_tokens_per_rank must be > 0");
  }
  return std::make_unique<NcclAllToAllPrepareAndFinalize>(std::move(ctx), std::move(comm),
                                                          std::move(placement), options);
}

}  // namespace moeserve
