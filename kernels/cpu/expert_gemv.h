// Few-row expert GEMMs on compressed weights (CPU): y[r, j] = sum_c W[j, c] * x[r, c].
//
// For decode sizes (1 to a few tens of rows per expert), where converting a whole expert to an
// FP32 copy before an sgemm costs more than the GEMM itself. The weights are decoded in
// registers, never materialized: BF16 (uint16_t bit patterns) or MXFP8 (E4M3 codes + one E8M0
// scale per 32 values along the reduction dim, the layout of kernels/cpu/mxfp8.h). The decoded
// values are exactly those of ConvertBf16ToFp32Ref / DequantizeMxfp8RowsRef; activations and
// accumulation are FP32 (the summation order differs from a plain loop: results agree to FP32
// rounding, not bit for bit).
//
// Each block of weight rows is read once from memory and reused across up to 16 activation rows
// (more rows are processed in groups of 16, re-reading the weights per group).
//
// Shapes: W [n, k] row-major (MXFP8 scales [n, ceil(k / 32)]); x: `rows` pointers, x[r] -> k
// FP32 values; y: `rows` pointers, y[r] -> n FP32 values. Only weight rows [j_begin, j_end) are
// computed, writing y[r][j_begin .. j_end) (so disjoint ranges can run on different threads).
// x and y must not overlap. Pure functions, thread-safe.
//
// The instruction set is picked once at run time (AVX-512F, AVX2+FMA, or baseline x86-64 /
// portable code); the binary needs nothing beyond the baseline.
#ifndef MOESERVE_KERNELS_CPU_EXPERT_GEMV_H_
#define MOESERVE_KERNELS_CPU_EXPERT_GEMV_H_

#include <cstdint>

namespace moeserve::kernels {

void ExpertGemvBf16(const uint16_t* w, int64_t k, int64_t j_begin, int64_t j_end,
                    const float* const* x, int64_t rows, float* const* y);

void ExpertGemvMxfp8(const uint8_t* q, const uint8_t* scales, int64_t k, int64_t j_begin,
                     int64_t j_end, const float* const* x, int64_t rows, float* const* y);

// Code paths, for tests and benchmarks. kAuto is the best one this CPU supports.
enum class GemvIsa : int { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };
const char* GemvIsaName(GemvIsa isa);
bool GemvIsaSupported(GemvIsa isa);
// The path kAuto resolves to on this CPU.
GemvIsa GemvIsaBest();

// The same, on a given path (which must be supported: GemvIsaSupported(isa)).
void ExpertGemvBf16Isa(GemvIsa isa, const uint16_t* w, int64_t k, int64_t j_begin, int64_t j_end,
                       const float* const* x, int64_t rows, float* const* y);
void ExpertGemvMxfp8Isa(GemvIsa isa, const uint8_t* q, const uint8_t* scales, int64_t k,
                        int64_t j_begin, int64_t j_end, const float* const* x, int64_t rows,
                        float* const* y);

}  // namespace moeserve::kernels

#endif  // MOESERVE_KERNELS_CPU_EXPERT_GEMV_H_
