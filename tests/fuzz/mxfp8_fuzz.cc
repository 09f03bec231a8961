// libFuzzer target: MXFP8 decode and encode (kernels/cpu/mxfp8.h), as checkpoints and the
// quantizer feed them.
//  - Decode: arbitrary E4M3 codes and E8M0 scales (as a pre-quantized checkpoint holds them)
//    dequantize to exactly code value x 2^(scale - 127), NaN exactly for NaN codes.
//  - Encode: arbitrary BF16 values quantize (or are refused for NaN/Inf, naming the first), and
//    dequantize back within MXFP8's error: half an E4M3 step at the block's scale.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"

namespace {

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz_mxfp8: violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace k = moeserve::kernels;
  if (size < 2) return 0;
  // Shape from the first two bytes: k in [1, 96] (partial blocks), rows as the data allows.
  const int64_t cols = 1 + data[0] % 96;
  const bool encode = data[1] & 1;
  data += 2;
  size -= 2;
  const int64_t blocks = k::Mxfp8ScaleBlocks(cols);
  if (!encode) {
    const int64_t rows = static_cast<int64_t>(size) / (cols + blocks);
    if (rows == 0) return 0;
    const uint8_t* q = data;
    const uint8_t* scales = data + rows * cols;
    std::vector<float> out(rows * cols);
    k::DequantizeMxfp8RowsRef(q, scales, rows, cols, out.data());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t code = q[r * cols + c], scale = scales[r * blocks + c / 32];
        const float v = out[r * cols + c];
        if ((code & 0x7f) == k::kE4M3NanCode || scale == k::kE8M0NanCode) {
          Check(std::isnan(v), "NaN code or scale decoded to a number");
          continue;
        }
        const double want = std::ldexp(static_cast<double>(k::E4M3ToFloat(code)), scale - 127);
        Check(static_cast<double>(v) == static_cast<double>(static_cast<float>(want)),
              "decode is not code x 2^(scale - 127)");
      }
    }
    return 0;
  }
  const int64_t rows = static_cast<int64_t>(size) / (2 * cols);
  if (rows == 0) return 0;
  std::vector<uint16_t> in(rows * cols);
  std::memcpy(in.data(), data, in.size() * 2);
  std::vector<uint8_t> q(rows * cols), scales(rows * blocks);
  int64_t bad = -1;
  const k::Mxfp8Status s =
      k::QuantizeMxfp8RowsFromBf16Ref(in.data(), rows, cols, q.data(), scales.data(), &bad);
  int64_t first_non_finite = -1;
  for (int64_t i = 0; i < rows * cols && first_non_finite < 0; ++i) {
    if (!std::isfinite(k::Bf16ToFloat(in[i]))) first_non_finite = i;
  }
  if (first_non_finite >= 0) {
    Check(s == k::Mxfp8Status::kNonFinite && bad == first_non_finite,
          "NaN/Inf input not refused at its index");
    return 0;
  }
  Check(s == k::Mxfp8Status::kOk, "finite input refused");
  std::vector<float> back(rows * cols);
  k::DequantizeMxfp8RowsRef(q.data(), scales.data(), rows, cols, back.data());
  for (int64_t i = 0; i < rows * cols; ++i) {
    const double x = k::Bf16ToFloat(in[i]);
    const int64_t r = i / cols, c = i % cols;
    Check((q[i] & 0x7f) != k::kE4M3NanCode, "finite input gave a NaN code");
    const uint8_t scale = scales[r * blocks + c / 32];
    Check(scale != k::kE8M0NanCode, "finite input gave a NaN scale");
    if (!std::isfinite(back[i])) {
      Check(std::fabs(x) >= 1.9375 * std::ldexp(1.0, 127) * (1 - 1.0 / 64),
            "a value far from FP32's top dequantized to Inf");
      continue;
    }
    // Half a step of E4M3 at this scale: 2^-4 relative for normals, 2^-10 x scale for
    // subnormals.
    const double unit = std::ldexp(1.0, scale - 127);
    const double tolerance =
        std::max(std::fabs(x) * std::ldexp(1.0, -4), unit * std::ldexp(1.0, -10));
    Check(std::fabs(back[i] - x) <= tolerance, "round trip error over half an E4M3 step");
  }
  return 0;
}
