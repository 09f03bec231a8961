// The CUDA backend of the modular kernel for one GPU: resident packed expert weights, CUDA
// Experts (Standard and BatchedExperts formats), a no-EP PrepareAndFinalize that moves requests
// host -> device through pinned memory and answers device -> host, and the WorkspaceAllocator
// that gives ModularKernel its workspaces on the GPU.
//
//   auto ctx = CudaContext::Create(/*device=*/0);                    // one per GPU / rank
//   auto dev_weights = DeviceWeightStore::Create(*host_store, **ctx); // uploads every layer once
//   auto kernel = ModularKernel::Create(
//       *CreateCudaNoEpPrepareAndFinalize(*ctx, max_tokens, ActivationFormat::kStandard),
//       *CreateCudaExperts(*ctx, *dev_weights, ActivationFormat::kStandard),
//       *CreateCudaWorkspaceAllocator(*ctx));
//   kernel->Forward({..., .layer = l, .weights = host_store->layer(l)}, host_output);
//
// Each PrepareAndFinalize owns the device buffers it fills (a1q, routing, its staging); the
// workspaces and the fused expert output come from ModularKernel's allocator and are handed to
// Apply and Finalize, as in vLLM. Every device call runs on the context's stream; a forward
// synchronizes once per round, at the end of Finalize, after the answer's device -> host copy.
// Stage times are CUDA event times on that stream.
//
// This header compiles without CUDA (no CUDA types); the implementation needs
// MOESERVE_ENABLE_CUDA (target moeserve_core_cuda).
#ifndef MOESERVE_CORE_CUDA_CUDA_BACKEND_H_
#define MOESERVE_CORE_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/modular_kernel.h"
#include "core/tensor.h"
#include "core/weights.h"
#include "core/workspace.h"

namespace moeserve {

// Number of CUDA devices visible (0 when there is no GPU or no driver).
int CudaDeviceCount();

// One GPU and the stream its rank's work runs on. Immutable after Create; owns the stream.
class CudaContext {
 public:
  // FAILED_PRECONDITION when `device` is not a visible CUDA device.
  static absl::StatusOr<std::shared_ptr<CudaContext>> Create(int device);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  int device() const { return device_; }
  // The cudaStream_t, as an opaque pointer.
  void* stream() const { return stream_; }
  int num_sms() const { return num_sms_; }
  // The Device of tensors on this GPU.
  Device tensor_device() const { return Device::Cuda(device_); }

 private:
  CudaContext() = default;
  int device_ = 0;
  int num_sms_ = 0;
  void* stream_ = nullptr;
};

// Grow-only device workspaces on ctx's GPU and a CUDA-event StageTimer on its stream.
absl::StatusOr<std::unique_ptr<WorkspaceAllocator>> CreateCudaWorkspaceAllocator(
    std::shared_ptr<CudaContext> ctx);

// Every MoE layer's local experts, packed for the CUDA kernels (kernels/cuda/moe_gemm.cuh) and
// resident on the context's device, keyed by layer index. Immutable after Create; safe to share
// across threads.
struct DevicePackedLayer;
class DeviceWeightStore {
 public:
  // Uploads and packs every MoE layer of `host` (synchronous; blocks until resident).
  static absl::StatusOr<std::shared_ptr<DeviceWeightStore>> Create(const ExpertWeightStore& host,
                                                                   const CudaContext& ctx);
  // The same for loose layers: layers[i] becomes layer i (null entries: no experts).
  static absl::StatusOr<std::shared_ptr<DeviceWeightStore>> CreateFromLayers(
      const std::vector<const LayerWeights*>& layers, const CudaContext& ctx);
  ~DeviceWeightStore();

  // Layer `index`'s resident experts, or null if it has none here.
  const DevicePackedLayer* layer(int index) const;
  // The same for an Experts::Apply of `caller`: FAILED_PRECONDITION when the layer has no
  // experts here, INTERNAL when `host` (optional: the layer's host weights handed in) does not
  // match their shape.
  absl::StatusOr<const DevicePackedLayer*> ResidentLayer(int index, const LayerWeights* host,
                                                         absl::string_view caller) const;
  int num_layers() const { return static_cast<int>(layers_.size()); }
  int device() const { return device_; }
  int64_t device_bytes() const { return device_bytes_; }

 private:
  DeviceWeightStore() = default;
  std::vector<std::unique_ptr<DevicePackedLayer>> layers_;
  int64_t device_bytes_ = 0;
  int device_ = 0;
};

// No expert parallelism, one GPU. Standard: a1q BF16 [M, K] on the device. BatchedExperts: a1q
// BF16 [E, max_tokens, K] built on the device (max_tokens = the largest expert's routes in this
// forward, so no route is ever dropped). Finalize applies the Experts' TopKWeightAndReduce on the
// device (Delegate -> Contiguous), converts to the output's dtype (FP32, BF16 or FP16) there and
// copies [M, K] straight into the host output (through pinned staging unless it is pinned).
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
