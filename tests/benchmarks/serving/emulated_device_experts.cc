// An Experts for scheduler experiments on a machine without a GPU: the CPU's BlasExperts
// computes the answer (so every call is still checked), then the step waits until a GPU's
// step would have ended, `--emulate_step_us + --emulate_token_us x tokens` after it began,
// holding one process-wide "device" lock meanwhile, as a GPU runs one step's experts at a
// time; with --emulate_host_us the step first spends that long outside the lock, as a step's
// host staging and launch do (another lane's device work may run meanwhile). A GPU decode step
// costs about the same whatever its size (it reads every weight): seed layer MXFP8 on an H200, 395
// us at 16 tokens, 441 at 64, 1186 at 1024 (tests/benchmarks/cuda/RESULTS.md), so A ~ 385 us and B
// ~ 0.8 us; the CPU's own experts cost grows with the tokens instead, which hides what the batcher
// does on a GPU.
//
// Linked into moeserve_emulated (server/main.cc plus this file), registered from a static
// initializer as "emulated_device" (--experts emulated_device). Not part of the server.
#include <sys/prctl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/flags/flag.h"
#include "core/cpu/cpu_experts.h"
#include "core/provider_registry.h"

ABSL_FLAG(
    double, emulate_step_us, 400,
    "--experts emulated_device: a step's fixed time (us), as a GPU decode step's weight read");
ABSL_FLAG(double, emulate_token_us, 0.8, "--experts emulated_device: a step's time per token (us)");
ABSL_FLAG(double, emulate_host_us, 0,
          "--experts emulated_device: a step's host work before its device work (us; staging "
          "and launching, about 60-100 us of an H200 decode step), outside the device lock");

namespace moeserve {
namespace {

std::mutex& DeviceLock() {
  static std::mutex* lock = new std::mutex;
  return *lock;
}

class EmulatedDeviceExperts final : public Experts {
 public:
  static constexpr absl::string_view kName = "EmulatedDeviceExperts";
  EmulatedDeviceExperts(int threads, double step_us, double token_us, double host_us)
      : inner_(threads), step_us_(step_us), token_us_(token_us), host_us_(host_us) {}
  absl::string_view name() const override { return kName; }
  ActivationFormats activation_formats() const override { return inner_.activation_formats(); }
  bool supports_expert_map() const override { return inner_.supports_expert_map(); }
  bool supports_weight_format(WeightFormat f) const override {
    return inner_.supports_weight_format(f);
  }
  DType activation_dtype() const override { return inner_.activation_dtype(); }
  WorkspaceShapes GetWorkspaceShapes(const MoeProblem& p) const override {
    return inner_.GetWorkspaceShapes(p);
  }
  std::unique_ptr<TopKWeightAndReduce> FinalizeWeightAndReduceImpl() const override {
    return inner_.FinalizeWeightAndReduceImpl();
  }
  absl::Status Apply(const ExpertsApplyArgs& args) override {
    const int64_t tokens = args.prepared != nullptr ? args.prepared->problem.num_tokens : 0;
    // Sleeps end within a few us of their deadline, not the default 50 us of timer slack (a
    // setting of the calling thread).
    thread_local const bool slack_set = prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0) == 0;
    (void)slack_set;
    if (host_us_ > 0) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(static_cast<int64_t>(host_us_ * 1000)));
    }
    std::lock_guard<std::mutex> device(DeviceLock());
    const auto start = std::chrono::steady_clock::now();
    absl::Status status = inner_.Apply(args);
    std::this_thread::sleep_until(
        start + std::chrono::nanoseconds(static_cast<int64_t>(
                    (step_us_ + token_us_ * static_cast<double>(tokens)) * 1000.0)));
    return status;
  }

 private:
  BlasExperts inner_;
  const double step_us_, token_us_, host_us_;
};

const bool kRegistered = [] {
  ExpertsProvider p;
  p.name = std::string(EmulatedDeviceExperts::kName);
  p.aliases = {"emulated_device"};
  p.format = ActivationFormat::kStandard;
  p.supports_ep = true;
  p.create = [](const EnginePlan& plan,
                const RankResources&) -> absl::StatusOr<std::unique_ptr<Experts>> {
    return std::make_unique<EmulatedDeviceExperts>(
        plan.threads_per_rank, absl::GetFlag(FLAGS_emulate_step_us),
        absl::GetFlag(FLAGS_emulate_token_us), absl::GetFlag(FLAGS_emulate_host_us));
  };
  return ProviderRegistry::Global().Register(std::move(p)).ok();
}();

}  // namespace
}  // namespace moeserve
