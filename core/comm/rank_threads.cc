#include "core/comm/rank_threads.h"

#include "core/thread_name.h"

namespace moeserve {

RankThreads::RankThreads(int num_ranks) {
  statuses_.resize(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    threads_.emplace_back([this, r] {
      SetCurrentThreadName("ms-rank" + std::to_string(r));
      Loop(r);
    });
  }
}

RankThreads::~RankThreads() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void RankThreads::Loop(int rank) {
  uint64_t seen = 0;
  while (true) {
    const std::function<absl::Status(int)>* step;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      step = step_;
    }
    absl::Status s = (*step)(rank);
    std::lock_guard<std::mutex> lock(mu_);
    statuses_[rank] = std::move(s);
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

std::vector<absl::Status> RankThreads::Run(const std::function<absl::Status(int)>& step) {
  std::lock_guard<std::mutex> run_lock(run_mu_);
  std::unique_lock<std::mutex> lock(mu_);
  step_ = &step;
  pending_ = num_ranks();
  ++generation_;
  start_cv_.notify_all();
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  step_ = nullptr;
  return statuses_;
}

}  // namespace moeserve
