#include "core/cuda/nccl_all_to_all.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cassert>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "core/cuda/answer_copy.h"
#include "core/cuda/grow_only_buffer.h"
#include "core/ep_plan.h"
#include "core/status_macros.h"
#include "kernels/cuda/dtype_convert.cuh"
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

// What Prepare hands to Finalize: the round's EP plan (its block is in pin_in_) and where its
// device twins live. Valid until the next Prepare (the buffers are reused).
struct NcclRoundHandle final : EpDispatchPlan {
  explicit NcclRoundHandle(EpDispatchPlan plan) : EpDispatchPlan(std::move(plan)) {}
  const int32_t* d_plan = nullptr;  // device copy of block(), laid out as layout()
  const int32_t* d_slot = nullptr;  // batched: route -> row within its expert
};

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
    stream_ = static_cast<cudaStream_t>(ctx_->stream());
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
  bool writes_output_dtype(DType dtype) const override {
    return dtype == DType::kFP32 || dtype == DType::kBF16 || dtype == DType::kFP16;
  }
  bool accepts_device_tensors() const override { return true; }
  TransferStats transfer_stats() const override { return stats_; }

  absl::StatusOr<std::vector<int64_t>> PlanChunks(const PrepareArgs& args) override;
  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override;
  absl::Status Finalize(const TensorView& output, const TensorView& fused_expert_output,
                        const PreparedActivations& prepared,
                        const TopKWeightAndReduce& weight_and_reduce) override;

 private:
  bool batched() const { return opts_.format == ActivationFormat::kBatchedExperts; }
  int64_t capacity() const { return opts_.max_num_tokens_per_rank * comm_->world_size(); }
  // ValidateEpPrepareArgs plus what the device kernels need.
  absl::Status CheckArgs(const PrepareArgs& args) const;
  // NCCL all-gather of `mine` (int64, same length on every rank), then D2H + Synchronize.
  absl::Status GatherCounts(const std::vector<int64_t>& mine, std::vector<int64_t>* all);
  // Frees what the buffers' growths replaced (waits for the device): at the start of a forward,
  // when this rank's earlier rounds are done. Growths themselves never wait, and every buffer of
  // a round is sized before the round's collective is queued, so no host wait of this rank can
  // sit behind a collective whose peer failed (only Synchronize, which is bounded, waits).
  void ReleaseSuperseded();

  std::shared_ptr<CudaContext> ctx_;
  std::shared_ptr<NcclCommunicator> comm_;
  std::shared_ptr<const Placement> placement_;
  NcclAllToAllOptions opts_;
  QuantConfig quant_;
  cudaStream_t stream_ = nullptr;
  TransferStats stats_;

  // Round 0's counts, exchanged by PlanChunks so that a one-round forward needs no other
  // exchange; the rest of a round's plan goes from Prepare to Finalize in NcclRoundHandle.
  bool have_counts_ = false;                 // planned_*_count_ hold round 0's counts
  std::vector<int64_t> planned_send_count_;  // what PlanChunks announced for round 0
  std::vector<int64_t> planned_recv_count_;  // what the peers announced to this rank

  DevBuf d_in_, d_x_bf16_, d_send_rows_, d_recv_rows_, d_recv_ids_, d_recv_w_, d_batched_, d_align_;
  DevBuf d_partial_, d_comb_recv_, d_out_, d_cnt_;
  PinBuf pin_in_, pin_cnt_;
  ParallelCopier copier_{4};  // staging copies between request bytes and pinned memory
  AnswerCopy answer_{&copier_};
};

absl::Status NcclAllToAllPrepareAndFinalize::CheckArgs(const PrepareArgs& args) const {
  MOESERVE_RETURN_IF_ERROR(ValidateEpPrepareArgs(name(), args, *placement_, comm_->rank()));
  if (args.hidden_states.dim(1) % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": hidden must be a multiple of 8 on the CUDA path, got ",
                     args.hidden_states.dim(1)));
  }
  if (batched() && args.num_local_experts > kernels::kMoeAlignMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": ", args.num_local_experts,
                                                   " local experts exceed ",
                                                   kernels::kMoeAlignMaxExperts));
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

void NcclAllToAllPrepareAndFinalize::ReleaseSuperseded() {
  for (GrowOnlyBuffer* b : std::initializer_list<GrowOnlyBuffer*>{
           &d_in_, &d_x_bf16_, &d_send_rows_, &d_recv_rows_, &d_recv_ids_, &d_recv_w_, &d_batched_,
           &d_align_, &d_partial_, &d_comb_recv_, &d_out_, &d_cnt_, &pin_in_, &pin_cnt_}) {
    b->ReleaseSuperseded();
  }
  answer_.ReleaseSuperseded();
}

