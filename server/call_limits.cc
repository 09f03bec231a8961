#include "server/call_limits.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/thread_name.h"

namespace moeserve {

bool ByteBudget::TryAcquire(int64_t bytes) {
  if (bytes <= 0) return true;
  int64_t used = used_.load();
  do {
    if (limit_ > 0 && (bytes > limit_ || used > limit_ - bytes)) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return true;
}

void ByteBudget::Release(int64_t bytes) {
  if (bytes > 0) used_.fetch_sub(bytes);
}

// One finished call. `mu` is recursive: TryCancel may run the call's OnDone (and so Done, which
// takes `mu`) inline on the thread that cancels.
struct AnswerHoldWatch::Held {
  std::recursive_mutex mu;
  grpc::ServerContextBase* context = nullptr;  // valid while !done
  bool done = false;
  bool cancel_requested = false;  // guarded by the watch's mu_
  std::chrono::steady_clock::time_point since;
  std::list<std::shared_ptr<Held>>::iterator where;  // guarded by the watch's mu_
  bool listed = false;                               // guarded by the watch's mu_
};

AnswerHoldWatch::AnswerHoldWatch(std::chrono::milliseconds max_hold,
                                 std::function<void()> on_cancel)
    : max_hold_(max_hold), on_cancel_(std::move(on_cancel)) {
  if (max_hold_.count() > 0) {
    thread_ = std::thread([this] {
      SetCurrentThreadName("ms-limits");
      Loop();
    });
  }
}

AnswerHoldWatch::~AnswerHoldWatch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<AnswerHoldWatch::Held> AnswerHoldWatch::Register(grpc::ServerContextBase* context) {
  auto held = std::make_shared<Held>();
  held->context = context;
  held->since = std::chrono::steady_clock::now();
  if (max_hold_.count() <= 0) return held;
  std::lock_guard<std::mutex> lock(mu_);
  held->where = held_.insert(held_.end(), held);
  held->listed = true;
  return held;
}

void AnswerHoldWatch::Done(const std::shared_ptr<Held>& held) {
  {
    std::lock_guard<std::recursive_mutex> lock(held->mu);
    held->done = true;
    held->context = nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (held->listed) {
    held_.erase(held->where);
    held->listed = false;
  }
}

int64_t AnswerHoldWatch::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(held_.size());
}

void AnswerHoldWatch::Loop() {
  // Check a few times per max_hold, so an answer is cancelled within about 1.25 x max_hold.
  const auto period = std::clamp<std::chrono::milliseconds>(
      max_hold_ / 4, std::chrono::milliseconds(5), std::chrono::milliseconds(250));
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, period, [this] { return stop_; });
    if (stop_) break;
    const auto overdue = std::chrono::steady_clock::now() - max_hold_;
    std::vector<std::shared_ptr<Held>> cancel;
    for (const std::shared_ptr<Held>& h : held_) {
      if (h->since > overdue) break;  // oldest first: the rest are younger
      if (!h->cancel_requested) {
        h->cancel_requested = true;
        cancel.push_back(h);
      }
    }
    if (cancel.empty()) continue;
    lock.unlock();
    for (const std::shared_ptr<Held>& h : cancel) {
      std::lock_guard<std::recursive_mutex> held_lock(h->mu);
      if (h->done) continue;
      h->context->TryCancel();  // OnDone follows (maybe inline); the answer is dropped
      ++cancelled_;
      if (on_cancel_) on_cancel_();
    }
    lock.lock();
  }
}

bool HeldUnaryReactor::Hold(int64_t bytes) {
  if (budget_ != nullptr && !budget_->TryAcquire(bytes)) return false;
  held_bytes_ += bytes;
  return true;
}

void HeldUnaryReactor::FinishAndHold(const grpc::Status& status) {
  if (watch_ != nullptr) held_ = watch_->Register(context_);
  Finish(status);
}

void HeldUnaryReactor::OnDone() {
  if (held_ != nullptr) watch_->Done(held_);
  if (budget_ != nullptr) budget_->Release(held_bytes_);
  if (on_done_) on_done_();
  delete this;
}

}  // namespace moeserve
