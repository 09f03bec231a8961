// Bounds on what calls in progress may hold: a byte budget for requests and answers (admission),
// and a watch that cancels answers a client does not take (so a client that never reads cannot
// pin memory).
#ifndef MOESERVE_SERVER_CALL_LIMITS_H_
#define MOESERVE_SERVER_CALL_LIMITS_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>

namespace moeserve {

// Bytes held by calls in progress, bounded. Thread-safe.
class ByteBudget {
 public:
  // limit <= 0: unbounded (everything is admitted, still counted).
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  // Takes `bytes` if they fit under the limit (with what is held); false and nothing taken
  // otherwise.
  bool TryAcquire(int64_t bytes);
  void Release(int64_t bytes);
  int64_t used() const { return used_.load(); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Cancels calls whose answer was finished but not taken by the client (HTTP/2 flow control
// keeps it in the server) within `max_hold`. Cancelling releases the answer and the request,
// and the call ends with CANCELLED. Thread-safe.
class AnswerHoldWatch {
 public:
  // max_hold <= 0: off (no thread; an unread answer waits as long as the connection lives).
  // `on_cancel` (may be null) runs on the watch's thread for every call it cancels.
  AnswerHoldWatch(std::chrono::milliseconds max_hold, std::function<void()> on_cancel);
  // Stops the thread (calls still held are left to gRPC's shutdown).
  ~AnswerHoldWatch();
  AnswerHoldWatch(const AnswerHoldWatch&) = delete;
  AnswerHoldWatch& operator=(const AnswerHoldWatch&) = delete;

  struct Held;
  // The call's answer was just finished; `context` stays valid until Done.
  std::shared_ptr<Held> Register(grpc::ServerContextBase* context);
  // gRPC is done with the call (the reactor's OnDone): `context` goes away after this returns.
  void Done(const std::shared_ptr<Held>& held);

  int64_t cancelled() const { return cancelled_.load(); }
  int64_t held() const;

 private:
  void Loop();

  const std::chrono::milliseconds max_hold_;
  const std::function<void()> on_cancel_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::shared_ptr<Held>> held_;  // oldest first
  bool stop_ = false;
  std::atomic<int64_t> cancelled_{0};
  std::thread thread_;
};

// A unary reactor that holds bytes of a ByteBudget for its call and registers its answer with
// an AnswerHoldWatch when it finishes; both are released when gRPC is done with the call
// (OnDone), then `on_done` runs and the reactor deletes itself. Finish with FinishAndHold.
class HeldUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  // `watch` and `budget` may be null; they must outlive the call.
  HeldUnaryReactor(grpc::CallbackServerContext* context, AnswerHoldWatch* watch, ByteBudget* budget,
                   std::function<void()> on_done = nullptr)
      : context_(context), watch_(watch), budget_(budget), on_done_(std::move(on_done)) {}

  // Adds `bytes` to what this call holds if the budget allows; false otherwise. Call before
  // FinishAndHold, from one thread at a time.
  bool Hold(int64_t bytes);
  // What Hold has taken so far.
  int64_t held_bytes() const { return held_bytes_; }
  // Finish(status), watched. Do not touch the reactor afterwards.
  void FinishAndHold(const grpc::Status& status);

  void OnDone() override;

 private:
  grpc::CallbackServerContext* const context_;
  AnswerHoldWatch* const watch_;
  ByteBudget* const budget_;
  const std::function<void()> on_done_;
  int64_t held_bytes_ = 0;
  std::shared_ptr<AnswerHoldWatch::Held> held_;
};

}  // namespace moeserve

#endif  // MOESERVE_SERVER_CALL_LIMITS_H_
