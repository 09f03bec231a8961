// kernels/cpu/expert_gemv.h against a float64 loop over the exactly decoded weights, on every
// instruction-set path this CPU supports: odd k (not a multiple of 8, 16 or 32, so the vector
// tails, the partial MXFP8 scale block and the scalar tail all run), row counts 1..16 and past
// the kernel's 16-row groups, weight-row ranges that split the register blocks.
// Tolerance: FP32 accumulation of k products -> relative L2 < 1e-5.
#include "kernels/cpu/expert_gemv.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/mxfp8.h"

namespace moeserve::kernels {
namespace {

constexpr double kTolerance = 1e-5;

std::vector<GemvIsa> SupportedIsas() {
  std::vector<GemvIsa> isas;
  for (GemvIsa isa : {GemvIsa::kPortable, GemvIsa::kAvx2, GemvIsa::kAvx512}) {
    if (GemvIsaSupported(isa)) isas.push_back(isa);
  }
  return isas;
}

struct Case {
  int64_t n, k, rows;
};

// Relative L2 error of y[r][j_begin..j_end) against float64 sum_c wf[j, c] x[r, c].
double Error(const std::vector<float>& wf, const std::vector<float>& x, int64_t k, int64_t j_begin,
             int64_t j_end, int64_t rows, const std::vector<float>& y, int64_t n) {
  double err = 0, norm = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = j_begin; j < j_end; ++j) {
      double e = 0;
      for (int64_t c = 0; c < k; ++c) e += double{wf[j * k + c]} * double{x[r * k + c]};
      err += (y[r * n + j] - e) * (y[r * n + j] - e);
      norm += e * e;
    }
  }
  return std::sqrt(err / norm);
}

class ExpertGemvTest : public ::testing::TestWithParam<GemvIsa> {
 protected:
  std::mt19937 rng_{7};

  // x [rows, k] standard normal; row pointers into it and into y [rows, n] (NaN-poisoned).
  void MakeRows(int64_t rows, int64_t n, int64_t k) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    x_.assign(rows * k, 0.0f);
    for (float& v : x_) v = dist(rng_);
    y_.assign(rows * n, NAN);
    xp_.resize(rows);
    yp_.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      xp_[r] = x_.data() + r * k;
      yp_[r] = y_.data() + r * n;
    }
  }
  // Values outside [j_begin, j_end) must be left alone.
  void ExpectUntouchedOutside(int64_t n, int64_t rows, int64_t j_begin, int64_t j_end) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        if (j < j_begin || j >= j_end) {
          ASSERT_TRUE(std::isnan(y_[r * n + j])) << "row " << r << " col " << j;
        }
      }
    }
  }

  std::vector<float> x_, y_;
  std::vector<const float*> xp_;
  std::vector<float*> yp_;
};

TEST_P(ExpertGemvTest, Bf16MatchesFloat64) {
  const GemvIsa isa = GetParam();
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (const Case& c :
       {Case{13, 77, 1}, Case{21, 77, 2}, Case{9, 131, 3}, Case{37, 45, 7}, Case{16, 300, 16},
        Case{11, 7, 5}, Case{6, 1, 4}, Case{29, 200, 23}, Case{40, 96, 33}}) {
    SCOPED_TRACE(::testing::Message()
                 << GemvIsaName(isa) << " n=" << c.n << " k=" << c.k << " rows=" << c.rows);
    std::vector<uint16_t> w(c.n * c.k);
    std::vector<float> wf(c.n * c.k);
    for (int64_t i = 0; i < c.n * c.k; ++i) {
      w[i] = FloatToBf16(dist(rng_));
      wf[i] = Bf16ToFloat(w[i]);
    }
    MakeRows(c.rows, c.n, c.k);
    ExpertGemvBf16Isa(isa, w.data(), c.k, 0, c.n, xp_.data(), c.rows, yp_.data());
    EXPECT_LT(Error(wf, x_, c.k, 0, c.n, c.rows, y_, c.n), kTolerance);

    // A sub-range of weight rows that does not start on a register block.
    const int64_t jb = c.n / 3, je = c.n - c.n / 4;
    MakeRows(c.rows, c.n, c.k);
    ExpertGemvBf16Isa(isa, w.data(), c.k, jb, je, xp_.data(), c.rows, yp_.data());
    EXPECT_LT(Error(wf, x_, c.k, jb, je, c.rows, y_, c.n), kTolerance);
    ExpectUntouchedOutside(c.n, c.rows, jb, je);
  }
}

