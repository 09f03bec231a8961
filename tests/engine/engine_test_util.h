// What the engine suites share (tests/engine, and the GPU engine suites in tests/cuda and
// tests/multi_gpu): small model options, one-call forwards, and the EP inputs and routings
// (tests/ep/ep_test_util.h).
#ifndef MOESERVE_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
#define MOESERVE_TESTS_ENGINE_ENGINE_TEST_UTIL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/engine.h"
#include "gtest/gtest.h"
#include "tests/ep/ep_test_util.h"
#include "tests/testing/test_util.h"

namespace moeserve::engine_testing {

// The "tiny" preset with `experts`, 2 threads, 128 tokens per request.
inline EngineOptions TinyOptions(absl::string_view experts) {
  EngineOptions o;
  o.model = *ModelPreset("tiny");
  o.experts = std::string(experts);
  o.num_threads = 2;
  o.max_tokens_per_request = 128;
  return o;
}

// The seed-megamoe preset (hidden 128, intermediate 64) on `ranks` CPU ranks.
inline EngineOptions SeedMegaMoe(int ranks, const std::string& pf, const std::string& experts) {
  EngineOptions o;
  o.model = *ApplyOverrides(*ModelPreset("seed-megamoe"),
                            ModelOverrides{.hidden = 128, .intermediate = 64});
  o.num_ranks = ranks;
  o.prepare_finalize = pf;
  o.experts = experts;
  o.seed = 3;
  o.num_threads = 2;
  o.max_tokens_per_request = 1024;
  return o;
}

// One forward of layer 0 with `x`'s dtype in, FP32 out [M, hidden]; a failure fails the test.
inline Tensor RunForward(Engine& engine, const Tensor& x, const Tensor& ids, const Tensor& w,
                         ForwardTimings* timings = nullptr) {
  const int64_t m = x.shape()[0], hidden = engine.info().model.hidden;
  Tensor out = Tensor::Empty(DType::kFP32, {m, hidden});
  ForwardInput in;
  in.hidden_states = x.view();
  in.topk_ids = ids.view();
  in.topk_weights = w.view();
  absl::Status s;
  if (x.dtype() == DType::kFP32) {
    s = engine.Forward(in, out.view(), timings);
  } else {
    Tensor typed = Tensor::Empty(x.dtype(), {m, hidden});
    s = engine.Forward(in, typed.view(), timings);
    if (s.ok()) s = ConvertTensor(typed.view(), out.view());
  }
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

}  // namespace moeserve::engine_testing

#endif  // MOESERVE_TESTS_ENGINE_ENGINE_TEST_UTIL_H_
