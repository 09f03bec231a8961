#include "core/step_cost_model.h"

#include <algorithm>

namespace moeserve {

StepCostModel::StepCostModel(double decay) : decay_(std::clamp(decay, 1e-3, 1.0)) {}

void StepCostModel::Add(int64_t tokens, absl::Duration took) {
  if (tokens <= 0) return;
  const double n = static_cast<double>(tokens);
  const double t = std::max(0.0, absl::ToDoubleMicroseconds(took));
  w_ = w_ * decay_ + 1;
  n_ = n_ * decay_ + n;
  nn_ = nn_ * decay_ + n * n;
  t_ = t_ * decay_ + t;
  nt_ = nt_ * decay_ + n * t;
  ++steps_;
  Refit();
}

void StepCostModel::Refit() {
  const double mean_n = n_ / w_, mean_t = t_ / w_;
  const double var = nn_ / w_ - mean_n * mean_n;
  // Sizes that differ by less than 5% say nothing of the slope.
  if (var > 0.0025 * mean_n * mean_n) {
    slope_known_ = true;
    per_token_us_ = std::max(0.0, (nt_ / w_ - mean_n * mean_t) / var);
  } else if (!slope_known_) {
    per_token_us_ = mean_t / mean_n;
  }
  fixed_us_ = mean_t - per_token_us_ * mean_n;
  if (fixed_us_ < 0) {  // the line through the origin and the mean
    fixed_us_ = 0;
    per_token_us_ = mean_t / mean_n;
  }
}

absl::Duration StepCostModel::Predict(int64_t tokens) const {
  if (steps_ == 0) return absl::ZeroDuration();
  return absl::Microseconds(fixed_us_ +
                            per_token_us_ * static_cast<double>(std::max<int64_t>(tokens, 0)));
}

}  // namespace moeserve
