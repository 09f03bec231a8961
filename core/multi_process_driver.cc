#include "core/multi_process_driver.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/engine_plan.h"
#include "core/status_macros.h"
#include "core/thread_name.h"

namespace moeserve {
namespace {

// The command: [magic, op, layer, M, hidden dtype, world, bounds[0..world]], zero-padded to a
// fixed size so every rank knows the byte count before receiving it.
constexpr int64_t kCommandMagic = 0x6d6f65736d703031;  // "moesmp01"
constexpr int64_t kOpNoop = 0, kOpForward = 1, kOpShutdown = 2;
constexpr int kOpAt = 1, kLayerAt = 2, kTokensAt = 3, kDtypeAt = 4, kWorldAt = 5, kBoundsAt = 6;
constexpr int kCommandWords = kBoundsAt + kMaxMultiProcessWorld + 1;

std::vector<int64_t> Command(int64_t op, int world) {
  std::vector<int64_t> command(kCommandWords, 0);
  command[0] = kCommandMagic;
  command[kOpAt] = op;
  command[kWorldAt] = world;
  return command;
}

// A follower's check of a forward command before it sizes anything from it: the leader is
// another process (another build, or a bug), and a bad count must fail the step, not a resize.
absl::Status CheckForwardCommand(const std::vector<int64_t>& h, const EnginePlan& plan, int rank) {
  auto bad = [rank](absl::string_view what) {
    return absl::InternalError(
        absl::StrCat("rank ", rank, ": bad forward command from the leader: ", what));
  };
  const int64_t layer = h[kLayerAt], m = h[kTokensAt], dtype = h[kDtypeAt];
  if (layer < 0 || layer >= plan.model.num_layers) {
    return bad(absl::StrCat("layer ", layer, ", expected [0, ", plan.model.num_layers, ")"));
  }
  if (dtype != static_cast<int64_t>(DType::kBF16) && dtype != static_cast<int64_t>(DType::kFP16) &&
      dtype != static_cast<int64_t>(DType::kFP32)) {
    return bad(absl::StrCat("hidden dtype code ", dtype, ", expected BF16, FP16 or FP32"));
  }
  if (m < 0 || m > plan.max_tokens_per_request) {
    return bad(absl::StrCat("M=", m, ", expected [0, ", plan.max_tokens_per_request, "]"));
  }
  const int64_t* bounds = &h[kBoundsAt];
  const int world = plan.world_size;
  if (bounds[0] != 0 || bounds[world] != m) {
    return bad(absl::StrCat("token bounds [", bounds[0], ", ", bounds[world],
                            "], expected [0, M=", m, "]"));
  }
  for (int r = 0; r < world; ++r) {
    if (bounds[r + 1] < bounds[r]) {
      return bad(absl::StrCat("token bounds of rank ", r, " run backwards (", bounds[r], " -> ",
                              bounds[r + 1], ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

MultiProcessDriver::MultiProcessDriver(RankGroup* group, std::mutex* step_mu)
    : group_(group),
      step_mu_(step_mu),
      world_(group->plan().world_size),
      command_(group->num_local_ranks()),
      slices_(group->num_local_ranks()),
      last_step_(std::chrono::steady_clock::now()) {}

MultiProcessDriver::~MultiProcessDriver() { Stop(); }

void MultiProcessDriver::Start() {
  started_ = true;
  last_step_ = std::chrono::steady_clock::now();
  if (is_leader() && group_->plan().heartbeat_ms > 0) {
    heartbeat_ = std::thread([this] {
      SetCurrentThreadName("ms-heartbeat");
      HeartbeatLoop();
    });
  }
}

absl::Status MultiProcessDriver::Forward(const ForwardStep& step) {
  // The followers' rows are packed with one copy per rank (routing views are packed already:
  // ValidateForwardShapes refuses strided ones).
  if (!step.hidden_states.is_contiguous()) {
    return absl::InvalidArgumentError(
        "multi-process serving takes packed hidden_states, topk_ids and topk_weights, not strided "
        "views");
  }
  std::vector<int64_t> command = Command(kOpForward, world_);
  command[kLayerAt] = step.layer;
  command[kTokensAt] = step.hidden_states.dim(0);
  command[kDtypeAt] = static_cast<int64_t>(step.hidden_states.dtype());
  std::copy(step.bounds.begin(), step.bounds.end(), command.begin() + kBoundsAt);
  return RunCommandOnEveryRank(&command, &step);
}

absl::Status MultiProcessDriver::RunFollower() {
  std::lock_guard<std::mutex> lock(*step_mu_);
  while (true) {
    if (absl::Status h = group_->health(); !h.ok()) return h;
    absl::Status s = RunCommandOnEveryRank(nullptr, nullptr);
    if (IsAgreedStepFailure(s)) continue;  // a refusal every rank agreed on
    if (!s.ok()) return s;
    if (command_[0][kOpAt] == kOpShutdown) return absl::OkStatus();
  }
}

void MultiProcessDriver::Stop() {
  {
    std::lock_guard<std::mutex> lock(heartbeat_mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  // Only a leader whose group formed (Engine::Create may have failed half-way) tells the
  // followers.
  if (!is_leader() || !started_) return;
  started_ = false;
  std::lock_guard<std::mutex> lock(*step_mu_);
  if (group_->health().ok()) {
    const std::vector<int64_t> command = Command(kOpShutdown, world_);
    (void)RunCommandOnEveryRank(&command, nullptr);
  }
}

absl::Status MultiProcessDriver::RunCommandOnEveryRank(const std::vector<int64_t>* command,
                                                       const ForwardStep* step) {
  absl::Status s =
      group_->RunOnEveryRank([&](int local) { return RunCommandOnRank(local, command, step); });
  last_step_ = std::chrono::steady_clock::now();
  return s;
}

absl::Status MultiProcessDriver::RunCommandOnRank(int i, const std::vector<int64_t>* command,
                                                  const ForwardStep* step) {
  HostTransfer* host = group_->host_transfer(i);
  if (host == nullptr) {
    return absl::FailedPreconditionError("multi-process serving needs NCCL");
  }
  const int g = group_->first_rank() + i;
  const int local = group_->num_local_ranks();
  // The leader's process hosts global ranks [0, local); the others' slices travel.
  auto remote = [local](int p) { return p >= local; };
  std::vector<int64_t>& h = command_[i];
  h.assign(kCommandWords, 0);
  if (command != nullptr) std::copy(command->begin(), command->end(), h.begin());
  MOESERVE_RETURN_IF_ERROR(
      host->Broadcast(h.data(), static_cast<int64_t>(h.size() * sizeof(int64_t)), 0));
  if (h[0] != kCommandMagic || h[kWorldAt] != world_) {
    return absl::InternalError(absl::StrCat("rank ", g, ": bad command from the leader (world ",
                                            h[kWorldAt], ", expected ", world_, ")"));
  }
  if (h[kOpAt] != kOpForward) return absl::OkStatus();
  const EnginePlan& plan = group_->plan();
  if (g != 0) MOESERVE_RETURN_IF_ERROR(CheckForwardCommand(h, plan, g));
  if (plan.fault_injection_for_testing) {
    MOESERVE_RETURN_IF_ERROR(plan.fault_injection_for_testing(g));
  }
  const int layer = static_cast<int>(h[kLayerAt]);
  const DType dtype = static_cast<DType>(h[kDtypeAt]);
  const int64_t* bounds = &h[kBoundsAt];
  const int64_t k = plan.model.hidden, topk = plan.model.topk;
  const int64_t hidden_row = k * static_cast<int64_t>(DTypeSize(dtype));
  const int64_t row_bytes = hidden_row + topk * 8;  // hidden, int32 ids, fp32 weights
  const int64_t begin = bounds[g], rows = bounds[g + 1] - bounds[g];
  std::vector<int64_t> send_counts(world_, 0), send_displs(world_, 0), recv_counts(world_, 0),
      recv_displs(world_, 0);
  std::vector<char>& slice = slices_[i];

  // 1. The leader sends every remote rank its tokens: hidden rows, then ids, then weights.
  TensorView hidden_states, topk_ids, topk_weights;
  if (g == 0) {
    int64_t total = 0;
    for (int p = local; p < world_; ++p) total += (bounds[p + 1] - bounds[p]) * row_bytes;
    slice.resize(static_cast<size_t>(total));
    char* dst = slice.data();
    for (int p = local; p < world_; ++p) {
      const int64_t b = bounds[p], n = bounds[p + 1] - bounds[p];
      send_displs[p] = dst - slice.data();
      send_counts[p] = n * row_bytes;
      std::memcpy(dst, static_cast<const char*>(step->hidden_states.raw_data()) + b * hidden_row,
                  n * hidden_row);
      dst += n * hidden_row;
      std::memcpy(dst, step->topk_ids.data<int32_t>() + b * topk, n * topk * 4);
      dst += n * topk * 4;
      std::memcpy(dst, step->topk_weights.data<float>() + b * topk, n * topk * 4);
      dst += n * topk * 4;
    }
    MOESERVE_RETURN_IF_ERROR(
        host->AllToAllV(slice.data(), send_counts, send_displs, nullptr, recv_counts, recv_displs));
  } else if (remote(g)) {
    recv_counts[0] = rows * row_bytes;
    slice.resize(static_cast<size_t>(recv_counts[0]));
    MOESERVE_RETURN_IF_ERROR(
        host->AllToAllV(nullptr, send_counts, send_displs, slice.data(), recv_counts, recv_displs));
    char* src = slice.data();
    hidden_states = TensorView(src, dtype, {rows, k});
    topk_ids = TensorView(src + rows * hidden_row, DType::kINT32, {rows, topk});
    topk_weights = TensorView(src + rows * (hidden_row + topk * 4), DType::kFP32, {rows, topk});
  }
  if (!remote(g)) {
    hidden_states = step->hidden_states.Slice(begin, begin + rows);
    topk_ids = step->topk_ids.Slice(begin, begin + rows);
    topk_weights = step->topk_weights.Slice(begin, begin + rows);
  }

  // 2. The modular kernel (its own collectives, the same on every rank).
  const TensorView out =
      remote(g) ? group_->OutputBuffer(i, rows, dtype) : step->output.Slice(begin, begin + rows);
  MOESERVE_RETURN_IF_ERROR(
      group_->ForwardSlice(i, layer, hidden_states, topk_ids, topk_weights, out));

  // 3. The remote ranks' output rows back to the leader.
  std::fill(send_counts.begin(), send_counts.end(), 0);
  std::fill(send_displs.begin(), send_displs.end(), 0);
  std::fill(recv_counts.begin(), recv_counts.end(), 0);
  std::fill(recv_displs.begin(), recv_displs.end(), 0);
  const int64_t out_row = hidden_row;  // the answer has the request's dtype
  if (g == 0) {
    for (int p = local; p < world_; ++p) {
      recv_counts[p] = (bounds[p + 1] - bounds[p]) * out_row;
      recv_displs[p] = bounds[p] * out_row;
    }
    return host->AllToAllV(nullptr, send_counts, send_displs, step->output.raw_data(), recv_counts,
                           recv_displs);
  }
  if (remote(g)) {
    send_counts[0] = rows * out_row;
    return host->AllToAllV(out.raw_data(), send_counts, send_displs, nullptr, recv_counts,
                           recv_displs);
  }
  return absl::OkStatus();
}

void MultiProcessDriver::HeartbeatLoop() {
  const auto period = std::chrono::milliseconds(group_->plan().heartbeat_ms);
  std::unique_lock<std::mutex> heartbeat_lock(heartbeat_mu_);
  while (!heartbeat_stop_) {
    heartbeat_cv_.wait_for(heartbeat_lock, period, [this] { return heartbeat_stop_; });
    if (heartbeat_stop_) break;
    heartbeat_lock.unlock();
    {
      // A forward is a heartbeat too.
      std::unique_lock<std::mutex> step_lock(*step_mu_, std::try_to_lock);
      if (step_lock.owns_lock() && group_->health().ok() &&
          std::chrono::steady_clock::now() - last_step_ >= period) {
        const std::vector<int64_t> command = Command(kOpNoop, world_);
        (void)RunCommandOnEveryRank(&command, nullptr);  // a failure marks the group unhealthy
      }
    }
    heartbeat_lock.lock();
  }
}

}  // namespace moeserve
