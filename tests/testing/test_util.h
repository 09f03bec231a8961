// Shared helpers for moeserve's tests: fresh random inputs, routings, error metrics.
#ifndef MOESERVE_TESTS_TESTING_TEST_UTIL_H_
#define MOESERVE_TESTS_TESTING_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/dtype_convert.h"

namespace moeserve::testing {

// Relative L2 error ||a - b|| / ||b|| (b the reference); 0 if both are zero.
inline double RelativeL2Error(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

inline double RelativeL2Error(const std::vector<float>& a, const std::vector<float>& b) {
  return RelativeL2Error(a.data(), b.data(), static_cast<int64_t>(b.size()));
}

// FP32 tensor -> BF16 tensor of the same shape (round to nearest even).
inline Tensor ToBf16(const Tensor& x) {
  Tensor y = Tensor::Empty(DType::kBF16, x.shape());
  kernels::ConvertFp32ToBf16Ref(x.data<float>(), y.data<uint16_t>(), x.numel());
  return y;
}

// BF16 tensor -> its values as floats (exact).
inline std::vector<float> Bf16ToFloats(const Tensor& y) {
  std::vector<float> f(y.numel());
  kernels::ConvertBf16ToFp32Ref(y.data<uint16_t>(), f.data(), y.numel());
  return f;
}

inline Tensor RandomNormal(Shape shape, std::mt19937& rng, float stddev = 1.0f) {
  Tensor t = Tensor::Empty(DType::kFP32, std::move(shape));
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = dist(rng);
  return t;
}

enum class Routing { kUniform, kBalancedAffine, kHotExpert };

// [M, topk] INT32 global expert ids.
//  kUniform: distinct uniform-random experts per token.
//  kBalancedAffine: the seed's ((token * topk + k) * 73 + 19) mod E.
//  kHotExpert: route 0 of every token goes to expert `hot`; the rest are distinct experts drawn
//    from [hot_begin, hot_end) (one rank's block) when it has room, else uniform.
inline Tensor MakeRouting(Routing routing, int64_t m, int topk, int num_experts, std::mt19937& rng,
                          int hot = 0, int hot_begin = 0, int hot_end = 0) {
  Tensor ids = Tensor::Empty(DType::kINT32, {m, topk});
  int32_t* p = ids.data<int32_t>();
  std::vector<int> perm(num_experts);
  for (int64_t t = 0; t < m; ++t) {
    if (routing == Routing::kBalancedAffine) {
      for (int k = 0; k < topk; ++k) {
        p[t * topk + k] = static_cast<int32_t>(((t * topk + k) * 73 + 19) % num_experts);
      }
      continue;
    }
    std::iota(perm.begin(), perm.end(), 0);
    int begin = 0, end = num_experts;
    if (routing == Routing::kHotExpert && hot_end - hot_begin >= topk)
      begin = hot_begin, end = hot_end;
    std::shuffle(perm.begin() + begin, perm.begin() + end, rng);
    for (int k = 0; k < topk; ++k) p[t * topk + k] = perm[begin + k];
    if (routing == Routing::kHotExpert) {
      auto it = std::find(p + t * topk, p + (t + 1) * topk, hot);
      if (it != p + t * topk) std::swap(*it, p[t * topk]);
      p[t * topk] = hot;
    }
  }
  return ids;
}

// [M, topk] FP32 softmax of random logits (positive, each row sums to 1).
inline Tensor RandomTopkWeights(int64_t m, int topk, std::mt19937& rng) {
  Tensor w = Tensor::Empty(DType::kFP32, {m, topk});
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t t = 0; t < m; ++t) {
    float sum = 0;
    for (int k = 0; k < topk; ++k) sum += (w.data<float>()[t * topk + k] = std::exp(dist(rng)));
    for (int k = 0; k < topk; ++k) w.data<float>()[t * topk + k] /= sum;
  }
  return w;
}

}  // namespace moeserve::testing

#endif  // MOESERVE_TESTS_TESTING_TEST_UTIL_H_
