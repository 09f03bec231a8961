// The CUDA backend of the modular kernel for one GPU: resident packed expert weights, CUDA
// Experts (Standard and BatchedExperts formats) and a no-EP PrepareAndFinalize that moves
// requests host -> device through pinned memory and answers device -> host.
//
// The pieces plug into the unchanged core ModularKernel:
//
//   auto ctx = CreateCudaContext(/*device=*/0);                      // one per GPU / rank
//   auto dev_weights = DeviceWeightStore::Create(*host_store, *ctx); // uploads every layer once
//   auto kernel = ModularKernel::Create(
//       *CreateCudaNoEpPrepareAndFinalize(*ctx, max_tokens, ActivationFormat::kStandard),
//       *CreateCudaExperts(*ctx, *dev_weights, ActivationFormat::kStandard));
//   kernel->Forward({.hidden_states = host, .topk_ids = host, ..., .weights =
//   host_store->layer(l)},
//                   host_output_fp32);
//
// Device memory (activations, routing workspaces, expert outputs) lives in the CudaContext that
// the PrepareAndFinalize and the Experts share, not in ModularKernel's host workspaces:
// CudaExperts::GetWorkspaceShapes() asks ModularKernel for empty host workspaces and an empty
// fused output; Finalize reads the Experts' device output from the context. Every device call
// runs on the context's stream; Forward synchronizes once, in Finalize, after the answer's
// device -> host copy. Weights are looked up by the host LayerWeights pointer that
// ModularKernelArgs::weights carries, so callers pass the same host views as on the CPU path.
//
// This header compiles without CUDA (no CUDA types); the implementation needs
// MOESERVE_ENABLE_CUDA (target moeserve_core_cuda).
#ifndef MOESERVE_CORE_CUDA_CUDA_BACKEND_H_
#define MOESERVE_CORE_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/modular_kernel.h"
#include "core/weights.h"

namespace moeserve {

// Number of CUDA devices visible (0 when there is no GPU or no driver).
int CudaDeviceCount();

// One GPU's stream and device buffers, shared by that GPU's PrepareAndFinalize and Experts.
// Not thread-safe: one forward at a time (as ModularKernel).
class CudaContext;
absl::StatusOr<std::shared_ptr<CudaContext>> CreateCudaContext(int device);
// The context's cudaStream_t, as an opaque pointer (for callers that add their own work).
void* CudaContextStream(const CudaContext& ctx);
// The device FP32 output the last CudaExperts::Apply on `ctx` wrote (Standard: [M, topk, K];
// BatchedExperts: [E, max_tokens, K]), for PrepareAndFinalize implementations in other files
// (the NCCL all-to-all ones).
TensorView CudaContextFusedOutput(const CudaContext& ctx);

// Every MoE layer's local experts, packed for the CUDA kernels (kernels/cuda/moe_gemm.cuh) and
// resident on the context's device. Immutable after Create; safe to share across threads.
struct DevicePackedLayer;
class DeviceWeightStore {
 public:
  // Uploads and packs every layer of `host` (synchronous; blocks until resident).
  static absl::StatusOr<std::shared_ptr<DeviceWeightStore>> Create(const ExpertWeightStore& host,
                                                                   const CudaContext& ctx);
  // The same for loose layers; Find() then answers for exactly these pointers.
  static absl::StatusOr<std::shared_ptr<DeviceWeightStore>> CreateFromLayers(
      const std::vector<const LayerWeights*>& layers, const CudaContext& ctx);
  ~DeviceWeightStore();

  // The resident copy of `host_layer`, or null if it was not uploaded.
  const DevicePackedLayer* Find(const LayerWeights* host_layer) const;
  int64_t device_bytes() const { return device_bytes_; }

 private:
  DeviceWeightStore() = default;
  std::vector<std::pair<const LayerWeights*, std::unique_ptr<DevicePackedLayer>>> layers_;
  int64_t device_bytes_ = 0;
  int device_ = 0;
};

// No expert parallelism, one GPU. Standard: a1q BF16 [M, K] on the device. BatchedExperts: a1q
// BF16 [E, max_tokens, K] built on the device (max_tokens = the largest expert's routes in this
// forward, so no route is ever dropped). Finalize applies the Experts' TopKWeightAndReduce on the
// device (Delegate -> Contiguous) and copies [M, K] FP32 to the host output.
absl::StatusOr<std::unique_ptr<PrepareAndFinalize>> CreateCudaNoEpPrepareAndFinalize(
    std::shared_ptr<CudaContext> ctx, int64_t max_num_tokens, ActivationFormat format);

// CUDA Experts for BF16 or MXFP8 weights (BF16 activations): Standard ("CudaExperts", output per
// route, Contiguous reduce) or BatchedExperts ("CudaBatchedExperts", NaiveBatched reduce).
// Requires hidden % 8 == 0 (16-byte activation rows).
absl::StatusOr<std::unique_ptr<Experts>> CreateCudaExperts(
    std::shared_ptr<CudaContext> ctx, std::shared_ptr<const DeviceWeightStore> weights,
    ActivationFormat format);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_CUDA_BACKEND_H_
