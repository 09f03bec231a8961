// Nearest-rank percentile of ascending `sorted` (0 when empty), as moeserve-cli reports its own
// (clients/ cannot include this): the benchmarks' tables set the tools' numbers side by side.
#ifndef MOESERVE_TESTS_BENCHMARKS_PERCENTILE_H_
#define MOESERVE_TESTS_BENCHMARKS_PERCENTILE_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace moeserve::bench {

inline double NearestRankPercentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

}  // namespace moeserve::bench

#endif  // MOESERVE_TESTS_BENCHMARKS_PERCENTILE_H_
