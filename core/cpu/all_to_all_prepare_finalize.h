// Expert-parallel PrepareAndFinalize implementations over a Communicator (host memory).
//
// Both dispatch the same way, by the EP plan of core/ep_plan.h: each source token is sent once
// per destination rank that hosts at least one of its experts (not once per route), as a record
//   [a1q row (K x activation dtype) | topk local expert ids on that rank, -1 elsewhere (INT32)
//    | topk router weights (FP32)],
// after an all-gather of per-peer record counts. Prepare hands the round's EpDispatchPlan to
// Finalize as PreparedActivations::handle. The expert rank applies the top-k weights and
// reduces its own routes (in Experts::Apply or in Finalize, per TopKWeightAndReduce), so the
// combine sends back one partial [K] FP32 row per record and the source rank sums the partials
// of each token in ascending rank order (deterministic).
//
//  - AllToAllContiguous (DeepEP high-throughput style): Standard format, a1q [M_recv, K] with
//    the records' local ids/weights [M_recv, topk]. Delegate resolves to Contiguous.
//  - AllToAllBatched (DeepEP low-latency style): BatchedExperts format, a fixed capacity of
//    max_num_tokens_per_rank x num_dispatchers rows per local expert, a1q [E_local, max_tokens,
//    K] + expert_num_tokens [E_local]; rows of expert e are its routes in (record, k) order, and
//    the records' ids/weights [M_recv, topk] are passed too. Delegate resolves to NaiveBatched.
//    PlanChunks splits a forward into rounds so that no rank contributes more than
//    max_num_tokens_per_rank rows to any expert in a round: a batch over capacity runs in more
//    rounds, never truncated.
//
// PlanChunks validates the forward (ValidateEpPrepareArgs, expert ids); Prepare expects a round
// of a forward PlanChunks accepted. Finalize takes the PreparedActivations of the matching
// Prepare.
//
// Every rank must call PlanChunks / Prepare / Finalize of its own instance in the same order
// (they run collectives). Not thread-safe; one instance per rank. Errors from the communicator
// (DEADLINE_EXCEEDED, ABORTED, INTERNAL) are returned as they come; the owner aborts the group
// when a rank fails outside a collective so that peers do not wait.
#ifndef MOESERVE_CORE_CPU_ALL_TO_ALL_PREPARE_FINALIZE_H_
#define MOESERVE_CORE_CPU_ALL_TO_ALL_PREPARE_FINALIZE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "core/comm/communicator.h"
#include "core/ep_plan.h"
#include "core/modular_kernel.h"
#include "core/placement.h"

namespace moeserve {

struct AllToAllOptions {
  // Most source tokens one rank submits to one dispatch round (and, for the batched format,
  // most rows one rank contributes to one expert in a round).
  int64_t max_num_tokens_per_rank = 256;
  QuantConfig quant;
  // kPerRank: one record per (token, destination rank). kPerRoute: one record per route, as a
  // dispatch without deduplication would send; kept to measure what deduplication saves.
  using Dispatch = EpDispatchMode;
  Dispatch dispatch = Dispatch::kPerRank;
  // Most dispatch rounds a rank may announce for one forward: a round carries at least one
  // token, so the most tokens of a forward. A larger gathered count is a broken peer (DATA_LOSS
  // on every rank).
  int64_t max_rounds = int64_t{1} << 20;
};

class AllToAllPrepareAndFinalizeBase : public PrepareAndFinalize {
 public:
  std::optional<DType> topk_indices_dtype() const override { return DType::kINT32; }
  int64_t max_num_tokens_per_rank() const override { return options_.max_num_tokens_per_rank; }
  int num_dispatchers() const override { return comm_->world_size(); }
  const QuantConfig& quant_config() const override { return options_.quant; }
  absl::StatusOr<std::vector<int64_t>> PlanChunks(const PrepareArgs& args) override;
  absl::Status Finalize(const TensorView& output, const TensorView& fused_expert_output,
                        const PreparedActivations& prepared,
                        const TopKWeightAndReduce& weight_and_reduce) override;
  TransferStats transfer_stats() const override { return stats_; }

 protected:
  AllToAllPrepareAndFinalizeBase(std::shared_ptr<Communicator> comm,
                                 std::shared_ptr<const Placement> placement,
                                 AllToAllOptions options);
  // Quantizes, plans, exchanges counts and sends the records; afterwards recv_ holds the plan's
  // num_recv() records grouped by source rank, and recv_ids_ / recv_weights_ their ids and
  // weights [num_recv, topk]. Returns the round's plan (recv_count filled).
  absl::StatusOr<std::shared_ptr<EpDispatchPlan>> Dispatch(const PrepareArgs& args);
  // Whether PlanChunks must also bound rows per expert (fixed-capacity formats).
  virtual bool bounded_expert_rows() const = 0;

  int64_t record_bytes() const { return record_bytes_; }
  const std::byte* record(int64_t i) const { return recv_.data() + i * record_bytes_; }
  int rank() const { return comm_->rank(); }

  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<const Placement> placement_;
  AllToAllOptions options_;
  HostBuffer recv_ids_, recv_weights_;

 private:
  // Scratch only: the round's plan travels in PreparedActivations::handle.
  int64_t record_bytes_ = 0;            // layout of send_ / recv_
  std::vector<std::byte> send_, recv_;  // record buffers
  std::vector<float> combine_recv_;     // [send slots, K] partials coming back
  HostBuffer a1q_src_, partial_;
  TransferStats stats_;
};

class AllToAllContiguousPrepareAndFinalize final : public AllToAllPrepareAndFinalizeBase {
 public:
  static constexpr absl::string_view kName = "AllToAllContiguous";
  AllToAllContiguousPrepareAndFinalize(std::shared_ptr<Communicator> comm,
                                       std::shared_ptr<const Placement> placement,
                                       AllToAllOptions options)
      : AllToAllPrepareAndFinalizeBase(std::move(comm), std::move(placement), options) {}
  absl::string_view name() const override { return kName; }
  ActivationFormat activation_format() const override { return ActivationFormat::kStandard; }
  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override;

 protected:
  bool bounded_expert_rows() const override { return false; }

 private:
  HostBuffer a1q_;
};

class AllToAllBatchedPrepareAndFinalize final : public AllToAllPrepareAndFinalizeBase {
 public:
  static constexpr absl::string_view kName = "AllToAllBatched";
  AllToAllBatchedPrepareAndFinalize(std::shared_ptr<Communicator> comm,
                                    std::shared_ptr<const Placement> placement,
                                    AllToAllOptions options)
      : AllToAllPrepareAndFinalizeBase(std::move(comm), std::move(placement), options) {}
  absl::string_view name() const override { return kName; }
  ActivationFormat activation_format() const override { return ActivationFormat::kBatchedExperts; }
  // Rows per local expert in a1q.
  int64_t max_tokens() const { return max_num_tokens_per_rank() * num_dispatchers(); }
  absl::Status Prepare(const PrepareArgs& args, PreparedActivations* out) override;

 protected:
  bool bounded_expert_rows() const override { return true; }

 private:
  HostBuffer a1q_, expert_num_tokens_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CPU_ALL_TO_ALL_PREPARE_FINALIZE_H_
