// Startup progress of the weight load, as operators see it: lines on stderr (the memory
// estimate first, then layer i of N, GiB so far, rate), gauges on /metrics, a sentence for
// calls refused while loading, and a stop request for a signal during the load.
//
// Thread-safe: the observer methods run on the loading threads, the rest on any thread.
#ifndef MOESERVE_SERVER_LOAD_PROGRESS_H_
#define MOESERVE_SERVER_LOAD_PROGRESS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "core/weight_loader.h"
#include "server/metrics.h"

namespace moeserve {

class LoadProgress final : public WeightLoadObserver {
 public:
  // Lines go to `log` (null: none); progress lines at most every `min_interval` (the first and
  // the last shard always). `metrics` (may be null) gets the gauges; both must outlive this.
  // Describe() never reads the metrics.
  LoadProgress(std::FILE* log, Metrics* metrics,
               std::chrono::milliseconds min_interval = std::chrono::milliseconds(1000));

  void OnLoadPlanned(int64_t bytes, int shards, int64_t available_bytes) override;
  absl::Status OnShardLoaded(int rank, int layer, int64_t bytes) override;

  // Makes the next OnShardLoaded return CANCELLED (the load stops within one layer).
  void Cancel() { cancelled_.store(true); }
  // Where the gauges go (may be null). Before the load starts: the load's threads read it.
  void set_metrics(Metrics* metrics) { metrics_ = metrics; }
  // Sleeps this long after each shard (tests and demonstrations of a slow load). Before the load.
  void set_shard_delay(std::chrono::milliseconds delay) { shard_delay_ = delay; }
  // Marks the load finished (the engine exists), printing the total time and rate.
  void Finish();

  // What the process is doing, for messages: "loading weights: layer 12 of 48, 3.1 of 12.3 GiB
  // (25%)", "preparing to load weights" before the plan, "loaded" after Finish().
  std::string Describe() const;
  int64_t loaded_bytes() const;
  int shards_loaded() const;

 private:
  void Print(const char* fmt, ...) __attribute__((format(printf, 2, 3)));

  std::FILE* const log_;
  Metrics* metrics_;
  const std::chrono::milliseconds min_interval_;
  std::chrono::milliseconds shard_delay_{0};
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  bool planned_ = false;
  bool finished_ = false;
  int64_t planned_bytes_ = 0;
  int planned_shards_ = 0;
  int64_t loaded_bytes_ = 0;
  int shards_loaded_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_print_{};
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_LOAD_PROGRESS_H_
