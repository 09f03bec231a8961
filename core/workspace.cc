#include "core/workspace.h"

#include <chrono>

namespace moeserve {
namespace {

class HostStageTimer final : public StageTimer {
 public:
  void Reset() override {
    elapsed_.fill(0);
    running_ = -1;
  }
  absl::Status Mark(Stage stage) override {
    if (stage == running_) return absl::OkStatus();
    const Clock::time_point now = Clock::now();
    Close(now);
    running_ = stage;
    since_ = now;
    return absl::OkStatus();
  }
  absl::Status Stop() override {
    Close(Clock::now());
    running_ = -1;
    return absl::OkStatus();
  }
  absl::StatusOr<std::array<double, kNumStages>> ElapsedUs() override { return elapsed_; }

 private:
  using Clock = std::chrono::steady_clock;
  void Close(Clock::time_point now) {
    if (running_ >= 0) {
      elapsed_[running_] += std::chrono::duration<double, std::micro>(now - since_).count();
    }
  }
  int running_ = -1;
  Clock::time_point since_;
  std::array<double, kNumStages> elapsed_{};
};

class HostWorkspaceAllocator final : public WorkspaceAllocator {
 public:
  Device device() const override { return Device::Host(); }
  absl::StatusOr<TensorView> Get(Slot slot, DType dtype, const Shape& shape) override {
    return buffers_[slot].TryGet(dtype, shape);
  }
  std::unique_ptr<StageTimer> MakeStageTimer() const override { return MakeHostStageTimer(); }

 private:
  HostBuffer buffers_[kNumSlots];
};

}  // namespace

absl::StatusOr<std::unique_ptr<StepGraph>> WorkspaceAllocator::Capture(
    const std::function<absl::Status()>&) {
  return absl::UnimplementedError("graphs need a device allocator (CUDA); this one has none");
}

std::unique_ptr<WorkspaceAllocator> MakeHostWorkspaceAllocator() {
  return std::make_unique<HostWorkspaceAllocator>();
}

std::unique_ptr<StageTimer> MakeHostStageTimer() { return std::make_unique<HostStageTimer>(); }

}  // namespace moeserve
