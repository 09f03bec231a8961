// Overflow-checked arithmetic on sizes (element counts, byte counts, offsets).
//
// Every product or sum of sizes that can come from outside the process (a request's shape, a
// config.json, a checkpoint header, a flag) goes through these, so that a hostile or mistaken
// size is refused with a message instead of wrapping around (signed overflow is undefined
// behaviour; a wrapped size under-allocates and the next write runs past the buffer).
//
// Header-only, no dependencies beyond absl::Status; usable from any layer.
#ifndef MOESERVE_CORE_CHECKED_MATH_H_
#define MOESERVE_CORE_CHECKED_MATH_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moeserve {

// a * b and a + b, or nullopt when the result does not fit int64.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// The product of sizes: nullopt if any factor is negative or the product overflows int64. A zero
// factor makes the product 0 whatever the others are (so [0, 2^62, 2^62] is 0, not overflow).
inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  for (int64_t f : factors) {
    if (f < 0) return std::nullopt;
  }
  for (int64_t f : factors) {
    if (f == 0) return 0;
  }
  int64_t out = 1;
  for (int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  }
  return out;
}

// The same as a Status: INVALID_ARGUMENT "<what>: <a> x <b> overflows 64-bit sizes".
inline absl::StatusOr<int64_t> CheckedMul(int64_t a, int64_t b, absl::string_view what) {
  if (std::optional<int64_t> r = CheckedMul(a, b); r && a >= 0 && b >= 0) return *r;
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", a, " x ", b, " is negative or overflows 64-bit sizes"));
}
inline absl::StatusOr<int64_t> CheckedAdd(int64_t a, int64_t b, absl::string_view what) {
  if (std::optional<int64_t> r = CheckedAdd(a, b); r && a >= 0 && b >= 0) return *r;
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": ", a, " + ", b, " is negative or overflows 64-bit sizes"));
}

}  // namespace moeserve

#endif  // MOESERVE_CORE_CHECKED_MATH_H_
