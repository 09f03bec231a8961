// The Experts contract, run against every CPU Standard-format implementation: the modular
// kernel (NoEp prepare/finalize + the implementation) must compute, for each token, the top-k
// weighted sum of its experts' SiLU-gated MLP outputs. Checked against a float64 evaluation of
// the same weights. Tolerance: FP32 activations and accumulation -> relative L2 < 1e-5.
#include <memory>
#include <random>

#include "core/cpu/cpu_experts.h"
#include "core/cpu/no_ep_prepare_finalize.h"
#include "core/modular_kernel.h"
#include "gtest/gtest.h"
#include "tests/testing/test_util.h"

namespace moeserve {
namespace {

constexpr double kFp32Tolerance = 1e-5;

struct ReferenceFactory {
  static std::unique_ptr<Experts> Make() { return std::make_unique<ReferenceExperts>(); }
};
struct BlasFactory {
  static std::unique_ptr<Experts> Make() { return std::make_unique<BlasExperts>(2); }
};

// float64 evaluation of the MoE layer.
std::vector<float> Float64Moe(const LayerWeights& w, const float* x, const int32_t* ids,
                              const float* wts, int64_t m, int64_t topk) {
  const int64_t k = w.hidden, n = w.intermediate;
  std::vector<float> w13(2 * n * k), w2(k * n);
  std::vector<double> out(m * k, 0.0);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      const int e = ids[t * topk + j];
      EXPECT_TRUE(DequantizeExpertToFp32(w, e, w13.data(), w2.data()).ok());
      std::vector<double> act(n);
      for (int64_t i = 0; i < n; ++i) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < k; ++h) {
          g += double{w13[i * k + h]} * x[t * k + h];
          u += double{w13[(n + i) * k + h]} * x[t * k + h];
        }
        act[i] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t h = 0; h < k; ++h) {
        double y = 0;
        for (int64_t i = 0; i < n; ++i) y += double{w2[h * n + i]} * act[i];
        out[t * k + h] += double{wts[t * topk + j]} * y;
      }
    }
  }
  return std::vector<float>(out.begin(), out.end());
}

template <typename Factory>
class ExpertsContractTest : public ::testing::Test {
 protected:
  void Build(int num_experts, int topk, int64_t hidden, int64_t intermediate) {
    model_.name = "contract";
    model_.num_layers = 1;
    model_.num_experts = num_experts;
    model_.topk = topk;
    model_.hidden = hidden;
    model_.intermediate = intermediate;
    std::vector<int> ids(num_experts);
    std::iota(ids.begin(), ids.end(), 0);
    store_ = *ExpertWeightStore::CreateSynthetic(model_, ids, /*seed=*/rng_(), 1);
    kernel_ =
        *ModularKernel::Create(std::make_unique<NoEpPrepareAndFinalize>(1 << 20), Factory::Make());
  }

  // Runs the kernel on `ids` with fresh random activations and weights; returns rel. error.
  double RunAndCompare(const Tensor& ids, DType input_dtype = DType::kFP32) {
    const int64_t m = ids.shape()[0];
    Tensor x = testing::RandomNormal({m, model_.hidden}, rng_);
    Tensor wts = testing::RandomTopkWeights(m, model_.topk, rng_);
    Tensor in = Tensor::Empty(input_dtype, {m, model_.hidden});
    EXPECT_TRUE(ConvertTensor(x.view(), in.view()).ok());
    EXPECT_TRUE(ConvertTensor(in.view(), x.view()).ok());  // what the kernel actually sees
    Tensor out = Tensor::Empty(DType::kFP32, {m, model_.hidden});
    for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] = NAN;  // poison
    ModularKernelArgs args;
    args.hidden_states = in.view();
    args.topk_ids = ids.view();
    args.topk_weights = wts.view();
    args.weights = store_->layer(0);
    args.num_experts = model_.num_experts;
    StageTimings timings;
    absl::Status s = kernel_->Forward(args, out.view(), &timings);
    EXPECT_TRUE(s.ok()) << s;
    if (m == 0) return 0;
    std::vector<float> exp = Float64Moe(*store_->layer(0), x.data<float>(), ids.data<int32_t>(),
                                        wts.data<float>(), m, model_.topk);
    return testing::RelativeL2Error(out.data<float>(), exp.data(), out.numel());
  }

  std::mt19937 rng_{2024};
  ModelConfig model_;
  std::unique_ptr<ExpertWeightStore> store_;
  std::unique_ptr<ModularKernel> kernel_;
};

using Implementations = ::testing::Types<ReferenceFactory, BlasFactory>;
TYPED_TEST_SUITE(ExpertsContractTest, Implementations);

TYPED_TEST(ExpertsContractTest, SweepOfShapes) {
  struct Case {
    int experts, topk;
    int64_t hidden, inter, m;
  };
  // hidden not a multiple of 8, topk 1 and 8, M = 0 and 1, and more tokens than BlasExperts'
  // chunk to cross chunk boundaries.
  for (Case c : {Case{4, 1, 16, 8, 1}, Case{16, 8, 36, 20, 7}, Case{16, 8, 37, 11, 0},
                 Case{8, 2, 29, 13, 300}, Case{16, 4, 64, 32, 64}}) {
    this->Build(c.experts, c.topk, c.hidden, c.inter);
    Tensor ids =
        testing::MakeRouting(testing::Routing::kUniform, c.m, c.topk, c.experts, this->rng_);
    EXPECT_LT(this->RunAndCompare(ids), kFp32Tolerance)
        << "E=" << c.experts << " topk=" << c.topk << " hidden=" << c.hidden << " M=" << c.m;
  }
}

TYPED_TEST(ExpertsContractTest, SameExpertTwiceInOneToken) {
  this->Build(8, 4, 24, 16);
  Tensor ids = Tensor::Empty(DType::kINT32, {3, 4});
  const int32_t v[] = {5, 5, 1, 5, 0, 0, 0, 0, 7, 2, 7, 2};
  std::copy(v, v + 12, ids.data<int32_t>());
  EXPECT_LT(this->RunAndCompare(ids), kFp32Tolerance);
}

TYPED_TEST(ExpertsContractTest, AllTokensToOneExpert) {
  this->Build(8, 1, 24, 16);
  Tensor ids = Tensor::Empty(DType::kINT32, {513, 1});
  for (int i = 0; i < 513; ++i) ids.data<int32_t>()[i] = 3;
  EXPECT_LT(this->RunAndCompare(ids), kFp32Tolerance);
}

TYPED_TEST(ExpertsContractTest, Bf16AndFp16InputsAreUpcastExactly) {
  this->Build(8, 2, 32, 16);
  for (DType d : {DType::kBF16, DType::kFP16}) {
    Tensor ids = testing::MakeRouting(testing::Routing::kBalancedAffine, 19, 2, 8, this->rng_);
    EXPECT_LT(this->RunAndCompare(ids, d), kFp32Tolerance) << DTypeName(d);
  }
}

}  // namespace
}  // namespace moeserve
