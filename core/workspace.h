// Where ModularKernel gets its per-forward buffers and how it times its stages, for the device
// the activations live on (vLLM's modular kernel allocates workspace13, workspace2 and the fused
// output on a1q's device; so does ours).
//
// One WorkspaceAllocator per ModularKernel (per rank). Not thread-safe: one forward at a time,
// as ModularKernel.
#ifndef MOESERVE_CORE_WORKSPACE_H_
#define MOESERVE_CORE_WORKSPACE_H_

#include <array>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace moeserve {

// Times the stages of a forward with boundary marks: Mark(s) means "from here on the work
// counts toward stage s", Stop() ends the last interval; stages may recur (one per round) and
// ElapsedUs sums them. The host timer reads the wall clock at each mark; device timers record
// one event per mark on their stream, so a stage's time is what the device spent between two
// marks, not the host's enqueue time. A mark for the stage already running records nothing.
class StageTimer {
 public:
  enum Stage { kPrepare = 0, kExperts = 1, kFinalize = 2, kNumStages = 3 };
  virtual ~StageTimer() = default;
  // Forgets every mark (start of a forward).
  virtual void Reset() = 0;
  virtual absl::Status Mark(Stage stage) = 0;
  // Ends the running stage; a second Stop before the next Mark does nothing.
  virtual absl::Status Stop() = 0;
  // Microseconds per stage, summed over the intervals. Device timers wait for the last mark.
  virtual absl::StatusOr<std::array<double, kNumStages>> ElapsedUs() = 0;

  // Marks inside a captured graph (StepGraph), for timers that support them (a CUDA timer: an
  // event node, recorded again at every replay into one event per stage). MarkInGraph is
  // called while the graph is captured, instead of Mark; after each launch of that graph,
  // MarkReplayed(stage) for each stage it marked, in the same order, takes the replay's event
  // as the next mark. Timers without them (the default) keep the stages of a graphed step
  // outside it.
  virtual bool marks_in_graphs() const { return false; }
  virtual absl::Status MarkInGraph(Stage stage) {
    return absl::UnimplementedError("this timer cannot mark inside a graph");
  }
  virtual absl::Status MarkReplayed(Stage stage) {
    return absl::UnimplementedError("this timer cannot mark inside a graph");
  }
  // Called once at the end of a capture that made MarkInGraph calls, before the capture ends
  // (a CUDA timer joins the side branch its event nodes hang on back into the stream).
  virtual absl::Status EndMarksInGraph() { return absl::OkStatus(); }
};

// Device work captured once and replayed (a CUDA graph): Launch enqueues all of it again, with
// the same arguments and addresses, on the stream it was captured from. Not thread-safe.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
  virtual absl::Status Launch() = 0;
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
  // Captures, without running it, the device work that `enqueue` puts on this allocator's
  // stream. `enqueue` must only enqueue: no host waits, no allocation, no host reads of data
  // that changes between replays. UNIMPLEMENTED where the device has no graphs (host memory).
  virtual absl::StatusOr<std::unique_ptr<StepGraph>> Capture(
      const std::function<absl::Status()>& enqueue);
  // Frees what growths of the slots replaced. A growth keeps the replaced buffer, which work
  // queued earlier may still use, instead of freeing it at once (a CUDA free waits for the whole
  // device); ModularKernel calls this at the start of each forward, when its earlier work is
  // done. May wait for the device.
  virtual void ReleaseSuperseded() {}
};

// Host memory (64-byte aligned) and the host clock.
std::unique_ptr<WorkspaceAllocator> MakeHostWorkspaceAllocator();
std::unique_ptr<StageTimer> MakeHostStageTimer();

}  // namespace moeserve

#endif  // MOESERVE_CORE_WORKSPACE_H_
