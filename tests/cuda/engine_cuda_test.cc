// Engine{backend=cuda} (CudaContext + DeviceWeightStore + CUDA no-EP PrepareAndFinalize +
// CudaExperts / CudaBatchedExperts on GPU 0) against Engine{backend=cpu, experts=reference},
// relative L2 < 1e-2 on BF16 outputs, for BF16 and MXFP8 weights. Without a GPU the cuda
// backend must be refused with FAILED_PRECONDITION and "auto" must pick cpu (those run in CI).
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_backend.h"
#include "core/cuda/cuda_grouped_experts.h"
#include "core/engine.h"
#include "core/provider_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/dtype_convert.h"
#include "tests/engine/engine_test_util.h"

namespace moeserve {
namespace {

using ep_testing::Routing;
using ::testing::HasSubstr;

constexpr double kBf16Tolerance = 1e-2;

EngineOptions Small(const std::string& backend, const std::string& experts, WeightFormat wf) {
  EngineOptions o;
  o.model = *ApplyOverrides(
      *ModelPreset("tiny"),
      ModelOverrides{.num_experts = 32, .topk = 4, .hidden = 512, .intermediate = 192});
  o.backend = backend;
  o.experts = experts;
  o.weight_format = wf;
  o.seed = 11;
  o.num_threads = 2;
  o.max_tokens_per_request = 4096;
  return o;
}

using ep_testing::Bf16ToFloats;
using ep_testing::ToBf16;

TEST(EngineCuda, RefusedOrAutoWithoutGpu) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  auto e = Engine::Create(Small("cuda", "blas", WeightFormat::kBF16));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("no CUDA device"));
  auto a = Engine::Create(Small("auto", "blas", WeightFormat::kBF16));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->info().backend, "cpu");
  EXPECT_TRUE((*a)->healthy());
}

TEST(EngineCuda, BadBackendIsRefused) {
  auto e = Engine::Create(Small("tpu", "blas", WeightFormat::kBF16));
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(e.status().message(), HasSubstr("expected cpu, cuda or auto"));
}

TEST(EngineCuda, MatchesCpuReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (WeightFormat wf : {WeightFormat::kBF16, WeightFormat::kMXFP8}) {
    auto reference = Engine::Create(Small("cpu", "reference", wf));
    ASSERT_TRUE(reference.ok()) << reference.status();
    std::vector<std::string> names = {"blas", "batched_blas"};
    // Hopper: the grouped GEMM at every size too.
    if (CudaGroupedSm90Supported(0).ok()) {
      names.push_back("cuda_grouped_sm90");
    }
    for (const std::string& experts : names) {
      EngineOptions o = Small("cuda", experts, wf);
      o.num_ranks = 1;
      auto engine = Engine::Create(o);
      ASSERT_TRUE(engine.ok()) << engine.status();
      const EngineInfo& info = (*engine)->info();
      EXPECT_EQ(info.backend, "cuda");
      EXPECT_EQ(info.experts, experts == "blas"           ? "CudaExperts"
                              : experts == "batched_blas" ? "CudaBatchedExperts"
                                                          : "CudaGroupedSm90Experts");
      EXPECT_TRUE((*engine)->healthy());
      const ModelConfig& model = info.model;
      std::mt19937 rng(5);
      for (int64_t m : {1, 37, 512, 4096}) {
        for (Routing routing : {Routing::kUniform, Routing::kHotExpert}) {
          SCOPED_TRACE(absl::StrCat(WeightFormatName(wf), " ", experts, " M=", m, " ",
                                    ep_testing::RoutingName(routing)));
          const Tensor x = ToBf16(ep_testing::RandomNormal({m, model.hidden}, rng));
          const Tensor ids =
              ep_testing::MakeRouting(routing, m, model.topk, model.num_experts, {3, 4, 5, 6}, rng);
          const Tensor w = ep_testing::RandomTopkWeights(m, model.topk, rng);
          ForwardInput in{.layer = 1,
                          .hidden_states = x.view(),
                          .topk_ids = ids.view(),
                          .topk_weights = w.view()};
          Tensor got = Tensor::Empty(DType::kBF16, {m, model.hidden});
          Tensor want = Tensor::Empty(DType::kBF16, {m, model.hidden});
          ASSERT_TRUE((*engine)->Forward(in, got.view()).ok());
          ASSERT_TRUE((*reference)->Forward(in, want.view()).ok());
          const std::vector<float> g = Bf16ToFloats(got), r = Bf16ToFloats(want);
          EXPECT_LT(ep_testing::RelativeL2Error(g.data(), r.data(), g.size()), kBf16Tolerance);
        }
      }
    }
  }
}