absl::StatusOr<std::vector<int64_t>> NcclAllToAllPrepareAndFinalize::PlanChunks(
    const PrepareArgs& args) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  ReleaseSuperseded();
  const int world = comm_->world_size(), me = comm_->rank();
  have_counts_ = false;
  // Local planning (the edge of a forward: validated once here); a refusal is announced to the
  // peers through the count exchange below, so every rank fails this forward together and NCCL
  // is left intact.
  absl::Status local = CheckArgs(args);
  std::vector<int64_t> bounds = {0};
  // Round 0's counts travel with the plan: a single-round forward needs no other exchange.
  std::vector<int64_t> round0(world, 0);
  if (local.ok()) {
    const int32_t* ids = args.topk_ids.data<int32_t>();
    const int64_t topk = args.topk_ids.dim(1);
    absl::StatusOr<std::vector<int64_t>> planned = PlanEpRounds(
        ids, args.topk_ids.dim(0), topk, *placement_, opts_.max_num_tokens_per_rank, batched());
    if (planned.ok() && planned->size() > 1) {
      absl::StatusOr<EpRouting> first =
          RouteEpTokens(ids, (*planned)[1], topk, *placement_, opts_.dispatch);
      if (first.ok()) {
        round0 = first->send_count;
      } else {
        planned = first.status();
      }
    }
    if (planned.ok()) {
      bounds = *std::move(planned);
    } else {
      local = PrefixEpStatus(name(), planned.status());
    }
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
  // Round 0's counts (a rank sends a peer at most one row per route of its round) before any
  // buffer is sized from them; every rank checks all of them, so all agree.
  std::vector<int64_t> counts0;
  counts0.reserve(static_cast<size_t>(world) * world);
  for (int p = 0; p < world; ++p) {
    counts0.insert(counts0.end(), all.begin() + p * stride + 2, all.begin() + (p + 1) * stride);
  }
  MOESERVE_RETURN_IF_ERROR(Agreed(CheckGatheredCounts(
      counts0, world, opts_.max_num_tokens_per_rank * args.topk_ids.dim(1), name())));
  std::vector<int64_t> rounds_of(world);
  for (int p = 0; p < world; ++p) rounds_of[p] = all[p * stride + 1];
  MOESERVE_RETURN_IF_ERROR(Agreed(
      CheckGatheredCounts(rounds_of, world, opts_.max_rounds, absl::StrCat(name(), " rounds"))));
  PadEpRounds(std::max<int64_t>(1, *std::max_element(rounds_of.begin(), rounds_of.end())), &bounds);
  planned_recv_count_.assign(world, 0);
  for (int p = 0; p < world; ++p) planned_recv_count_[p] = all[p * stride + 2 + me];
  planned_send_count_ = std::move(round0);
  have_counts_ = true;
  return bounds;
}

