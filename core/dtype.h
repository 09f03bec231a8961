// Element types moeserve moves and computes with.
#ifndef MOESERVE_CORE_DTYPE_H_
#define MOESERVE_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moeserve {

enum class DType : uint8_t {
  kBF16,
  kFP16,
  kFP32,
  kINT32,
  kINT64,
  kUINT8,    // raw bytes, e.g. E8M0 scale codes
  kFP8E4M3,  // OCP FP8 E4M3 (finite, max 448)
};

// Size of one element in bytes.
size_t DTypeSize(DType dtype);
// Lower-case name: "bf16", "fp16", "fp32", "int32", "int64", "uint8", "fp8_e4m3".
absl::string_view DTypeName(DType dtype);
absl::StatusOr<DType> ParseDType(absl::string_view name);
bool IsFloatingPoint(DType dtype);

}  // namespace moeserve

#endif  // MOESERVE_CORE_DTYPE_H_
