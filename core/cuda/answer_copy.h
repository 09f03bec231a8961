// The last step of a CUDA Finalize: the answer, reduced in FP32 on the device, converted to the
// caller's dtype on the device and copied once into the caller's host buffer (straight into it
// when it is page-locked, else through pinned staging). No CUDA types; one per PrepareAndFinalize,
// not thread-safe.
#ifndef MOESERVE_CORE_CUDA_ANSWER_COPY_H_
#define MOESERVE_CORE_CUDA_ANSWER_COPY_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "core/cuda/grow_only_buffer.h"
#include "core/parallel_copy.h"
#include "core/tensor.h"

namespace moeserve {

class AnswerCopy {
 public:
  // `copier` (owned by the caller, outlives this) moves staged bytes in Finish().
  explicit AnswerCopy(ParallelCopier* copier) : copier_(copier) {}

  // Enqueues on `stream` (a cudaStream_t of the current device): FP32 -> output.dtype() (FP32,
  // BF16 or FP16, bit-identical to the host conversion) of d_answer [rows, cols] (device,
  // contiguous) and the copy into `output` (contiguous, same shape: host memory, or device
  // memory of any GPU, copied device to device).
  // The caller synchronizes the stream, then calls Finish().
  absl::Status Enqueue(const float* d_answer, const TensorView& output, void* stream);
  // The same for an answer already in output.dtype() on the device (e.g. a reduce that rounded
  // as it stored): the copy alone.
  absl::Status EnqueueInOutputDtype(const void* d_answer, const TensorView& output, void* stream);
  // After the stream synchronized: moves staged bytes into the output (nothing when direct).
  void Finish();
  // Grows now what Enqueue(..., output, ...) would grow, so that a caller can size its buffers
  // before it queues work that may wait on a peer (a growth allocates; see GrowOnlyBuffer).
  absl::Status Reserve(const TensorView& output);
  // GrowOnlyBuffer::ReleaseSuperseded of both buffers: where no earlier copy is still queued.
  void ReleaseSuperseded();

 private:
  GrowOnlyBuffer converted_{GrowOnlyBuffer::Memory::kDevice, 512, /*quarter_slack=*/true};
  GrowOnlyBuffer staging_{GrowOnlyBuffer::Memory::kPinnedHost, 4096, /*quarter_slack=*/true};
  ParallelCopier* copier_;
  void* pending_dst_ = nullptr;
  const void* pending_src_ = nullptr;
  size_t pending_bytes_ = 0;
};

// Enqueues on `stream` the conversion of d_answer (FP32, n values, device) into d_out in `dtype`
// (BF16 or FP16, bit-identical to the host conversion). INVALID_ARGUMENT for other dtypes.
absl::Status ConvertAnswerOnDevice(const float* d_answer, DType dtype, void* d_out, int64_t n,
                                   void* stream);

// Whether host pointer `p` is page-locked (cudaMallocHost / cudaHostRegister).
bool IsPinnedHostPointer(const void* p);

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_ANSWER_COPY_H_
