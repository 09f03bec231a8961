#include "core/dtype.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moeserve {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
    case DType::kINT32:
      return 4;
    case DType::kINT64:
      return 8;
    case DType::kUINT8:
    case DType::kFP8E4M3:
      return 1;
  }
  return 0;
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
    case DType::kINT32:
      return "int32";
    case DType::kINT64:
      return "int64";
    case DType::kUINT8:
      return "uint8";
    case DType::kFP8E4M3:
      return "fp8_e4m3";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kINT32, DType::kINT64,
                  DType::kUINT8, DType::kFP8E4M3}) {
    if (DTypeName(d) == name) return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name,
                   "'; expected one of bf16, fp16, fp32, int32, int64, "
                   "uint8, fp8_e4m3"));
}

bool IsFloatingPoint(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kFP16 || dtype == DType::kFP32 ||
         dtype == DType::kFP8E4M3;
}

}  // namespace moeserve
