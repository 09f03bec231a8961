#include "core/workspace.h"

#include <chrono>

namespace moeserve {
namespace {

class HostStageTimer final : public StageTimer {
 public:
  void Reset() override { elapsed_.fill(0); }
  absl::Status Begin(Stage stage) override {
    begin_[stage] = Clock::now();
    return absl::OkStatus();
  }
  absl::Status End(Stage stage) override {
    elapsed_[stage] +=
        std::chrono::duration<double, std::micro>(Clock::now() - begin_[stage]).count();
    return absl::OkStatus();
  }
  absl::StatusOr<std::array<double, kNumStages>> ElapsedUs() override { return elapsed_; }

 private:
  using Clock = std::chrono::steady_clock;
  std::array<Clock::time_point, kNumStages> begin_;
  std::array<double, kNumStages> elapsed_{};
};

class HostWorkspaceAllocator final : public WorkspaceAllocator {
 public:
  Device device() const override { return Device::Host(); }
  absl::StatusOr<TensorView> Get(Slot slot, DType dtype, const Shape& shape) override {
    return buffers_[slot].Get(dtype, shape);
  }
  std::unique_ptr<StageTimer> MakeStageTimer() const override { return MakeHostStageTimer(); }

 private:
  HostBuffer buffers_[kNumSlots];
};

}  // namespace

std::unique_ptr<WorkspaceAllocator> MakeHostWorkspaceAllocator() {
  return std::make_unique<HostWorkspaceAllocator>();
}

std::unique_ptr<StageTimer> MakeHostStageTimer() { return std::make_unique<HostStageTimer>(); }

}  // namespace moeserve
