// Small helpers of the transport benchmarks' command lines.
#ifndef MOESERVE_TESTS_BENCHMARKS_TRANSPORT_BENCH_FLAGS_H_
#define MOESERVE_TESTS_BENCHMARKS_TRANSPORT_BENCH_FLAGS_H_

#include <cstdint>
#include <cstdlib>
#include <vector>

namespace moeserve::bench {

// "1,2,4" -> {1, 2, 4}; stops at the first item that is not a number.
inline std::vector<int64_t> ParseList(const char* text) {
  std::vector<int64_t> out;
  for (const char* p = text; *p != '\0';) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

}  // namespace moeserve::bench

#endif  // MOESERVE_TESTS_BENCHMARKS_TRANSPORT_BENCH_FLAGS_H_
