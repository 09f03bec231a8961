#include "server/load_progress.h"

#include <cstdarg>

#include "absl/strings/str_format.h"

namespace moeserve {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

LoadProgress::LoadProgress(std::FILE* log, Metrics* metrics, std::chrono::milliseconds min_interval)
    : log_(log), metrics_(metrics), min_interval_(min_interval) {}

void LoadProgress::Print(const char* fmt, ...) {
  if (log_ == nullptr) return;
  va_list args;
  va_start(args, fmt);
  std::vfprintf(log_, fmt, args);
  va_end(args);
  std::fflush(log_);
}

void LoadProgress::OnLoadPlanned(int64_t bytes, int shards, int64_t available_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  planned_ = true;
  planned_bytes_ = bytes;
  planned_shards_ = shards;
  start_ = std::chrono::steady_clock::now();
  if (metrics_) metrics_->SetLoadProgress(bytes, 0);
  Print(
      "moeserve: loading weights: %.2f GiB of expert weights in host memory (%d layer shards), "
      "%.1f GiB available\n",
      bytes / kGiB, shards, available_bytes / kGiB);
}

absl::Status LoadProgress::OnShardLoaded(int rank, int layer, int64_t bytes) {
  if (shard_delay_.count() > 0) std::this_thread::sleep_for(shard_delay_);
  if (cancelled_.load()) {
    return absl::CancelledError("weight load stopped: the process is shutting down");
  }
  std::lock_guard<std::mutex> lock(mu_);
  loaded_bytes_ += bytes;
  ++shards_loaded_;
  if (metrics_) metrics_->SetLoadProgress(planned_bytes_, loaded_bytes_);
  const auto now = std::chrono::steady_clock::now();
  const bool last = shards_loaded_ >= planned_shards_;
  if (shards_loaded_ == 1 || last || now - last_print_ >= min_interval_) {
    last_print_ = now;
    const double seconds = SecondsSince(start_);
    const double rate = seconds > 0 ? loaded_bytes_ / kGiB / seconds : 0;
    Print(
        "moeserve: loading weights: layer %d of %d (rank %d, model layer %d), %.2f of %.2f GiB "
        "(%.0f%%), %.2f GiB/s, %.1f s\n",
        shards_loaded_, planned_shards_, rank, layer, loaded_bytes_ / kGiB, planned_bytes_ / kGiB,
        planned_bytes_ > 0 ? 100.0 * loaded_bytes_ / planned_bytes_ : 100.0, rate, seconds);
  }
  return absl::OkStatus();
}

void LoadProgress::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = true;
  const double seconds = SecondsSince(start_);
  if (metrics_) metrics_->SetLoadProgress(planned_bytes_, loaded_bytes_, seconds);
  Print("moeserve: weights loaded: %.2f GiB in %.1f s (%.2f GiB/s)\n", loaded_bytes_ / kGiB,
        seconds, seconds > 0 ? loaded_bytes_ / kGiB / seconds : 0.0);
}

std::string LoadProgress::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return "weights loaded";
  if (!planned_) return "preparing to load weights";
  if (shards_loaded_ >= planned_shards_) {
    return "weights loaded, starting the expert-parallel ranks";
  }
  return absl::StrFormat("loading weights: layer %d of %d, %.2f of %.2f GiB (%.0f%%)",
                         shards_loaded_, planned_shards_, loaded_bytes_ / kGiB,
                         planned_bytes_ / kGiB,
                         planned_bytes_ > 0 ? 100.0 * loaded_bytes_ / planned_bytes_ : 0.0);
}

int64_t LoadProgress::loaded_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return loaded_bytes_;
}

int LoadProgress::shards_loaded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shards_loaded_;
}

}  // namespace moeserve
