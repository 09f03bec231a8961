#include "kernels/cpu/expert_gemv.h"

#include <cstring>

#include "kernels/cpu/mxfp8.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOESERVE_GEMV_X86 1
#include <immintrin.h>
#endif

// One kernel body (expert_gemv_impl.inc), written with GCC vector extensions, compiled once per
// instruction set: included inside a `#pragma GCC target` region and a namespace of its own
// that sets the vector width, the register tile and the two widening loads (the only
// intrinsics: GCC 12 lowers __builtin_convertvector of narrow integers poorly). A run-time
// check picks the path, so the binary needs nothing beyond baseline x86-64.

// The vector helpers are internal and always inlined into one target, so their ABI never
// matters.
#pragma GCC diagnostic ignored "-Wpsabi"

#define MOESERVE_INLINE inline __attribute__((always_inline))
#define MOESERVE_LAMBDA_INLINE __attribute__((always_inline))

namespace moeserve::kernels {
namespace {

inline constexpr int64_t kRowGroup = 16;

MOESERVE_INLINE float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// 2^(code - 127): 0 -> 2^-127 (subnormal), 255 -> NaN. The values of E8M0ToFloat, inline.
MOESERVE_INLINE float E8M0Value(uint8_t code) {
  if (code == 0) return BitsToFloat(0x00400000u);
  if (code == 255) return BitsToFloat(0x7fc00000u);
  return BitsToFloat(static_cast<uint32_t>(code) << 23);
}

namespace portable {
inline constexpr int kW = 4, kNb = 2, kRb = 4;
typedef float F __attribute__((vector_size(16)));
typedef uint32_t U __attribute__((vector_size(16)));
MOESERVE_INLINE U WidenBf16(const uint16_t* p) { return U{p[0], p[1], p[2], p[3]}; }
MOESERVE_INLINE U WidenE4M3(const uint8_t* p) { return U{p[0], p[1], p[2], p[3]}; }
#include "kernels/cpu/expert_gemv_impl.inc"
}  // namespace portable

#ifdef MOESERVE_GEMV_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
// 16 ymm registers: 2x4 accumulators + 2 weight vectors + one activation vector.
inline constexpr int kW = 8, kNb = 2, kRb = 4;
typedef float F __attribute__((vector_size(32)));
typedef uint32_t U __attribute__((vector_size(32)));
MOESERVE_INLINE U WidenBf16(const uint16_t* p) {
  return (U)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
MOESERVE_INLINE U WidenE4M3(const uint8_t* p) {
  return (U)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
#include "kernels/cpu/expert_gemv_impl.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,prefer-vector-width=512")
namespace avx512 {
// 32 zmm registers: 4x6 accumulators + 4 weight vectors + one activation vector.
inline constexpr int kW = 16, kNb = 4, kRb = 6;
typedef float F __attribute__((vector_size(64)));
typedef uint32_t U __attribute__((vector_size(64)));
MOESERVE_INLINE U WidenBf16(const uint16_t* p) {
  return (U)_mm512_maskz_cvtepu16_epi32(0xffff,
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
MOESERVE_INLINE U WidenE4M3(const uint8_t* p) {
  return (U)_mm512_maskz_cvtepu8_epi32(0xffff,
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#include "kernels/cpu/expert_gemv_impl.inc"
}  // namespace avx512
#pragma GCC pop_options
#endif  // MOESERVE_GEMV_X86

GemvIsa DetectIsa() {
#ifdef MOESERVE_GEMV_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return GemvIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return GemvIsa::kAvx2;
#endif
  return GemvIsa::kPortable;
}

GemvIsa Resolve(GemvIsa isa) { return isa == GemvIsa::kAuto ? GemvIsaBest() : isa; }

}  // namespace

const char* GemvIsaName(GemvIsa isa) {
  switch (isa) {
    case GemvIsa::kAuto:
      return "auto";
    case GemvIsa::kPortable:
      return "portable";
    case GemvIsa::kAvx2:
      return "avx2";
    case GemvIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

GemvIsa GemvIsaBest() {
  static const GemvIsa best = DetectIsa();
  return best;
}

bool GemvIsaSupported(GemvIsa isa) {
  return isa == GemvIsa::kAuto || isa == GemvIsa::kPortable ||
         static_cast<int>(isa) <= static_cast<int>(GemvIsaBest());
}

void ExpertGemvBf16Isa(GemvIsa isa, const uint16_t* w, int64_t k, int64_t j_begin, int64_t j_end,
                       const float* const* x, int64_t rows, float* const* y) {
  if (rows <= 0 || j_begin >= j_end) return;
  switch (Resolve(isa)) {
#ifdef MOESERVE_GEMV_X86
    case GemvIsa::kAvx512:
      return avx512::RunBf16(w, k, j_begin, j_end, x, rows, y);
    case GemvIsa::kAvx2:
      return avx2::RunBf16(w, k, j_begin, j_end, x, rows, y);
#endif
    default:
      return portable::RunBf16(w, k, j_begin, j_end, x, rows, y);
  }
}

void ExpertGemvMxfp8Isa(GemvIsa isa, const uint8_t* q, const uint8_t* scales, int64_t k,
                        int64_t j_begin, int64_t j_end, const float* const* x, int64_t rows,
                        float* const* y) {
  if (rows <= 0 || j_begin >= j_end) return;
  switch (Resolve(isa)) {
#ifdef MOESERVE_GEMV_X86
    case GemvIsa::kAvx512:
      return avx512::RunMxfp8(q, scales, k, j_begin, j_end, x, rows, y);
    case GemvIsa::kAvx2:
      return avx2::RunMxfp8(q, scales, k, j_begin, j_end, x, rows, y);
#endif
    default:
      return portable::RunMxfp8(q, scales, k, j_begin, j_end, x, rows, y);
  }
}

void ExpertGemvBf16(const uint16_t* w, int64_t k, int64_t j_begin, int64_t j_end,
                    const float* const* x, int64_t rows, float* const* y) {
  ExpertGemvBf16Isa(GemvIsa::kAuto, w, k, j_begin, j_end, x, rows, y);
}

void ExpertGemvMxfp8(const uint8_t* q, const uint8_t* scales, int64_t k, int64_t j_begin,
                     int64_t j_end, const float* const* x, int64_t rows, float* const* y) {
  ExpertGemvMxfp8Isa(GemvIsa::kAuto, q, scales, k, j_begin, j_end, x, rows, y);
}

}  // namespace moeserve::kernels
