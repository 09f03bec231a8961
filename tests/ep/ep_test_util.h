// Inputs and routings for the expert-parallel tests, the moeserve-mk-check tool and the EP
// benchmark.
#ifndef MOESERVE_TESTS_EP_EP_TEST_UTIL_H_
#define MOESERVE_TESTS_EP_EP_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/tensor.h"
#include "tests/testing/test_util.h"

namespace moeserve::ep_testing {

enum class Routing { kUniform, kBalancedAffine, kHotExpert };

inline const char* RoutingName(Routing r) {
  switch (r) {
    case Routing::kUniform:
      return "uniform";
    case Routing::kBalancedAffine:
      return "balanced_affine";
    case Routing::kHotExpert:
      return "hot_expert";
  }
  return "?";
}

inline absl::StatusOr<Routing> ParseRouting(absl::string_view name) {
  for (Routing r : {Routing::kUniform, Routing::kBalancedAffine, Routing::kHotExpert}) {
    if (name == RoutingName(r)) return r;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("routing: got '", name, "', expected uniform, balanced_affine or hot_expert"));
}

// [M, topk] INT32 global expert ids, distinct within a token.
//  kUniform: uniformly random experts.
//  kBalancedAffine: the seed's topk_ids = ((token * topk + k) * 73 + 19) mod E.
//  kHotExpert: route 0 of every token goes to hot_experts[0]; every other route, with
//    probability 7/8, to one of hot_experts (one rank's experts), else anywhere.
inline Tensor MakeRouting(Routing routing, int64_t m, int topk, int num_experts,
                          const std::vector<int>& hot_experts, std::mt19937& rng) {
  Tensor ids = Tensor::Empty(DType::kINT32, {m, topk});
  int32_t* p = ids.data<int32_t>();
  std::uniform_int_distribution<int> any(0, num_experts - 1);
  std::uniform_int_distribution<int> hot(0, std::max<int>(0, hot_experts.size()) - 1);
  std::uniform_int_distribution<int> coin(0, 7);
  for (int64_t t = 0; t < m; ++t) {
    int32_t* row = p + t * topk;
    for (int k = 0; k < topk; ++k) {
      int32_t e;
      if (routing == Routing::kBalancedAffine) {
        e = static_cast<int32_t>(((t * topk + k) * 73 + 19) % num_experts);
      } else {
        do {
          if (routing == Routing::kHotExpert && k == 0) {
            e = hot_experts[0];
          } else if (routing == Routing::kHotExpert && coin(rng) != 0) {
            e = hot_experts[hot(rng)];
          } else {
            e = any(rng);
          }
        } while (std::find(row, row + k, e) != row + k);
      }
      row[k] = e;
    }
  }
  return ids;
}

// Shared with the other suites (tests/testing/test_util.h).
using ::moeserve::testing::Bf16ToFloats;
using ::moeserve::testing::RandomNormal;
using ::moeserve::testing::RandomTopkWeights;
using ::moeserve::testing::RelativeL2Error;
using ::moeserve::testing::ToBf16;

}  // namespace moeserve::ep_testing

#endif  // MOESERVE_TESTS_EP_EP_TEST_UTIL_H_