absl::Status NcclAllToAllPrepareAndFinalize::Prepare(const PrepareArgs& args,
                                                     PreparedActivations* out) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  const int world = comm_->world_size(), me = comm_->rank();
  const TensorView& x = args.hidden_states;
  // Preconditions (CheckArgs in PlanChunks): a round of a validated forward.
  assert(x.rank() == 2 && args.topk_ids.rank() == 2 && args.topk_ids.dim(0) == x.dim(0) &&
         args.topk_weights.shape() == args.topk_ids.shape() && x.dim(1) % 8 == 0);
  const int64_t m = x.dim(0), k = x.dim(1), topk = args.topk_ids.dim(1);
  if (m > opts_.max_num_tokens_per_rank) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name(), ": ", m, " tokens exceed max_num_tokens_per_rank=", opts_.max_num_tokens_per_rank,
        " in one round (use PlanChunks)"));
  }
  const int32_t* ids = args.topk_ids.data<int32_t>();
  const float* weights = args.topk_weights.data<float>();
  absl::StatusOr<EpRouting> routing = RouteEpTokens(ids, m, topk, *placement_, opts_.dispatch);
  if (!routing.ok()) return PrefixEpStatus(name(), routing.status());
  if (have_counts_ && routing->send_count != planned_send_count_) {
    // The peers expect what PlanChunks announced; a different exchange would mismatch theirs.
    return absl::InternalError(absl::StrCat(name(), " on rank ", me,
                                            ": Prepare got other "
                                            "tokens than PlanChunks planned for this round"));
  }
  std::vector<int64_t> recv_count;
  if (have_counts_) {
    recv_count = std::move(planned_recv_count_);
  } else {
    std::vector<int64_t> all;
    MOESERVE_RETURN_IF_ERROR(GatherCounts(routing->send_count, &all));
    MOESERVE_RETURN_IF_ERROR(
        Agreed(CheckGatheredCounts(all, world, opts_.max_num_tokens_per_rank * topk, name())));
    recv_count.assign(world, 0);
    for (int p = 0; p < world; ++p) recv_count[p] = all[p * world + me];
  }
  have_counts_ = false;
  const int64_t num_send = routing->num_send();
  int64_t num_recv = 0;
  for (int p = 0; p < world; ++p) num_recv += recv_count[p];

  // Pinned staging: [x in its wire dtype | the plan's block (EpPlanLayout: send_token | rec_ids |
  // rec_w | comb_off (m+1) | comb_slots)]. FP16 / FP32 input becomes BF16 on the device; a
  // strided view is converted on the host instead.
  const DType wire = x.is_contiguous() ? x.dtype() : DType::kBF16;
  const size_t wire_bytes = m * k * DTypeSize(wire);
  const size_t x_bytes = Align256(wire_bytes);
  const EpPlanLayout layout = EpPlanLayout::For(num_send, m, topk);
  const size_t plan_elems = layout.words;
  const size_t in_bytes = x_bytes + plan_elems * 4;
  MOESERVE_ASSIGN_OR_RETURN(void* pin, pin_in_.Get(in_bytes));
  MOESERVE_ASSIGN_OR_RETURN(void* d_in, d_in_.Get(in_bytes));
  auto* pin_x = static_cast<uint8_t*>(pin);
  // Input in device memory (a client's CUDA region) is copied device to device in its dtype;
  // pinned BF16 input goes to the device as it is; anything else through the staging buffer.
  const bool device_x = x.device().space == MemorySpace::kCuda;
  if (device_x && !x.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": hidden_states in device memory must be contiguous"));
  }
  const bool direct_x = m > 0 && (device_x || (wire == DType::kBF16 && x.is_contiguous() &&
                                               IsPinnedHostPointer(x.raw_data())));
  if (m > 0 && !direct_x) {
    if (x.is_contiguous()) {
      copier_.Copy(pin_x, x.raw_data(), wire_bytes);
    } else {
      MOESERVE_RETURN_IF_ERROR(
          ConvertTensor(x, TensorView(pin_x, DType::kBF16, {m, k}, Device::PinnedHost())));
    }
  }
  // The round's plan, filled straight into the staging block (records grouped by destination
  // rank, tokens ascending within each, as the CPU oracle).
  auto handle = std::make_shared<NcclRoundHandle>(
      FillEpDispatchPlan(*routing, ids, weights, *placement_, pin_x + x_bytes));
  handle->recv_count = std::move(recv_count);
  if (direct_x) {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_in, x.raw_data(), wire_bytes,
                        device_x ? cudaMemcpyDefault : cudaMemcpyHostToDevice, stream_));
    MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<uint8_t*>(d_in) + x_bytes,
                                                  pin_x + x_bytes, plan_elems * 4,
                                                  cudaMemcpyHostToDevice, stream_));
  } else {
    MOESERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d_in, pin, in_bytes, cudaMemcpyHostToDevice, stream_));
  }
  const int32_t* d_plan = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(d_in) + x_bytes);
  handle->d_plan = d_plan;
  const int32_t* d_send_token = d_plan + layout.send_token;
  const int32_t* d_rec_ids = d_plan + layout.rec_ids;
  const int32_t* d_rec_w = d_plan + layout.rec_weights;
  auto* d_x = static_cast<const uint16_t*>(d_in);  // BF16 rows
  if (m > 0 && wire != DType::kBF16) {
    MOESERVE_ASSIGN_OR_RETURN(void* d_bf16, d_x_bf16_.Get(m * k * 2));
    if (wire == DType::kFP32) {
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchConvertFp32ToBf16(
          static_cast<const float*>(d_in), static_cast<uint16_t*>(d_bf16), m * k, stream_));
    } else if (wire == DType::kFP16) {
      MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchConvertFp16ToBf16(
          static_cast<const uint16_t*>(d_in), static_cast<uint16_t*>(d_bf16), m * k, stream_));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          name(), ": hidden_states must be bf16, fp16 or fp32, got ", DTypeName(wire)));
    }
    d_x = static_cast<const uint16_t*>(d_bf16);
  }

  // Pack, then one NCCL group for rows, ids and weights.
  MOESERVE_ASSIGN_OR_RETURN(void* d_send_rows, d_send_rows_.Get(num_send * k * 2));
  MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchEpGatherRows(
      d_x, d_send_token, num_send, k, static_cast<uint16_t*>(d_send_rows), stream_));
  MOESERVE_ASSIGN_OR_RETURN(void* d_rows, d_recv_rows_.Get(num_recv * k * 2));
  MOESERVE_ASSIGN_OR_RETURN(void* d_rids, d_recv_ids_.Get(num_recv * topk * 4));
  MOESERVE_ASSIGN_OR_RETURN(void* d_rw, d_recv_w_.Get(num_recv * topk * 4));
  // The batched layout's buffers too, before the collective is queued (see ReleaseSuperseded).
  // (CheckArgs bounded the local experts.)
  const int64_t e = args.num_local_experts;
  const int64_t cap = capacity(), routes = num_recv * topk;
  void* d_a = nullptr;
  void* d_al = nullptr;
  if (batched()) {
    MOESERVE_ASSIGN_OR_RETURN(d_a, d_batched_.Get(e * cap * k * 2));
    MOESERVE_ASSIGN_OR_RETURN(d_al, d_align_.Get((2 * e + 2 + 2 * routes) * 4));
  }
  const EpAllToAllVBytes bytes[3] = {{handle->send_count, handle->recv_count, k * 2},
                                     {handle->send_count, handle->recv_count, topk * 4},
                                     {handle->send_count, handle->recv_count, topk * 4}};
  for (const EpAllToAllVBytes& b : bytes) {
    b.CountPeerBytes(me, &stats_.dispatch_bytes_sent, &stats_.dispatch_bytes_received);
  }
  auto transfer = [](const void* send, void* recv, const EpAllToAllVBytes& b) {
    return AllToAllVTransfer{send, b.send_counts.data(), b.send_displs.data(),
                             recv, b.recv_counts.data(), b.recv_displs.data()};
  };
  const AllToAllVTransfer transfers[3] = {transfer(d_send_rows, d_rows, bytes[0]),
                                          transfer(d_rec_ids, d_rids, bytes[1]),
                                          transfer(d_rec_w, d_rw, bytes[2])};
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllVGroup(transfers));

  out->a1q_scale = TensorView();
  out->topk_ids = TensorView(d_rids, DType::kINT32, {num_recv, topk}, ctx_->tensor_device());
  out->topk_weights = TensorView(d_rw, DType::kFP32, {num_recv, topk}, ctx_->tensor_device());
  out->problem = EpRecvProblem(args, *handle, /*max_num_tokens=*/num_recv);
  if (!batched()) {
    out->format = ActivationFormat::kStandard;
    out->a1q = TensorView(d_rows, DType::kBF16, {num_recv, k}, ctx_->tensor_device());
    out->expert_num_tokens = TensorView();
    out->handle = std::move(handle);
    return absl::OkStatus();
  }
  // BatchedExperts: rows of local expert e are its routes in (record, k) order (stable align),
  // at most capacity() of them (PlanChunks keeps every rank's contribution within
  // max_num_tokens_per_rank).
  auto* counts = static_cast<int32_t*>(d_al);
  int32_t* offsets = counts + e;
  int32_t* sorted = offsets + e + 1;
  int32_t* d_slot = sorted + routes;
  handle->d_slot = d_slot;
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counts, 0, e * 4, stream_));
  if (routes > 0) {
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchMoeAlign(static_cast<int32_t*>(d_rids), routes,
                                                          static_cast<int>(e), counts, offsets,
                                                          sorted, d_slot, stream_));
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchPermuteToBatched(
        static_cast<uint16_t*>(d_rows), static_cast<int32_t*>(d_rids), d_slot, num_recv,
        static_cast<int>(topk), k, static_cast<int>(e), cap, static_cast<uint16_t*>(d_a), stream_));
  }
  out->format = ActivationFormat::kBatchedExperts;
  out->a1q = TensorView(d_a, DType::kBF16, {e, cap, k}, ctx_->tensor_device());
  out->expert_num_tokens = TensorView(counts, DType::kINT32, {e}, ctx_->tensor_device());
  out->problem.max_num_tokens = cap;
  out->handle = std::move(handle);
  return absl::OkStatus();
}

