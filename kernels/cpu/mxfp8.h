// MXFP8 (OCP Microscaling, FP8 E4M3 elements + one E8M0 scale per 32-element block): scalar
// codecs and the CPU reference quantize / dequantize of row-major weight matrices.
//
// FP8 E4M3 (OCP "fn" variant): 1 sign, 4 exponent (bias 7), 3 mantissa bits. Normal values
// (1 + m/8) * 2^(e-7) for e in [1, 15] (except e=15, m=7), subnormals m/8 * 2^-6 = m * 2^-9,
// max finite 448 (0x7e), NaN = 0x7f / 0xff, no infinities. -0 is 0x80.
//
// E8M0 scale code c in [0, 254] means 2^(c - 127); 255 is NaN.
//
// Quantizing a block of 32 consecutive values along K (the last dim of each row, the GEMM
// reduction dim), amax = max |x| over the block:
//   c = clamp(ceil(log2(amax / 448)) + 127, 0, 254), and c = 0 for an all-zero block,
//   q[i] = E4M3(x[i] / 2^(c - 127)), rounded to nearest, ties to even, saturating at +-448.
// ceil(log2(amax / 448)) is computed exactly (from the binary exponent and mantissa of amax),
// so amax = 448 * 2^j gets c = 127 + j and q = 448 (0x7e / 0xfe) exactly.
//
// Layout for a [rows, k] matrix: q is row-major [rows, k] (one byte per value); scales are
// row-major [rows, ceil(k / 32)], scale (r, b) covering q[r, 32b .. min(32b + 32, k)). This is
// the layout of core/weights.h's LayerWeights (w13_scale [E, 2I, ceil(H/32)], ...).
//
// K not a multiple of 32 is accepted: the last block of each row is partial (k % 32 values)
// and its scale is computed from those values only (as if padded with zeros, which do not
// change amax).
//
// Dequantization is exact in FP32: an E4M3 value has 4 significant bits and the scale is a
// power of two, and products stay within FP32's range (the smallest is 2^-9 * 2^-127 =
// 2^-136) except above FLT_MAX: only |x| >= 1.9375 * 2^127 (about 3.3e38, the top 3% of FP32's
// range) rounds up to 2^128, a valid MXFP8 value that dequantizes to +-Inf in FP32.
//
// Thread-safety: all functions are pure (no shared state); callers may run disjoint rows on
// different threads.
#ifndef MOESERVE_KERNELS_CPU_MXFP8_H_
#define MOESERVE_KERNELS_CPU_MXFP8_H_

#include <cstdint>

namespace moeserve::kernels {

inline constexpr int64_t kMxfp8BlockSize = 32;
inline constexpr float kE4M3MaxFinite = 448.0f;
inline constexpr uint8_t kE4M3MaxFiniteCode = 0x7e;
inline constexpr uint8_t kE4M3NanCode = 0x7f;
inline constexpr int kE8M0Bias = 127;
inline constexpr uint8_t kE8M0MaxCode = 254;
inline constexpr uint8_t kE8M0NanCode = 255;

// Scale blocks per row of k values: ceil(k / 32).
inline constexpr int64_t Mxfp8ScaleBlocks(int64_t k) {
  return (k + kMxfp8BlockSize - 1) / kMxfp8BlockSize;
}

// Exact value of an E4M3 code (NaN for 0x7f / 0xff).
float E4M3ToFloat(uint8_t code);

// E4M3 code nearest to x, ties to even; |x| > 448 (including +-Inf) saturates to +-448; NaN
// gives 0x7f (0xff when the sign bit is set). The sign of zero (and of values that round to
// zero) is kept. Rounds once: the double overload is exact for any double input.
uint8_t FloatToE4M3(float x);
uint8_t DoubleToE4M3(double x);

// Value of an E8M0 scale code, 2^(code - 127) (NaN for 255).
float E8M0ToFloat(uint8_t code);

// E8M0 scale code for a block whose largest magnitude is `amax` (finite, >= 0):
// clamp(ceil(log2(amax / 448)) + 127, 0, 254), computed exactly; 0 when amax == 0.
uint8_t Mxfp8ScaleCode(float amax);

enum class Mxfp8Status : int {
  kOk = 0,
  kNonFinite = 1,     // an input value is NaN or +-Inf; *bad_index says where
  kInvalidShape = 2,  // rows < 0 or k < 0
};
const char* Mxfp8StatusName(Mxfp8Status status);

// Quantizes in [rows, k] (FP32, row-major) to q [rows, k] E4M3 codes and
// scales [rows, ceil(k / 32)] E8M0 codes (layout above). Refuses NaN / Inf input with
// kNonFinite, setting *bad_index (if not null) to the flat index (r * k + c) of the first such
// value; q and scales are then partially written and must not be used. Buffers must not
// overlap.
Mxfp8Status QuantizeMxfp8RowsRef(const float* in, int64_t rows, int64_t k, uint8_t* q,
                                 uint8_t* scales, int64_t* bad_index = nullptr);

// The same for BF16 input (uint16_t bit patterns), without an FP32 copy.
Mxfp8Status QuantizeMxfp8RowsFromBf16Ref(const uint16_t* in, int64_t rows, int64_t k, uint8_t* q,
                                         uint8_t* scales, int64_t* bad_index = nullptr);

// out[r, c] = E4M3ToFloat(q[r, c]) * E8M0ToFloat(scales[r, c / 32]) for q [rows, k] and
// scales [rows, ceil(k / 32)]; out FP32 [rows, k]. Exact (see above). Buffers must not overlap.
void DequantizeMxfp8RowsRef(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t k,
                            float* out);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CPU_MXFP8_H_
