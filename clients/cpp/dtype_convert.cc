#include "clients/cpp/dtype_convert.h"

#include <cmath>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace moeserve::client {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Shifts `value` right by `shift` (>= 1) bits, rounding to nearest, ties to even.
uint32_t ShiftRoundNearestEven(uint32_t value, int shift) {
  const uint32_t q = value >> shift;
  const uint32_t rem = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

}  // namespace

float Bf16ToFloat(uint16_t bits) { return BitsToFloat(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToBf16(float value) {
  const uint32_t u = FloatBits(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: keep sign and payload, set quiet
  }
  // Finite values and Inf. Rounding up from the largest finite BF16 carries into Inf, correctly.
  return static_cast<uint16_t>(ShiftRoundNearestEven(u & 0x7fffffffu, 16) | ((u >> 16) & 0x8000u));
}

float Fp16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in FP32.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));  // Inf, NaN
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t FloatToFp16(float value) {
  const uint32_t u = FloatBits(value);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: quiet, keep the top payload bits
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  // 65520 is halfway between 65504 (largest finite) and 65536; ties-to-even rounds it to Inf.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {  // below 2^-14: FP16 subnormal (or zero)
    if (abs <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 rounds to zero
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    // value = mantissa * 2^(exponent - 150); in units of 2^-24 that is mantissa >> (126 - e).
    return static_cast<uint16_t>(sign |
                                 ShiftRoundNearestEven(mantissa, static_cast<int>(126 - exponent)));
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits; a carry
  // out of the mantissa correctly bumps the exponent.
  return static_cast<uint16_t>(sign | ShiftRoundNearestEven(abs - 0x38000000u, 13));
}

int64_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16:
      return 2;
    case v1::DTYPE_FP32:
    case v1::DTYPE_INT32:
      return 4;
    case v1::DTYPE_INT64:
      return 8;
    default:
      return 0;
  }
}

std::string DTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_FP16:
      return "fp16";
    case v1::DTYPE_FP32:
      return "fp32";
    case v1::DTYPE_INT32:
      return "int32";
    case v1::DTYPE_INT64:
      return "int64";
    default:
      return absl::StrCat("unspecified(", static_cast<int>(dtype), ")");
  }
}

absl::StatusOr<v1::DType> ParseFloatDType(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "bf16" || n == "bfloat16") return v1::DTYPE_BF16;
  if (n == "fp16" || n == "float16" || n == "half") return v1::DTYPE_FP16;
  if (n == "fp32" || n == "float32" || n == "float") return v1::DTYPE_FP32;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype '", name, "' is not one of bf16, fp16, fp32"));
}

absl::StatusOr<std::string> EncodeFloats(const float* values, int64_t n, v1::DType dtype) {
  std::string out;
  switch (dtype) {
    case v1::DTYPE_FP32:
      out.resize(static_cast<size_t>(n) * 4);
      std::memcpy(out.data(), values, out.size());
      return out;
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16: {
      out.resize(static_cast<size_t>(n) * 2);
      const bool bf16 = dtype == v1::DTYPE_BF16;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = bf16 ? FloatToBf16(values[i]) : FloatToFp16(values[i]);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      return out;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("cannot encode floats as ", DTypeName(dtype)));
  }
}

absl::StatusOr<std::vector<float>> DecodeFloats(const v1::Tensor& tensor) {
  const int64_t itemsize = DTypeSize(tensor.dtype());
  if (tensor.dtype() != v1::DTYPE_BF16 && tensor.dtype() != v1::DTYPE_FP16 &&
      tensor.dtype() != v1::DTYPE_FP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor dtype ", DTypeName(tensor.dtype()), " is not a float dtype"));
  }
  int64_t n = 1;
  for (int64_t d : tensor.shape()) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dim ", d));
    n *= d;
  }
  if (static_cast<int64_t>(tensor.data().size()) != n * itemsize) {
    return absl::InvalidArgumentError(absl::StrCat("tensor data has ", tensor.data().size(),
                                                   " bytes; shape and dtype need ", n * itemsize));
  }
  std::vector<float> out(static_cast<size_t>(n));
  const char* p = tensor.data().data();
  if (tensor.dtype() == v1::DTYPE_FP32) {
    std::memcpy(out.data(), p, out.size() * 4);
    return out;
  }
  const bool bf16 = tensor.dtype() == v1::DTYPE_BF16;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = bf16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
  }
  return out;
}

}  // namespace moeserve::client