// Two steps in flight (the default on one GPU): concurrent forwards from several threads run on
// two lanes (streams, buffers, workspaces) over shared weights; every answer matches the CPU
// reference, in every answer dtype, for both weight formats and both activation formats.
TEST(EngineCuda, StepsInFlightMatchCpuReference) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (WeightFormat wf : {WeightFormat::kBF16, WeightFormat::kMXFP8}) {
    auto reference = Engine::Create(Small("cpu", "reference", wf));
    ASSERT_TRUE(reference.ok()) << reference.status();
    for (const std::string experts : {"blas", "batched_blas"}) {
      EngineOptions o = Small("cuda", experts, wf);
      o.num_ranks = 1;
      auto engine = Engine::Create(o);
      ASSERT_TRUE(engine.ok()) << engine.status();
      ASSERT_EQ((*engine)->steps_in_flight(), 2);
      const ModelConfig& model = (*engine)->info().model;
      struct Case {
        Tensor x, ids, w, got, want;
        int layer;
      };
      std::vector<Case> cases;
      std::mt19937 rng(21);
      const DType dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
      for (int i = 0; i < 24; ++i) {
        const int64_t m = (i % 4 == 0) ? 1024 : 1 + (i * 37) % 200;
        Case c;
        c.layer = i % model.num_layers;
        Tensor f = ep_testing::RandomNormal({m, model.hidden}, rng);
        c.x = Tensor::Empty(dtypes[i % 3], {m, model.hidden});
        ASSERT_TRUE(ConvertTensor(f.view(), c.x.view()).ok());
        c.ids = ep_testing::MakeRouting(i % 2 ? Routing::kHotExpert : Routing::kUniform, m,
                                        model.topk, model.num_experts, {3, 4, 5, 6}, rng);
        c.w = ep_testing::RandomTopkWeights(m, model.topk, rng);
        c.got = Tensor::Empty(dtypes[i % 3], {m, model.hidden});
        c.want = Tensor::Empty(dtypes[i % 3], {m, model.hidden});
        cases.push_back(std::move(c));
      }
      std::vector<std::thread> threads;
      std::vector<absl::Status> statuses(cases.size());
      for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&, t] {
          for (size_t i = t; i < cases.size(); i += 4) {
            const Case& c = cases[i];
            statuses[i] = (*engine)->Forward({c.layer, c.x.view(), c.ids.view(), c.w.view()},
                                             c.got.view());
          }
        });
      }
      for (std::thread& t : threads) t.join();
      for (size_t i = 0; i < cases.size(); ++i) {
        SCOPED_TRACE(absl::StrCat(WeightFormatName(wf), " ", experts, " case ", i));
        ASSERT_TRUE(statuses[i].ok()) << statuses[i];
        const Case& c = cases[i];
        ASSERT_TRUE(
            (*reference)->Forward({c.layer, c.x.view(), c.ids.view(), c.w.view()}, c.want.view())
                .ok());
        Tensor g = Tensor::Empty(DType::kFP32, c.got.shape());
        Tensor r = Tensor::Empty(DType::kFP32, c.want.shape());
        ASSERT_TRUE(ConvertTensor(c.got.view(), g.view()).ok());
        ASSERT_TRUE(ConvertTensor(c.want.view(), r.view()).ok());
        EXPECT_LT(ep_testing::RelativeL2Error(g.data<float>(), r.data<float>(), g.numel()),
                  kBf16Tolerance);
      }
    }
  }
}

// The grouped GEMM's provider says why it cannot serve: no sm_90 device (or none at all; this
// part runs in CI).
TEST(EngineCuda, GroupedSm90ProviderRefusesWithReason) {
  const ExpertsProvider* p = ProviderRegistry::Global().FindExperts("cuda_grouped_sm90");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->name, "CudaGroupedSm90Experts");
  EnginePlan plan;
  plan.model = Small("cuda", "cuda_grouped_sm90", WeightFormat::kBF16).model;
  plan.backend = Backend::kCuda;
  const absl::Status s = p->Supports(plan);
  if (CudaGroupedSm90Supported(0).ok()) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("unavailable on CUDA device 0"));
  }
}

TEST(EngineCuda, TooManyGpuRanksRefused) {
  const int n = CudaDeviceCount();
  if (n == 0) GTEST_SKIP() << "no CUDA device";
  EngineOptions o = Small("cuda", "blas", WeightFormat::kBF16);
  o.num_ranks = n * 2 <= 32 ? n * 2 : 32;
  if (o.num_ranks <= n) GTEST_SKIP();
  auto e = Engine::Create(o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition) << e.status();
  EXPECT_THAT(e.status().message(), HasSubstr("CUDA devices are visible"));
}

}  // namespace
}  // namespace moeserve
