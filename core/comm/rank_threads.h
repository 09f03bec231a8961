// One worker thread per CPU rank: the rank runtime's executor.
#ifndef MOESERVE_CORE_COMM_RANK_THREADS_H_
#define MOESERVE_CORE_COMM_RANK_THREADS_H_

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"

namespace moeserve {

// Starts num_ranks threads at construction and joins them at destruction. Run() hands every
// rank thread the same step and blocks until all have returned from it. Run() calls are
// serialized (one step at a time); the step function must be safe to call concurrently for
// different ranks.
class RankThreads {
 public:
  explicit RankThreads(int num_ranks);
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int num_ranks() const { return static_cast<int>(threads_.size()); }
  // statuses[r] = step(r), run on rank r's thread.
  std::vector<absl::Status> Run(const std::function<absl::Status(int rank)>& step);

 private:
  void Loop(int rank);

  std::mutex run_mu_;  // serializes Run
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<absl::Status(int)>* step_ = nullptr;
  std::vector<absl::Status> statuses_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_COMM_RANK_THREADS_H_
