// The decode GEMMs' split-K workspace (kernels::MoeGemmParams::split_workspace) for one stream.
// No CUDA types here. Not thread-safe: one owner, whose launches run on one stream.
#ifndef MOESERVE_CORE_CUDA_SPLIT_K_WORKSPACE_H_
#define MOESERVE_CORE_CUDA_SPLIT_K_WORKSPACE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/cuda/grow_only_buffer.h"

namespace moeserve {

class SplitKWorkspace {
 public:
  // kernels::kMoeGemmSplitWorkspaceBytes on `device`, counters zeroed (synchronously) before it
  // returns: call it where the Experts are made, never while a stream is being captured.
  static absl::StatusOr<std::unique_ptr<SplitKWorkspace>> Create(int device);
  SplitKWorkspace(const SplitKWorkspace&) = delete;
  SplitKWorkspace& operator=(const SplitKWorkspace&) = delete;

  void* data() const { return data_; }

 private:
  SplitKWorkspace() = default;
  GrowOnlyBuffer buffer_{GrowOnlyBuffer::Memory::kDevice, 0, false};  // one size, never grown
  void* data_ = nullptr;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_CUDA_SPLIT_K_WORKSPACE_H_
