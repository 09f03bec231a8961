#include "core/cancellation.h"

#include "absl/strings/str_cat.h"
#include "core/rank_group.h"

namespace moeserve {

absl::Status StopLatch::Check(int64_t point, absl::string_view where) {
  std::lock_guard<std::mutex> lock(mu_);
  if (point >= stop_at_) return MarkAgreedStepFailure(reason_);
  if (point <= evaluated_) return absl::OkStatus();  // a peer passed this point already
  evaluated_ = point;
  absl::Status s = check_ ? check_() : absl::OkStatus();
  if (s.ok()) return s;
  stop_at_ = point;
  reason_ = absl::Status(s.code(), absl::StrCat(s.message(), " (stopped before ", where, ")"));
  return MarkAgreedStepFailure(reason_);
}

absl::Status StopLatch::stopped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

}  // namespace moeserve
