// Expert-parallel PrepareAndFinalize on GPUs over NCCL: the device twins of
// core/cpu/all_to_all_prepare_finalize.h, planned by the same host-side EP plan
// (core/ep_plan.h), so the CPU implementations stay the oracle:
//  - each source token is sent once per destination rank that hosts at least one of its experts
//    (kPerRoute: once per route, to measure what deduplication saves), as a BF16 row plus the
//    topk local expert ids on that rank (-1 elsewhere) and the topk router weights;
//  - the expert rank applies the weights and reduces its own routes (the Experts'
//    TopKWeightAndReduce, on the device), so the combine sends back one FP32 partial row per
//    record and the source rank sums each token's partials in ascending rank order.
// "NcclAllToAllContiguous" (Standard format, a1q [M_recv, K]) and "NcclAllToAllBatched"
// (BatchedExperts, a fixed capacity of max_num_tokens_per_rank x num_dispatchers rows per local
// expert; PlanChunks splits a batch into rounds so no route is ever dropped).
//
// Device work: Prepare converts the host input to BF16 in pinned memory, copies it and a small
// routing plan (built on the host from the host ids) to the device, packs the send rows with a
// gather kernel and runs one NCCL group of sends/receives (rows, ids, weights) per round.
// Finalize reduces on the expert rank, runs the combine group, sums on the source rank and
// copies [M, K] FP32 to the host output; it reads the round's plan from
// PreparedActivations::handle. Host synchronizations per forward: one after the
// count exchange in PlanChunks (an NCCL all-gather of [status, rounds, round-0 counts per peer],
// which also makes a refusal on one rank a refusal on all, without aborting NCCL), one per
// extra round for its counts, and one at the end of each round's Finalize (the answer's D2H).
// Everything runs on the CudaContext's stream (the NcclCommunicator's stream).
//
// Header without CUDA/NCCL types; implementation needs MOESERVE_ENABLE_CUDA and
// MOESERVE_HAVE_NCCL (target moeserve_core_cuda).
#ifndef MOESERVE_CORE_CUDA_NCCL_ALL_TO_ALL_H_
#define MOESERVE_CORE_CUDA_NCCL_ALL_TO_ALL_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/comm/nccl_communicator.h"
#include "core/cpu/all_to_all_prepare_finalize.h"
#include "core/cuda/cuda_backend.h"
#include "core/modular_kernel.h"
#include "core/placement.h"

namespace moeserve {

struct NcclAllToAllOptions {
  int64_t max_num_tokens_per_rank = 256;
  ActivationFormat format = ActivationFormat::kStandard;
  AllToAllOptions::Dispatch dispatch = AllToAllOptions::Dispatch::kPerRank;
  int64_t max_rounds = int64_t{1} << 20;  // as AllToAllOptions::max_rounds
};

// `ctx` and `comm` must be the same rank's (comm->stream() == the context's stream).
absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> CreateNcclAllToAllPrepareAndFinalize(
    std::shared_ptr<CudaContext> ctx, std::shared_ptr<NcclCommunicator> comm,
    std::shared_ptr<const Placement> placement, NcclAllToAllOptions options);

// A failure every rank agreed on in PlanChunks (the NCCL group is intact; no abort needed).
bool IsAgreedFailure(const absl::Status& status);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_NCCL_ALL_TO_ALL_H_
