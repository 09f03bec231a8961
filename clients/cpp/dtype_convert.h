// BF16 / FP16 <-> FP32 conversions for clients (independent of core/ and kernels/, which the
// layering rule keeps clients from using).
//
// 16-bit values are uint16_t bit patterns, little-endian on the wire like every tensor in the API.
// Narrowing rounds to nearest, ties to even; NaN stays a (quiet) NaN, infinities and signed zeros
// are preserved, FP16 overflow (|x| >= 65520) becomes Inf and FP16 subnormals are produced and
// read exactly. Widening is exact.
#ifndef MOESERVE_CLIENTS_CPP_DTYPE_CONVERT_H_
#define MOESERVE_CLIENTS_CPP_DTYPE_CONVERT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "moeserve/v1/moeserve.pb.h"

namespace moeserve::client {

float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);
float Fp16ToFloat(uint16_t bits);
uint16_t FloatToFp16(float value);

// Bytes per element of `dtype` (0 for DTYPE_UNSPECIFIED or unknown values).
int64_t DTypeSize(v1::DType dtype);
// "bf16", "fp16", "fp32", "int32", "int64" (or "unspecified").
std::string DTypeName(v1::DType dtype);
// Parses "bf16" | "fp16" | "fp32" (also "float32", "float16", "bfloat16").
absl::StatusOr<v1::DType> ParseFloatDType(absl::string_view name);

// Encodes n floats as little-endian bytes of `dtype` (BF16, FP16 or FP32).
absl::StatusOr<std::string> EncodeFloats(const float* values, int64_t n, v1::DType dtype);
// Decodes a tensor's data (BF16, FP16 or FP32) to floats; checks data size against shape.
absl::StatusOr<std::vector<float>> DecodeFloats(const v1::Tensor& tensor);

}  // namespace moeserve::client

#endif  // MOESERVE_CLIENTS_CPP_DTYPE_CONVERT_H_
