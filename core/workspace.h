// Where ModularKernel gets its per-forward buffers and how it times its stages, for the device
// the activations live on (vLLM's modular kernel allocates workspace13, workspace2 and the fused
// output on a1q's device; so does ours).
//
// One WorkspaceAllocator per ModularKernel (per rank). Not thread-safe: one forward at a time,
// as ModularKernel.
#ifndef MOESERVE_CORE_WORKSPACE_H_
#define MOESERVE_CORE_WORKSPACE_H_

#include <array>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace moeserve {

// Times the stages of a forward. Begin/End pairs may repeat (one per round); ElapsedUs sums
// them. The host timer reads the wall clock when Begin/End are called; device timers record
// events on their stream, so a stage's time is what the device spent between the two marks,
// not the host's enqueue time.
class StageTimer {
 public:
  enum Stage { kPrepare = 0, kExperts = 1, kFinalize = 2, kNumStages = 3 };
  virtual ~StageTimer() = default;
  // Forgets every mark (start of a forward).
  virtual void Reset() = 0;
  virtual absl::Status Begin(Stage stage) = 0;
  virtual absl::Status End(Stage stage) = 0;
  // Microseconds per stage, summed over the marked pairs. Device timers wait for the last mark.
  virtual absl::StatusOr<std::array<double, kNumStages>> ElapsedUs() = 0;
};

class WorkspaceAllocator {
 public:
  enum Slot { kWorkspace13 = 0, kWorkspace2 = 1, kFusedOutput = 2, kNumSlots = 3 };
  virtual ~WorkspaceAllocator() = default;
  // The device every returned view lives on.
  virtual Device device() const = 0;
  // A contiguous view of `shape` on device(), backed by `slot`'s grow-only buffer (contents
  // unspecified). Valid until the next Get of the same slot. RESOURCE_EXHAUSTED when the
  // memory cannot be had.
  virtual absl::StatusOr<TensorView> Get(Slot slot, DType dtype, const Shape& shape) = 0;
  // A timer for work on this device (for a CUDA allocator: on its stream).
  virtual std::unique_ptr<StageTimer> MakeStageTimer() const = 0;
};

// Host memory (64-byte aligned) and the host clock.
std::unique_ptr<WorkspaceAllocator> MakeHostWorkspaceAllocator();
std::unique_ptr<StageTimer> MakeHostStageTimer();

}  // namespace moeserve

#endif  // MOESERVE_CORE_WORKSPACE_H_
