// How long an engine step takes for its token count, learned from the steps that ran: the
// line t(n) = fixed + per_token * n fitted by least squares over recent steps (older steps
// weigh less, by `decay` per step). A GPU decode step reads every weight whatever its size
// (seed layer MXFP8 on an H200: 395 us at 16 tokens, 441 at 64, 1186 at 1024), so a merged
// step of many calls costs far less than the calls' steps one by one; a time per token would
// mistake one for the other. A CPU step's time grows with its tokens: the same fit serves.
//
// While every step had about the same size the slope is unknown; then the model keeps the
// last slope it could fit (or, before any, the time per token: no fixed part), through the
// recent steps' mean. Not thread-safe (ForwardBatcher calls it under its lock).
#ifndef MOESERVE_CORE_STEP_COST_MODEL_H_
#define MOESERVE_CORE_STEP_COST_MODEL_H_

#include <cstdint>

#include "absl/time/time.h"

namespace moeserve {

class StepCostModel {
 public:
  // decay in (0, 1]: the weight of a step falls by this factor with every newer one.
  explicit StepCostModel(double decay = 0.9);

  // A step of `tokens` (> 0) that took `took`.
  void Add(int64_t tokens, absl::Duration took);
  // The expected time of a step of `tokens`; zero before the first Add.
  absl::Duration Predict(int64_t tokens) const;
  int64_t steps() const { return steps_; }
  // The current line (us, us per token), for messages and tests.
  double fixed_us() const { return fixed_us_; }
  double per_token_us() const { return per_token_us_; }

 private:
  void Refit();

  const double decay_;
  int64_t steps_ = 0;
  // Decayed sums of 1, n, n^2, t, n*t (t in us).
  double w_ = 0, n_ = 0, nn_ = 0, t_ = 0, nt_ = 0;
  double fixed_us_ = 0, per_token_us_ = 0;
  bool slope_known_ = false;  // a slope was fitted from steps of different sizes
};

}  // namespace moeserve

#endif  // MOESERVE_CORE_STEP_COST_MODEL_H_
