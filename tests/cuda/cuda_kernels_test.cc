// CUDA routing / reduce / dequant kernels against their CPU twins (kernels/cpu/moe_routing_ref.h,
// kernels/cpu/moe_ref.h). Fresh random inputs per case; device outputs poisoned before each run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/dtype_convert.h"
#include "kernels/cpu/moe_ref.h"
#include "kernels/cpu/moe_routing_ref.h"
#include "kernels/cpu/mxfp8.h"
#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/ep_pack.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_grouped_sm90.cuh"
#include "kernels/cuda/moe_routing.cuh"

namespace moeserve::kernels {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)
#define CUDA_EXPECT(x) EXPECT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count, int poison = 0xAB) : n(count) {
    cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T));
    cudaMemset(p, poison, std::max<size_t>(1, n) * sizeof(T));
  }
  Dev(const std::vector<T>& v) : Dev(v.size()) {
    cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> Get() const {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
};

double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

class CudaKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

// One block, and (with scratch, from 4096 routes of at most 256 experts) several: the same
// outputs as the reference, stable. Skewed ids too (most routes on one expert), and block sizes
// that do not divide the routes.
TEST_F(CudaKernelsTest, AlignMatchesRefAndIsStable) {
  std::mt19937 rng(1);
  for (int64_t routes : {0, 1, 7, 300, 2048, 4095, 4096, 4096 * 8, 4096 * 8 + 17, 100000, 300001}) {
    for (int e : {1, 8, 32, 256, 257, 1000, 5000, kMoeAlignMaxExperts}) {
      for (bool skewed : {false, true}) {
        if (skewed && routes < 2048) continue;
        std::uniform_int_distribution<int> id(-1, e);  // -1 and e: not served here
        std::vector<int32_t> ids(routes);
        for (auto& v : ids) v = skewed && rng() % 4 != 0 ? e / 2 : id(rng);
        std::vector<int32_t> c(e), o(e + 1), s(routes), sl(routes);
        MoeAlignRef(ids.data(), routes, e, c.data(), o.data(), s.data(), sl.data());
        const int64_t scratch_ints = MoeAlignScratchInts(routes, e);
        EXPECT_EQ(scratch_ints > 0,
                  routes >= kMoeAlignMultiBlockMinRoutes && e <= kMoeAlignMultiBlockMaxExperts)
            << routes << " routes, " << e << " experts";
        for (bool with_scratch : {false, true}) {
          SCOPED_TRACE(testing::Message()
                       << routes << " routes, " << e << " experts" << (skewed ? ", skewed" : "")
                       << (with_scratch ? ", with scratch" : ""));
          Dev<int32_t> d_ids(ids), dc(e), doff(e + 1), ds(routes), dsl(routes),
              scratch(static_cast<size_t>(std::max<int64_t>(scratch_ints, 1)));
          CUDA_OK(LaunchMoeAlign(d_ids.p, routes, e, dc.p, doff.p, ds.p, dsl.p, nullptr,
                                 with_scratch ? scratch.p : nullptr));
          CUDA_OK(cudaDeviceSynchronize());
          EXPECT_EQ(dc.Get(), c);
          EXPECT_EQ(doff.Get(), o);
          if (routes > 0) {
            EXPECT_EQ(ds.Get(), s);
            EXPECT_EQ(dsl.Get(), sl);
          }
        }
      }
    }
  }
  // Beyond the counters' shared memory: refused before launching.
  Dev<int32_t> ids(std::vector<int32_t>{0}), c(kMoeAlignMaxExperts + 1), o(kMoeAlignMaxExperts + 2),
      s(1), sl(1);
  EXPECT_EQ(LaunchMoeAlign(ids.p, 1, kMoeAlignMaxExperts + 1, c.p, o.p, s.p, sl.p, nullptr),
            cudaErrorInvalidValue);
}

TEST_F(CudaKernelsTest, StageRoutingMatchesRefAndReportsFirstOffenders) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const float kNan = std::nanf(""), kInf = INFINITY;
  for (int64_t m : {0, 1, 5, 256, 1000, 9000}) {
    for (int topk : {1, 8}) {
      for (int bad : {0, 1, 2}) {  // none; a few bad ids and weights; many
        const int e = 32;
        const int64_t padded = m + (m % 3), r = m * topk, pr = padded * topk;
        std::vector<int32_t> ids(r);
        std::vector<float> w(r);
        std::uniform_int_distribution<int> id(0, e - 1);
        for (auto& v : ids) v = id(rng);
        for (auto& v : w) v = nd(rng);
        if (bad > 0 && r > 0) {
          std::uniform_int_distribution<int64_t> at(0, r - 1);
          const int count = bad == 1 ? 2 : static_cast<int>(r / 3 + 1);
          for (int i = 0; i < count; ++i) {
            ids[at(rng)] = i % 2 ? e : -7;
            w[at(rng)] = i % 3 == 0 ? kNan : (i % 3 == 1 ? kInf : 2e4f);
          }
        }
        // Every other case through a map: half the experts here, permuted; the rest elsewhere.
        std::vector<int32_t> map(e, -1);
        for (int j = 0; j < e / 2; ++j) map[(j * 7 + 3) % e] = j;
        const bool mapped = (m + topk + bad) % 2 == 1;
        std::vector<int32_t> ref_ids(pr);
        std::vector<float> ref_w(pr);
        RoutingReportRef ref;
        StageRoutingRef(ids.data(), w.data(), m, topk, padded, e, mapped ? map.data() : nullptr,
                        mapped ? e / 2 : e, 1e4f, ref_ids.data(), ref_w.data(), &ref);
        Dev<int32_t> d_map(map);
        Dev<int32_t> d_ids(ids), d_out_ids(pr);
        Dev<float> d_w(w), d_out_w(pr);
        RoutingReport* rep = nullptr;
        CUDA_OK(cudaMallocHost(&rep, sizeof(RoutingReport)));
        // Poisoned: the kernel must write it in full.
        std::memset(static_cast<void*>(rep), 0x5A, sizeof(RoutingReport));
        CUDA_OK(LaunchStageRouting(d_ids.p, d_w.p, m, topk, padded, e, mapped ? d_map.p : nullptr,
                                   mapped ? e / 2 : e, 1e4f, d_out_ids.p, d_out_w.p, rep, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::string where = "m=" + std::to_string(m) + " topk=" + std::to_string(topk) +
                                  " bad=" + std::to_string(bad);
        if (pr > 0) {
          EXPECT_EQ(d_out_ids.Get(), ref_ids) << where;
          const std::vector<float> got_w = d_out_w.Get();
          EXPECT_EQ(std::memcmp(got_w.data(), ref_w.data(), pr * sizeof(float)), 0) << where;
        }
        EXPECT_EQ(rep->bad_id_route, ref.bad_id_route) << where;
        EXPECT_EQ(rep->bad_weight_route, ref.bad_weight_route) << where;
        if (ref.bad_id_route >= 0) {
          EXPECT_EQ(rep->bad_id_value, ref.bad_id_value) << where;
        }
        if (ref.bad_weight_route >= 0) {
          uint32_t got_bits = 0, want_bits = 0;  // bit patterns: NaNs compare too
          std::memcpy(&got_bits, &rep->bad_weight_value, sizeof(got_bits));
          std::memcpy(&want_bits, &ref.bad_weight_value, sizeof(want_bits));
          EXPECT_EQ(got_bits, want_bits) << where;
        }
        if (bad == 0) {
          EXPECT_EQ(ref.bad_id_route, -1);
          EXPECT_EQ(ref.bad_weight_route, -1);
        } else if (r > 0) {
          EXPECT_GE(ref.bad_id_route, 0) << where;
        }
        cudaFreeHost(rep);
      }
    }
  }
}

TEST_F(CudaKernelsTest, TopKReduceContiguousAndNaiveBatched) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  for (int64_t m : {1, 7, 300}) {
    for (int topk : {1, 8}) {
      for (int64_t hidden : {8, 200, 3}) {
        const int e = 16;
        const int64_t r = m * topk;
        std::vector<int32_t> ids(r);
        std::uniform_int_distribution<int> id(-1, e - 1);
        for (auto& v : ids) v = id(rng);
        std::vector<float> w(r), in(r * hidden);
        for (auto& v : w) v = nd(rng);
        for (auto& v : in) v = nd(rng);
        std::vector<float> ref(m * hidden);
        TopKWeightAndReduceContiguousRef(in.data(), w.data(), ids.data(), m, topk, hidden,
                                         ref.data());
        Dev<int32_t> d_ids(ids);
        Dev<float> d_w(w), d_in(in), d_out(m * hidden, 0xFF);
        CUDA_OK(LaunchTopKWeightAndReduceContiguous(d_in.p, d_w.p, d_ids.p, m, topk, hidden, e,
                                                    d_out.p, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        EXPECT_LT(RelL2(d_out.Get(), ref), 1e-6);

        // NaiveBatched: the batched layout from align's slots.
        std::vector<int32_t> c(e), o(e + 1), s(r), sl(r);
        MoeAlignRef(ids.data(), r, e, c.data(), o.data(), s.data(), sl.data());
        int64_t max_tokens = 1;
        for (int32_t v : c) max_tokens = std::max<int64_t>(max_tokens, v);
        std::vector<float> bin(e * max_tokens * hidden);
        for (auto& v : bin) v = nd(rng);
        TopKWeightAndReduceNaiveBatchedRef(bin.data(), w.data(), ids.data(), sl.data(), m, topk,
                                           hidden, e, max_tokens, ref.data());
        Dev<int32_t> d_sl(sl);
        Dev<float> d_bin(bin), d_out2(m * hidden, 0xFF);
        CUDA_OK(LaunchTopKWeightAndReduceNaiveBatched(d_bin.p, d_w.p, d_ids.p, d_sl.p, m, topk,
                                                      hidden, e, max_tokens, d_out2.p, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        EXPECT_LT(RelL2(d_out2.Get(), ref), 1e-6);
      }
    }
  }
}

// The reduce that rounds as it stores: bit-identical to the FP32 reduce followed by the
// conversion kernel and to the CPU twins (reduce, then ConvertFp32To{Bf16,Fp16}Ref), into device
// memory and into page-locked host memory (the graph path's small answers).
TEST_F(CudaKernelsTest, TopKReduceRoundsToBf16AndFp16AsReduceThenConvert) {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd;
  for (int64_t m : {1, 5, 130}) {
    for (int64_t hidden : {7168, 200, 3}) {
      const int topk = 4, e = 16;
      const int64_t r = m * topk, n = m * hidden;
      std::vector<int32_t> ids(r);
      std::uniform_int_distribution<int> id(-1, e - 1);
      for (auto& v : ids) v = id(rng);
      std::vector<float> w(r), in(r * hidden);
      for (auto& v : w) v = nd(rng);
      for (auto& v : in) v = 100.0f * nd(rng);  // large sums: FP16 rounding and overflow paths
      std::vector<float> ref(n);
      TopKWeightAndReduceContiguousRef(in.data(), w.data(), ids.data(), m, topk, hidden,
                                       ref.data());
      Dev<int32_t> d_ids(ids);
      Dev<float> d_w(w), d_in(in), d_fp32(n, 0xFF);
      CUDA_OK(LaunchTopKWeightAndReduceContiguous(d_in.p, d_w.p, d_ids.p, m, topk, hidden, e,
                                                  d_fp32.p, nullptr));
      for (ReduceOutput kind : {ReduceOutput::kBf16, ReduceOutput::kFp16}) {
        SCOPED_TRACE(testing::Message() << "m=" << m << " hidden=" << hidden
                                        << " fp16=" << (kind == ReduceOutput::kFp16));
        Dev<uint16_t> d_two_pass(n, 0xCD), d_fused(n, 0xCD);
        CUDA_OK(kind == ReduceOutput::kBf16
                    ? LaunchConvertFp32ToBf16(d_fp32.p, d_two_pass.p, n, nullptr)
                    : LaunchConvertFp32ToFp16(d_fp32.p, d_two_pass.p, n, nullptr));
        CUDA_OK(LaunchTopKWeightAndReduceContiguous(d_in.p, d_w.p, d_ids.p, m, topk, hidden, e,
                                                    d_fused.p, kind, nullptr));
        uint16_t* pinned = nullptr;
        CUDA_OK(cudaMallocHost(&pinned, n * sizeof(uint16_t)));
        std::memset(pinned, 0xCD, n * sizeof(uint16_t));
        CUDA_OK(LaunchTopKWeightAndReduceContiguous(d_in.p, d_w.p, d_ids.p, m, topk, hidden, e,
                                                    pinned, kind, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<uint16_t> two_pass = d_two_pass.Get(), fused = d_fused.Get();
        const std::vector<uint16_t> host(pinned, pinned + n);
        cudaFreeHost(pinned);
        std::vector<uint16_t> cpu(n);
        if (kind == ReduceOutput::kBf16) {
          ConvertFp32ToBf16Ref(d_fp32.Get().data(), cpu.data(), n);
        } else {
          ConvertFp32ToFp16Ref(d_fp32.Get().data(), cpu.data(), n);
        }
        EXPECT_EQ(fused, two_pass);
        EXPECT_EQ(host, two_pass);
        EXPECT_EQ(fused, cpu);
        // And the sums themselves against the CPU reduce: BF16's rounding, relative L2 1e-2.
        if (kind == ReduceOutput::kBf16) {
          std::vector<float> widened(n);
          for (int64_t i = 0; i < n; ++i) widened[i] = Bf16ToFloat(fused[i]);
          EXPECT_LT(RelL2(widened, ref), 1e-2);
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, PermuteToBatchedMatchesRef) {
  std::mt19937 rng(3);
  const int64_t m = 77, hidden = 200;
  const int topk = 4, e = 9;
  std::vector<int32_t> ids(m * topk);
  std::uniform_int_distribution<int> id(-1, e - 1);
  for (auto& v : ids) v = id(rng);
  std::vector<uint16_t> x(m * hidden);
  for (auto& v : x) v = static_cast<uint16_t>(rng());
  std::vector<int32_t> c(e), o(e + 1), s(m * topk), sl(m * topk);
  MoeAlignRef(ids.data(), m * topk, e, c.data(), o.data(), s.data(), sl.data());
  const int64_t max_tokens = 40;  // some routes past capacity are skipped by both
  std::vector<uint16_t> ref(e * max_tokens * hidden, 0x7fc1);
  PermuteToBatchedRef(x.data(), ids.data(), sl.data(), m, topk, hidden, e, max_tokens, ref.data());
  Dev<uint16_t> d_x(x), d_out(ref.size());
  std::vector<uint16_t> poison(ref.size(), 0x7fc1);
  cudaMemcpy(d_out.p, poison.data(), poison.size() * 2, cudaMemcpyHostToDevice);
  Dev<int32_t> d_ids(ids), d_sl(sl);
  CUDA_OK(LaunchPermuteToBatched(d_x.p, d_ids.p, d_sl.p, m, topk, hidden, e, max_tokens, d_out.p,
                                 nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(d_out.Get(), ref);
}

TEST_F(CudaKernelsTest, DequantizeMxfp8IsExact) {
  std::mt19937 rng(4);
  for (int64_t k : {32, 200, 7}) {
    const int64_t rows = 64, blocks = (k + 31) / 32;
    std::vector<uint8_t> q(rows * k), s(rows * blocks);
    for (auto& v : q) {
      v = static_cast<uint8_t>(rng());
      if ((v & 0x7f) == 0x7f) v &= 0xfe;  // no NaN codes
    }
    for (int64_t i = 0; i < rows * blocks; ++i) {
      s[i] = static_cast<uint8_t>(i % 7 == 0 ? (i % 2 ? 0 : 254) : 100 + rng() % 50);
    }
    std::vector<uint16_t> ref(rows * k);
    DequantizeMxfp8ToBf16Ref(q.data(), s.data(), rows, k, ref.data());
    Dev<uint8_t> dq(q), ds(s);
    Dev<uint16_t> d_out(rows * k);
    CUDA_OK(LaunchDequantizeMxfp8ToBf16(dq.p, ds.p, rows, k, d_out.p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = d_out.Get();
    int mismatches = 0;
    for (int64_t i = 0; i < rows * k; ++i) {
      // Scale 254 overflows BF16 for large codes and 0 underflows it for small ones: both sides
      // round the same exact value, so they must still agree bit for bit.
      mismatches += got[i] != ref[i];
    }
    EXPECT_EQ(mismatches, 0) << "k=" << k;
  }
}

// The grouped GEMM dequantizes MXFP8 in registers with integer ops (moe_gemm.cu, Fp8x4ToBf16).
// One-hot activation rows read the dequantized weights back out of the down GEMM (w * 1 plus
// w' * 0 is exact), so every weight must equal the CPU twin bit for bit, for every E4M3 code and
// for scale codes up to 134 (one multiply; BF16 subnormal products at the low end) and, with a
// NaN code, up to 245: the pack reports the largest code (255 for the NaN block) and that selects
// the two-multiply path. The NaN makes its row's dot products NaN, as in the reference GEMM.
// Tile families: mma.sync decode (16 and 64 routes per expert), the adaptive wide decode tile
// that takes over when one expert has more routes than the narrow tile holds (30 + 2, 40 + 8),
// the two-CTA cluster tile (5 + 12: two weight tiles per cluster; 20 + 3: weights multicast),
// and the large tiles (192: wgmma where built).
TEST_F(CudaKernelsTest, GroupedGemmDequantizesMxfp8BitForBit) {
  std::mt19937 rng(21);
  const int64_t e = 2, h = 256, n = 128, blocks = n / 32;
  int num_sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  for (int max_code : {134, 245}) {
    // Routes per expert: uniform (the narrow decode tiles, and 192: the large tiles), and a hot
    // expert beside a cold one (the adaptive wide tile that the device-side gate picks).
    for (const std::vector<int32_t>& counts :
         {std::vector<int32_t>{16, 16}, {64, 64}, {192, 192}, {30, 2}, {40, 8}, {5, 12}, {20, 3}}) {
      const std::string name = std::to_string(counts[0]) + "," + std::to_string(counts[1]);
      std::vector<int32_t> offsets = {0, counts[0]};
      const int64_t rows = counts[0] + counts[1];
      std::vector<uint8_t> q(e * h * n), s(e * h * blocks);
      for (auto& v : q) {
        v = static_cast<uint8_t>(rng());
        if ((v & 0x7f) == 0x7f) v &= 0xfe;
      }
      for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<uint8_t>(rng() % (max_code + 1));
      s[5] = static_cast<uint8_t>(max_code);
      const bool wide = max_code > kMxfp8NarrowScaleMax;
      const int64_t nan_row = 37, nan_expert = 1;  // wide: one NaN code in one row
      if (wide) q[(nan_expert * h + nan_row) * n + 70] = 0xff;
      std::vector<uint16_t> deq(e * h * n);
      DequantizeMxfp8ToBf16Ref(q.data(), s.data(), e * h, n, deq.data());

      const MoePackedLayout l = MakeMoePackedLayout(h, n);
      Dev<uint8_t> dq(q), ds(s);
      Dev<uint8_t> packed(e * l.w2_elems_per_expert()), pscale(e * l.w2_scales_per_expert());
      Dev<int32_t> d_max(std::vector<int32_t>{0});
      CUDA_OK(LaunchPackMoeW2(dq.p, ds.p, e, l, 1, packed.p, pscale.p, nullptr, d_max.p));
      const int32_t reported = d_max.Get()[0];
      EXPECT_EQ(reported, wide ? 255 : max_code);  // the NaN block is packed with code 255
      std::vector<uint16_t> act(rows * l.intermediate_padded, 0);
      for (int64_t x = 0; x < e; ++x) {
        for (int64_t r = 0; r < counts[x]; ++r) {
          act[(offsets[x] + r) * l.intermediate_padded + r % n] = 0x3f80;  // 1.0
        }
      }
      Dev<uint16_t> d_act(act);
      Dev<int32_t> d_counts(counts), d_offsets(offsets);
      Dev<float> d_out(rows * h);
      MoeGemmParams p;
      p.kind = MoeGemmKind::kDown;
      p.mxfp8 = true;
      p.mxfp8_max_scale_code = reported;
      p.num_experts = static_cast<int>(e);
      p.layout = l;
      p.weights = packed.p;
      p.scales = pscale.p;
      p.act = d_act.p;
      p.act_stride = l.intermediate_padded;
      p.expert_counts = d_counts.p;
      p.expert_offsets = d_offsets.p;
      p.out = d_out.p;
      p.out_stride = h;
      p.max_rows_hint = rows;
      p.total_rows_hint = rows;
      // At most 12 routes per expert on average: the cluster tile, with either dequantization.
      if (rows <= 24) p.decode_pair = MoeDecodePair::kOn;
      CUDA_OK(LaunchMoeGroupedGemm(p, num_sms, nullptr));
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> out = d_out.Get();
      int mismatches = 0, nan_rows = 0;
      for (int64_t x = 0; x < e; ++x) {
        for (int64_t r = 0; r < counts[x]; ++r) {
          const int64_t k = r % n;
          for (int64_t row = 0; row < h; ++row) {
            const float got = out[(offsets[x] + r) * h + row];
            if (wide && x == nan_expert && row == nan_row) {
              nan_rows += std::isnan(got);
              continue;
            }
            mismatches += !(got == Bf16ToFloat(deq[(x * h + row) * n + k]));
          }
        }
      }
      EXPECT_EQ(mismatches, 0) << "max_code=" << max_code << " counts=" << name;
      if (wide) {
        EXPECT_EQ(nan_rows, counts[nan_expert]) << "counts=" << name;
      }
    }
  }
}

// One problem for LaunchMoeGroupedGemm (the split-K and the wgmma tile tests): random weights
// (BF16 of N(0, 0.05^2), or E4M3 codes without NaN with E8M0 scales in [scale_lo, scale_lo +
// scale_span)), packed on the device, and BF16 N(0, 1) activations for `counts` routes per
// expert; the down GEMM's intermediate padding columns are zero, as the W13 output leaves them.
class GemmProblem {
 public:
  GemmProblem(MoeGemmKind kind, bool fp8, int64_t h, int64_t n, std::vector<int32_t> counts,
              int scale_lo, int scale_span, std::mt19937& rng)
      : gate_up(kind == MoeGemmKind::kGateUpSilu),
        fp8(fp8),
        e(static_cast<int64_t>(counts.size())),
        h(h),
        n(n),
        l(MakeMoePackedLayout(h, n)),
        w_rows(gate_up ? 2 * n : h),
        w_k(gate_up ? h : n),
        act_k(gate_up ? h : l.intermediate_padded),
        out_cols(gate_up ? l.intermediate_padded : h),
        counts_(std::move(counts)),
        offsets_(e) {
    for (int64_t x = 0; x < e; ++x) {
      offsets_[x] = static_cast<int32_t>(rows);
      rows += counts_[x];
    }
    std::normal_distribution<float> nd;
    std::vector<uint8_t> w(e * w_rows * w_k), sc(e * w_rows * ((w_k + 31) / 32));
    deq.resize(w.size());
    if (fp8) {
      for (auto& v : w) {
        v = static_cast<uint8_t>(rng());
        if ((v & 0x7f) == 0x7f) v &= 0xfe;
      }
      for (auto& v : sc) v = static_cast<uint8_t>(scale_lo + rng() % scale_span);
      DequantizeMxfp8ToBf16Ref(w.data(), sc.data(), e * w_rows, w_k, deq.data());
    } else {
      for (auto& v : deq) v = FloatToBf16(0.05f * nd(rng));
    }
    const int esize = fp8 ? 1 : 2;
    Dev<uint8_t> dw(w.size() * esize), dsc(sc);
    CUDA_EXPECT(cudaMemcpy(dw.p, fp8 ? static_cast<const void*>(w.data()) : deq.data(),
                           w.size() * esize, cudaMemcpyHostToDevice));
    packed_ = std::make_unique<Dev<uint8_t>>(
        e * (gate_up ? l.w13_elems_per_expert() : l.w2_elems_per_expert()) * esize);
    pscale_ = std::make_unique<Dev<uint8_t>>(
        fp8 ? e * (gate_up ? l.w13_scales_per_expert() : l.w2_scales_per_expert()) : 1);
    Dev<int32_t> d_max(std::vector<int32_t>{0});
    uint8_t* const scales = fp8 ? pscale_->p : nullptr;
    const cudaError_t packed =
        gate_up ? LaunchPackMoeW13(dw.p, fp8 ? dsc.p : nullptr, e, l, esize, packed_->p, scales,
                                   nullptr, fp8 ? d_max.p : nullptr)
                : LaunchPackMoeW2(dw.p, fp8 ? dsc.p : nullptr, e, l, esize, packed_->p, scales,
                                  nullptr, fp8 ? d_max.p : nullptr);
    CUDA_EXPECT(packed);
    max_code = fp8 ? d_max.Get()[0] : 255;
    act.assign(rows * act_k, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < w_k; ++k) act[r * act_k + k] = FloatToBf16(nd(rng));
    d_act_ = std::make_unique<Dev<uint16_t>>(act);
    d_counts_ = std::make_unique<Dev<int32_t>>(counts_);
    d_offsets_ = std::make_unique<Dev<int32_t>>(offsets_);
  }

  // Everything but out, split_workspace and wgmma_min_routes.
  MoeGemmParams Params() const {
    MoeGemmParams p;
    p.kind = gate_up ? MoeGemmKind::kGateUpSilu : MoeGemmKind::kDown;
    p.mxfp8 = fp8;
    p.mxfp8_max_scale_code = max_code;
    p.num_experts = static_cast<int>(e);
    p.layout = l;
    p.weights = packed_->p;
    p.scales = fp8 ? pscale_->p : nullptr;
    p.act = d_act_->p;
    p.act_stride = act_k;
    p.expert_counts = d_counts_->p;
    p.expert_offsets = d_offsets_->p;
    p.out_stride = out_cols;
    p.max_rows_hint = rows;
    p.total_rows_hint = rows;
    return p;
  }

  // Runs `p` into a fresh output and returns it as floats ([rows, n] BF16 gate-up values, whose
  // padding columns must stay zero, or [rows, h] FP32).
  std::vector<float> Run(MoeGemmParams p, int num_sms) const {
    Dev<uint16_t> out(rows * out_cols * (gate_up ? 1 : 2));  // in 16-bit units
    p.out = out.p;
    EXPECT_EQ(LaunchMoeGroupedGemm(p, num_sms, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> raw = out.Get();
    std::vector<float> f;
    if (gate_up) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < n; ++j) f.push_back(Bf16ToFloat(raw[r * out_cols + j]));
        for (int64_t j = n; j < out_cols; ++j) EXPECT_EQ(raw[r * out_cols + j], 0) << j;
      }
    } else {
      f.resize(rows * h);
      std::memcpy(f.data(), raw.data(), f.size() * sizeof(float));
    }
    return f;
  }

  // Expert x's rows times its weights as the GEMM sees them, in double.
  std::vector<float> Reference() const {
    std::vector<float> ref;
    for (int64_t x = 0; x < e; ++x) {
      for (int64_t r = offsets_[x]; r < offsets_[x] + counts_[x]; ++r) {
        auto dot = [&](int64_t wrow) {
          double acc = 0;
          for (int64_t k = 0; k < w_k; ++k) {
            acc += static_cast<double>(Bf16ToFloat(act[r * act_k + k])) *
                   Bf16ToFloat(deq[(x * w_rows + wrow) * w_k + k]);
          }
          return acc;
        };
        if (gate_up) {
          for (int64_t j = 0; j < n; ++j) {
            const double gt = dot(j), up = dot(n + j);
            ref.push_back(static_cast<float>(gt / (1.0 + std::exp(-gt)) * up));
          }
        } else {
          for (int64_t j = 0; j < h; ++j) ref.push_back(static_cast<float>(dot(j)));
        }
      }
    }
    return ref;
  }

  std::string Name() const {
    return std::string(fp8 ? "mxfp8 " : "bf16 ") + (gate_up ? "w13" : "w2") + " H" +
           std::to_string(h) + " I" + std::to_string(n) + " rows " + std::to_string(rows);
  }

  const bool gate_up, fp8;
  const int64_t e, h, n;
  const MoePackedLayout l;
  const int64_t w_rows, w_k, act_k, out_cols;
  int64_t rows = 0;
  int32_t max_code = 255;     // the packed scales' largest code (255 for BF16)
  std::vector<uint16_t> deq;  // [e][w_rows][w_k]: the weights as the GEMM sees them (BF16)
  std::vector<uint16_t> act;  // [rows][act_k]

 private:
  std::vector<int32_t> counts_, offsets_;
  std::unique_ptr<Dev<uint8_t>> packed_, pscale_;
  std::unique_ptr<Dev<uint16_t>> d_act_;
  std::unique_ptr<Dev<int32_t>> d_counts_, d_offsets_;
};

struct GemmShape {
  MoeGemmKind kind;
  int64_t h, n;
  std::vector<int32_t> counts;
};

int NumSms() {
  int num_sms = 0;
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0);
  return num_sms;
}

// Split-K: with a workspace, few units of long K are split over several CTAs and the last one
// adds the partial sums in split order. Against the unsplit launch of the same inputs: BF16
// gate-up output within one BF16 rounding (relative L2 < 4e-3, sums in another order), FP32 down
// output within 1e-5. The partials region is NaN-poisoned first, so a launch that did not split
// is caught (it writes none); every launch leaves the counters zero, and repeats are bit-equal.
TEST_F(CudaKernelsTest, GroupedGemmSplitKMatchesUnsplit) {
  std::mt19937 rng(33);
  const int num_sms = NumSms();
  const std::vector<GemmShape> shapes = {
      {MoeGemmKind::kGateUpSilu, 4096, 64, {1, 0, 2, 1}},  // one token's narrow experts
      {MoeGemmKind::kGateUpSilu, 1000, 200, {3, 1}},       // K padded inside its last block
      {MoeGemmKind::kDown, 256, 4096, {2, 1}},             // W2 of long K
      {MoeGemmKind::kDown, 200, 1000, {1, 5, 0}}};
  for (const bool fp8 : {false, true}) {
    for (const GemmShape& sh : shapes) {
      const GemmProblem pr(sh.kind, fp8, sh.h, sh.n, sh.counts, 110, 10, rng);
      MoeGemmParams p = pr.Params();
      p.decode_pair = MoeDecodePair::kOff;  // the cluster tile never splits
      const std::vector<float> ref = pr.Run(p, num_sms);
      Dev<uint8_t> ws(kMoeGemmSplitWorkspaceBytes, 0xff);
      CUDA_OK(cudaMemset(ws.p, 0, sizeof(int32_t) * kMoeGemmSplitCounters));
      p.split_workspace = ws.p;
      const std::vector<float> got = pr.Run(p, num_sms);
      const std::string name = pr.Name();
      EXPECT_LT(RelL2(got, ref), pr.gate_up ? 4e-3 : 1e-5) << name;
      // The first partial was written (the launch split), and the counters are zero again.
      const std::vector<uint8_t> after = ws.Get();
      float first = 0;
      std::memcpy(&first, after.data() + sizeof(int32_t) * kMoeGemmSplitCounters, sizeof(float));
      EXPECT_FALSE(std::isnan(first)) << name << ": the launch did not split";
      int nonzero = 0;
      for (int i = 0; i < kMoeGemmSplitCounters * 4; ++i) nonzero += after[i] != 0;
      EXPECT_EQ(nonzero, 0) << name;
      for (int rep = 0; rep < 3; ++rep) {
        const std::vector<float> again = pr.Run(p, num_sms);
        EXPECT_EQ(std::memcmp(again.data(), got.data(), got.size() * sizeof(float)), 0)
            << name << " repeat " << rep;
      }
    }
  }
}

// MoeGemmParams::weights_before_wait: a W13 that counts its route ids and a W2 that reads the
// counts, both requesting their first weights before they wait for the kernel before them, must
// still compute on that kernel's whole output. The chain is the engine's, align -> W13 -> W2 on
// one stream, with the counts, offsets and the intermediate poisoned before each run (a count
// read too early is garbage, an intermediate row read too early is NaN) and ids that serve no
// expert among the routes; against the same chain with the flags off, bit for bit, repeated.
// Decode tiles of both formats: BF16 narrow tiles with W13 split over K (one token), the MXFP8
// cluster tile, the MXFP8 narrow + adaptive pair of launches (a hot expert) and the 32-token
// tile.
TEST_F(CudaKernelsTest, GroupedGemmWeightsBeforeWaitSeeTheKernelsBefore) {
  std::mt19937 rng(91);
  const int num_sms = NumSms();
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Case {
    bool fp8;
    int64_t h, n;
    std::vector<int32_t> counts;
  };
  const std::vector<Case> cases = {{false, 2048, 64, {1, 0, 2, 1}},
                                   {false, 296, 192, {9, 16, 3}},
                                   {true, 448, 192, {3, 0, 1, 5}},
                                   {true, 1000, 128, {30, 2}},
                                   {true, 512, 128, {20, 24}}};
  Dev<uint8_t> ws(kMoeGemmSplitWorkspaceBytes, 0);  // split-K counters start at zero
  for (const Case& c : cases) {
    const GemmProblem w13(MoeGemmKind::kGateUpSilu, c.fp8, c.h, c.n, c.counts, 112, 8, rng);
    const GemmProblem w2(MoeGemmKind::kDown, c.fp8, c.h, c.n, c.counts, 112, 8, rng);
    const int e = static_cast<int>(c.counts.size());
    std::vector<int32_t> ids;  // one route per row, grouped by expert as the problems' rows are
    for (int x = 0; x < e; ++x) ids.insert(ids.end(), c.counts[x], x);
    const int64_t rows = static_cast<int64_t>(ids.size());
    ids.insert(ids.end(), {-1, e, 1000});  // routes no local expert serves
    const int64_t routes = static_cast<int64_t>(ids.size());
    Dev<int32_t> d_ids(ids), counts(e), offsets(e + 1), sorted(routes), slot(routes);
    Dev<uint16_t> inter(rows * w13.out_cols);
    Dev<float> out(rows * c.h);
    MoeGemmParams p1 = w13.Params(), p2 = w2.Params();
    for (MoeGemmParams* p : {&p1, &p2}) {
      p->expert_counts = counts.p;
      p->expert_offsets = offsets.p;
      p->split_workspace = ws.p;
    }
    p1.out = inter.p;
    p2.act = inter.p;
    p2.out = out.p;
    const std::string name = w2.Name();
    p1.route_ids = d_ids.p;
    p1.num_routes = routes;
    auto run = [&](bool early) {
      p1.weights_before_wait = p2.weights_before_wait = early;
      CUDA_EXPECT(cudaMemsetAsync(counts.p, 0x7f, e * sizeof(int32_t), stream));
      CUDA_EXPECT(cudaMemsetAsync(offsets.p, 0x7f, (e + 1) * sizeof(int32_t), stream));
      CUDA_EXPECT(cudaMemsetAsync(inter.p, 0xff, rows * w13.out_cols * 2, stream));  // NaN
      CUDA_EXPECT(cudaMemsetAsync(out.p, 0, rows * c.h * sizeof(float), stream));
      CUDA_EXPECT(
          LaunchMoeAlign(d_ids.p, routes, e, counts.p, offsets.p, sorted.p, slot.p, stream));
      CUDA_EXPECT(LaunchMoeGroupedGemm(p1, num_sms, stream));
      CUDA_EXPECT(LaunchMoeGroupedGemm(p2, num_sms, stream));
      CUDA_EXPECT(cudaStreamSynchronize(stream));
      return out.Get();
    };
    const std::vector<float> ref = run(false);
    int nans = 0, zeros = 0;
    for (float v : ref) {
      nans += std::isnan(v);
      zeros += v == 0.0f;
    }
    ASSERT_EQ(nans, 0) << name << ": the chain without the flag";
    EXPECT_LT(zeros, static_cast<int>(ref.size() / 100)) << name;
    for (int rep = 0; rep < 4; ++rep) {
      const std::vector<float> got = run(true);
      EXPECT_EQ(std::memcmp(got.data(), ref.data(), ref.size() * sizeof(float)), 0)
          << name << " repeat " << rep;
    }
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

// The warpgroup-MMA tiles (64, 128 and 256 tokens wide, chosen by the average routes per expert;
// forced here with wgmma_min_routes = 1), BF16 and MXFP8, against a double-precision host GEMM of
// the (dequantized) weights: both kinds, for MXFP8 the one-multiply and the two-multiply
// dequantization, odd and even numbers of 64-K stages, K padded, counts above the tile width
// (two token tiles), empty experts, and on the same inputs the default dispatch (wgmma from
// kMxfp8WgmmaMinRoutes / kBf16WgmmaMinRoutes) and the mma.sync tiles (min_routes -1: wgmma only
// above 128 routes). Tolerances: relative L2 4e-3 for the BF16 gate-up output (one BF16
// rounding), 1e-5 for the FP32 down output.
TEST_F(CudaKernelsTest, GroupedGemmWgmmaTilesMatchReference) {
  std::mt19937 rng(47);
  const int num_sms = NumSms();
  const std::vector<GemmShape> shapes = {
      {MoeGemmKind::kGateUpSilu, 448, 128, {64, 70, 0, 5}},  // 64 wide, 7 stages, a second tile
      {MoeGemmKind::kGateUpSilu, 1000, 200, {100, 90}},      // 128 wide, K padded
      {MoeGemmKind::kGateUpSilu, 256, 64, {200, 160}},       // 256 wide
      {MoeGemmKind::kDown, 296, 192, {64, 3, 61}},           // 3 stages, H not a tile multiple
      {MoeGemmKind::kDown, 256, 256, {130, 120, 0}},         // 128 wide, 130 > 128
      {MoeGemmKind::kDown, 128, 1000, {300, 1}}};            // 256 wide, two token tiles
  for (const bool fp8 : {true, false}) {
    for (const GemmShape& sh : shapes) {
      const GemmProblem pr(sh.kind, fp8, sh.h, sh.n, sh.counts, 112, 8, rng);
      const std::vector<float> ref = pr.Reference();
      MoeGemmParams p = pr.Params();
      const double tol = pr.gate_up ? 4e-3 : 1e-5;
      for (const int min_routes : {1, 0, -1}) {
        for (const int max_code : {kMxfp8NarrowScaleMax, 255}) {
          if (!fp8 && max_code != 255) continue;
          p.wgmma_min_routes = min_routes;
          p.mxfp8_max_scale_code = max_code;
          EXPECT_LT(RelL2(pr.Run(p, num_sms), ref), tol)
              << pr.Name() << " min_routes=" << min_routes << " max_code=" << max_code;
        }
      }
    }
  }
}

// The MXFP8 32-token decode tile (17-32 routes per expert) with warpgroup MMAs
// (MoeDecodeMma::kWgmma, its default) and with mma.sync, against a double-precision host GEMM of
// the dequantized weights: both kinds, odd numbers of 64-K blocks (a stage's second block
// absent), K padded, H not a tile multiple, a count above the tile width (two token tiles), an
// expert of one route, split-K, and the two-multiply dequantization (served by the 64-token
// mma.sync tile whatever decode_mma says). Tolerances: relative L2 4e-3 for the BF16 gate-up
// output (one BF16 rounding), 1e-5 for the FP32 down output.
TEST_F(CudaKernelsTest, GroupedGemmDecodeWgmmaMatchesReference) {
  std::mt19937 rng(53);
  const int num_sms = NumSms();
  int major = 0;
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  const std::vector<GemmShape> shapes = {
      {MoeGemmKind::kGateUpSilu, 448, 128, {32, 17, 24, 29}},  // 7 blocks
      {MoeGemmKind::kGateUpSilu, 1000, 200, {20, 25, 31}},     // K padded
      {MoeGemmKind::kGateUpSilu, 256, 64, {40, 2}},            // two token tiles
      {MoeGemmKind::kDown, 296, 192, {30, 20, 1}},             // 3 blocks, H = 296
      {MoeGemmKind::kDown, 128, 4096, {20, 18}}};              // long K: split-K below
  for (const GemmShape& sh : shapes) {
    const GemmProblem pr(sh.kind, true, sh.h, sh.n, sh.counts, 112, 8, rng);
    const std::vector<float> ref = pr.Reference();
    const double tol = pr.gate_up ? 4e-3 : 1e-5;
    Dev<uint8_t> ws(kMoeGemmSplitWorkspaceBytes, 0);
    MoeGemmParams probe = pr.Params();
    probe.wgmma_min_routes = -1;
    const bool built = MoeGemmUsesDecodeWgmma(probe);  // the default: wgmma at 17-32 routes
    if (major == 9) {
      EXPECT_TRUE(built) << pr.Name() << ": an sm_90 device, no sm_90a build?";
    }
    for (const MoeDecodeMma mma : {MoeDecodeMma::kWgmma, MoeDecodeMma::kMmaSync}) {
      for (const int max_code : {kMxfp8NarrowScaleMax, 255}) {
        for (const bool split : {false, true}) {
          MoeGemmParams p = pr.Params();
          p.decode_mma = mma;
          p.wgmma_min_routes = -1;  // the decode tiles up to 64 routes per expert
          p.mxfp8_max_scale_code = max_code;
          p.split_workspace = split ? ws.p : nullptr;
          // The wgmma form serves where asked, with narrow scales (every shape: 17-32 routes).
          EXPECT_EQ(MoeGemmUsesDecodeWgmma(p),
                    built && mma == MoeDecodeMma::kWgmma && max_code == kMxfp8NarrowScaleMax)
              << pr.Name();
          EXPECT_LT(RelL2(pr.Run(p, num_sms), ref), tol)
              << pr.Name() << (mma == MoeDecodeMma::kWgmma ? " wgmma" : " mma.sync")
              << " max_code=" << max_code << " split=" << split;
        }
      }
    }
  }
}

// The two-CTA cluster decode tile (MoeDecodePair::kOn), against a double-precision host GEMM of
// the dequantized weights: experts of one token tile (two weight tiles per cluster unit; odd
// numbers of weight tiles leave a CTA idle), of two (weights multicast into both CTAs) and of
// three token tiles (the second unit's peer idles), empty experts, odd numbers of 64-K blocks, K
// padded, H = 296, a split-K workspace (which the tile leaves alone), and both dequantizations.
// By default it serves where kMxfp8DecodePairOnByDefault and kMxfp8DecodePairMaxRoutes say.
// Tolerances: relative L2 4e-3 for the BF16 gate-up output, 1e-5 for the FP32 down output.
TEST_F(CudaKernelsTest, GroupedGemmDecodePairMatchesReference) {
  std::mt19937 rng(71);
  const int num_sms = NumSms();
  int major = 0;
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  const std::vector<GemmShape> shapes = {
      {MoeGemmKind::kGateUpSilu, 448, 128, {3, 0, 1, 5}},     // 7 blocks, one token tile each
      {MoeGemmKind::kGateUpSilu, 1000, 200, {20, 0, 31, 2}},  // K padded, multicast
      {MoeGemmKind::kGateUpSilu, 256, 64, {40, 1}},           // three token tiles
      {MoeGemmKind::kDown, 296, 192, {30, 9, 1}},             // 3 weight tiles, H = 296
      {MoeGemmKind::kDown, 128, 4096, {2, 18}}};              // long K
  const bool env_set = std::getenv("MOESERVE_DECODE_PAIR") != nullptr;
  for (const GemmShape& sh : shapes) {
    const GemmProblem pr(sh.kind, true, sh.h, sh.n, sh.counts, 112, 8, rng);
    const std::vector<float> ref = pr.Reference();
    const double tol = pr.gate_up ? 4e-3 : 1e-5;
    Dev<uint8_t> ws(kMoeGemmSplitWorkspaceBytes, 0);
    for (const int max_code : {kMxfp8NarrowScaleMax, 255}) {
      MoeGemmParams p = pr.Params();
      p.wgmma_min_routes = -1;  // the decode tiles up to 64 routes per expert
      p.mxfp8_max_scale_code = max_code;
      p.split_workspace = ws.p;
      const int64_t avg = (pr.rows + pr.e - 1) / pr.e;
      if (!env_set && major == 9) {
        EXPECT_EQ(MoeGemmUsesDecodePair(p), kMxfp8DecodePairOnByDefault &&
                                                max_code == kMxfp8NarrowScaleMax &&
                                                avg <= kMxfp8DecodePairMaxRoutes)
            << pr.Name() << " max_code=" << max_code << ": the default (no sm_90a build?)";
      }
      p.decode_pair = MoeDecodePair::kOn;
      if (major == 9) {
        EXPECT_TRUE(MoeGemmUsesDecodePair(p)) << pr.Name() << ": an sm_90 device, no sm_90a build?";
      }
      EXPECT_LT(RelL2(pr.Run(p, num_sms), ref), tol) << pr.Name() << " max_code=" << max_code;
    }
  }
}

// The grouped GEMM's tile rows by the average expert's rows (no device needed): 64-row tiles up
// to 64 and from 129 to 192 rows per expert, 128-row tiles otherwise.
TEST(GroupedSm90TileChoiceTest, SmallTilesWhereTheyPadLess) {
  const int e = 32;
  for (int64_t avg = 1; avg <= 600; ++avg) {
    const bool small = avg <= 64 || (avg >= 129 && avg <= 192);
    EXPECT_EQ(MoeGroupedSm90UsesSmallTiles(avg * e, e), small) << avg;
  }
  EXPECT_TRUE(MoeGroupedSm90UsesSmallTiles(64 * e - 5, e));   // the average rounds up
  EXPECT_FALSE(MoeGroupedSm90UsesSmallTiles(64 * e + 1, e));  // 65 rows on average
  EXPECT_TRUE(MoeGroupedSm90UsesSmallTiles(0, e));
  EXPECT_TRUE(MoeGroupedSm90UsesSmallTiles(100, 0));
}

// The CUTLASS grouped GEMM (sm_90a) on its own, against a double-precision host GEMM of the
// same BF16 inputs: an expert of 300 rows (three 128-row tiles, the last partial), an empty one,
// one of a single row, 129 rows; K = 200 (not a multiple of the 64-wide K tile); N = 384 (the
// last 256-wide N tile half empty). Both tile configurations (the row hint picks them). Rows
// past the last expert are poisoned and must stay so (an epilogue that wrote past an expert's
// rows would also overwrite its neighbour's). Tolerance: relative L2 4e-3 (one BF16 rounding of
// the output). Misaligned strides are refused.
TEST_F(CudaKernelsTest, GroupedSm90GemmMatchesReference) {
  if (const char* why = MoeGroupedSm90Unsupported(0)) GTEST_SKIP() << why;
  std::mt19937 rng(59);
  std::normal_distribution<float> nd;
  const std::vector<int32_t> counts = {300, 0, 1, 129, 64};
  const int e = static_cast<int>(counts.size());
  const int64_t k = 200, n = 384, guard = 8;
  std::vector<int32_t> offsets(e);
  int64_t rows = 0;
  for (int x = 0; x < e; ++x) {
    offsets[x] = static_cast<int32_t>(rows);
    rows += counts[x];
  }
  std::vector<uint16_t> a(rows * k), b(e * n * k);
  for (auto& v : a) v = FloatToBf16(nd(rng));
  for (auto& v : b) v = FloatToBf16(0.05f * nd(rng));
  std::vector<float> ref(rows * n);  // each row times its expert's weights, in double
  for (int x = 0; x < e; ++x) {
    for (int64_t r = offsets[x]; r < offsets[x] + counts[x]; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t q = 0; q < k; ++q) {
          acc += double(Bf16ToFloat(a[r * k + q])) * Bf16ToFloat(b[(x * n + j) * k + q]);
        }
        ref[r * n + j] = static_cast<float>(acc);
      }
    }
  }
  const int num_sms = NumSms();
  Dev<uint16_t> d_a(a), d_b(b);
  Dev<int32_t> d_counts(counts), d_offsets(offsets);
  const size_t ws_bytes = MoeGroupedSm90WorkspaceBytes(e, num_sms);
  Dev<uint8_t> ws(ws_bytes);
  MoeGroupedSm90Gemm g;
  g.num_experts = e;
  g.expert_counts = d_counts.p;
  g.expert_offsets = d_offsets.p;
  g.n = n;
  g.k = k;
  g.a = d_a.p;
  g.lda = k;
  g.b = d_b.p;
  g.ldb = k;
  g.b_expert_stride = n * k;
  g.ldd = n;
  for (const int64_t hint : {rows, int64_t{8}}) {  // 128-row tiles, then the 64-row ones
    g.total_rows_hint = hint;
    Dev<uint16_t> d((rows + guard) * n);  // poisoned 0xABAB
    g.d = d.p;
    EXPECT_EQ(LaunchMoeGroupedSm90Gemm(g, ws.p, ws_bytes, 0, num_sms, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> raw = d.Get();
    int64_t touched = 0;
    for (int64_t i = rows * n; i < (rows + guard) * n; ++i) touched += raw[i] != 0xABAB;
    EXPECT_EQ(touched, 0) << "hint " << hint << ": rows past the last expert were written";
    std::vector<float> got(rows * n);
    for (int64_t i = 0; i < rows * n; ++i) got[i] = Bf16ToFloat(raw[i]);
    EXPECT_LT(RelL2(got, ref), 4e-3) << "hint " << hint;
  }
  g.ldd = n + 4;  // not a multiple of 8 elements
  EXPECT_EQ(LaunchMoeGroupedSm90Gemm(g, ws.p, ws_bytes, 0, num_sms, nullptr),
            cudaErrorInvalidValue);
}

// The FP8 grouped GEMM with blockwise scaling (W8A8) on its own, against a double-precision host
// GEMM of the same E4M3 codes and FP32 scales: experts of 300 / 0 / 1 / 129 / 64 rows, K = 256
// (two scale blocks), N = 384; both tile configurations; rows past the last expert poisoned and
// untouched. Tolerance: relative L2 4e-3 (one BF16 rounding of the output). Bad arguments
// (K not a multiple of 128, no scales, misaligned ldd) are refused.
TEST_F(CudaKernelsTest, GroupedSm90Fp8GemmMatchesReference) {
  if (const char* why = MoeGroupedSm90Unsupported(0)) GTEST_SKIP() << why;
  std::mt19937 rng(61);
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> sd(0.25f, 4.0f);
  const std::vector<int32_t> counts = {300, 0, 1, 129, 64};
  const int e = static_cast<int>(counts.size());
  const int64_t k = 256, n = 384, kb = k / kMoeFp8ScaleK, guard = 8;
  std::vector<int32_t> offsets(e);
  int64_t rows = 0;
  for (int x = 0; x < e; ++x) {
    offsets[x] = static_cast<int32_t>(rows);
    rows += counts[x];
  }
  auto e4m3 = [&] {
    uint8_t c = static_cast<uint8_t>(code(rng));
    return (c & 0x7f) == 0x7f ? static_cast<uint8_t>(c - 1) : c;  // no NaN
  };
  std::vector<uint8_t> a(rows * k), b(e * n * k);
  for (auto& v : a) v = e4m3();
  for (auto& v : b) v = e4m3();
  // Activation scales in the per-expert [kb, count] layout; weight scales [E, kb, n].
  std::vector<float> sa(rows * kb), sb(e * kb * n);
  for (auto& v : sa) v = sd(rng) / 448.0f;
  for (auto& v : sb) v = sd(rng) / 448.0f;
  std::vector<float> ref(rows * n);
  for (int x = 0; x < e; ++x) {
    for (int64_t i = 0; i < counts[x]; ++i) {
      const int64_t r = offsets[x] + i;
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t blk = 0; blk < kb; ++blk) {
          double part = 0;
          for (int64_t q = blk * 128; q < (blk + 1) * 128; ++q) {
            part += double(E4M3ToFloat(a[r * k + q])) * E4M3ToFloat(b[(x * n + j) * k + q]);
          }
          acc += part * sa[offsets[x] * kb + blk * counts[x] + i] * sb[(x * kb + blk) * n + j];
        }
        ref[r * n + j] = static_cast<float>(acc);
      }
    }
  }
  const int num_sms = NumSms();
  Dev<uint8_t> d_a(a), d_b(b);
  Dev<float> d_sa(sa), d_sb(sb);
  Dev<int32_t> d_counts(counts), d_offsets(offsets);
  const size_t ws_bytes = MoeGroupedSm90Fp8WorkspaceBytes(e, num_sms);
  Dev<uint8_t> ws(ws_bytes);
  MoeGroupedSm90Fp8Gemm g;
  g.num_experts = e;
  g.expert_counts = d_counts.p;
  g.expert_offsets = d_offsets.p;
  g.n = n;
  g.k = k;
  g.a = d_a.p;
  g.a_scale = d_sa.p;
  g.b = d_b.p;
  g.b_scale = d_sb.p;
  g.b_expert_stride = n * k;
  g.ldd = n;
  for (const int64_t hint : {rows, int64_t{8}}) {  // 128-row tiles, then the 64-row ones
    g.total_rows_hint = hint;
    Dev<uint16_t> d((rows + guard) * n);  // poisoned 0xABAB
    g.d = d.p;
    EXPECT_EQ(LaunchMoeGroupedSm90Fp8Gemm(g, ws.p, ws_bytes, 0, num_sms, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> raw = d.Get();
    int64_t touched = 0;
    for (int64_t i = rows * n; i < (rows + guard) * n; ++i) touched += raw[i] != 0xABAB;
    EXPECT_EQ(touched, 0) << "hint " << hint << ": rows past the last expert were written";
    std::vector<float> got(rows * n);
    for (int64_t i = 0; i < rows * n; ++i) got[i] = Bf16ToFloat(raw[i]);
    EXPECT_LT(RelL2(got, ref), 4e-3) << "hint " << hint;
  }
  MoeGroupedSm90Fp8Gemm bad = g;
  bad.k = 200;
  EXPECT_EQ(LaunchMoeGroupedSm90Fp8Gemm(bad, ws.p, ws_bytes, 0, num_sms, nullptr),
            cudaErrorInvalidValue);
  bad = g;
  bad.a_scale = nullptr;
  EXPECT_EQ(LaunchMoeGroupedSm90Fp8Gemm(bad, ws.p, ws_bytes, 0, num_sms, nullptr),
            cudaErrorInvalidValue);
  bad = g;
  bad.ldd = n + 4;
  EXPECT_EQ(LaunchMoeGroupedSm90Fp8Gemm(bad, ws.p, ws_bytes, 0, num_sms, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchMoeGroupedSm90Fp8Gemm(g, ws.p, ws_bytes - 256, 0, num_sms, nullptr),
            cudaErrorInvalidValue);
}

// LaunchMoeGatherRows equals a row gather on the host (EpGatherRowsRef of the routes' tokens)
// bit for bit: hidden sizes of one 16-byte chunk, of
// a partial last pass of the block's threads (200), of DeepSeek-V3 (7168) and larger ones
// (8200, 16000); routes shuffled, topk 3, fewer rows served than the grid's bound (the rest stay
// poisoned). Bad sizes and a misaligned x or a1 are refused.
TEST_F(CudaKernelsTest, GatherRowsMatchesReference) {
  std::mt19937 rng(71);
  for (const int64_t h : {int64_t{8}, int64_t{200}, int64_t{7168}, int64_t{8200}, int64_t{16000}}) {
    const int64_t m = 37;
    const int topk = 3;
    const int64_t max_rows = m * topk, served = max_rows - 10;
    std::vector<uint16_t> x(m * h);
    for (auto& v : x) v = static_cast<uint16_t>(rng());
    std::vector<int32_t> sorted(max_rows);
    for (int64_t i = 0; i < max_rows; ++i) sorted[i] = static_cast<int32_t>(i);
    std::shuffle(sorted.begin(), sorted.end(), rng);
    std::vector<int32_t> src_row(served);  // the tokens of the served routes
    for (int64_t i = 0; i < served; ++i) src_row[i] = sorted[i] / topk;
    std::vector<uint16_t> want(max_rows * h, 0xABAB);
    EpGatherRowsRef(x.data(), src_row.data(), served, h, want.data());
    Dev<uint16_t> d_x(x);
    Dev<int32_t> d_sorted(sorted), d_served(std::vector<int32_t>{static_cast<int32_t>(served)});
    Dev<uint16_t> d_a(max_rows * h);  // poisoned 0xABAB
    ASSERT_EQ(LaunchMoeGatherRows(d_x.p, d_sorted.p, d_served.p, max_rows, topk, h, d_a.p, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> got = d_a.Get();
    int64_t differ = 0;
    for (int64_t i = 0; i < max_rows * h; ++i) differ += got[i] != want[i];
    EXPECT_EQ(differ, 0) << "h " << h;
  }
  Dev<uint16_t> d_x(64), d_a(64);
  Dev<int32_t> d_sorted(std::vector<int32_t>{0, 1}), d_served(std::vector<int32_t>{2});
  EXPECT_EQ(LaunchMoeGatherRows(d_x.p, d_sorted.p, d_served.p, 2, 1, 12, d_a.p, nullptr),
            cudaErrorInvalidValue);  // h % 8 != 0
  EXPECT_EQ(LaunchMoeGatherRows(d_x.p, d_sorted.p, d_served.p, 2, 0, 8, d_a.p, nullptr),
            cudaErrorInvalidValue);  // topk 0
  EXPECT_EQ(LaunchMoeGatherRows(d_x.p + 1, d_sorted.p, d_served.p, 2, 1, 8, d_a.p, nullptr),
            cudaErrorInvalidValue);  // x not 16-byte aligned
  EXPECT_EQ(LaunchMoeGatherRows(d_x.p, d_sorted.p, d_served.p, 2, 1, 8, d_a.p + 4, nullptr),
            cudaErrorInvalidValue);  // a1 not 16-byte aligned
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// LaunchMoeUnpermuteReduce against its definition in double: topk 10, routes to experts this
// rank does not hold (-1 and num_experts: skipped) and a token with none of its own (zeros);
// tolerance relative L2 1e-6 (FP32 sums of BF16 products).
TEST_F(CudaKernelsTest, UnpermuteReduceMatchesReference) {
  std::mt19937 rng(73);
  std::normal_distribution<float> nd;
  const int64_t m = 29, h = 264;
  const int topk = 10, e = 6;
  std::vector<int32_t> ids(m * topk);
  std::vector<float> w(m * topk);
  for (int64_t r = 0; r < m * topk; ++r) {
    ids[r] = static_cast<int32_t>(rng() % (e + 2)) - 1;  // -1 .. e
    w[r] = nd(rng);
  }
  for (int k = 0; k < topk; ++k) ids[3 * topk + k] = k % 2 == 0 ? -1 : e;  // token 3: none local
  // Rows grouped by expert in route order, as LaunchMoeAlign lays them out.
  std::vector<int32_t> counts(e), offsets(e + 1), sorted(m * topk), slot(m * topk);
  MoeAlignRef(ids.data(), m * topk, e, counts.data(), offsets.data(), sorted.data(), slot.data());
  const int64_t rows = offsets[e];
  std::vector<uint16_t> d2(rows * h);
  for (auto& v : d2) v = FloatToBf16(nd(rng));
  std::vector<float> want(m * h, 0.0f);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < h; ++j) {
      double acc = 0;
      for (int k = 0; k < topk; ++k) {
        const int64_t r = t * topk + k;
        if (ids[r] < 0 || ids[r] >= e) continue;
        acc += double(w[r]) * Bf16ToFloat(d2[(offsets[ids[r]] + slot[r]) * h + j]);
      }
      want[t * h + j] = static_cast<float>(acc);
    }
  }
  Dev<uint16_t> d_d2(d2);
  Dev<int32_t> d_ids(ids), d_offsets(offsets), d_slot(slot);
  Dev<float> d_w(w), d_out(m * h);
  ASSERT_EQ(LaunchMoeUnpermuteReduce(d_d2.p, d_ids.p, d_w.p, d_offsets.p, d_slot.p, m, topk, h, e,
                                     d_out.p, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = d_out.Get();
  EXPECT_LT(RelL2(got, want), 1e-6);
  int64_t nonzero = 0;
  for (int64_t j = 0; j < h; ++j) nonzero += got[3 * h + j] != 0.0f;
  EXPECT_EQ(nonzero, 0) << "a token with no local route";
  EXPECT_EQ(LaunchMoeUnpermuteReduce(d_d2.p, d_ids.p, d_w.p, d_offsets.p, d_slot.p, m, topk, 12, e,
                                     d_out.p, nullptr),
            cudaErrorInvalidValue);  // h % 8 != 0
}

// LaunchMoeGatherQuantizeRows equals its definition bit for bit: rows gathered by the sorted
// routes, each 128 K block to E4M3 at 448 / amax, scale amax / 448 in the per-expert layout; K
// padded with zero codes (h = 200 -> 256); an all-zero row (scale 0, codes 0), a row with a
// NaN (its block's scale NaN) and a row of subnormals (448 / amax clamped: no NaN codes).
TEST_F(CudaKernelsTest, GatherQuantizeRowsMatchesDefinition) {
  std::mt19937 rng(67);
  std::normal_distribution<float> nd;
  const int64_t m = 40, h = 200, kp = Fp8PaddedK(h), kb = kp / kMoeFp8ScaleK;
  const int topk = 2, e = 3;
  std::vector<uint16_t> x(m * h);
  for (auto& v : x) v = FloatToBf16(std::ldexp(nd(rng), static_cast<int>(rng() % 9) - 4));
  for (int64_t i = 0; i < h; ++i) x[5 * h + i] = 0;  // token 5: zeros
  x[7 * h + 150] = 0x7fc0;                           // token 7: a NaN in block 1
  for (int64_t i = 0; i < h; ++i) x[9 * h + i] = static_cast<uint16_t>(1 + i % 5);  // subnormals
  // Routes: token t, slot s -> expert (t + s) % e; grouped by expert, ascending route.
  std::vector<int32_t> counts(e, 0), offsets(e + 1, 0), sorted;
  for (int x_ = 0; x_ < e; ++x_) {
    offsets[x_] = static_cast<int32_t>(sorted.size());
    for (int64_t r = 0; r < m * topk; ++r) {
      if ((r / topk + r % topk) % e == x_) sorted.push_back(static_cast<int32_t>(r));
    }
    counts[x_] = static_cast<int32_t>(sorted.size()) - offsets[x_];
  }
  offsets[e] = static_cast<int32_t>(sorted.size());
  const int64_t rows = m * topk;
  Dev<uint16_t> d_x(x);
  Dev<int32_t> d_sorted(sorted), d_counts(counts), d_offsets(offsets);
  Dev<uint8_t> d_q(rows * kp);
  Dev<float> d_s(rows * kb);
  ASSERT_EQ(LaunchMoeGatherQuantizeRows(d_x.p, d_sorted.p, d_counts.p, d_offsets.p, e, rows, topk,
                                        h, d_q.p, d_s.p, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> q = d_q.Get();
  const std::vector<float> sc = d_s.Get();
  int64_t bad_codes = 0, bad_scales = 0;
  for (int x_ = 0; x_ < e; ++x_) {
    for (int64_t i = 0; i < counts[x_]; ++i) {
      const int64_t p = offsets[x_] + i, t = sorted[p] / topk;
      for (int64_t blk = 0; blk < kb; ++blk) {
        float amax = 0;
        bool nan = false;
        for (int64_t c = blk * 128; c < std::min(h, (blk + 1) * 128); ++c) {
          const float v = Bf16ToFloat(x[t * h + c]);
          amax = std::max(amax, std::fabs(v));
          nan |= std::isnan(v);
        }
        const float inv = amax > 0 ? std::min(448.0f / amax, FLT_MAX) : 0.0f;
        const float want_scale = amax / 448.0f;
        const float got_scale = sc[offsets[x_] * kb + blk * counts[x_] + i];
        bad_scales += nan ? !std::isnan(got_scale) : got_scale != want_scale;
        if (nan) continue;
        for (int64_t c = blk * 128; c < (blk + 1) * 128; ++c) {
          const uint8_t want = c < h ? FloatToE4M3(Bf16ToFloat(x[t * h + c]) * inv) : 0;
          bad_codes += q[p * kp + c] != want || (q[p * kp + c] & 0x7f) == 0x7f;
        }
      }
    }
  }
  EXPECT_EQ(bad_codes, 0);
  EXPECT_EQ(bad_scales, 0);
}

// The answer's FP32 -> BF16 / FP16 conversion and the FP16 -> BF16 input conversion on the device
// must equal the host twins bit for
// bit: random normals over a wide exponent range plus the edge values (subnormals, rounding
// ties, overflow to Inf, NaN, signed zero).
TEST_F(CudaKernelsTest, Fp32ToHalfMatchesRefBitForBit) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-30, 20);
  std::vector<float> in(100003);
  for (auto& v : in) v = std::ldexp(nd(rng), ex(rng));
  const float edges[] = {0.0f,     -0.0f,     65504.0f, 65520.0f,           -70000.0f,
                         6.0e-8f,  2.9e-8f,   6.1e-5f,  1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048,
                         INFINITY, -INFINITY, NAN,      3.3895314e38f};
  for (size_t i = 0; i < sizeof(edges) / sizeof(edges[0]); ++i) in[i * 7] = edges[i];
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> want_bf16(n), want_fp16(n);
  ConvertFp32ToBf16Ref(in.data(), want_bf16.data(), n);
  ConvertFp32ToFp16Ref(in.data(), want_fp16.data(), n);
  Dev<float> d_in(in);
  Dev<uint16_t> d_bf16(n), d_fp16(n);
  CUDA_OK(LaunchConvertFp32ToBf16(d_in.p, d_bf16.p, n, nullptr));
  CUDA_OK(LaunchConvertFp32ToFp16(d_in.p, d_fp16.p, n, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> bf16 = d_bf16.Get(), fp16 = d_fp16.Get();
  int64_t bad_bf16 = 0, bad_fp16 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool nan = std::isnan(in[i]);
    // NaN: any quiet NaN of the right sign will do for BF16 (payloads differ by library).
    if (nan) {
      bad_bf16 += (bf16[i] & 0x7f80) != 0x7f80 || (bf16[i] & 0x7f) == 0;
    } else {
      bad_bf16 += bf16[i] != want_bf16[i];
    }
    bad_fp16 += fp16[i] != want_fp16[i];
  }
  EXPECT_EQ(bad_bf16, 0);
  EXPECT_EQ(bad_fp16, 0);
  // FP16 input -> BF16 activations, as the host's ConvertTensor does it (through FP32).
  std::vector<uint16_t> want_fp16_to_bf16(n);
  for (int64_t i = 0; i < n; ++i) want_fp16_to_bf16[i] = FloatToBf16(Fp16ToFloat(want_fp16[i]));
  Dev<uint16_t> d_from_fp16(n);
  CUDA_OK(LaunchConvertFp16ToBf16(d_fp16.p, d_from_fp16.p, n, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> from_fp16 = d_from_fp16.Get();
  int64_t bad_from_fp16 = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(in[i])) continue;  // NaN payloads differ by library
    bad_from_fp16 += from_fp16[i] != want_fp16_to_bf16[i];
  }
  EXPECT_EQ(bad_from_fp16, 0);
}

// LaunchCopyBytes between page-locked host memory and the device, both ways, at 16-byte aligned
// and unaligned offsets and sizes: byte-exact, and no byte outside the range is written.
TEST_F(CudaKernelsTest, CopyBytesBetweenPageLockedAndDeviceIsExact) {
  constexpr size_t kBytes = 300007;
  uint8_t* pinned = nullptr;
  CUDA_OK(cudaMallocHost(&pinned, kBytes + 64));
  std::unique_ptr<uint8_t, decltype(&cudaFreeHost)> hold(pinned, &cudaFreeHost);
  std::mt19937 rng(5);
  std::vector<uint8_t> src(kBytes + 64);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  struct Case {
    size_t offset, bytes;
  };
  for (const Case c : {Case{0, 16}, Case{0, 14336}, Case{16, 229376}, Case{3, 1}, Case{5, 14339},
                       Case{0, 300001}, Case{32, 0}}) {
    SCOPED_TRACE(testing::Message() << "offset " << c.offset << ", bytes " << c.bytes);
    // Host -> device: the SMs read the page-locked bytes.
    std::memcpy(pinned, src.data(), src.size());
    Dev<uint8_t> dev(kBytes + 64, 0x5A);
    CUDA_OK(LaunchCopyBytes(dev.p + c.offset, pinned + c.offset, c.bytes, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> got = dev.Get();
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const bool inside = i >= c.offset && i < c.offset + c.bytes;
      bad += got[i] != (inside ? src[i] : uint8_t{0x5A});
    }
    EXPECT_EQ(bad, 0u);
    // Device -> host: the SMs write the page-locked bytes.
    std::memset(pinned, 0x33, kBytes + 64);
    Dev<uint8_t> from(src);
    CUDA_OK(LaunchCopyBytes(pinned + c.offset, from.p + c.offset, c.bytes, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    bad = 0;
    for (size_t i = 0; i < kBytes + 64; ++i) {
      const bool inside = i >= c.offset && i < c.offset + c.bytes;
      bad += pinned[i] != (inside ? src[i] : uint8_t{0x33});
    }
    EXPECT_EQ(bad, 0u);
  }
}

}  // namespace
}  // namespace moeserve::kernels