TEST_P(ExpertGemvTest, Mxfp8MatchesFloat64) {
  const GemvIsa isa = GetParam();
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (const Case& c :
       {Case{13, 77, 1}, Case{21, 77, 2}, Case{9, 131, 3}, Case{37, 45, 7}, Case{16, 300, 16},
        Case{11, 7, 5}, Case{6, 1, 4}, Case{29, 200, 23}, Case{40, 96, 33}}) {
    SCOPED_TRACE(::testing::Message()
                 << GemvIsaName(isa) << " n=" << c.n << " k=" << c.k << " rows=" << c.rows);
    std::vector<float> src(c.n * c.k), wf(c.n * c.k);
    for (int64_t i = 0; i < c.n * c.k; ++i) {
      // Spread magnitudes over many binades so subnormal E4M3 codes and exact zeros occur.
      src[i] = (i % 11 == 0) ? 0.0f : dist(rng_) * std::ldexp(1.0f, -static_cast<int>(i % 9));
    }
    std::vector<uint8_t> q(c.n * c.k), scales(c.n * Mxfp8ScaleBlocks(c.k));
    ASSERT_EQ(QuantizeMxfp8RowsRef(src.data(), c.n, c.k, q.data(), scales.data()),
              Mxfp8Status::kOk);
    DequantizeMxfp8RowsRef(q.data(), scales.data(), c.n, c.k, wf.data());
    MakeRows(c.rows, c.n, c.k);
    ExpertGemvMxfp8Isa(isa, q.data(), scales.data(), c.k, 0, c.n, xp_.data(), c.rows, yp_.data());
    EXPECT_LT(Error(wf, x_, c.k, 0, c.n, c.rows, y_, c.n), kTolerance);

    const int64_t jb = c.n / 3, je = c.n - c.n / 4;
    MakeRows(c.rows, c.n, c.k);
    ExpertGemvMxfp8Isa(isa, q.data(), scales.data(), c.k, jb, je, xp_.data(), c.rows, yp_.data());
    EXPECT_LT(Error(wf, x_, c.k, jb, je, c.rows, y_, c.n), kTolerance);
    ExpectUntouchedOutside(c.n, c.rows, jb, je);
  }
}

// The required row counts {1, 2, 3, 7, 16} at an odd k, BF16 and MXFP8.
TEST_P(ExpertGemvTest, RequiredRowCountsAtOddK) {
  const GemvIsa isa = GetParam();
  const int64_t n = 19, k = 203;
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> src(n * k), wf(n * k);
  for (float& v : src) v = dist(rng_);
  std::vector<uint16_t> w(n * k);
  for (int64_t i = 0; i < n * k; ++i) w[i] = FloatToBf16(src[i]);
  std::vector<uint8_t> q(n * k), scales(n * Mxfp8ScaleBlocks(k));
  ASSERT_EQ(QuantizeMxfp8RowsRef(src.data(), n, k, q.data(), scales.data()), Mxfp8Status::kOk);
  for (int64_t rows : {1, 2, 3, 7, 16}) {
    SCOPED_TRACE(::testing::Message() << GemvIsaName(isa) << " rows=" << rows);
    for (int64_t i = 0; i < n * k; ++i) wf[i] = Bf16ToFloat(w[i]);
    MakeRows(rows, n, k);
    ExpertGemvBf16Isa(isa, w.data(), k, 0, n, xp_.data(), rows, yp_.data());
    EXPECT_LT(Error(wf, x_, k, 0, n, rows, y_, n), kTolerance);
    DequantizeMxfp8RowsRef(q.data(), scales.data(), n, k, wf.data());
    MakeRows(rows, n, k);
    ExpertGemvMxfp8Isa(isa, q.data(), scales.data(), k, 0, n, xp_.data(), rows, yp_.data());
    EXPECT_LT(Error(wf, x_, k, 0, n, rows, y_, n), kTolerance);
  }
}

// Every E4M3 code decodes exactly as E4M3ToFloat (x = one-hot picks single weights), with
// scales across the E8M0 range, including NaN codes.
TEST_P(ExpertGemvTest, Mxfp8DecodesEveryCodeExactly) {
  const GemvIsa isa = GetParam();
  const int64_t n = 256, k = 64;  // row j holds code j at column j % k
  for (uint8_t scale : {uint8_t{1}, uint8_t{100}, uint8_t{127}, uint8_t{140}}) {
    std::vector<uint8_t> q(n * k, 0), scales(n * Mxfp8ScaleBlocks(k), scale);
    for (int64_t j = 0; j < n; ++j) q[j * k + j % k] = static_cast<uint8_t>(j);
    MakeRows(k, n, k);
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = 0; c < k; ++c) x_[r * k + c] = r == c ? 1.0f : 0.0f;
    }
    ExpertGemvMxfp8Isa(isa, q.data(), scales.data(), k, 0, n, xp_.data(), k, yp_.data());
    for (int64_t j = 0; j < n; ++j) {
      const float expected = E4M3ToFloat(static_cast<uint8_t>(j)) * E8M0ToFloat(scale);
      const float got = y_[(j % k) * n + j];
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(got)) << "code " << j;
      } else {
        EXPECT_EQ(got, expected) << "code " << j << " scale " << int{scale};
      }
    }
  }
}

TEST_P(ExpertGemvTest, ZeroRowsOrEmptyRangeWritesNothing) {
  const GemvIsa isa = GetParam();
  std::vector<uint16_t> w(4 * 40, FloatToBf16(1.0f));
  MakeRows(2, 4, 40);
  ExpertGemvBf16Isa(isa, w.data(), 40, 0, 4, xp_.data(), 0, yp_.data());
  ExpertGemvBf16Isa(isa, w.data(), 40, 2, 2, xp_.data(), 2, yp_.data());
  ExpectUntouchedOutside(4, 2, 0, 0);
}

INSTANTIATE_TEST_SUITE_P(Isas, ExpertGemvTest, ::testing::ValuesIn(SupportedIsas()),
                         [](const ::testing::TestParamInfo<GemvIsa>& info) {
                           return std::string(GemvIsaName(info.param));
                         });

TEST(ExpertGemvIsa, AutoIsTheBestSupported) {
  EXPECT_TRUE(GemvIsaSupported(GemvIsaBest()));
  EXPECT_TRUE(GemvIsaSupported(GemvIsa::kPortable));
  EXPECT_NE(GemvIsaBest(), GemvIsa::kAuto);
}

}  // namespace
}  // namespace moeserve::kernels