absl::Status NcclAllToAllPrepareAndFinalize::Finalize(
    const TensorView& output, const TensorView& fused_expert_output,
    const PreparedActivations& prepared, const TopKWeightAndReduce& weight_and_reduce) {
  MOESERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm_->device()));
  const auto* h = dynamic_cast<const NcclRoundHandle*>(prepared.handle.get());
  if (h == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": Finalize needs the PreparedActivations of its own Prepare"));
  }
  const int me = comm_->rank();
  const int64_t k = prepared.problem.hidden, topk = h->topk, m = h->num_src_tokens;
  const int64_t num_send = h->num_send(), num_recv = h->num_recv();
  if (output.rank() != 2 || !writes_output_dtype(output.dtype()) || output.dim(0) != m ||
      output.dim(1) != k || !output.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": output must be FP32/BF16/FP16 [", m,
                                                   ", ", k, "], got ", output.DebugString()));
  }
  const TensorView& fused = fused_expert_output;
  if (num_recv > 0 && fused.device() != ctx_->tensor_device()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": expert output must be on ",
                                                   DeviceName(ctx_->tensor_device()), ", got ",
                                                   fused.DebugString()));
  }
  const TopKWeightAndReduce::Kind kind =
      ResolveWeightAndReduce(weight_and_reduce.kind(), opts_.format);
  const int e = static_cast<int>(prepared.problem.num_local_experts);
  const float* w = prepared.topk_weights.data<float>();
  const int32_t* ids = prepared.topk_ids.data<int32_t>();
  void* d_partial = nullptr;
  switch (kind) {
    case TopKWeightAndReduce::Kind::kNoOp:
      if (num_recv > 0 && (fused.numel() != num_recv * k || fused.dtype() != DType::kFP32)) {
        return absl::InvalidArgumentError(absl::StrCat(name(), ": NoOp reduce needs FP32 [",
                                                       num_recv, ", ", k, "] expert output, got ",
                                                       fused.DebugString()));
      }
      d_partial = fused.raw_data();
      break;
    case TopKWeightAndReduce::Kind::kContiguous: {
      if (batched()) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": Contiguous reduce needs Standard-format expert output"));
      }
      MOESERVE_ASSIGN_OR_RETURN(d_partial, d_partial_.Get(num_recv * k * 4));
      if (num_recv > 0) {
        MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceContiguous(
            fused.data<float>(), w, ids, num_recv, static_cast<int>(topk), k, e,
            static_cast<float*>(d_partial), stream_));
      }
      break;
    }
    case TopKWeightAndReduce::Kind::kNaiveBatched: {
      if (!batched()) {
        return absl::FailedPreconditionError(
            absl::StrCat(name(), ": NaiveBatched reduce needs BatchedExperts output"));
      }
      MOESERVE_ASSIGN_OR_RETURN(d_partial, d_partial_.Get(num_recv * k * 4));
      if (num_recv > 0) {
        MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchTopKWeightAndReduceNaiveBatched(
            fused.data<float>(), w, ids, h->d_slot, num_recv, static_cast<int>(topk), k, e,
            capacity(), static_cast<float*>(d_partial), stream_));
      }
      break;
    }
    default:
      return absl::InternalError("unresolved TopKWeightAndReduce");
  }
  // Combine: the partials go back to their source ranks (the reverse of the dispatch). Every
  // buffer after it is sized before it is queued (see ReleaseSuperseded).
  MOESERVE_ASSIGN_OR_RETURN(void* d_comb, d_comb_recv_.Get(num_send * k * 4));
  void* d_out = nullptr;
  if (m > 0) {
    MOESERVE_ASSIGN_OR_RETURN(d_out, d_out_.Get(m * k * 4));
    MOESERVE_RETURN_IF_ERROR(answer_.Reserve(output));
  }
  const EpAllToAllVBytes bytes(h->recv_count, h->send_count, k * 4);
  bytes.CountPeerBytes(me, &stats_.combine_bytes_sent, &stats_.combine_bytes_received);
  MOESERVE_RETURN_IF_ERROR(comm_->AllToAllV(d_partial, bytes.send_counts, bytes.send_displs, d_comb,
                                            bytes.recv_counts, bytes.recv_displs));
  if (m > 0) {
    // Device twin of the staging layout: [send_token | rec_ids | rec_w | comb_off | comb_slots].
    MOESERVE_CUDA_RETURN_IF_ERROR(kernels::LaunchEpCombineReduce(
        static_cast<const float*>(d_comb), h->d_plan + h->layout().comb_offsets,
        h->d_plan + h->layout().comb_slots, m, k, static_cast<float*>(d_out), stream_));
    MOESERVE_RETURN_IF_ERROR(answer_.Enqueue(static_cast<const float*>(d_out), output, stream_));
    MOESERVE_RETURN_IF_ERROR(comm_->Synchronize());  // bounded, aborts the group on a timeout
    answer_.Finish();
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
  if (comm->stream() != ctx->stream()) {
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
